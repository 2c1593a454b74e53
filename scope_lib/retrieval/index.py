"""Opening a run's retrieval index from its params: the one place that dispatches on `retrieval.backend`.

    retriever = open_retriever(params)          # the local index (built once, then reused) or a /retrieve server
    retriever = build_or_open_index(params)     # `scope index build`: chroma, faiss or bm25
    retriever = open_index(params)              # never builds: missing or mismatched indexes are errors

Backends (chroma_index, faiss_index, bm25_index, http_client) import the API module, never this one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scope_lib.config import RetrievalConfig
from scope_lib.retrieval.api import (
    REBUILD_HINT,
    BuildStats,
    IndexMismatchError,
    IndexTooLargeError,
    LocalRetriever,
    RetrievalError,
    Retriever,
)
from scope_lib.retrieval.bm25_index import bm25_key, build_bm25_index, open_bm25
from scope_lib.retrieval.chroma_index import (
    build_index,
    fingerprint_differences,
    get_collection,
    index_fingerprint,
    make_chroma_client,
)
from scope_lib.retrieval.corpus import corpus_checksum, iter_passages, require_passages
from scope_lib.retrieval.embedders import ScopeEmbedder, make_embedder
from scope_lib.retrieval.faiss_index import build_faiss_index, index_key, open_faiss
from scope_lib.retrieval.http_client import HttpRetriever
from scope_lib.retrieval.plan import plan_index
from scope_lib.retrieval.store import (
    EmbeddingStore,
    PassageStore,
    StoreMismatchError,
    build_embeddings,
    build_passage_store,
    differences,
    read_json,
    slug,
)
from scope_lib.runs import writing

if TYPE_CHECKING:
    from scope_lib.config import Params

log = logging.getLogger(__name__)


def index_path(params: Params) -> Path:
    """Where a run's local indexes live: `retrieval.index_dir`, else <run_dir>/index. The embedded chroma
    store is this directory; a faiss or bm25 store is its <collection>/ subdirectory."""
    configured = params.retrieval.index_dir
    if configured:
        return Path(os.path.expandvars(os.path.expanduser(configured)))
    return Path(params.run_dir) / "index"


def store_path(params: Params) -> Path:
    """The faiss / bm25 store of a run: passages, embeddings and indexes (see `scope_lib.retrieval.store`)."""
    return index_path(params) / params.retrieval.collection


def corpus_sha_cache(params: Params) -> Path:
    """Where a build of the configured backend remembers the corpus checksum (so opening or checking an index does
    not hash a 14 GB corpus again): the store of faiss and bm25, the embedded chroma folder, else the run folder."""
    cfg = params.retrieval
    if cfg.backend in ("faiss", "bm25"):
        return store_path(params)
    if cfg.backend == "chroma" and cfg.chroma_mode == "embedded":
        return index_path(params)
    return Path(params.run_dir)


def cached_corpus_sha256(corpus_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The corpus file's sha256, remembered in `cache_dir` by (path, size, mtime) so reopening an index
    over a 14 GB corpus does not hash it again."""
    path = Path(corpus_path)
    stat = path.stat()
    key = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cache = Path(cache_dir) / "corpus_sha256.json" if cache_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            stored = json.loads(cache.read_text())
            if {k: stored.get(k) for k in key} == key:
                return str(stored["sha256"])
        except (json.JSONDecodeError, KeyError, TypeError):
            pass
    digest = corpus_checksum(path)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp")
        tmp.write_text(json.dumps({**key, "sha256": digest}) + "\n")
        os.replace(tmp, cache)
    return digest


def _corpus_file(params: Params) -> Path:
    corpus = Path(params.corpus_path)
    if corpus.is_dir():
        require_passages(corpus)  # the corpus reader's own line: a folder, retrieval.corpus names the file
    if not corpus.is_file():
        raise RetrievalError(f"corpus {corpus} not found: run `scope data fetch --params PARAMS`, or point "
                             "retrieval.corpus (or $SCOPE_DATA_DIR) at a wiki-18 style JSONL file")
    return corpus


def passages_fingerprint(cfg: RetrievalConfig, corpus_sha256: str) -> dict[str, Any]:
    """What a passage store must have been built from: the corpus bytes and the slice read from them."""
    return {"scope_corpus_sha256": corpus_sha256, "scope_max_passages": cfg.max_passages or 0,
            "scope_on_error": cfg.on_error}


