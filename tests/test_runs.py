"""Artifacts: atomic writes, append-only records, resume after a kill mid-write, stage sentinels."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scope_lib.runs import (
    RecordLog,
    RunError,
    Stage,
    atomic_write_json,
    atomic_write_text,
    build_directory,
    in_own_process,
)

#: A process that builds `final` with build_directory: the build appends its pid to `builds`, takes SLOW seconds,
#: and the process prints the folder it got back.
_BUILDER = """
import os, sys, time
from pathlib import Path
from scope_lib.runs import build_directory

final, builds, slow = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])

def build(tmp):
    with open(builds, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(slow)
    (tmp / "config.json").write_text("{}")

print(build_directory(final, build))
"""


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


def _builder(tmp_path, slow_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _BUILDER, str(tmp_path / "cache" / "model"),
                             str(tmp_path / "builds"), str(slow_s)], stdout=subprocess.PIPE, text=True)


def test_two_processes_asking_for_one_folder_build_it_once(tmp_path):
    """Parallel test workers (and two users' runs) ask for the same cache entry: the second waits for the first's
    build instead of repeating it, and both get the finished folder."""
    first = _builder(tmp_path, 3.0)
    while not (tmp_path / "builds").exists():   # the first holds the lock and is building
        assert first.poll() is None, "the first builder ended before building"
        time.sleep(0.05)
    second = _builder(tmp_path, 3.0)
    outs = [p.communicate(timeout=120)[0].strip() for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0]
    assert outs == [str(tmp_path / "cache" / "model")] * 2
    assert (tmp_path / "builds").read_text().splitlines() == [str(first.pid)]   # one build, by the first
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".model.lock", "model"]


def test_a_killed_build_leaves_nothing_the_next_one_keeps(tmp_path):
    """SIGKILL mid-build leaves a temporary folder (and no finished one); the next build removes it."""
    killed = _builder(tmp_path, 60.0)
    while not (tmp_path / "builds").exists():
        time.sleep(0.05)
    killed.kill()
    killed.wait(timeout=30)
    cache = tmp_path / "cache"
    assert [p.name.startswith(".model.build-") for p in cache.iterdir() if p.name != ".model.lock"] == [True]
    final = build_directory(cache / "model", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert sorted(p.name for p in cache.iterdir()) == [".model.lock", "model"] and (final / "config.json").is_file()


# -- work in a process of its own (runs.in_own_process: the pretrained model's warm start) ----------------------


def _pid_and_log(level_name: str) -> int:
    logging.getLogger("scope_lib.test_child").log(logging.getLevelName(level_name), "from the child %d", os.getpid())
    return os.getpid()


def _fails(message: str) -> None:
    raise ValueError(message)


class _TwoArguments(Exception):
    def __init__(self, file: str, line: int) -> None:   # pickles, but cannot be rebuilt from its args
        super().__init__(f"{file}:{line} is damaged")


def _fails_with_two_arguments() -> None:
    raise _TwoArguments("a.jsonl", 3)


def _dies(signum: int) -> None:
    os.kill(os.getpid(), signum)


def _sleeps_after_writing_pid(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


def test_work_in_its_own_process_returns_its_value_and_its_logs_reach_ours(caplog):
    caplog.set_level(logging.INFO)
    pid = in_own_process(_pid_and_log, "WARNING")
    assert pid != os.getpid()
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name.endswith("test_child")] == [
        ("scope_lib.test_child", "WARNING", f"from the child {pid}")]


def test_work_in_its_own_process_raises_what_it_raised_with_its_traceback():
    with pytest.raises(ValueError) as info:
        in_own_process(_fails, "the corpus is empty")
    assert str(info.value) == "the corpus is empty"
    assert "in the process of _fails" in info.value.__notes__[0] and "raise ValueError" in info.value.__notes__[0]


def test_an_exception_that_cannot_be_rebuilt_here_arrives_as_its_text():
    with pytest.raises(RuntimeError) as info:
        in_own_process(_fails_with_two_arguments)
    assert str(info.value) == "_TwoArguments: a.jsonl:3 is damaged" and "raise _TwoArguments" in info.value.__notes__[0]


def test_a_process_killed_mid_work_is_a_run_error_that_names_its_exit_status():
    with pytest.raises(RunError, match=r"_dies's process \(pid \d+\) ended with exit status -9 \(SIGKILL\)"):
        in_own_process(_dies, int(signal.SIGKILL))


def test_an_interrupted_caller_leaves_no_child_working(tmp_path):
    """Ctrl-C or SIGTERM (`Stopped`) in the caller kills the child rather than waiting for it or leaving it."""
    pid_file = tmp_path / "pid"

    def interrupt(signum, frame):   # once the child is at work
        if pid_file.exists() and pid_file.read_text():
            raise KeyboardInterrupt
        signal.setitimer(signal.ITIMER_REAL, 0.2)

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            in_own_process(_sleeps_after_writing_pid, str(pid_file))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 60
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_a_folder_without_its_marker_is_not_overwritten(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="holds no config.json"):
        build_directory(tmp_path / "model", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert (tmp_path / "model" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]   # its attempt removed
