"""On-disk passages and embeddings for the faiss and bm25 back ends: streamed, sharded, resumable.

A store lives in one directory (``<index_dir>/<collection>``) and is built in stages, each one resumable
after a kill at any point because every file is written to a temporary name and renamed into place, and a
manifest (also renamed into place) records what is complete:

    passages/    shard_00000.jsonl  one JSON ``[id, title, text]`` per line, in corpus order
                 shard_00000.offsets.npy  int64 byte offsets (n + 1) of those lines
                 manifest.json      the corpus fingerprint, the passages per shard, the status
    embeddings/<embedder>/  shard_00000.npy  float32 (n, dim), L2-normalised, row i = passage i
                            manifest.json    embedder, model, dimension, shards done, status
    faiss/<factory>/  index.faiss + manifest.json        (scope_lib.retrieval.faiss_index)
    bm25/<settings>/  bm25s arrays + manifest.json        (scope_lib.retrieval.bm25_index)

Nothing is held in memory but one shard at a time while building, and the offsets (memory-mapped) while
searching: a hit's text is read from disk by offset (`PassageStore.get`), and so is a re-ranked candidate's
embedding (`EmbeddingStore.rows`). A resumed build skips the complete shards (the corpus stream is read past them
without embedding anything) and ends byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from scope_lib.retrieval.corpus import Passage

if TYPE_CHECKING:
    from scope_lib.retrieval.corpus import Passage
    from scope_lib.retrieval.embedders import ScopeEmbedder

log = logging.getLogger(__name__)

#: Bump when the on-disk layout changes, so older stores are rebuilt, not misread.
STORE_FORMAT_VERSION = 1


class StoreMismatchError(RuntimeError):
    """A store on disk was built from other settings; `diffs` names each differing key."""

    def __init__(self, where: Path, diffs: list[str], building: bool) -> None:
        self.where, self.diffs, self.building = where, diffs, building
        what = "an interrupted build of another index" if building else "another index"
        super().__init__(f"{where} holds {what}:\n  " + "\n  ".join(diffs))


# -- small file helpers ---------------------------------------------------------------------------------


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON to a temporary file and rename it over `path` (a kill leaves the old or the new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:  # only a hand-edited file: every write is atomic
        raise RuntimeError(f"{path} is not valid JSON ({exc}); delete the directory and build again") from exc


def differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """'key: index has X, params want Y' for each key of `wanted` that `stored` does not match."""
    return [f"{key.removeprefix('scope_')}: index has {stored.get(key)!r}, params want {value!r}"
            for key, value in wanted.items() if stored.get(key) != value]


def slug(text: str, readable: str | None = None) -> str:
    """A directory name for `text` (settings, a model id): a readable part (default: `text`) + a short hash
    of `text`, e.g. 'IVF1024_SQ8-3fa2c1de'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", readable if readable is not None else text).strip("_")[:48] or "x"
    return f"{name}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def directory_bytes(path: Path) -> int:
    """Bytes of every file under `path` (0 if missing)."""
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- passages -------------------------------------------------------------------------------------------


@dataclass
class StageStats:
    """What one build stage did: 'built', 'resumed' or 'reused', with its counts and seconds."""

    action: str = "reused"
    n_done: int = 0  # items processed by this call
    n_skipped: int = 0  # items found complete on disk (resume)
    seconds: float = 0.0