def build_or_open_index(params: Params, rebuild: bool = False, progress: bool = True, *, force: bool = False,
                        embedder: ScopeEmbedder | None = None) -> LocalRetriever:
    """`scope index build`: the run's index for `retrieval.backend` (chroma, faiss or bm25) over
    `params.corpus_path`, built on first use, reused afterwards (fingerprint check), resumed after an
    interruption, rebuilt when `rebuild`. Before a build, the memory plan must fit `retrieval.memory_budget_gb`
    (default: the available RAM), else IndexTooLargeError, unless `force`."""
    cfg = params.retrieval
    if cfg.backend == "http":
        raise RetrievalError(f"retrieval.backend is 'http': the index lives with the server at {cfg.server_url}. "
                             "Build it where the server runs (`scope index build` with backend chroma, faiss "
                             "or bm25), then `scope serve retrieval` there.")
    corpus = _corpus_file(params)
    require_passages(corpus, cfg.on_error)  # before anything is built: an empty index would pass for one
    if not force and (rebuild or not index_is_built(params)):
        _refuse_if_too_big(params)
    if cfg.backend in ("faiss", "bm25"):
        with writing(store_path(params)):
            return _build_or_open_store(params, corpus, rebuild, progress, embedder)

    path = index_path(params) if cfg.chroma_mode == "embedded" else None
    # chromadb's embedded store reports a full disk as "InternalError: Error in compaction: ..." (issue 36)
    with writing(path if path is not None else Path(params.run_dir), opaque=path is not None):
        sha = cached_corpus_sha256(corpus, corpus_sha_cache(params))
        stream = iter_passages(corpus, cfg.on_error, max_passages=cfg.max_passages)
        try:
            return build_index(stream, cfg, corpus_sha256=sha, path=path, rebuild=rebuild, progress=progress,
                               total=cfg.max_passages, embedder=embedder)
        finally:
            stream.close()


def _refuse_if_too_big(params: Params) -> None:
    plan = plan_index(params, measure=False)
    row = plan.configured
    if row is not None and not row.fits:
        raise IndexTooLargeError(
            f"building the {row.backend} index {row.index!r} over {plan.n_passages:,} passages needs about "
            f"{row.build_peak_gb:.1f} GB of memory (serving it: {row.index_ram_gb:.1f} GB), more than the "
            f"{plan.budget_gb:.1f} GB budget ({plan.budget_source}).\n{plan.table()}\n"
            "Pick an index that fits (`scope index plan --params P` compares them; e.g. "
            "-o retrieval.faiss_factory=...), raise retrieval.memory_budget_gb, or build anyway with "
            "`scope index build --force` (build_or_open_index(..., force=True)).")


def index_is_built(params: Params) -> bool:
    """True when the configured local index exists completely on disk (chroma: the collection exists)."""
    cfg = params.retrieval
    if cfg.backend == "http":
        return False
    if cfg.backend == "chroma":
        if cfg.chroma_mode == "server":
            return True  # the server holds it: its memory is not ours to plan
        if not (index_path(params) / "chroma.sqlite3").is_file():
            return False
        collection = get_collection(make_chroma_client(cfg, index_path(params)), cfg.collection)
        return collection is not None and (collection.metadata or {}).get("scope_status") == "complete"
    root = store_path(params)

    if cfg.backend == "bm25":
        manifest = read_json(root / "bm25" / bm25_key(cfg) / "manifest.json")
        return manifest is not None and manifest.get("status") == "complete"

    embedder = make_embedder(cfg)
    emb = read_json(root / "embeddings" / slug(f"{embedder.name()}:{embedder.model_id}") / "manifest.json")
    if emb is None or emb.get("status") != "complete":
        return False
    key, _ = index_key(cfg, int(emb["dimension"]))
    manifest = read_json(root / "faiss" / key / "manifest.json")
    return manifest is not None and manifest.get("status") == "complete"


def _embeddings_dir(root: Path, embedder: ScopeEmbedder) -> Path:
    return root / "embeddings" / slug(f"{embedder.name()}:{embedder.model_id}")


def _build_or_open_store(params: Params, corpus: Path, rebuild: bool, progress: bool,
                         embedder: ScopeEmbedder | None) -> LocalRetriever:
    """faiss / bm25: passages to disk, then (faiss) embeddings and the index, or (bm25) the bm25 index."""
    import shutil

    cfg = params.retrieval
    root = store_path(params)
    started = time.perf_counter()
    if rebuild and root.exists():
        log.info("rebuilding the retrieval store at %s", root)
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    sha = cached_corpus_sha256(corpus, corpus_sha_cache(params))
    stream = iter_passages(corpus, cfg.on_error, max_passages=cfg.max_passages)
    try:
        passages, pstats = build_passage_store(stream, root / "passages", passages_fingerprint(cfg, sha),
                                               cfg.shard_passages, progress=progress, total=cfg.max_passages)
    except StoreMismatchError as exc:
        raise IndexMismatchError(f"the retrieval store {exc}\n{REBUILD_HINT}") from exc
    finally:
        stream.close()
    if cfg.backend == "bm25":
        istats = build_bm25_index(passages, cfg, root / "bm25" / bm25_key(cfg), progress=progress)
        stats = _store_stats(rebuild, pstats, istats, istats, started, passages.n_passages)
        stats.embed_s = 0.0  # nothing is embedded: add_s is the tokenising and indexing
        retriever = open_bm25(root, cfg, passages, stats)
    else:
        embedder = embedder if embedder is not None else make_embedder(cfg)
        embeddings, estats = build_embeddings(passages, embedder, _embeddings_dir(root, embedder),
                                              batch_size=cfg.embed_batch_size, progress=progress)
        key, _ = index_key(cfg, embeddings.dimension)
        istats = build_faiss_index(embeddings, cfg, root / "faiss" / key, progress=progress)
        stats = _store_stats(rebuild, pstats, estats, istats, started, passages.n_passages)
        retriever = open_faiss(root, cfg, embedder, passages, embeddings, stats)
    log.info("index %s %s", retriever.describe(), stats.summary())
    return retriever


