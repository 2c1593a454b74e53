"""Runs that cannot be corrupted (issue 21): one writer per run, exact recovery of damaged records, verified
checkpoints, one-line errors, a rebuilt judge cache, de-duplicated health alarms, safe run names.
(The retrieval server's fairness: test_retrieval_server.py; mid-stage resume: test_resume.py.)"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from training_helpers import AlternatingEngine, fast_params, load_policy

from scope_lib.cli import main, one_line
from scope_lib.config import ParamsError, load_params
from scope_lib.runs import LOCK_ENV, RecordLog, RunError, Stage, load_weights, read_jsonl, verify_run
from scope_lib.selfplay import health

REPO = Path(__file__).resolve().parents[1]


# -- one writer per run -------------------------------------------------------------------------------------

HOLD = "import sys, time; from scope_lib.runs import lock_run; lock_run(sys.argv[1]); print('held', flush=True); " \
       "time.sleep(120)"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != LOCK_ENV}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _holder(run_dir: Path, env=None) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                               env=env or _env(), cwd=REPO)
    assert process.stdout.readline().strip() == "held"
    return process


def _scope(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scope_lib.cli", *args], capture_output=True, text=True,
                          env=env or _env(), cwd=REPO, timeout=120)


def test_a_second_writer_is_refused_at_once_naming_the_holder_and_a_killed_holder_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    holder = _holder(run_dir)
    try:
        overrides = ["-o", f"run.runs_dir={tmp_path / 'runs'}", "-o", "run.name=r"]
        for command in (["train", "params/smoke.yaml"], ["eval", "params/smoke.yaml"]):
            started = time.monotonic()
            result = _scope(*command, *overrides)
            assert result.returncode == 2, result.stderr
            errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "Traceback" not in result.stderr
            assert f"pid {holder.pid}" in errors[0] and "started" in errors[0] and str(run_dir) in errors[0]
            assert time.monotonic() - started < 60
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock", ".lock.holder"]  # nothing else written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    _holder(run_dir).kill()  # the kernel dropped the killed holder's lock: a new process takes it


def test_two_scope_train_on_one_run_the_second_is_refused(tmp_path):
    """Two real `scope train` on one run, started one after the other: the second exits at once naming the first."""
    runs = tmp_path / "runs"
    env = _env(SCOPE_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    overrides = ["-o", f"run.runs_dir={runs}", "-o", "run.name=twice"]
    first = subprocess.Popen([sys.executable, "-m", "scope_lib.cli", "train", "params/smoke.yaml", *overrides],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        holder = runs / "twice" / ".lock.holder"
        deadline = time.monotonic() + 60
        while not (holder.is_file() and json.loads(holder.read_text() or "{}").get("pid") == first.pid):
            assert first.poll() is None and time.monotonic() < deadline, "the first `scope train` never took the lock"
            time.sleep(0.05)
        second = _scope("train", "params/smoke.yaml", *overrides, env=env)
        assert second.returncode == 2 and f"is in use by pid {first.pid}" in second.stderr, second.stderr
        assert first.poll() is None  # the first one goes on
    finally:
        first.kill()
        first.wait()


def test_children_of_the_holder_may_write_others_may_not(tmp_path):
    run_dir = (tmp_path / "r").resolve()
    holder = _holder(run_dir)
    try:
        child = _holder(run_dir, env=_env(**{LOCK_ENV: f"{run_dir}|{holder.pid}"}))  # a notebook kernel of `scope run`
        child.kill()
        stranger = subprocess.run([sys.executable, "-c", HOLD, str(run_dir)], capture_output=True, text=True,
                                  env=_env(**{LOCK_ENV: f"{run_dir}|999999999"}), cwd=REPO, timeout=60)
        assert stranger.returncode != 0 and "is in use by pid" in stranger.stderr
    finally:
        holder.kill()
        holder.wait()


# -- exact recovery of damaged records --------------------------------------------------------------------------


def _write_records(path: Path, n: int) -> list[dict]:
    records = [{"id": f"r{i:02d}", "chunk": i // 4, "value": i} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _cut(line: bytes) -> bytes:
    return line[: len(line) // 2]


def _change_a_digit(line: bytes) -> bytes:
    """The last digit of the first reward, e.g. 0.5 -> 0.6: the line is still valid JSON."""
    end = re.search(rb'"reward": -?[0-9.]+', line).end()
    return line[: end - 1] + str((int(line[end - 1: end]) + 1) % 10).encode() + line[end:]


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in _strings(item)]


def _shorten_a_string(line: bytes) -> bytes:
    """The longest string of the record loses its second half: the line is still valid JSON."""
    text = max(_strings(json.loads(line)), key=len)
    return line.replace(json.dumps(text, ensure_ascii=False).encode(),
                        json.dumps(text[: len(text) // 2], ensure_ascii=False).encode(), 1)


#: Damage to one line in the middle of a file: cut in half (not JSON), or changed into other valid JSON that only
#: the record's checksum can tell from the original (issue 46).
DAMAGE = {"cut": _cut, "digit": _change_a_digit, "shortened": _shorten_a_string}


def _damage_line(path: Path, number: int, damage: str = "cut") -> None:
    """Damage line `number` (1-based), keeping its newline: damage in the middle of the file."""
    lines = path.read_bytes().split(b"\n")
    damaged = DAMAGE[damage](lines[number - 1])
    assert damaged != lines[number - 1]
    if damage != "cut":
        json.loads(damaged)  # still parses: only the checksum finds it
    lines[number - 1] = damaged
    path.write_bytes(b"\n".join(lines))


def _cut_line(path: Path, number: int) -> None:
    _damage_line(path, number, "cut")


def test_a_damaged_middle_line_is_moved_aside_and_every_valid_record_kept(tmp_path, caplog):
    path = tmp_path / "candidates.jsonl"
    records = _write_records(path, 12)
    _cut_line(path, 5)
    with path.open("ab") as f:
        f.write(b'{"id": "torn", "val')  # and a torn final write
    with caplog.at_level(logging.WARNING, logger="scope_lib.runs"):
        log = RecordLog(path)
    assert log.ids == {r["id"] for r in records} - {"r04"}
    assert [r["id"] for r in read_jsonl(path)] == [r["id"] for r in records if r["id"] != "r04"]
    assert (tmp_path / "candidates.jsonl.damaged").read_text().count("\n") == 1
    assert f"{path}:5: damaged record moved to" in caplog.text
    assert RecordLog(path).damaged == 0  # repaired once; the file is clean now
    log.append([{"id": "r04", "chunk": 1, "value": 4}])  # the lost record is redone
    assert len(RecordLog(path)) == 12


def test_a_torn_final_line_alone_is_dropped_as_before(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    _write_records(path, 3)
    size = path.stat().st_size
    with path.open("ab") as f:
        f.write(b'{"id": "x", "va')
    assert len(RecordLog(path)) == 3 and path.stat().st_size == size
    assert not (tmp_path / "rollouts.jsonl.damaged").exists()


@pytest.mark.parametrize("damage", ["digit", "shortened"])
def test_a_record_damaged_into_other_valid_json_is_found_by_its_checksum_and_redone(tmp_path, caplog, damage):
    path = tmp_path / "rollouts.jsonl"
    records = [{"id": f"r{i:02d}", "chunk": i // 4, "reward": 0.5, "text": f"the answer to question {i} is here"}
               for i in range(12)]
    RecordLog(path).append(records)
    _damage_line(path, 5, damage)
    with caplog.at_level(logging.WARNING, logger="scope_lib.runs"):
        assert read_jsonl(path) == records[:4] + records[5:]  # a notebook reader skips it (no checksum key shown)
        assert f"{path}:5: damaged record skipped" in caplog.text
        log = RecordLog(path)
    assert f"{path}:5: damaged record moved to" in caplog.text and log.damaged == 1
    assert log.ids == {r["id"] for r in records} - {"r04"}
    assert (tmp_path / "rollouts.jsonl.damaged").read_text().count("\n") == 1
    assert log.append(records) == 1  # the lost record is redone, once
    assert sorted(read_jsonl(path), key=lambda r: r["id"]) == records and RecordLog(path).damaged == 0


def test_an_old_run_without_checksums_resumes_with_nothing_lost_or_duplicated(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    old = _write_records(path, 8)  # written before records had checksums
    with path.open("ab") as f:
        f.write(b'{"id": "r08", "chu')  # and killed mid-write
    log = RecordLog(path)
    assert log.ids == {r["id"] for r in old} and log.damaged == 0
    records = [{"id": f"r{i:02d}", "chunk": i // 4, "value": i} for i in range(12)]
    assert log.append(records) == 4  # the resumed run appends what is missing, with checksums
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert ["_sum" in line for line in lines] == [False] * 8 + [True] * 4  # one file holds both: fine
    assert read_jsonl(path) == records and list(RecordLog(path)) == records
    assert log.retain(lambda r: r["chunk"] < 2) == 4 and read_jsonl(path) == records[:8]  # rewritten, checksummed
    assert all("_sum" in json.loads(line) for line in path.read_text().splitlines())


def test_verify_names_each_damaged_record_by_file_and_line(tmp_path, capsys):
    run = tmp_path / "run"
    pool = Stage(run / "iter_01" / "pool")
    records = [{"id": f"c{i}", "chunk": 0, "evaluation": {"reward": 0.25 * i}} for i in range(6)]
    pool.records("candidates").append(records)
    health.report({"alarm": "zero_spread", "role": "solver", "iteration": 1, "step": 2, "message": "m"}, run)
    assert main(["runs", "verify", str(run)]) == 0
    out = capsys.readouterr().out
    assert "iter_01/pool/candidates.jsonl" in out and "ok: 6 record(s)" in out and "health.jsonl" in out
    _damage_line(pool.path / "candidates.jsonl", 3, "digit")
    _damage_line(pool.path / "candidates.jsonl", 5, "shortened")
    assert main(["runs", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    file = pool.path / "candidates.jsonl"
    assert f"FAIL: damaged record(s) (not JSON, or the checksum does not match) at {file}:3, {file}:5" in out
    assert "1 failed" in out
    pool.records("candidates").append(records)  # the next run moves them aside and redoes them
    assert main(["runs", "verify", str(run)]) == 0
    pool.mark_done({})
    with file.open("ab") as f:
        f.write(b'{"id": "c9", "chu')  # a torn line in a finished stage: records were lost after it finished
    assert main(["runs", "verify", str(run)]) == 1
    assert f"FAIL: {file}: its last line is torn" in capsys.readouterr().out


def test_notebook_readers_skip_a_damaged_line_naming_it(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    _write_records(path, 6)
    _cut_line(path, 2)
    with caplog.at_level(logging.WARNING, logger="scope_lib.runs"):
        assert len(read_jsonl(path)) == 5
    assert f"{path}:2: damaged record skipped" in caplog.text


# -- a prepared run: Stage 1 and the pool in-process with the scripted engine --------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, wiki_sample, tiny_model_dir):
    """(params, policy, engine, run) of a run with Stage 1 and the task pool done."""
    from scope_lib.protocol.dialects import get_dialect
    from scope_lib.selfplay.judge import Judge
    from scope_lib.selfplay.loop import open_run
    from scope_lib.selfplay.methods.scope import build_pool, train_challenger

    params = fast_params(tmp_path_factory.mktemp("robust"), wiki_sample.parent,
                         **{"selfplay.max_candidate_batches": 3, "selfplay.target_tasks": 12})
    policy = load_policy(params, tiny_model_dir)
    engine = AlternatingEngine(policy.tokenizer, get_dialect("qwen2.5"))
    r = open_run(params, engine=engine, judge=Judge(engine, params.judge, seed=params.selfplay.seed), policy=policy)
    train_challenger(r, 1)
    build_pool(r, 1)
    return params, policy, engine, r


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_pool_record_damaged_in_the_middle_is_redone_and_the_pool_equals_the_original(prepared, caplog, damage):
    from scope_lib.selfplay.methods.scope import build_pool

    params, _policy, _engine, r = prepared
    pool = r.stage(1, "pool")
    original = {name: sorted(read_jsonl(pool.path / f"{name}.jsonl"), key=lambda x: x["id"])
                for name in ("candidates", "tasks")}
    assert len({c["chunk"] for c in original["candidates"]}) >= 2
    saved = pool.path.parent / "pool-original"
    shutil.copytree(pool.path, saved)
    try:
        (pool.path / "DONE").unlink()  # as if killed before the end
        _damage_line(pool.path / "candidates.jsonl", 2, damage)  # a record of batch 0: later batches stay intact
        with caplog.at_level(logging.WARNING):
            summary = build_pool(r, 1)
        assert "candidates.jsonl:2: damaged record moved to" in caplog.text
        assert "batch 0 has" in caplog.text and "it is redone" in caplog.text
        again = {name: sorted(read_jsonl(pool.path / f"{name}.jsonl"), key=lambda x: x["id"])
                 for name in ("candidates", "tasks")}
        drop = ("time_total_s", "time_generation_s", "time_retrieval_s", "time_judge_s")
        assert [{k: v for k, v in c.items() if k not in drop} for c in again["candidates"]] == \
               [{k: v for k, v in c.items() if k not in drop} for c in original["candidates"]]
        assert again["tasks"] == original["tasks"]
        assert summary["candidates"] == len(original["candidates"]) and pool.done
    finally:
        shutil.rmtree(pool.path)
        saved.rename(pool.path)


def test_a_record_damaged_in_a_finished_stage_stops_the_run_then_is_redone(prepared):
    """A finished stage's records are read by later stages (the Solver reads the pool's tasks): a record damaged
    there into other valid JSON is an error naming file and line, never a task dropped in silence; deleting DONE,
    as the error says, redoes it and the pool equals the original (issue 46, item 3)."""
    from scope_lib.selfplay.methods.scope import build_pool

    _params, _policy, _engine, r = prepared
    pool = r.stage(1, "pool")
    tasks = pool.path / "tasks.jsonl"
    original = sorted(read_jsonl(tasks), key=lambda x: x["id"])
    saved = pool.path.parent / "pool-original"
    shutil.copytree(pool.path, saved)
    try:
        _damage_line(tasks, 1, "shortened")
        damaged = tasks.read_bytes()
        with pytest.raises(RunError, match=rf"{re.escape(str(tasks))}:1: a damaged record .* delete .*DONE"):
            pool.records("tasks")
        assert tasks.read_bytes() == damaged and not tasks.with_name("tasks.jsonl.damaged").exists()  # untouched
        (pool.path / "DONE").unlink()
        build_pool(r, 1)
        assert sorted(read_jsonl(tasks), key=lambda x: x["id"]) == original and pool.done
    finally:
        shutil.rmtree(pool.path)
        saved.rename(pool.path)


def test_a_pool_written_before_checksums_resumes_with_nothing_lost_or_duplicated(prepared):
    from scope_lib.selfplay.methods.scope import build_pool

    _params, _policy, _engine, r = prepared
    pool = r.stage(1, "pool")
    names = ("candidates", "tasks", "chunks")
    original = {name: read_jsonl(pool.path / f"{name}.jsonl") for name in names}
    saved = pool.path.parent / "pool-original"
    shutil.copytree(pool.path, saved)
    try:
        (pool.path / "DONE").unlink()
        for name in names:  # as an older version wrote them, killed before the last batch's marker
            kept = original[name][:-1] if name == "chunks" else original[name]
            (pool.path / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kept))
        build_pool(r, 1)
        drop = ("time_total_s", "time_generation_s", "time_retrieval_s", "time_judge_s")
        for name in names:
            lines = [json.loads(line) for line in (pool.path / f"{name}.jsonl").read_text().splitlines()]
            assert len({x["id"] for x in lines}) == len(lines) == len(original[name])  # none lost, none twice
            assert [{k: v for k, v in x.items() if k not in drop} for x in read_jsonl(pool.path / f"{name}.jsonl")] \
                == [{k: v for k, v in x.items() if k not in drop} for x in original[name]]
        markers = [json.loads(line) for line in (pool.path / "chunks.jsonl").read_text().splitlines()]
        assert ["_sum" in m for m in markers] == [False] * (len(markers) - 1) + [True]  # old and new in one file
        assert pool.done and all(v.startswith("ok") for _, v in verify_run(r.run_dir))
    finally:
        shutil.rmtree(pool.path)
        saved.rename(pool.path)


# -- verified checkpoints ------------------------------------------------------------------------------------


def test_the_done_sentinel_holds_checksums_and_verify_passes(prepared):
    _params, _policy, _engine, r = prepared
    stage = r.stage(1, "challenger")
    assert "adapter/adapter_model.safetensors" in stage.summary["checksums"]
    assert stage.verify()
    results = verify_run(r.run_dir)
    assert results and all(v.startswith("ok") for _, v in results), results


@pytest.mark.parametrize("damage", ["flip", "truncate", "nan"])
def test_a_damaged_adapter_is_refused_by_name(prepared, tmp_path, damage, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    from scope_lib.selfplay.loop import _restore_roles

    params, policy, _engine, r = prepared
    stage = r.stage(1, "challenger")
    weights = stage.path / "adapter" / "adapter_model.safetensors"
    backup = tmp_path / "backup.safetensors"
    shutil.copy(weights, backup)
    try:
        if damage == "flip":  # same size, a few bytes changed in the tensor data
            data = bytearray(weights.read_bytes())
            data[-64:-32] = bytes(b ^ 0xFF for b in data[-64:-32])
            weights.write_bytes(bytes(data))
        elif damage == "truncate":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
            with pytest.raises(RunError, match=f"{weights} cannot be read .*damaged or truncated"):
                load_weights(weights)
        else:  # NaN weights whose checksum is (re)recorded: only the finiteness check can catch them
            tensors = load_file(str(weights))
            first = sorted(tensors)[0]
            tensors[first] = torch.full_like(tensors[first], float("nan"))
            save_file(tensors, str(weights), metadata={"format": "pt"})
            stage.mark_done({k: v for k, v in stage.summary.items() if k != "checksums"}, saved=weights.parent)
        with pytest.raises(RunError) as caught:
            _restore_roles(r)
        message = str(caught.value)
        assert str(weights) in message and "DONE" in message
        if damage == "flip":
            assert "does not match" in message
        assert main(["runs", "verify", str(r.run_dir)]) == 1
        assert f"FAIL: {weights}" in capsys.readouterr().out
    finally:
        shutil.copy(backup, weights)
        stage.mark_done({k: v for k, v in stage.summary.items() if k != "checksums"}, saved=weights.parent)
    assert main(["runs", "verify", str(r.run_dir)]) == 0


# -- one-line errors ----------------------------------------------------------------------------------------


def test_a_damaged_sentinel_or_manifest_is_one_line_naming_the_file(tmp_path, capsys):
    stage = Stage(tmp_path / "run" / "iter_01" / "solver")
    (stage.path / "DONE").write_text('{"steps": 2, "saved": ')
    assert main(["runs", "verify", str(tmp_path / "run")]) == 1
    assert f"{stage.path / 'DONE'} is damaged" in capsys.readouterr().out
    from scope_lib.runs import write_manifest

    (tmp_path / "run" / "manifest.json").write_text('{"params_hash": "ab')
    with pytest.raises(RunError, match=r"manifest\.json is damaged .*delete it"):
        write_manifest(tmp_path / "run", "a: 1\n")


def test_disk_full_names_the_file_and_keeps_nothing_half_written(tmp_path, monkeypatch, capsys):
    path = tmp_path / "rollouts.jsonl"
    log = RecordLog(path)
    log.append([{"id": "a"}])
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        log.append([{"id": "b"}])
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert caught.value.filename == str(path) and "b" not in log
    user, line = one_line(caught.value)
    assert user and str(path) in line and "free space" in line and "\n" not in line
    # the CLI: one line, exit 2, no traceback
    monkeypatch.setattr("scope_lib.cli.cmd_params_show", lambda args: (_ for _ in ()).throw(caught.value))
    assert main(["params", "show", "params/smoke.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: disk full writing") and "Traceback" not in err


def test_a_corrupt_judge_cache_is_moved_aside_and_rebuilt(tmp_path, caplog):
    from scope_lib.evaluation.judge import JudgeCache

    path = tmp_path / "judge_cache.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    with caplog.at_level(logging.WARNING):
        cache = JudgeCache(path)
    assert len(cache) == 0 and "is damaged" in caplog.text and "rebuilt" in caplog.text
    assert len(list(tmp_path.glob("judge_cache.sqlite.corrupt-*"))) == 1
    cache.close()


# -- health alarms, run names, paths -------------------------------------------------------------------------


def test_health_alarms_are_recorded_once_however_many_resumes(tmp_path):
    alarm = {"alarm": "zero_spread", "role": "solver", "iteration": 1, "step": 2, "value": 1.0, "threshold": 1.0,
             "message": "every group has identical rewards"}
    assert health.report(alarm, tmp_path) is True
    for _ in range(3):  # three resumes re-checking the same step
        assert health.report(dict(alarm), tmp_path) is False
    assert health.report({**alarm, "step": 3}, tmp_path) is True
    assert len((tmp_path / "health.jsonl").read_text().splitlines()) == 2
    with open(tmp_path / "health.jsonl", "a") as f:  # a file written before de-duplication
        f.write(json.dumps(alarm) + "\n")
    assert len(health.read_alarms(tmp_path)) == 2


@pytest.mark.parametrize("name", ["../../../tmp/x", "a/b", "..", ".", " ", "a\\b"])
def test_run_names_are_one_folder_name(name):
    with pytest.raises(ParamsError, match="run.name"):
        load_params(REPO / "params" / "smoke.yaml", [f"run.name={name}"])


def test_good_run_names_and_folders_given_as_files(tmp_path):
    assert load_params(REPO / "params" / "smoke.yaml", ["run.name=my-run_2.b"]).run_dir.name == "my-run_2.b"
    with pytest.raises(ParamsError, match="is a folder"):
        load_params(REPO / "params")
    from scope_lib.retrieval.corpus import CorpusError, read_corpus

    with pytest.raises(CorpusError, match="is a folder"):
        read_corpus(tmp_path)