class PassageStore:
    """Passages on disk, read by offset: nothing but the offsets (memory-mapped) is held in memory."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        manifest = read_json(self.directory / "manifest.json")
        if manifest is None or manifest.get("status") != "complete":
            raise FileNotFoundError(f"no complete passage store at {self.directory}")
        self.manifest = manifest
        self.shard_size: int = int(manifest["shard_passages"])
        self.shard_counts: list[int] = [int(n) for n in manifest["shards"]]
        self.n_passages = sum(self.shard_counts)
        self._offsets: dict[int, np.ndarray] = {}
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self.manifest["fingerprint"])

    def __len__(self) -> int:
        return self.n_passages

    def _shard(self, s: int) -> tuple[np.ndarray, int]:
        with self._lock:
            if s not in self._fds:
                self._offsets[s] = np.load(self.directory / f"shard_{s:05d}.offsets.npy", mmap_mode="r")
                self._fds[s] = os.open(self.directory / f"shard_{s:05d}.jsonl", os.O_RDONLY)
            return self._offsets[s], self._fds[s]

    def get(self, rows: Sequence[int]) -> list[Passage]:
        """The passages at these 0-based corpus positions (each read from disk by its offset)."""
        out = []
        for row in rows:
            row = int(row)
            if not 0 <= row < self.n_passages:
                raise IndexError(f"passage row {row} outside the store's {self.n_passages} passages")
            s, i = divmod(row, self.shard_size)
            offsets, fd = self._shard(s)
            start, end = int(offsets[i]), int(offsets[i + 1])
            pid, title, text = json.loads(os.pread(fd, end - start, start))
            out.append(Passage(id=pid, title=title, text=text))
        return out

    def iter_shard(self, s: int) -> list[Passage]:
        """Every passage of shard `s`, in order (one sequential read)."""
        with open(self.directory / f"shard_{s:05d}.jsonl", "rb") as f:
            return [Passage(*json.loads(line)) for line in f]

    def __iter__(self) -> Iterator[Passage]:
        for s in range(len(self.shard_counts)):
            yield from self.iter_shard(s)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._offsets.clear()


def _encode_shard(passages: list[Passage]) -> tuple[bytes, np.ndarray]:
    lines = [json.dumps([p.id, p.title, p.text], ensure_ascii=False).encode() + b"\n" for p in passages]
    offsets = np.zeros(len(lines) + 1, dtype=np.int64)
    np.cumsum([len(line) for line in lines], out=offsets[1:])
    return b"".join(lines), offsets


def _open_build(directory: Path, wanted: dict[str, Any], fresh: dict[str, Any]) -> tuple[dict[str, Any], StageStats]:
    """The manifest of a resumable shard build under `directory`: a new one (with the `fresh` fields) when
    none exists; the existing one when its fingerprint equals `wanted` (status "complete": reuse it; else
    resume); StoreMismatchError when it differs."""
    manifest = read_json(directory / "manifest.json")
    if manifest is None:
        manifest = {"fingerprint": wanted, **fresh, "shards": [], "status": "building"}
        write_json_atomic(directory / "manifest.json", manifest)
        return manifest, StageStats(action="built")
    diffs = differences(manifest["fingerprint"], wanted)
    if diffs:
        raise StoreMismatchError(directory, diffs, manifest.get("status") != "complete")
    if manifest["status"] == "complete":
        return manifest, StageStats(n_skipped=sum(manifest["shards"]))
    return manifest, StageStats(action="resumed")


def build_passage_store(passages: Iterable[Passage], directory: str | os.PathLike, fingerprint: dict[str, Any],
                        shard_passages: int, *, progress: bool = True, total: int | None = None
                        ) -> tuple[PassageStore, StageStats]:
    """Write `passages` (a lazy stream in corpus order) as shards under `directory`; resume an interrupted
    write with the same fingerprint; reuse a complete one. Another fingerprint raises StoreMismatchError."""
    directory = Path(directory)
    manifest_path = directory / "manifest.json"
    wanted = {**fingerprint, "scope_store_format": STORE_FORMAT_VERSION, "scope_shard_passages": shard_passages}
    started = time.perf_counter()
    manifest, stats = _open_build(directory, wanted, {"shard_passages": shard_passages})
    if manifest["status"] == "complete":
        return PassageStore(directory), stats
    done = list(manifest["shards"])
    skip = sum(done)
    if skip:
        log.info("passages at %s: resuming after %d passages (%d shards)", directory, skip, len(done))
    stats.n_skipped = skip
    stream = iter(passages)
    with tqdm(total=total, desc="passages to disk", unit="passage", disable=not progress) as bar:
        for _ in range(skip):  # read past the complete shards (parsed, not stored)
            if next(stream, None) is None:
                raise RuntimeError(f"{directory}: the corpus has fewer passages than the interrupted build "
                                   f"stored ({skip}); the corpus changed - rebuild")
        bar.update(skip)
        while True:
            batch = list(islice(stream, shard_passages))
            if not batch:
                break
            blob, offsets = _encode_shard(batch)
            s = len(done)
            shard = directory / f"shard_{s:05d}.jsonl"
            tmp = _tmp(shard)
            tmp.write_bytes(blob)
            os.replace(tmp, shard)
            save_npy_atomic(directory / f"shard_{s:05d}.offsets.npy", offsets)
            done.append(len(batch))
            write_json_atomic(manifest_path, {**manifest, "shards": done})
            stats.n_done += len(batch)
            bar.update(len(batch))
            if len(batch) < shard_passages:
                break
    if not done or sum(done) == 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError("the corpus holds no passages: nothing to index (check retrieval.corpus and "
                           "retrieval.on_error)")
    write_json_atomic(manifest_path, {**manifest, "shards": done, "status": "complete",
                                      "n_passages": sum(done), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    stats.seconds = time.perf_counter() - started
    return PassageStore(directory), stats


# -- embeddings -----------------------------------------------------------------------------------------


def embedding_text(passage: Passage) -> str:
    """What a dense back end embeds for a passage: its wiki-18 `contents` (quoted title, newline, text), as
    the authors' e5_Flat index and Search-R1 do (the embedder adds its own "passage: " prefix)."""
    return passage.contents


