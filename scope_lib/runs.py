"""Run directories and artifacts: atomic writes, append-only JSONL records, stage sentinels, resume.

A stage directory holds `<name>.jsonl` record files and a `DONE` sentinel. Records carry ids that link
document -> task -> rubrics -> rollouts -> grades. A run killed mid-stage resumes from its records: a
torn last line (the kill landed mid-write) is dropped, finished ids are skipped, none is written twice.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
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


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class RecordLog:
    """An append-only JSONL file of records, each with a unique string `id`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
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
