"""The faiss back end (`retrieval.backend: faiss`): any FAISS index behind the one `Retriever` interface.

`retrieval.faiss_factory` is a FAISS index factory string over inner product of L2-normalised embeddings:
``Flat`` is exact search (the authors' e5_Flat index, App. G / §9 of the implementation notes), ``HNSW32``
and ``HNSW32,SQ8`` are graphs, ``IVF4096,SQ8`` / ``IVF4096,PQ64`` are compressed inverted files, trained on
`retrieval.faiss_train_size` embeddings sampled (seeded) from the build. `retrieval.faiss_rerank` re-scores a
compressed index's candidates exactly against the float32 embeddings, read from disk by offset.

Building (resumable at every stage; see `scope_lib.retrieval.store`): passages to disk -> embeddings to disk
(batched, GPU when the embedder runs there) -> train + add from the embedding shards, one at a time -> one
``index.faiss`` written atomically. Different factory strings over the same corpus and embedder share the
passages and embeddings, so trying another index type costs no re-embedding.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from scope_lib.retrieval.api import (
    REBUILD_HINT,
    BuildStats,
    Hit,
    IndexMismatchError,
    RetrievalError,
    dense_search,
)
from scope_lib.retrieval.store import (
    EmbeddingStore,
    PassageStore,
    StageStats,
    read_json,
    slug,
    write_json_atomic,
)

if TYPE_CHECKING:
    from scope_lib.config import RetrievalConfig
    from scope_lib.retrieval.api import BuildStats, Hit
    from scope_lib.retrieval.embedders import ScopeEmbedder

log = logging.getLogger(__name__)

FAISS_FORMAT_VERSION = 1
TRAIN_SEED = 0
#: Exact (brute-force) index classes.
FLAT_TYPES = ("IndexFlat", "IndexFlatIP", "IndexFlatL2")


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - a main dependency
        raise ImportError("retrieval.backend 'faiss' needs the faiss-cpu package (pip install faiss-cpu), "
                          "or faiss-gpu on a CUDA machine") from exc
    return faiss


def new_index(factory: str, dimension: int) -> Any:
    """An empty inner-product index from a factory string; a bad string is a ValueError naming the key."""
    faiss = _faiss()
    try:
        return faiss.index_factory(int(dimension), factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1][:300]
        raise ValueError(f"retrieval.faiss_factory {factory!r} is not a FAISS index factory string ({first}). "
                         "Examples: 'Flat' (exact), 'HNSW32', 'HNSW32,SQ8', 'IVF4096,SQ8', 'IVF4096,PQ64'") from exc


def hnsw_of(index: Any) -> Any | None:
    """The HNSW graph of an IndexHNSW* (None for other types)."""
    faiss = _faiss()
    inner = faiss.downcast_index(index)
    return inner.hnsw if hasattr(inner, "hnsw") else None


def ivf_of(index: Any) -> Any | None:
    """The IndexIVF inside an index (None for other types)."""
    faiss = _faiss()
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def index_key(cfg: RetrievalConfig, dimension: int) -> tuple[str, dict[str, Any]]:
    """(directory name, fingerprint) of the faiss index the config asks for: the factory string plus the
    build settings that change the index (training sample, HNSW build breadth)."""
    probe = new_index(cfg.faiss_factory, dimension)
    settings: dict[str, Any] = {"scope_faiss_format": FAISS_FORMAT_VERSION, "scope_faiss_factory": cfg.faiss_factory,
                                "scope_metric": "inner_product"}
    if not probe.is_trained:
        settings["scope_faiss_train_size"] = cfg.faiss_train_size
        settings["scope_faiss_train_seed"] = TRAIN_SEED
    if hnsw_of(probe) is not None:
        settings["scope_hnsw_ef_construction"] = cfg.hnsw_ef_construction
    return slug(json.dumps(settings, sort_keys=True), cfg.faiss_factory), settings


def gpu_available(wanted: bool) -> bool:
    """True when `retrieval.faiss_gpu` asks for the GPU and this FAISS build sees one (else warns once)."""
    if not wanted:
        return False
    faiss = _faiss()
    n = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if n == 0:
        log.warning("retrieval.faiss_gpu is true but this FAISS build sees no GPU (faiss-cpu, or no CUDA): "
                    "using the CPU. Install faiss-gpu on a CUDA machine to use it.")
    return n > 0


def _to_gpu(index: Any) -> Any:
    faiss = _faiss()
    try:
        return faiss.index_cpu_to_all_gpus(index)
    except (RuntimeError, AttributeError) as exc:  # HNSW and some codecs have no GPU version
        log.warning("this FAISS index type has no GPU version (%s); it stays on the CPU", exc)
        return index


def build_faiss_index(embeddings: EmbeddingStore, cfg: RetrievalConfig, directory: str | os.PathLike, *,
                      progress: bool = True) -> StageStats:
    """Train (if the type needs it) and fill the index from the embedding shards (one in memory at a time), and write
    ``index.faiss`` + manifest atomically; a complete index with the same settings is reused. A build killed
    here restarts this stage only (from the embeddings on disk)."""
    faiss = _faiss()
    directory = Path(directory)
    manifest_path = directory / "manifest.json"
    _, settings = index_key(cfg, embeddings.dimension)
    wanted = {**settings, "scope_embeddings": embeddings.fingerprint, "scope_n_vectors": embeddings.n_vectors}
    manifest = read_json(manifest_path)
    if manifest is not None and manifest.get("status") == "complete" and manifest.get("fingerprint") == wanted:
        return StageStats(n_skipped=embeddings.n_vectors)
    started = time.perf_counter()
    index = new_index(cfg.faiss_factory, embeddings.dimension)
    hnsw = hnsw_of(index)
    if hnsw is not None:
        hnsw.efConstruction = cfg.hnsw_ef_construction
    use_gpu = gpu_available(cfg.faiss_gpu)
    work = _to_gpu(index) if use_gpu else index
    if not index.is_trained:
        n_train = min(cfg.faiss_train_size, embeddings.n_vectors)
        sample = np.ascontiguousarray(embeddings.sample(n_train, TRAIN_SEED))
        log.info("training %s on %d embeddings", cfg.faiss_factory, n_train)
        ivf = ivf_of(index)
        if ivf is not None and n_train < ivf.nlist:
            raise ValueError(f"retrieval.faiss_factory {cfg.faiss_factory!r} has {ivf.nlist} IVF lists but only "
                             f"{n_train} training vectors: use about 4*sqrt(n) lists (IVF{_pow2_lists(embeddings.n_vectors)}) "
                             "or Flat for a corpus this small")
        work.train(sample)
        del sample
    with tqdm(total=embeddings.n_vectors, desc=f"faiss {cfg.faiss_factory}", unit="vector",
              disable=not progress) as bar:
        if _is_flat(work):
            _fill_flat(work, embeddings, bar)
        else:
            for s in range(len(embeddings.shard_counts)):
                shard = embeddings.load_shard(s)
                for i in range(0, len(shard), 65_536):
                    block = np.ascontiguousarray(shard[i:i + 65_536])
                    work.add(block)
                    bar.update(len(block))
    if work is not index:
        index = faiss.index_gpu_to_cpu(work)
    if index.ntotal != embeddings.n_vectors:
        raise RuntimeError(f"faiss index holds {index.ntotal} vectors, expected {embeddings.n_vectors}")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".index.faiss.tmp-{os.getpid()}"
    faiss.write_index(index, str(tmp))
    os.replace(tmp, directory / "index.faiss")
    write_json_atomic(manifest_path, {"fingerprint": wanted, "status": "complete",
                                      "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return StageStats(action="built", n_done=embeddings.n_vectors, seconds=time.perf_counter() - started)


def _is_flat(index: Any) -> bool:
    return type(_faiss().downcast_index(index)).__name__ in FLAT_TYPES


def _fill_flat(index: Any, embeddings: EmbeddingStore, bar: tqdm) -> None:
    """Copy the shards straight into an exact index's storage, sized once: `add` would grow it by doubling
    (a transient 1.5-3x of the index), this needs the index plus one shard. Same bytes as `add`."""
    faiss = _faiss()
    inner = faiss.downcast_index(index)
    n, d = embeddings.n_vectors, embeddings.dimension
    inner.codes.resize(n * d * 4)
    storage = faiss.rev_swig_ptr(inner.codes.data(), n * d * 4).view(np.float32).reshape(n, d)
    start = 0
    for s in range(len(embeddings.shard_counts)):
        shard = embeddings.load_shard(s)
        storage[start:start + len(shard)] = shard
        start += len(shard)
        bar.update(len(shard))
    inner.ntotal = n


def _pow2_lists(n: int) -> int:
    return int(2 ** max(0, round(np.log2(max(1.0, 4 * np.sqrt(n))))))


class FaissRetriever:
    """Batched search over a FAISS index; hit text is read from the passage store on disk by offset."""

    def __init__(self, index: Any, passages: PassageStore, embeddings: EmbeddingStore, embedder: ScopeEmbedder,
                 cfg: RetrievalConfig, fingerprint: dict[str, Any], build_stats: BuildStats | None = None,
                 location: str = "") -> None:
        self.passages, self.embeddings, self.embedder = passages, embeddings, embedder
        self.cfg, self.top_k = cfg, cfg.top_k
        self.factory = cfg.faiss_factory
        self.location = location
        self._fingerprint = fingerprint
        self.build_stats = build_stats or BuildStats()
        self.dimension = int(index.d)
        self.n_vectors = int(index.ntotal)
        ivf, hnsw = ivf_of(index), hnsw_of(index)
        if ivf is not None:
            ivf.nprobe = cfg.faiss_nprobe
        if hnsw is not None:
            hnsw.efSearch = cfg.hnsw_ef_search
        self.exact = _is_flat(index)
        self.index = _to_gpu(index) if gpu_available(cfg.faiss_gpu) else index

    def search(self, queries: list[str], k: int | None = None) -> list[list[Hit]]:
        return dense_search(self, queries, k)

    def search_embeddings(self, embeddings: np.ndarray, k: int | None = None, *,
                          into: list[list[Hit]] | None = None, rows: list[int] | None = None) -> list[list[Hit]]:
        """Search with precomputed query embeddings (one row per query): one index call for all."""
        k = k or self.top_k
        queries = np.ascontiguousarray(embeddings, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dimension:
            raise RetrievalError(f"query embeddings of shape {queries.shape} for a {self.dimension}-dim faiss "
                                 f"index at {self.location}: the embedder does not match the index")
        scores, found = self.index.search(queries, max(k, self.cfg.faiss_rerank))
        if self.cfg.faiss_rerank > k:
            scores, found = self._rerank(queries, found, k)
        rows = rows if rows is not None else list(range(len(queries)))
        into = into if into is not None else [[] for _ in rows]
        wanted = [(row, [(int(i), float(s)) for i, s in zip(ids, sc, strict=True) if i >= 0])
                  for row, ids, sc in zip(rows, found, scores, strict=True)]
        passages = iter(self.passages.get([i for _, pairs in wanted for i, _ in pairs]))
        for row, pairs in wanted:
            into[row] = [_hit(Hit, next(passages), score) for _, score in pairs]
        return into

    def _rerank(self, queries: np.ndarray, found: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact inner products of each query with its candidates (embeddings read from disk by offset)."""
        valid = found >= 0
        vectors = self.embeddings.rows(np.where(valid, found, 0)).reshape(*found.shape, self.dimension)
        exact = np.einsum("qd,qcd->qc", queries, vectors)
        exact[~valid] = -np.inf
        order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(exact, order, axis=1)
        ids = np.take_along_axis(found, order, axis=1)
        ids[~np.isfinite(top)] = -1
        return top, ids

    def count(self) -> int:
        """Passages in the index."""
        return self.n_vectors

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)

    def describe(self) -> str:
        """'faiss Flat (exact): 1,000 passages, scope-e5 (intfloat/e5-base-v2), dim 768'."""
        knobs = []
        if ivf_of(self.index) is not None or "IVF" in self.factory:
            knobs.append(f"nprobe {self.cfg.faiss_nprobe}")
        if "HNSW" in self.factory:
            knobs.append(f"ef_search {self.cfg.hnsw_ef_search}")
        if self.cfg.faiss_rerank:
            knobs.append(f"rerank {self.cfg.faiss_rerank}")
        kind = "exact" if self.exact else "approximate"
        extra = f", {', '.join(knobs)}" if knobs else ""
        return (f"faiss {self.factory} ({kind}{extra}): {self.count():,} passages, {self.embedder.describe()}, "
                f"dim {self.dimension}")

    def close(self) -> None:
        self.passages.close()
        self.embeddings.close()