class EmbeddingStore:
    """Float32 embeddings of a PassageStore, one .npy per passage shard. Rows are read from disk by offset
    (`rows`, for re-ranking and training samples) or a shard at a time (`load_shard`, for builds); nothing is
    memory-mapped, because mapped pages count as the process's resident memory (and read-ahead maps whole
    files), which would blur what an index really needs."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        manifest = read_json(self.directory / "manifest.json")
        if manifest is None or manifest.get("status") != "complete":
            raise FileNotFoundError(f"no complete embeddings at {self.directory}")
        self.manifest = manifest
        self.dimension = int(manifest["dimension"])
        self.shard_counts = [int(n) for n in manifest["shards"]]
        self.shard_size = int(manifest["shard_passages"])
        self.n_vectors = sum(self.shard_counts)
        self._files: dict[int, tuple[int, int]] = {}  # shard -> (fd, byte offset of row 0)
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self.manifest["fingerprint"])

    def load_shard(self, s: int) -> np.ndarray:
        """Shard `s` read into memory, (n_s, dim)."""
        return np.load(self.directory / f"shard_{s:05d}.npy")

    def _file(self, s: int) -> tuple[int, int]:
        with self._lock:
            if s not in self._files:
                path = self.directory / f"shard_{s:05d}.npy"
                with open(path, "rb") as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        np.lib.format.read_array_header_1_0(f)
                    else:
                        np.lib.format.read_array_header_2_0(f)
                    offset = f.tell()
                self._files[s] = (os.open(path, os.O_RDONLY), offset)
            return self._files[s]

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """The embeddings of these passage rows, (len(rows), dim), each read from disk by its offset."""
        rows = np.asarray(rows, dtype=np.int64).ravel()
        width = self.dimension * 4
        out = np.empty((len(rows), self.dimension), dtype=np.float32)
        for i, row in enumerate(rows.tolist()):
            s, local = divmod(row, self.shard_size)
            fd, offset = self._file(s)
            out[i] = np.frombuffer(os.pread(fd, width, offset + local * width), dtype=np.float32)
        return out

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        """n rows drawn without replacement (seeded), in row order; all rows when n >= the total. Read one
        shard at a time: the peak is one shard plus the sample."""
        if n >= self.n_vectors:
            return np.concatenate([self.load_shard(s) for s in range(len(self.shard_counts))])
        rows = np.sort(np.random.default_rng(seed).choice(self.n_vectors, size=n, replace=False))
        shards, local = np.divmod(rows, self.shard_size)
        parts = []
        for s in np.unique(shards):
            parts.append(self.load_shard(int(s))[local[shards == s]])
        return np.concatenate(parts)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._files.values():
                os.close(fd)
            self._files.clear()


def embeddings_fingerprint(embedder: ScopeEmbedder, passages: PassageStore) -> dict[str, Any]:
    return {"scope_embedder": embedder.name(), "scope_embedder_model": embedder.model_id,
            "scope_embedded_text": "contents", "scope_passages_sha256": _passages_key(passages)}


def _passages_key(passages: PassageStore) -> str:
    fp = json.dumps(passages.fingerprint, sort_keys=True) + json.dumps(passages.shard_counts)
    return hashlib.sha256(fp.encode()).hexdigest()


def build_embeddings(passages: PassageStore, embedder: ScopeEmbedder, directory: str | os.PathLike, *,
                     batch_size: int = 256, progress: bool = True) -> tuple[EmbeddingStore, StageStats]:
    """Embed every passage shard not yet on disk (batched, `batch_size` texts per embedder call), one .npy
    per shard written atomically; a complete store with the same fingerprint is reused."""
    directory = Path(directory)
    manifest_path = directory / "manifest.json"
    wanted = embeddings_fingerprint(embedder, passages)
    started = time.perf_counter()
    manifest, stats = _open_build(directory, wanted, {"shard_passages": passages.shard_size, "dimension": None})
    if manifest["status"] == "complete":
        return EmbeddingStore(directory), stats
    done = list(manifest["shards"])
    dimension = manifest.get("dimension")
    stats.n_skipped = sum(done)
    with tqdm(total=passages.n_passages, initial=stats.n_skipped, desc=f"embedding ({embedder.name()})",
              unit="passage", disable=not progress) as bar:
        for s in range(len(done), len(passages.shard_counts)):
            texts = [embedding_text(p) for p in passages.iter_shard(s)]
            parts = []
            for i in range(0, len(texts), batch_size):
                parts.append(np.asarray(embedder.embed_documents(texts[i:i + batch_size]), dtype=np.float32))
                bar.update(len(parts[-1]))
            vectors = np.concatenate(parts)
            if vectors.shape[0] != len(texts) or (dimension is not None and vectors.shape[1] != dimension):
                raise RuntimeError(f"embedder {embedder.describe()} returned {vectors.shape} for shard {s} "
                                   f"of {len(texts)} passages (dimension {dimension})")
            dimension = int(vectors.shape[1])
            save_npy_atomic(directory / f"shard_{s:05d}.npy", vectors)
            done.append(len(texts))
            manifest = {**manifest, "shards": done, "dimension": dimension}
            write_json_atomic(manifest_path, manifest)
            stats.n_done += len(texts)
    write_json_atomic(manifest_path, {**manifest, "status": "complete"})
    stats.seconds = time.perf_counter() - started
    return EmbeddingStore(directory), stats


__all__ = [
    "EmbeddingStore", "PassageStore", "StageStats", "StoreMismatchError", "build_embeddings",
    "build_passage_store", "differences", "directory_bytes", "embedding_text", "read_json",
    "save_npy_atomic", "slug", "write_json_atomic",
]
