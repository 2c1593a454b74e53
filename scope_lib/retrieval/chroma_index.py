"""`retrieval.backend: chroma` (the default): a chromadb collection, embedded (`PersistentClient` in
``<run_dir>/index``) or a `chroma run` server (`HttpClient`), HNSW with cosine distance over normalised embeddings.

    retriever = build_index(passages, cfg, corpus_sha256=sha, path=folder)   # or: index.build_or_open_index(params)

The index fingerprint (corpus sha256 and slice, embedder and model, HNSW build settings) is stored in the
collection metadata. It is written in two steps: ``scope_status="building"`` with the fingerprint before
the first add, ``"complete"`` with the passage count after the last one. Reopening a complete index with
the same fingerprint reuses it without embedding anything; a different fingerprint is an error unless
``rebuild=True``. An interrupted build (status still "building", same fingerprint) is RESUMED: passages
are added in corpus order, so the ones already in the collection are skipped without being embedded (the
last batch before the resume point is checked id by id), and the final count is verified.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from scope_lib.config import RetrievalConfig
from scope_lib.retrieval.api import (
    REBUILD_HINT,
    BuildStats,
    Hit,
    IndexMismatchError,
    RetrievalError,
    RetrieverUnavailable,
    dense_search,
)
from scope_lib.retrieval.embedders import SPACE, ScopeEmbedder, make_embedder
from scope_lib.retrieval.store import embedding_text

if TYPE_CHECKING:
    from scope_lib.retrieval.corpus import Passage

log = logging.getLogger(__name__)


#: Bump when the way passages are stored or embedded changes, so older indexes are rebuilt, not reused.
#: 2: passages are embedded as their `contents` (title + text), as the authors' index is (was: text only).
INDEX_FORMAT_VERSION = 2


def index_fingerprint(cfg: RetrievalConfig, corpus_sha256: str, embedder: ScopeEmbedder) -> dict[str, Any]:
    """What an index must have been built from to be reused: corpus bytes and slice, embedder, HNSW graph."""
    return {
        "scope_format": INDEX_FORMAT_VERSION,
        "scope_corpus_sha256": corpus_sha256,
        "scope_max_passages": cfg.max_passages or 0,  # 0 = all
        "scope_on_error": cfg.on_error,
        "scope_embedder": embedder.name(),
        "scope_embedder_model": embedder.model_id,
        "scope_space": SPACE,
        "scope_hnsw_max_neighbors": cfg.hnsw_max_neighbors,
        "scope_hnsw_ef_construction": cfg.hnsw_ef_construction,
    }


def fingerprint_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    diffs = []
    for key, value in wanted.items():
        if stored.get(key) != value:
            diffs.append(f"{key.removeprefix('scope_')}: index has {stored.get(key)!r}, params want {value!r}")
    return diffs


def make_chroma_client(cfg: RetrievalConfig, path: str | os.PathLike | None = None) -> Any:
    """An embedded PersistentClient at `path` (chroma_mode=embedded) or an HttpClient (chroma_mode=server)."""
    import chromadb
    from chromadb.config import Settings

    settings = Settings(anonymized_telemetry=False)
    if cfg.chroma_mode == "embedded":
        if path is None:
            raise ValueError("an embedded chroma index needs a path (the run's index directory)")
        Path(path).mkdir(parents=True, exist_ok=True)
        return chromadb.PersistentClient(path=str(path), settings=settings)
    where = f"http://{cfg.chroma_host}:{cfg.chroma_port}"
    try:
        client = chromadb.HttpClient(host=cfg.chroma_host, port=cfg.chroma_port, settings=settings)
        client.heartbeat()
    except Exception as exc:  # chromadb raises its own and httpx's errors here
        raise RetrieverUnavailable(
            f"cannot reach the chroma server at {where} ({type(exc).__name__}: {exc}). Start one with "
            f"`chroma run --path DIR --host {cfg.chroma_host} --port {cfg.chroma_port}`, or set "
            "retrieval.chroma_mode: embedded.") from exc
    return client


class ChromaRetriever:
    """A chromadb collection of passages (id, text as document, title as metadata) searched with HNSW."""

    def __init__(self, client: Any, collection: Any, embedder: ScopeEmbedder, top_k: int = 3,
                 build_stats: BuildStats | None = None) -> None:
        self.client = client
        self.collection = collection
        self.embedder = embedder
        self.top_k = top_k
        self.build_stats = build_stats or BuildStats()

    def search(self, queries: list[str], k: int | None = None) -> list[list[Hit]]:
        return dense_search(self, queries, k)

    def search_embeddings(self, embeddings: np.ndarray, k: int | None = None, *,
                          into: list[list[Hit]] | None = None, rows: list[int] | None = None) -> list[list[Hit]]:
        """Search with precomputed query embeddings (one row per query): one chroma query for all."""
        k = k or self.top_k
        found = self.collection.query(query_embeddings=np.asarray(embeddings, dtype=np.float32), n_results=k,
                                      include=["documents", "metadatas", "distances"])
        rows = rows if rows is not None else list(range(len(found["ids"])))
        into = into if into is not None else [[] for _ in rows]
        for row, ids, docs, metas, dists in zip(rows, found["ids"], found["documents"], found["metadatas"],
                                                found["distances"], strict=True):
            into[row] = [Hit(id=i, title=str((m or {}).get("title", "")), text=d or "", score=1.0 - float(dist))
                         for i, d, m, dist in zip(ids, docs, metas, dists, strict=True)]
        return into

    def count(self) -> int:
        """Passages in the index."""
        return int(self.collection.count())

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self.collection.metadata or {})

    def describe(self) -> str:
        """'wiki18: 1,000 passages, scope-e5 (intfloat/e5-base-v2), ef_search 128'."""
        hnsw = (self.collection.configuration_json or {}).get("hnsw") or {}
        return (f"{self.collection.name}: {self.count():,} passages, {self.embedder.describe()}, "
                f"ef_search {hnsw.get('ef_search')}")


def _batches(items: Iterable[Passage], size: int) -> Iterator[list[Passage]]:
    batch: list[Passage] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _hnsw_configuration(cfg: RetrievalConfig) -> dict[str, Any]:
    return {"hnsw": {"space": SPACE, "ef_construction": cfg.hnsw_ef_construction,
                     "max_neighbors": cfg.hnsw_max_neighbors, "ef_search": cfg.hnsw_ef_search}}


def build_index(passages: Iterable[Passage], cfg: RetrievalConfig, *, corpus_sha256: str,
                path: str | os.PathLike | None = None, client: Any = None,
                embedder: ScopeEmbedder | None = None, rebuild: bool = False, progress: bool = True,
                total: int | None = None) -> ChromaRetriever:
    """Open the index `cfg.collection`, or build it from `passages` (a list or a lazy stream).

    `passages` must be the corpus read with `cfg.on_error` and `cfg.max_passages`, and `corpus_sha256`
    the corpus file's checksum: both go into the fingerprint. A complete index with the same fingerprint
    is reused and `passages` is not read. An interrupted build with the same fingerprint is resumed. An
    index with another fingerprint raises IndexMismatchError. `rebuild` deletes any existing index first.
    `client` defaults to `make_chroma_client(cfg, path)`; `embedder` to `make_embedder(cfg)`.
    """
    started = time.perf_counter()
    owns_client = client is None
    client = client if client is not None else make_chroma_client(cfg, path)
    embedder = embedder if embedder is not None else make_embedder(cfg)
    wanted = index_fingerprint(cfg, corpus_sha256, embedder)
    where = f"{path or f'{cfg.chroma_host}:{cfg.chroma_port}'} (collection {cfg.collection!r})"
    existing = get_collection(client, cfg.collection)
    stats = BuildStats(action="built")
    skip = 0
    if existing is not None:
        stored = dict(existing.metadata or {})
        diffs = fingerprint_differences(stored, wanted)
        status = stored.get("scope_status")
        if diffs and all(d.startswith("format:") for d in diffs):  # an older layout: unusable, rebuild it
            log.warning("the index at %s has an older format (%s); rebuilding it", where, diffs[0])
            rebuild = True
        if diffs and not rebuild:
            what = "an interrupted build of another index" if status == "building" else "another index"
            raise IndexMismatchError(f"the retrieval index at {where} holds {what}:\n  " + "\n  ".join(diffs)
                                     + f"\n{REBUILD_HINT}")
        if rebuild:
            log.info("rebuilding the index at %s", where)
            client.delete_collection(cfg.collection)
            existing, stats.action = None, "rebuilt"
        elif status == "complete":
            n_stored, n_now = stored.get("scope_n_passages"), existing.count()
            if n_stored != n_now:
                raise IndexMismatchError(f"the retrieval index at {where} is marked complete with {n_stored} "
                                         f"passages but holds {n_now}. {REBUILD_HINT}")
            if _apply_ef_search(existing, cfg) and owns_client and cfg.chroma_mode == "embedded":
                # chroma keeps a loaded collection's HNSW settings until its client system stops: reload
                client.close()
                client = make_chroma_client(cfg, path)
                existing = client.get_collection(cfg.collection, embedding_function=None)
            stats = BuildStats(action="reused", n_passages=n_now, total_s=time.perf_counter() - started)
            log.info("reusing the retrieval index at %s: %d passages", where, n_now)
            return ChromaRetriever(client, existing, embedder, cfg.top_k, stats)
        else:  # same fingerprint, build interrupted: resume
            skip, stats.action = existing.count(), "resumed"
            _apply_ef_search(existing, cfg)
            log.info("resuming the interrupted build of %s after %d passages", where, skip)
    collection = existing
    if collection is None:
        collection = client.create_collection(cfg.collection, configuration=_hnsw_configuration(cfg),
                                              metadata={**wanted, "scope_status": "building"},
                                              embedding_function=embedder)
    if total is None and hasattr(passages, "__len__"):
        total = len(passages)  # type: ignore[arg-type]
    _add_all(collection, passages, cfg, embedder, client, skip, stats, progress, total)
    n_final = collection.count()
    expected = stats.n_skipped + stats.n_added
    if n_final != expected:
        raise RetrievalError(f"the index at {where} holds {n_final} passages after the build, expected "
                             f"{expected} (duplicate ids in the corpus, or a damaged resume). {REBUILD_HINT}")
    collection.modify(metadata={**wanted, "scope_status": "complete", "scope_n_passages": n_final,
                                "scope_built_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    stats.n_passages = n_final
    stats.total_s = time.perf_counter() - started
    log.info("index %s %s", cfg.collection, stats.summary())
    return ChromaRetriever(client, collection, embedder, cfg.top_k, stats)


def get_collection(client: Any, name: str) -> Any:
    from chromadb.errors import NotFoundError

    try:
        return client.get_collection(name, embedding_function=None)
    except (NotFoundError, ValueError):
        return None


def _apply_ef_search(collection: Any, cfg: RetrievalConfig) -> bool:
    """ef_search is a search-time knob: store the params' value in a reused index; True if it changed.

    chromadb applies a changed ef_search when the collection is next loaded (a new client system, e.g.
    the next process); `build_index` reloads its own embedded client so that it applies at once.
    """
    hnsw = (collection.configuration_json or {}).get("hnsw") or {}
    if hnsw.get("ef_search") == cfg.hnsw_ef_search:
        return False
    log.info("index %s: ef_search %s -> %d", collection.name, hnsw.get("ef_search"), cfg.hnsw_ef_search)
    collection.modify(configuration={"hnsw": {"ef_search": cfg.hnsw_ef_search}})
    return True


def _add_all(collection: Any, passages: Iterable[Passage], cfg: RetrievalConfig, embedder: ScopeEmbedder,
             client: Any, skip: int, stats: BuildStats, progress: bool, total: int | None) -> None:
    add_batch = max(1, min(cfg.add_batch_size, int(client.get_max_batch_size())))
    stream = iter(passages)
    with tqdm(total=total, desc=f"indexing {cfg.collection}", unit="passage", disable=not progress,
              initial=0) as bar:
        if skip:
            tail = _skip_indexed(stream, skip, add_batch, bar)
            missing = _missing(collection, tail)
            stats.n_skipped = skip
            if missing:  # a partly written last batch (chroma adds are atomic, so this is defensive)
                log.warning("resume: %d passages of the last batch were missing; adding them", len(missing))
                stats.n_skipped -= len(missing)
                _add_batch(collection, missing, embedder, cfg, stats)
        for batch in _batches(stream, add_batch):
            _add_batch(collection, batch, embedder, cfg, stats)
            bar.update(len(batch))


def _skip_indexed(stream: Iterator[Passage], skip: int, window: int, bar: tqdm) -> list[Passage]:
    """Advance `stream` past `skip` passages without embedding them; return the last `window` of them."""
    tail: deque[Passage] = deque(maxlen=window)
    for n, passage in enumerate(stream, start=1):
        tail.append(passage)
        if n == skip:
            break
    bar.update(skip)
    return list(tail)


def _missing(collection: Any, passages: list[Passage]) -> list[Passage]:
    if not passages:
        return []
    present = set(collection.get(ids=[p.id for p in passages], include=[])["ids"])
    return [p for p in passages if p.id not in present]


def _add_batch(collection: Any, batch: list[Passage], embedder: ScopeEmbedder, cfg: RetrievalConfig,
               stats: BuildStats) -> None:
    t0 = time.perf_counter()
    size = cfg.embed_batch_size
    embeddings = np.concatenate([embedder.embed_documents([embedding_text(p) for p in batch[i:i + size]])
                                 for i in range(0, len(batch), size)])
    t1 = time.perf_counter()
    collection.add(ids=[p.id for p in batch], embeddings=embeddings, documents=[p.text for p in batch],
                   metadatas=[{"title": p.title} for p in batch])
    stats.embed_s += t1 - t0
    stats.add_s += time.perf_counter() - t1
    stats.n_added += len(batch)