def _store_stats(rebuild: bool, pstats: Any, estats: Any, istats: Any, started: float, n: int) -> BuildStats:
    actions = {pstats.action, estats.action, istats.action}
    action = ("rebuilt" if rebuild else "resumed" if "resumed" in actions
              else "built" if "built" in actions else "reused")
    return BuildStats(action=action, n_passages=n, n_added=estats.n_done, n_skipped=estats.n_skipped,
                      embed_s=estats.seconds, add_s=istats.seconds, total_s=time.perf_counter() - started)


def open_index(params: Params, embedder: ScopeEmbedder | None = None) -> LocalRetriever:
    """The configured local index if it is completely built and matches the params; never builds anything.
    FileNotFoundError when it is missing (or built for another embedder), IndexMismatchError when it was built
    from another corpus or settings."""
    cfg = params.retrieval
    corpus = _corpus_file(params)
    if cfg.backend == "http":
        raise RetrievalError("retrieval.backend is 'http': there is no local index to open")
    if cfg.backend == "chroma":
        if cfg.chroma_mode == "embedded" and not (index_path(params) / "chroma.sqlite3").is_file():
            raise FileNotFoundError(f"no chroma index at {index_path(params)}: run `scope index build`")
        path = index_path(params) if cfg.chroma_mode == "embedded" else None
        client = make_chroma_client(cfg, path)
        collection = get_collection(client, cfg.collection)
        if collection is None or (collection.metadata or {}).get("scope_status") != "complete":
            state = "no" if collection is None else "an unfinished"
            raise FileNotFoundError(f"{state} chroma collection {cfg.collection!r} at "
                                    f"{path or cfg.chroma_host}: run `scope index build`")
        sha = cached_corpus_sha256(corpus, corpus_sha_cache(params))
        embedder = embedder if embedder is not None else make_embedder(cfg)
        diffs = fingerprint_differences(dict(collection.metadata or {}), index_fingerprint(cfg, sha, embedder))
        if diffs:
            raise IndexMismatchError(f"the chroma index {cfg.collection!r} at {path or cfg.chroma_host} was built "
                                     "from other settings:\n  " + "\n  ".join(diffs) + f"\n{REBUILD_HINT}")
        return build_index(iter(()), cfg, corpus_sha256=sha, path=path, client=client, embedder=embedder,
                           progress=False)
    root = store_path(params)
    try:
        passages = PassageStore(root / "passages")
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no {cfg.backend} index at {root}: run `scope index build`") from exc
    diffs = differences(passages.fingerprint, passages_fingerprint(cfg, cached_corpus_sha256(corpus, corpus_sha_cache(params))))
    if diffs:
        raise IndexMismatchError(f"the retrieval store at {root} was built from another corpus or slice:\n  "
                                 + "\n  ".join(diffs) + f"\n{REBUILD_HINT}")
    if cfg.backend == "bm25":
        return open_bm25(root, cfg, passages)

    embedder = embedder if embedder is not None else make_embedder(cfg)
    directory = _embeddings_dir(root, embedder)
    try:
        embeddings = EmbeddingStore(directory)
    except FileNotFoundError as exc:
        built = sorted(p.name for p in (root / "embeddings").glob("*") if (p / "manifest.json").is_file())
        raise FileNotFoundError(f"no embeddings by {embedder.describe()} at {root}: the index was built with "
                                f"{built or 'no embedder'}; run `scope index build` for this embedder") from exc
    return open_faiss(root, cfg, embedder, passages, embeddings)


def open_retriever(params: Params, progress: bool = True) -> Retriever:
    """The retriever the params ask for: the run's local index (built if missing) or a /retrieve server."""
    cfg = params.retrieval
    if cfg.backend == "http":
        return HttpRetriever(cfg.server_url, cfg.timeout_s, top_k=cfg.top_k)
    return build_or_open_index(params, progress=progress)
