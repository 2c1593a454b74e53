"""The corpus D: wiki-18 passages, read from JSONL, sampled as source documents, fetched with a checksum.

A corpus line is ``{"id": str, "contents": "\\"Title\\"\\npassage text"}`` (the DPR Dec-2018 Wikipedia in
FlashRAG / Search-R1 format). The title is the first line of `contents` (one pair of surrounding double
quotes removed); the text is the rest. Files may be plain or gzip-compressed (detected from the bytes).

    corpus = read_corpus("data/wiki-18.jsonl", on_error="skip", max_passages=100_000)
    documents = sample_documents(corpus.passages, n=64, seed=42, iteration=1)

The full wiki-18 is 21M lines (14 GB): `iter_passages` streams it line by line for indexing.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import itertools
import json
import logging
import os
import random
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse
from urllib.request import url2pathname

import httpx
import numpy as np
from tqdm.auto import tqdm

from scope_lib.config import ParamsError

if TYPE_CHECKING:
    from scope_lib.config import Params, WarmStartConfig

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]

GZIP_MAGIC = b"\x1f\x8b"
CHUNK_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 5.0

SKIP_HINT = ("To skip malformed lines and count them instead, set `retrieval.on_error: skip` in the params "
             "(or pass on_error='skip').")


def _local_files_hint(name: str) -> str:
    return (f"To use a local copy instead, set SCOPE_DATA_DIR to a folder holding {name!r}, "
            f"or set `retrieval.corpus` in the params to the corpus file's path.")


class CorpusError(ValueError):
    """A corpus that cannot be read; the message names the file, the line and what to do."""

    def __init__(self, message: str, problem: CorpusProblem | None = None):
        super().__init__(message)
        self.problem = problem


class FetchError(CorpusError):
    """A corpus that cannot be downloaded; the message says how to point the toolkit at local files."""


class _SourceUnavailable(Exception):
    """The source cannot be opened (HTTP error status, missing file); fetch_corpus adds the local hint."""


# -- passages ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passage:
    """One 100-word Wikipedia passage: a retrieval unit and a candidate source document d."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """The wiki-18 `contents` field: quoted title, newline, text."""
        return f'"{self.title}"\n{self.text}'

    @property
    def document(self) -> str:
        """The source document d as the Challenger sees it."""
        return f"(Title: {self.title})\n{self.text}"

    @classmethod
    def from_contents(cls, id: str, contents: str) -> Passage:
        """Split wiki-18 `contents` into title (first line, unquoted) and text (the rest)."""
        first, _, rest = contents.partition("\n")
        title = first.strip()
        if len(title) >= 2 and title[0] == title[-1] == '"':
            title = title[1:-1]
        return cls(id=id, title=title, text=rest.strip())


@dataclass(frozen=True)
class CorpusProblem:
    """A corpus line that was not a usable passage."""

    path: str
    line: int
    kind: str  # invalid_json | not_object | bad_field | empty_passage | duplicate_id
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Corpus:
    """Passages read from one corpus file, with the problems that were skipped."""

    passages: list[Passage]
    path: Path
    problems: list[CorpusProblem] = field(default_factory=list)

    @cached_property
    def sha256(self) -> str:
        """sha256 of the file bytes (computed on first use: a max_passages read need not hash 14 GB)."""
        return corpus_checksum(self.path)

    def __len__(self) -> int:
        return len(self.passages)

    def __iter__(self) -> Iterator[Passage]:
        return iter(self.passages)

    def summary(self) -> str:
        """One line: '1000 passages, 0 skipped (wiki18_sample.jsonl)'."""
        where = self.path.name
        if self.problems:
            where += "; " + _count_kinds(self.problems)
        return f"{len(self.passages)} passages, {len(self.problems)} skipped ({where})"


def _count_kinds(problems: Iterable[CorpusProblem]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in Counter(p.kind for p in problems).items())


# -- reading ----------------------------------------------------------------------------------------


def read_corpus(path: str | os.PathLike, on_error: OnError = "raise",
                max_passages: int | None = None) -> Corpus:
    """Read a corpus JSONL(.gz) into memory; see `iter_passages` for the rules."""
    problems: list[CorpusProblem] = []
    passages = list(iter_passages(path, on_error, problems, max_passages=max_passages))
    return Corpus(passages=passages, path=Path(path), problems=problems)


def iter_passages(path: str | os.PathLike, on_error: OnError = "raise",
                  problems: list[CorpusProblem] | None = None, *,
                  max_passages: int | None = None) -> Iterator[Passage]:
    """Stream passages from a JSONL(.gz) corpus, one line at a time.

    Blank lines are ignored. Malformed lines, passages without text and duplicate ids are problems:
    on_error="raise" stops at the first with a CorpusError naming file:line; "skip" leaves them out,
    appends them to `problems` and logs one summary at the end.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = Path(path)
    skipped: Counter[str] = Counter()
    first_skipped: CorpusProblem | None = None
    seen = _SeenIds()
    n_passages = 0
    if max_passages is not None and max_passages < 1:
        return
    lines = _numbered_lines(path)
    try:
        for line_no, raw in lines:
            if not raw.strip():
                continue
            passage, problem = _parse_line(raw, seen)
            if problem is not None:
                kind, message = problem
                found = CorpusProblem(str(path), line_no, kind, message)
                if on_error == "raise":
                    raise CorpusError(f"{found}\n{SKIP_HINT}", found)
                skipped[kind] += 1
                first_skipped = first_skipped or found
                if problems is not None:
                    problems.append(found)
                continue
            n_passages += 1
            yield passage
            if n_passages == max_passages:
                return
    finally:
        lines.close()
        if skipped:
            log.warning("%s: skipped %d malformed line(s) (%s); first: %s", path, skipped.total(),
                        ", ".join(f"{kind} {n}" for kind, n in skipped.items()), first_skipped)


