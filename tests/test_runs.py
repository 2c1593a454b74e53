"""Artifacts: atomic writes, append-only records, resume after a kill mid-write, stage sentinels."""

from __future__ import annotations

import json

import pytest

from scope_lib.runs import RecordLog, Stage, atomic_write_json, atomic_write_text


def test_atomic_write_leaves_no_temp(tmp_path):
    target = atomic_write_text(tmp_path / "a" / "b.txt", "hello")
    assert target.read_text() == "hello"
    assert [p.name for p in target.parent.iterdir()] == ["b.txt"]
    atomic_write_json(tmp_path / "x.json", {"k": 1})
    assert json.loads((tmp_path / "x.json").read_text()) == {"k": 1}


def test_records_skip_duplicates_and_survive_reopen(tmp_path):
    log = RecordLog(tmp_path / "r.jsonl")
    assert log.append([{"id": "a", "v": 1}, {"id": "b", "v": 2}, {"id": "a", "v": 3}]) == 2
    again = RecordLog(tmp_path / "r.jsonl")
    assert again.ids == {"a", "b"} and again.append([{"id": "b"}, {"id": "c"}]) == 1
    assert [r["id"] for r in again] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="needs an 'id'"):
        again.append([{"v": 1}])


def test_resume_after_torn_write(tmp_path):
    """A kill mid-write leaves half a line: reopening drops it, and the record is written again once."""
    path = tmp_path / "r.jsonl"
    RecordLog(path).append([{"id": str(i)} for i in range(3)])
    with open(path, "a") as f:
        f.write('{"id": "3", "text": "half a rec')
    log = RecordLog(path)
    assert log.ids == {"0", "1", "2"}
    log.append([{"id": str(i)} for i in range(5)])
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert ids == ["0", "1", "2", "3", "4"]


def test_stage_sentinel(tmp_path):
    stage = Stage(tmp_path / "iter_01" / "pool")
    assert not stage.done
    stage.mark_done({"tasks": 4})
    assert Stage(tmp_path / "iter_01" / "pool").done
    assert json.loads((stage.path / "DONE").read_text()) == {"tasks": 4}


def test_retain_drops_unfinished_work_atomically(tmp_path):
    log = RecordLog(tmp_path / "c.jsonl")
    log.append([{"id": f"a{i}", "chunk": i // 2} for i in range(6)])
    assert log.retain(lambda r: r["chunk"] < 2) == 2
    again = RecordLog(tmp_path / "c.jsonl")
    assert [r["id"] for r in again] == ["a0", "a1", "a2", "a3"] and "a4" not in again
    assert again.append([{"id": "a4", "chunk": 2}]) == 1                  # redone once, not twice
    assert RecordLog(tmp_path / "empty.jsonl").path.is_file()             # an empty log exists as a file


def test_reset_restarts_an_unfinished_stage_only(tmp_path):
    stage = Stage(tmp_path / "iter_01" / "solver")
    (stage.path / "rollouts.jsonl").write_text('{"id": "x"}\n')
    (stage.path / "trainer").mkdir()
    stage.reset()
    assert list(stage.path.iterdir()) == []
    stage.mark_done({"steps": 2})
    assert stage.summary == {"steps": 2}
    with pytest.raises(RuntimeError, match="finished"):
        stage.reset()


def test_manifest_refuses_to_resume_with_other_parameters(tmp_path):
    from scope_lib.runs import write_manifest

    path = write_manifest(tmp_path, "a: 1\n", science="a: 1\n", seeds={"selfplay": 42})
    manifest = json.loads(path.read_text())
    assert manifest["seeds"] == {"selfplay": 42} and manifest["packages"]["torch"]
    assert "sha" in manifest["git"] and (tmp_path / "params.yaml").read_text() == "a: 1\n"
    write_manifest(tmp_path, "a: 1\nrun: moved\n", science="a: 1\n")      # the same science: fine
    with pytest.raises(RuntimeError, match="other parameters"):
        write_manifest(tmp_path, "a: 2\n", science="a: 2\n")
