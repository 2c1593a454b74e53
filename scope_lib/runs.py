"""Run directories and artifacts: atomic writes, append-only JSONL records, stage sentinels, resume.

A stage directory holds `<name>.jsonl` record files and a `DONE` sentinel. Records carry ids that link
document -> task -> rubrics -> rollouts -> grades. A run killed mid-stage resumes from its records: a
torn last line (the kill landed mid-write) is dropped, finished ids are skipped, none is written twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write via a temporary file in the same folder and rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Replace a JSONL file atomically (for artifacts rewritten whole, e.g. an exploration's rollouts)."""
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records))


def build_directory(final: str | os.PathLike, build: Callable[[Path], Any], *, marker: str = "config.json") -> Path:
    """`final`, built on first use by `build(tmp)` in a temporary folder beside it and renamed into place, so a
    reader never sees a half-built folder (a model, a cache entry). A folder holding `marker` is finished and
    returned as it is; when two processes build at once, the first rename wins and the other build is dropped."""
    import tempfile

    final = Path(final)
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache entry is shared like any model folder
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():
                raise
            log.info("%s was built concurrently; using that one", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class RecordLog:
    """An append-only JSONL file of records, each with a unique string `id`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()  # an empty log is a file too: readers need not tell "none yet" from "missing"
        self._ids = {r["id"] for r in self._read(repair=True)}

    def _read(self, repair: bool = False) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        good_bytes = 0
        with open(self.path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # torn final write
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                good_bytes += len(line)
                yield record
        if repair and good_bytes < self.path.stat().st_size:
            log.warning("%s: dropping a torn final record (%d bytes) left by an interrupted write",
                        self.path, self.path.stat().st_size - good_bytes)
            with open(self.path, "r+b") as f:
                f.truncate(good_bytes)

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
        records = list(self._read(repair=True))
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
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in fresh))
                f.flush()
                os.fsync(f.fileno())
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
        return RecordLog(self.path / f"{name}.jsonl")

    def mark_done(self, summary: dict[str, Any] | None = None) -> None:
        atomic_write_json(self.path / "DONE", summary or {})

    @property
    def summary(self) -> dict[str, Any]:
        """What `mark_done` recorded ({} while the stage is not done)."""
        return json.loads((self.path / "DONE").read_text()) if self.done else {}

    def reset(self) -> None:
        """Remove everything an unfinished attempt left, so the stage restarts from its own start."""
        if self.done:
            raise RuntimeError(f"{self.path}: refusing to reset a finished stage")
        for child in self.path.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def iteration_dir(run_dir: str | os.PathLike, iteration: int) -> Path:
    """runs/<name>/iter_NN: one folder per self-play iteration (1-based)."""
    return Path(run_dir) / f"iter_{iteration:02d}"


# -- the run manifest --------------------------------------------------------------------------------

MANIFEST_PACKAGES = ("scope-lib", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "chromadb",
                     "sentence-transformers", "vllm", "unsloth", "faiss-cpu", "bm25s")


def package_versions(names: Iterable[str] = MANIFEST_PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


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
                   **facts: Any) -> Path:
    """runs/<name>/manifest.json: package versions, git sha, the params hash and whatever else the run states
    (seeds, corpus and index fingerprints, Judge models). The hash is over `science` (the parameters that
    decide results; default all of them). Resuming a run with different parameters is an error: results
    would mix two configurations."""
    run_dir = Path(run_dir)
    path = run_dir / "manifest.json"
    digest = params_hash(params_yaml if science is None else science)
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous.get("params_hash") not in (None, digest):
            raise RuntimeError(
                f"{run_dir} was started with other parameters (params hash {previous['params_hash'][:12]} vs "
                f"{digest[:12]} now; the earlier ones are in {run_dir / 'params.yaml'}). Resuming would mix two "
                "configurations: choose another run.name, or delete the folder to start over.")
    atomic_write_text(run_dir / "params.yaml", params_yaml)
    manifest = {"params_hash": digest, "packages": package_versions(), "git": git_state(), **facts}
    atomic_write_json(path, manifest)
    return path