def _hit(hit_type: type, passage: Any, score: float) -> Hit:
    return hit_type(id=passage.id, title=passage.title, text=passage.text, score=score)


def open_faiss(root: Path, cfg: RetrievalConfig, embedder: ScopeEmbedder, passages: PassageStore,
               embeddings: EmbeddingStore, build_stats: BuildStats | None = None) -> FaissRetriever:
    """The complete faiss index for `cfg` under `root` (FileNotFoundError when it is not built)."""
    faiss = _faiss()
    key, _ = index_key(cfg, embeddings.dimension)
    directory = root / "faiss" / key
    manifest = read_json(directory / "manifest.json")
    if manifest is None or manifest.get("status") != "complete":
        raise FileNotFoundError(f"no complete faiss index {cfg.faiss_factory!r} at {directory}")
    index = faiss.read_index(str(directory / "index.faiss"))
    if index.ntotal != passages.n_passages or index.d != embeddings.dimension:
        raise IndexMismatchError(f"the faiss index at {directory} holds {index.ntotal} vectors of dimension "
                                 f"{index.d}, but the store has {passages.n_passages} passages embedded in "
                                 f"{embeddings.dimension} dimensions (a damaged or replaced index file). {REBUILD_HINT}")
    fingerprint = {**passages.fingerprint, **embeddings.fingerprint, "scope_dimension": embeddings.dimension,
                   **{k: v for k, v in manifest["fingerprint"].items() if k != "scope_embeddings"},
                   "scope_n_passages": passages.n_passages}
    return FaissRetriever(index, passages, embeddings, embedder, cfg, fingerprint, build_stats, str(directory))


def remove_index(root: Path) -> None:
    """Delete a store root (passages, embeddings, indexes): `--rebuild`."""
    shutil.rmtree(root, ignore_errors=True)


__all__ = ["FaissRetriever", "build_faiss_index", "index_key", "new_index", "open_faiss"]
