"""Faults that recover but used to say the wrong thing (issue 36): each ends in one line naming the cause, the file
or key and the remedy, with the exit code docs/runs.md promises.

- a full disk while the chroma index is built, and while an adapter or a trainer checkpoint is saved: on a real
  small tmpfs where this machine may mount one (root), and with the library's own error injected everywhere;
- an empty corpus, refused before anything is built; the index check's table shown once;
- SIGTERM on a real `scope train`: one line saying how to resume, exit 143; a write under way is finished first;
- a folder given as the corpus names the real key (`retrieval.corpus`);
- a read-only run folder names the remedy.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from training_helpers import FAST, fast_params, load_policy

from scope_lib.cli import main, one_line
from scope_lib.config import ParamsError, load_params
from scope_lib.retrieval.corpus import CorpusError, read_corpus
from scope_lib.runs import LOCK_ENV, RecordLog, Stopped, read_jsonl, safe_point, stop_on_sigterm, writing

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "params" / "smoke.yaml")
#: chromadb's words for a full disk, as the issue met them (its embedded store hides the OS error).
COMPACTION = "Error in compaction: Failed to apply logs to the metadata segment"


# -- a real small file system, where this machine allows one -------------------------------------------------


def _mount(folder: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.fixture()
def small_disk(tmp_path):
    """`small_disk("6m")`: a fresh tmpfs of that size (unmounted after the test); skips where mounting is not
    allowed (not root): the injected-error tests below cover the same lines there."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        if not _mount(folder, size):
            pytest.skip("cannot mount a tmpfs here (needs root): the injected-error variant covers this fault")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    errors = _error_lines(err)
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def _index_build(tmp_path, wiki_sample, *extra: str) -> int:
    return main(["index", "build", "--params", SMOKE, "-o", f"run.runs_dir={tmp_path / 'runs'}",
                 "-o", f"run.data_dir={wiki_sample.parent}", "-o", "retrieval.embedder=hashing", *extra])


# -- 1. a full disk while the chroma index is built ----------------------------------------------------------