def empty_corpus_message(path: str | os.PathLike, on_error: OnError = "raise") -> str:
    """What is said of a corpus file without a single passage (everyone who refuses one says the same)."""
    skipped = ", or only malformed lines, which retrieval.on_error: skip leaves out" if on_error == "skip" else ""
    return (f"{path} holds no passages (an empty file{skipped}): nothing can be indexed or trained on; "
            'retrieval.corpus must name a JSONL file with one {"id": ..., "contents": "title\\ntext"} object per '
            "line: fix the file, or point retrieval.corpus at another")


def require_passages(path: str | os.PathLike, on_error: OnError = "raise") -> None:
    """Refuse a corpus without a single passage before anything is built from it: an empty index passes for
    an index, and once built it is kept. Reads up to the first passage (a missing or malformed file raises as
    `iter_passages` does)."""
    stream = iter_passages(path, on_error, max_passages=1)
    try:
        first = next(stream, None)
    finally:
        stream.close()
    if first is None:
        raise CorpusError(empty_corpus_message(path, on_error))


def _numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) for a plain or gzip file; a broken gzip stream is a CorpusError."""
    if path.is_dir():
        raise CorpusError(f"{path} is a folder: retrieval.corpus must name the corpus file (JSONL, e.g. "
                          "wiki-18.jsonl)")
    if not path.is_file():
        raise CorpusError(f"{path}: no such corpus file. Run `scope data fetch` to download it. "
                          + _local_files_hint(path.name))
    line_no = 0
    with open_binary(path) as f:
        try:
            for line_no, raw in enumerate(f, start=1):
                yield line_no, raw
        except (OSError, EOFError, zlib.error) as exc:
            raise CorpusError(f"{path}:{line_no + 1}: the gzip stream is corrupt or truncated ({exc}); "
                              "fetch the file again") from exc


def open_binary(path: Path) -> IO[bytes]:
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")


def _parse_line(raw: bytes, seen: _SeenIds) -> tuple[Passage | None, tuple[str, str] | None]:
    """A passage, or (kind, message) saying what is wrong with the line."""
    try:
        record = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        return None, ("invalid_json", f"not valid JSON ({exc})")
    if not isinstance(record, dict):
        return None, ("not_object", f"expected a JSON object with 'id' and 'contents', got "
                                    f"{type(record).__name__}")
    for key in ("id", "contents"):
        bad = _field_problem(record, key)
        if bad:
            return None, ("bad_field", bad)
    passage = Passage.from_contents(record["id"], record["contents"])
    if not passage.text:
        return None, ("empty_passage", f"passage {passage.id!r} has no text after its title")
    if not seen.add(passage.id):
        return None, ("duplicate_id", f"duplicate id {passage.id!r} (ids must be unique)")
    return passage, None


def _field_problem(record: dict[str, Any], key: str) -> str | None:
    if key not in record:
        return f"missing {key!r} (a corpus line is {{\"id\": str, \"contents\": str}})"
    value = record[key]
    if not isinstance(value, str):
        return f"{key!r} must be a string, got {type(value).__name__}"
    if key == "id" and not value:
        return "'id' is empty"
    return None


class _SeenIds:
    """Ids seen so far: a bitmap for decimal ids (wiki-18's 21M ids fit in ~3 MB), a set for the rest."""

    _BITMAP_LIMIT = 1 << 28  # ids below this use at most 32 MB of bitmap

    def __init__(self) -> None:
        self._bits = bytearray()
        self._other: set[str] = set()

    def add(self, pid: str) -> bool:
        """Record `pid`; False if it was seen before."""
        if pid.isascii() and pid.isdigit() and len(pid) < 10 and (pid == "0" or pid[0] != "0"):
            number = int(pid)
            if number < self._BITMAP_LIMIT:
                return self._add_number(number)
        if pid in self._other:
            return False
        self._other.add(pid)
        return True

    def _add_number(self, number: int) -> bool:
        index, bit = number >> 3, 1 << (number & 7)
        if index >= len(self._bits):
            self._bits.extend(bytes(max(index + 1 - len(self._bits), len(self._bits))))
        if self._bits[index] & bit:
            return False
        self._bits[index] |= bit
        return True


def corpus_checksum(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# -- sampling source documents (Algorithm 1: sample d ~ D) ------------------------------------------


def permutation_slice(n_total: int, n: int, seed: int, index: int) -> list[int]:
    """Positions 0..n_total-1 of slice `index` (0-based) of a fixed seeded permutation.

    Slice i holds permutation[i*n : (i+1)*n], so consecutive slices never overlap until the permutation
    runs out; then it wraps around (documents repeat) with a logged warning.
    """
    if n_total < 1:
        raise ValueError("cannot sample from an empty corpus")
    if n < 0 or index < 0:
        raise ValueError(f"n and index must be >= 0, got n={n}, index={index}")
    order = list(range(n_total))
    random.Random(seed).shuffle(order)  # Python's shuffle is stable across versions
    start = index * n
    if start + n > n_total:
        log.warning("corpus has %d documents but slice %d of %d needs positions %d..%d: wrapping around, "
                    "documents repeat", n_total, index, n, start, start + n - 1)
    return [order[(start + j) % n_total] for j in range(n)]


@functools.lru_cache(maxsize=4)
def _permutation(n_total: int, seed: int) -> np.ndarray:
    """One fixed permutation of 0..n_total-1 per seed (cached: a run asks for many ranges of it)."""
    return np.random.default_rng(seed).permutation(n_total)


def document_range(passages: Sequence[Passage], start: int, n: int, seed: int, *,
                   limit: int | None = None) -> list[Passage]:
    """Documents at positions start..start+n-1 of the run's one seeded permutation of the corpus.

    Self-play hands out consecutive ranges (Stage 1 prompts, then Stage 2 candidate batches, iteration after
    iteration), so no document is used twice until the corpus runs out; then the ranges wrap (logged). `limit`
    (default: the whole corpus) is where they wrap: positions from `limit` on are never handed out, which is how
    the learning check's held-out tail stays out of training (`held_out_documents`)."""
    if start < 0 or n < 0:
        raise ValueError(f"start and n must be >= 0, got start={start}, n={n}")
    if not passages:
        raise ValueError("cannot sample from an empty corpus")
    order = _permutation(len(passages), seed)
    size = len(order) if limit is None else limit
    if not 0 < size <= len(order):
        raise ValueError(f"limit must be in 1..{len(order)} (the corpus's documents), got {limit}")
    if start + n > size:
        log.warning("%d documents can be sampled but positions %d..%d were asked for: wrapping around, documents "
                    "repeat", size, start, start + n - 1)
    return [passages[int(order[(start + j) % size])] for j in range(n)]


def held_out_documents(passages: Sequence[Passage], n: int, seed: int) -> list[Passage]:
    """The learning check's held-out documents (`learning_check.held_out_documents`): the last n of the run's
    seeded permutation (positions len - n .. len - 1). Training hands out `document_range(..., limit=
    training_documents(...))`, which never reaches them."""
    if not 0 <= n < len(passages):
        raise ValueError(f"cannot hold out {n} of {len(passages)} documents: leave some for training")
    order = _permutation(len(passages), seed)
    return [passages[int(i)] for i in order[len(order) - n:]]


def training_documents(params: Params, n_passages: int) -> int:
    """How many positions of the run's document permutation training may hand out: positions 0..n-1 are
    training's; the last `learning_check.held_out_documents` are the learning check's and never handed out
    (`held_out_documents`)."""
    reserved = params.learning_check.held_out_documents
    if reserved >= n_passages:
        raise ParamsError(f"learning_check.held_out_documents ({reserved}) must be below the corpus's {n_passages} "
                          "passages: lower it, or use a larger corpus")
    return n_passages - reserved


def teacher_split(passages: Sequence[Passage], ws: WarmStartConfig) -> tuple[list[Passage], list[Passage]]:
    """(teacher pool, the teacher's unread share) of the warm start (`model.warm_start`, `scope_lib.smoke.teacher`):
    a permutation of the corpus seeded by `ws.seed`, its last `ws.held_out_share` never read by the teacher. Here,
    below the teacher, so the judges' calibration probes can leave out what the teacher wrote traces from
    (`teacher_documents`). Not the learning check's held-out documents (`held_out_documents`)."""
    order = permutation_slice(len(passages), len(passages), ws.seed, 0)
    cut = len(passages) - int(round(len(passages) * ws.held_out_share))
    return [passages[i] for i in order[:cut]], [passages[i] for i in order[cut:]]


def teacher_documents(passages: Sequence[Passage], ws: WarmStartConfig) -> list[Passage]:
    """The documents a warm start's teacher writes every trace from: the first `ws.documents` of its pool."""
    return teacher_split(passages, ws)[0][:ws.documents]


def unread_by_teacher(passages: Sequence[Passage], ws: WarmStartConfig) -> list[Passage]:
    """The warm start's unread share (`ws.held_out_share`): documents its teacher never writes a trace from, for
    measuring the warmed model on unseen documents."""
    return teacher_split(passages, ws)[1]


def sample_documents(passages: Sequence[Passage], n: int, seed: int, iteration: int, *,
                     exclude: Iterable[str] = ()) -> list[Passage]:
    """The n source documents for self-play iteration `iteration` (1-based).

    One permutation of the passages (minus ids in `exclude`) is fixed by `seed`; iteration 1 gets its
    first n documents, iteration 2 the next n, and so on, so iterations see fresh documents. When the
    corpus runs out the slices wrap around (logged). Same passages, seed and iteration -> same documents.
    """
    if iteration < 1:
        raise ValueError(f"iteration is 1-based, got {iteration}")
    excluded = set(exclude)
    pool = [p for p in passages if p.id not in excluded] if excluded else passages
    if not pool:
        raise ValueError(f"no documents to sample: {len(passages)} passages, {len(excluded)} excluded")
    return [pool[i] for i in permutation_slice(len(pool), n, seed, iteration - 1)]


# -- fetching ---------------------------------------------------------------------------------------


@dataclass
class _Source:
    """Bytes of a corpus source from `start` on; `total` is the full size when known."""

    chunks: Iterator[bytes]
    start: int
    total: int | None


def fetch_corpus(url: str, dest: str | os.PathLike, *, max_passages: int | None = None,
                 sha256: str | None = None, timeout_s: float = 30, progress: bool = True,
                 overwrite: bool = False) -> Path:
    """Download a corpus JSONL(.gz) from an http(s)/file URL or a local path to `dest`.

    Full download: bytes go to `dest.part` (resumed with an HTTP Range request when it exists), are
    checked against `sha256` (the published file's checksum; a mismatch deletes the .part), then
    renamed to `dest`; a gzip source is decompressed when `dest` does not end in .gz.
    With `max_passages`: the first N non-blank lines are streamed (decompressed on the fly) into a slice;
    `sha256` is not checked (it describes the whole file), no resume (slices are small).
    Either way the sha256 of the file written is recorded in `dest.sha256`. An existing `dest` is
    kept unless `overwrite`; an existing `dest.part` is taken to be a prefix of the same source. Network failures raise FetchError quickly, saying how to use local files.
    """
    dest = Path(dest)
    if dest.exists() and not overwrite:
        log.info("%s already exists; keeping it (delete it or pass overwrite=True to fetch again)", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        if max_passages is not None:
            if sha256:
                log.info("fetching a %d-passage slice: the expected sha256 applies to the full file only, "
                         "so it is not checked", max_passages)
            digest = _fetch_slice(url, dest, max_passages, timeout_s, progress)
        else:
            digest = _fetch_full(url, dest, sha256, timeout_s, progress)
    except _SourceUnavailable as exc:
        raise FetchError(f"{exc}. " + _local_files_hint(dest.name)) from None
    except httpx.TransportError as exc:
        raise _network_error(url, dest, exc) from None
    except httpx.HTTPError as exc:
        raise FetchError(f"downloading {url} failed: {exc}. " + _local_files_hint(dest.name)) from None
    _write_sidecar(dest, digest)
    log.info("fetched %s -> %s (sha256 %s)", url, dest, digest)
    return dest


def fetch_data(params: Params, *, overwrite: bool = False, progress: bool = True) -> Path:
    """`scope data fetch`: download `retrieval.corpus_url` to `params.corpus_path` (data dir created)."""
    retrieval = params.retrieval
    return fetch_corpus(retrieval.corpus_url, params.corpus_path, max_passages=retrieval.fetch_max_passages,
                        sha256=retrieval.corpus_sha256, overwrite=overwrite, progress=progress)


def _network_error(url: str, dest: Path, exc: httpx.TransportError) -> FetchError:
    part = _part_path(dest)
    resume = (f" The partial download {part} is kept; run again to resume."
              if part.exists() and part.stat().st_size else "")
    kind = "could not connect to" if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) else \
        "lost the connection to"
    return FetchError(f"{kind} {url} ({type(exc).__name__}: {exc}).{resume} " + _local_files_hint(dest.name))


def _part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _fetch_full(url: str, dest: Path, sha256: str | None, timeout_s: float, progress: bool) -> str:
    part = _part_path(dest)
    raw_digest = _download(url, part, timeout_s, progress)
    if sha256 and raw_digest != sha256.strip().lower():
        part.unlink()
        raise FetchError(f"{url}: sha256 mismatch: expected {sha256.strip().lower()}, got {raw_digest}. "
                         f"The download was deleted. Check `retrieval.corpus_sha256` or the URL.")
    if _is_gzip(part) and not dest.name.endswith(".gz"):
        try:
            digest = _decompress(part, dest, progress)
        except FetchError:
            part.unlink()  # not a usable gzip file
            raise
        part.unlink()
        return digest
    os.replace(part, dest)
    return raw_digest


def _download(url: str, part: Path, timeout_s: float, progress: bool) -> str:
    """Bring `part` up to the full source (resuming what is there); return the sha256 of its bytes."""
    offset = part.stat().st_size if part.exists() else 0
    with _open_source(url, offset, timeout_s) as source:
        if source.start:
            log.info("resuming %s at byte %d", part, source.start)
        digest = _hash_prefix(part, source.start)
        with open(part, "r+b" if source.start else "wb") as out:
            out.seek(source.start)
            out.truncate()
            with _bar(progress, part.name, source.total, source.start, "B") as bar:
                for chunk in source.chunks:
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    size = part.stat().st_size
    if source.total is not None and size != source.total:
        raise FetchError(f"{url}: download stopped at {size} of {source.total} bytes; "
                         f"the partial file {part} is kept: run again to resume.")
    return digest.hexdigest()


def _hash_prefix(path: Path, n_bytes: int) -> Any:
    digest = hashlib.sha256()
    if n_bytes:
        with open(path, "rb") as f:
            while n_bytes > 0 and (chunk := f.read(min(CHUNK_BYTES, n_bytes))):
                digest.update(chunk)
                n_bytes -= len(chunk)
    return digest


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _decompress(source: Path, dest: Path, progress: bool) -> str:
    """gunzip `source` into `dest` atomically; return the sha256 of the decompressed bytes."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    digest = hashlib.sha256()
    try:
        with gzip.open(source, "rb") as f, open(tmp, "wb") as out, \
                _bar(progress, f"decompressing {dest.name}", None, 0, "B") as bar:
            while chunk := f.read(CHUNK_BYTES):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{source}: the downloaded gzip file is corrupt ({exc}); it was deleted. "
                         "Run again, or set `retrieval.corpus_sha256` to catch this before decompressing.") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)  # interrupted or disk full: the verified .part stays for the next run
        raise
    os.replace(tmp, dest)
    return digest.hexdigest()


def _fetch_slice(url: str, dest: Path, max_passages: int, timeout_s: float, progress: bool) -> str:
    """Write the first `max_passages` non-blank lines of the source to `dest`; return its sha256."""
    tmp = dest.with_name(f".{dest.name}.slice.tmp")  # never a .part: that would be resumed as raw bytes
    try:
        n_written = _write_slice(url, tmp, dest, max_passages, timeout_s, progress)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if n_written < max_passages:
        log.warning("%s has only %d passages (asked for %d); wrote all of them", url, n_written, max_passages)
    os.replace(tmp, dest)
    return corpus_checksum(dest)


def _write_slice(url: str, tmp: Path, dest: Path, max_passages: int, timeout_s: float,
                 progress: bool) -> int:
    n_written = 0
    with _open_source(url, 0, timeout_s) as source, _open_output(tmp, dest) as out, \
            _bar(progress, dest.name, max_passages, 0, "passage") as bar:
        try:
            for line in _split_lines(_gunzip_if_needed(source.chunks)):
                if n_written >= max_passages:
                    break
                if line.strip():
                    out.write(line if line.endswith(b"\n") else line + b"\n")
                    n_written += 1
                    bar.update(1)
        except zlib.error as exc:
            raise FetchError(f"{url}: not a valid gzip stream ({exc})") from exc
    return n_written


@contextmanager
def _open_output(tmp: Path, dest: Path) -> Iterator[IO[bytes]]:
    opener = gzip.open if dest.name.endswith(".gz") else open
    with opener(tmp, "wb") as out:
        yield out


def _gunzip_if_needed(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Pass bytes through, or decompress them (multi-member gzip too) if they start with the gzip magic."""
    head = b""
    for chunk in chunks:
        head += chunk
        if len(head) >= 2:
            break
    if head[:2] != GZIP_MAGIC:
        yield head
        yield from chunks
        return
    inflater = zlib.decompressobj(wbits=31)
    for chunk in itertools.chain([head], chunks):
        while chunk:
            yield inflater.decompress(chunk)
            if not inflater.eof:
                break
            chunk = inflater.unused_data  # the next gzip member
            inflater = zlib.decompressobj(wbits=31)


def _split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines (with their b'\\n') from a stream of byte chunks; a last line without newline too."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        lines = pending.split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending


def _write_sidecar(dest: Path, digest: str) -> None:
    """`dest.sha256` in sha256sum format: the checksum of the file this fetch wrote."""
    sidecar = dest.with_name(dest.name + ".sha256")
    tmp = sidecar.with_name(f".{sidecar.name}.tmp")
    tmp.write_text(f"{digest}  {dest.name}\n")
    os.replace(tmp, sidecar)


def _bar(progress: bool, desc: str, total: int | None, initial: int, unit: str) -> tqdm:
    byte_units = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not progress, **byte_units)


# -- sources: http(s), file:// and local paths ------------------------------------------------------


@contextmanager
def _open_source(url: str, offset: int, timeout_s: float) -> Iterator[_Source]:
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        with _open_http(url, offset, timeout_s) as source:
            yield source
    elif scheme in ("file", ""):
        path = Path(url2pathname(urlparse(url).path)) if scheme == "file" else Path(url).expanduser()
        with _open_local(path, offset) as source:
            yield source
    else:
        raise _SourceUnavailable(f"{url}: unsupported URL scheme {scheme!r}; use http(s)://, file:// or a path")


@contextmanager
def _open_local(path: Path, offset: int) -> Iterator[_Source]:
    if not path.is_file():
        raise _SourceUnavailable(f"{path}: no such source file")
    size = path.stat().st_size
    start = offset if offset <= size else 0
    with open(path, "rb") as f:
        f.seek(start)
        yield _Source(iter(lambda: f.read(CHUNK_BYTES), b""), start, size)


@contextmanager
def _open_http(url: str, offset: int, timeout_s: float) -> Iterator[_Source]:
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
    with httpx.Client(follow_redirects=True, timeout=timeout) as client:
        with _get(client, url, offset) as response:
            if response.status_code != 416 or not offset:
                yield _http_source(url, response, offset)
                return
            if _range_total(response.headers.get("content-range", "")) == offset:
                yield _Source(iter(()), offset, offset)  # the .part is already complete
                return
        log.warning("%s: cannot resume at byte %d (416); downloading from the start", url, offset)
        with _get(client, url, 0) as response:
            yield _http_source(url, response, 0)


def _get(client: httpx.Client, url: str, offset: int) -> Any:
    headers = {"Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    return client.stream("GET", url, headers=headers)


def _http_source(url: str, response: httpx.Response, offset: int) -> _Source:
    if response.status_code >= 400:
        raise _SourceUnavailable(f"{url}: HTTP {response.status_code} {response.reason_phrase}")
    chunks = response.iter_raw()  # as received: a dropped connection keeps every byte
    if response.status_code == 206:
        start = _range_start(response.headers.get("content-range", ""))
        if start != offset:
            raise FetchError(f"{url}: asked to resume at byte {offset}, server sent byte {start}; "
                             "delete the .part file and run again")
        return _Source(chunks, start, _range_total(response.headers.get("content-range", "")))
    if offset:
        log.info("%s: server does not support resuming (HTTP Range); downloading from the start", url)
    length = response.headers.get("content-length")
    return _Source(chunks, 0, int(length) if length and length.isdigit() else None)


def _range_start(content_range: str) -> int | None:
    """'bytes 100-199/200' -> 100."""
    spec = content_range.partition(" ")[2]
    first = spec.partition("-")[0]
    return int(first) if first.isdigit() else None


def _range_total(content_range: str) -> int | None:
    """'bytes 100-199/200' or 'bytes */200' -> 200; '*' -> None."""
    total = content_range.rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None