@pytest.mark.parametrize("size", ["1m", "6m"])  # SQLite's "database or disk is full"; chromadb's compaction error
def test_a_full_disk_during_the_chroma_build_is_the_disk_full_line_naming_the_index(
        small_disk, tmp_path, wiki_sample, capsys, size):
    index = small_disk(size) / "index"
    assert _index_build(tmp_path, wiki_sample, "-o", f"retrieval.index_dir={index}") == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: disk full writing {index} (") and "free space and run the same command" in line
    assert "internal error" not in line


def test_chromadb_hiding_a_full_disk_is_still_the_disk_full_line(tmp_path, wiki_sample, capsys, monkeypatch):
    """The injected variant (any machine): chromadb's own InternalError while the folder has little space left."""
    from chromadb.api.models.Collection import Collection
    from chromadb.errors import InternalError

    def full(self, *args, **kwargs):
        raise InternalError(COMPACTION)

    monkeypatch.setattr(Collection, "add", full)
    index = tmp_path / "index"
    # plenty of space: chromadb's error is an internal error (exit 1), not guessed to be a full disk
    assert _index_build(tmp_path, wiki_sample, "-o", f"retrieval.index_dir={index}") == 1
    assert "an internal error" in _one_error(capsys)
    monkeypatch.setattr("scope_lib.runs.free_bytes", lambda path: 3 << 20)  # what a full tmpfs answers
    assert _index_build(tmp_path, wiki_sample, "-o", f"retrieval.index_dir={index}") == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: disk full writing {index} (") and COMPACTION in line


# -- 2. a full disk while the adapter (or a trainer checkpoint) is saved ----------------------------------------


@pytest.fixture()
def policy(tmp_path, wiki_sample, tiny_model_dir):
    return load_policy(fast_params(tmp_path, wiki_sample.parent), tiny_model_dir)


def _assert_disk_full_naming(exc: BaseException, folder: Path) -> None:
    user, line = one_line(exc)
    assert user and line.startswith(f"disk full writing {folder} (") and "\n" not in line, line
    assert "damaged" not in line and "runs verify" not in line


def test_a_full_disk_during_the_adapter_save_names_the_adapter_folder(small_disk, policy):
    stage = small_disk("64k") / "iter_01" / "solver"  # the tiny model's adapter is 81 KiB
    with pytest.raises(OSError) as caught:
        policy.save("solver", stage)
    assert caught.value.errno == errno.ENOSPC
    _assert_disk_full_naming(caught.value, stage / "adapter")
    assert list(stage.iterdir()) == []  # nothing half-written left to trust


def test_safetensors_saying_disk_full_is_not_a_damaged_file(tmp_path, policy, monkeypatch):
    """The injected variant (any machine): safetensors' own error, as the issue met it."""
    import peft.peft_model
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(peft.peft_model, "safe_save_file", full)
    stage = tmp_path / "iter_01" / "solver"
    with pytest.raises(OSError) as caught:
        policy.save("solver", stage)
    _assert_disk_full_naming(caught.value, stage / "adapter")
    assert "os error 28" in one_line(caught.value)[1]
    assert list(stage.iterdir()) == []


def test_torch_save_on_a_full_disk_names_the_checkpoint_folder(small_disk):
    """torch.save (the trainer's optimiser and RNG states) says "unexpected pos ..." on a full disk."""
    import torch

    folder = small_disk("64k") / "trainer"
    with pytest.raises(OSError) as caught, writing(folder, opaque=True):
        folder.mkdir()
        torch.save({"state": torch.zeros(100_000)}, folder / "optimizer.pt")
    _assert_disk_full_naming(caught.value, folder)
    with pytest.raises(RuntimeError, match="not a full disk"), writing(folder.parent.parent, opaque=True):
        raise RuntimeError("not a full disk")  # plenty of space where tmp_path lives: not guessed to be full


# -- 3. an empty corpus ----------------------------------------------------------------------------------------


def _empty_corpus(tmp_path) -> Path:
    corpus = tmp_path / "data" / "empty.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus.write_text("\n")
    return corpus


def test_an_empty_corpus_is_refused_by_index_build_and_train_before_anything_is_built(tmp_path, wiki_sample, capsys):
    corpus = _empty_corpus(tmp_path)
    index = tmp_path / "index"
    assert _index_build(tmp_path, wiki_sample, "-o", f"retrieval.corpus={corpus}",
                        "-o", f"retrieval.index_dir={index}") == 2
    line = _one_error(capsys)
    assert str(corpus) in line and "holds no passages" in line and "retrieval.corpus" in line
    assert not index.exists()
    # `scope train`, in its own process (it takes the run's lock): refused before the warm start or the index
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != LOCK_ENV} | {"SCOPE_CACHE_DIR": str(cache)}
    result = subprocess.run([sys.executable, "-m", "scope_lib.cli", "train", SMOKE, "-o",
                             f"run.runs_dir={tmp_path / 'runs'}", "-o", f"retrieval.corpus={corpus}"],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    errors = _error_lines(result.stderr)
    assert result.returncode == 2 and len(errors) == 1 and "holds no passages" in errors[0], result.stderr
    assert not cache.exists()  # no warm start built from it
    assert sorted(p.name for p in (tmp_path / "runs" / "smoke").iterdir()) == [".lock", ".lock.holder"]


def test_an_empty_corpus_is_refused_when_a_run_opens_and_fails_the_index_check(tmp_path, wiki_sample, capsys):
    from scope_lib.selfplay.loop import open_run

    corpus = _empty_corpus(tmp_path)
    params = fast_params(tmp_path / "runs", wiki_sample.parent, **{"retrieval.corpus": str(corpus)})
    with pytest.raises(CorpusError, match="holds no passages"):
        open_run(params)
    assert not params.run_dir.exists()  # no index, no manifest
    assert main(["index", "check", "--params", SMOKE, "-o", f"run.runs_dir={tmp_path / 'runs'}",
                 "-o", "retrieval.embedder=hashing", "-o", f"retrieval.corpus={corpus}"]) == 1
    table = capsys.readouterr().out
    assert "| corpus | FAIL |" in table and "holds no passages" in table


def test_a_corpus_of_only_skipped_lines_is_refused_saying_so(tmp_path, wiki_sample):
    from scope_lib.retrieval.index import build_or_open_index

    corpus = tmp_path / "bad.jsonl"
    corpus.write_text("not json\n{\"id\": 1}\n")
    params = fast_params(tmp_path / "runs", wiki_sample.parent,
                         **{"retrieval.corpus": str(corpus), "retrieval.on_error": "skip"})
    with pytest.raises(CorpusError, match=r"holds no passages .*retrieval.on_error: skip"):
        build_or_open_index(params, progress=False)
    assert not params.run_dir.exists()


def test_a_failed_index_check_is_one_line_and_its_table_is_shown_once(tmp_path, wiki_sample, caplog):
    from scope_lib.retrieval.api import IndexCheckError
    from scope_lib.selfplay.loop import open_run

    class Silent:
        def search(self, queries, k=None):
            return [[] for _ in queries]

    with caplog.at_level(logging.INFO), pytest.raises(IndexCheckError) as caught:
        open_run(fast_params(tmp_path, wiki_sample.parent), retriever=Silent())
    line = str(caught.value)
    assert "\n" not in line and "canaries" in line and "| " not in line
    assert caplog.text.count("| check | result | detail |") == 1  # the table, logged once


# -- 4. SIGTERM ------------------------------------------------------------------------------------------------


def test_sigterm_stops_scope_train_with_one_line_saying_how_to_resume(tmp_path, wiki_sample, tiny_model_dir):
    """A real `scope train` sent SIGTERM (a scheduler, `docker stop`) once its index check has passed."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny").symlink_to(Path(tiny_model_dir).parent, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != LOCK_ENV} | {
        "SCOPE_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    overrides = {**FAST, "run.runs_dir": str(tmp_path / "runs"), "run.data_dir": str(wiki_sample.parent)}
    command = [sys.executable, "-m", "scope_lib.cli", "train", SMOKE]
    for key, value in overrides.items():
        command += ["-o", f"{key}={value}"]
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while "\nPASS" not in log.read_text():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the index check never passed"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    finally:
        process.kill()
        process.wait()
    text = log.read_text()
    stopped = [line for line in text.splitlines() if line.startswith("stopped:")]
    assert code == 143 and len(stopped) == 1 and "Traceback" not in text, text[-3000:]
    assert "SIGTERM" in stopped[0] and "scope train" in stopped[0] and "to resume" in stopped[0]
    assert f"run.runs_dir={tmp_path / 'runs'}" in stopped[0]  # the same command, overrides and all


@pytest.fixture()
def sigterm_stops():
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm()
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_during_a_record_write_lets_the_write_finish_then_stops(tmp_path, monkeypatch, sigterm_stops):
    log = RecordLog(tmp_path / "rollouts.jsonl")
    real_fsync = os.fsync

    def fsync_then_sigterm(fd):  # the signal lands in the middle of the append
        os.kill(os.getpid(), signal.SIGTERM)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_then_sigterm)
    with pytest.raises(Stopped):
        log.append([{"id": "a", "text": "x" * 1000}])
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [r["id"] for r in read_jsonl(tmp_path / "rollouts.jsonl")] == ["a"]  # whole, not torn
    finished = []
    with pytest.raises(Stopped):
        with safe_point():  # nested writes (an adapter saved inside a checkpoint): the stop waits for the outermost
            with safe_point():
                os.kill(os.getpid(), signal.SIGTERM)
            finished.append("inner")
        finished.append("after")
    assert finished == ["inner"]
    with pytest.raises(Stopped):  # outside a write: at once
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)


# -- 5. a folder given as the corpus ----------------------------------------------------------------------------


def test_a_folder_given_as_corpus_names_the_key_that_exists(tmp_path, wiki_sample, capsys):
    assert _index_build(tmp_path, wiki_sample, "-o", f"retrieval.corpus={tmp_path}") == 2
    line = _one_error(capsys)
    assert f"{tmp_path} is a folder" in line and "retrieval.corpus must name" in line and "corpus_path" not in line
    with pytest.raises(CorpusError) as caught:  # the reader itself (`scope train`, notebooks)
        read_corpus(tmp_path)
    assert "retrieval.corpus must name" in str(caught.value) and "corpus_path" not in str(caught.value)
    assert load_params(SMOKE, [f"retrieval.corpus={wiki_sample}"]).corpus_path == wiki_sample  # the key is real
    with pytest.raises(ParamsError):
        load_params(SMOKE, [f"retrieval.corpus_path={wiki_sample}"])  # the one the message used to name is not


# -- 6. a read-only run folder ----------------------------------------------------------------------------------


def _assert_read_only_line(line: str, run_dir: Path) -> None:
    assert line.startswith(f"error: {run_dir} is on a read-only file system"), line
    assert "-o run.runs_dir=DIR" in line and "remount it read-write" in line


def test_a_read_only_run_folder_names_the_remedy(small_disk, capsys):
    runs = small_disk("1m")
    (runs / "r" / "iter_01").mkdir(parents=True)  # a run written earlier; the disk is then mounted read-only
    assert subprocess.run(["mount", "-o", "remount,ro", str(runs)], capture_output=True).returncode == 0
    held = os.environ.get(LOCK_ENV)   # an earlier test of this process may hold another run's lock
    for command in ("train", "eval"):
        assert main([command, SMOKE, "-o", f"run.runs_dir={runs}", "-o", "run.name=r"]) == 2
        _assert_read_only_line(_one_error(capsys), runs / "r")
    assert main(["train", SMOKE, "-o", f"run.runs_dir={runs / 'new'}"]) == 2  # a run folder it cannot create
    _assert_read_only_line(_one_error(capsys), runs / "new" / "smoke")
    assert os.environ.get(LOCK_ENV) == held   # no lock was taken


def test_a_read_only_lock_file_names_the_remedy(tmp_path, capsys, monkeypatch):
    """The injected variant (any machine): the lock's own OSError, as the issue met it."""
    from filelock import FileLock

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), self.lock_file)

    monkeypatch.setattr(FileLock, "acquire", read_only)
    held = os.environ.get(LOCK_ENV)   # an earlier test of this process may hold another run's lock
    assert main(["eval", SMOKE, "-o", f"run.runs_dir={tmp_path}", "-o", "run.name=r"]) == 2
    _assert_read_only_line(_one_error(capsys), tmp_path / "r")
    assert os.environ.get(LOCK_ENV) == held   # no lock was taken
