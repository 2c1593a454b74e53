"""Retrieval speed and HNSW quality: prints markdown tables (a measurement, not a pass/fail test).

    python benchmarks/retrieval.py --sizes 1000,100000 --embedder minilm-offline --queries 256
    python benchmarks/retrieval.py --scale 1000000     # every backend and faiss index type at 1M passages

Corpora, per size:
- size <= 1000: the real wiki-18 sample, embedded with `--embedder`, stored as our index stores passages
  (text as document, title as metadata), searched through `ChromaRetriever`;
- larger sizes, two variants:
  * "synthetic text": sample passages with 40% of their words replaced by words drawn from the sample's
    word distribution (deterministic), embedded with the hashing embedder (embedding 100k passages with
    MiniLM on 2 CPU cores takes too long; MiniLM's own throughput is the 1000-passage row), full index with
    documents. Bag-of-words hashing vectors are nearly orthogonal: a hard case for HNSW.
  * "<embedder>-derived vectors": vectors made from the real sample's embeddings (passage a + w x passage b
    + a little Gaussian noise, normalised; a, b, w seeded), so the neighbourhood structure is that of real
    sentence embeddings. Vectors only (no documents): this row isolates the HNSW index.

Reported: build throughput (embedding and chroma add separately); chroma query latency p50/p95 for single
queries and batches of 64 (precomputed query embeddings) and `search()` end to end; recall@3 and recall@1 of
chroma's HNSW against EXACT search (numpy over the same stored normalised embeddings; a hit counts when its
exact score reaches the exact k-th best, so ties are not misses); exact search latency and batched
throughput; an ef_search sweep on the largest size; recall on the labelled questions (real sample).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scope_lib.config import RetrievalConfig  # noqa: E402
from scope_lib.retrieval.chroma_index import ChromaRetriever, build_index, make_chroma_client  # noqa: E402
from scope_lib.retrieval.corpus import Passage, read_corpus  # noqa: E402
from scope_lib.retrieval.embedders import HashingEmbedder, make_embedder  # noqa: E402
from scope_lib.retrieval.formatting import passages_sha256  # noqa: E402
from scope_lib.retrieval.recall import LABELLED_QUERIES, recall_at_k  # noqa: E402

K = 3
BATCH = 64


def default_sample() -> Path:
    data = Path(os.environ.get("SCOPE_DATA_DIR") or REPO.parent / "shared" / "data")
    return data / "wiki18_sample.jsonl"


# -- corpora and queries -------------------------------------------------------------------------------


def synthetic_corpus(sample: list[Passage], n: int, seed: int = 0, replace: float = 0.4) -> list[Passage]:
    """n passages: sample passage i % len(sample), 40% of its words swapped for sample-distributed words."""
    rng = np.random.default_rng(seed)
    word_lists = [p.text.split() for p in sample]
    vocabulary = np.array([w for words in word_lists for w in words], dtype=object)
    out = []
    for i in range(n):
        base = sample[i % len(sample)]
        words = np.array(word_lists[i % len(sample)], dtype=object)
        mask = rng.random(len(words)) < replace
        words[mask] = vocabulary[rng.integers(0, len(vocabulary), int(mask.sum()))]
        out.append(Passage(id=f"s{i}", title=f"{base.title} ({i // len(sample)})", text=" ".join(words)))
    return out


def derived_vectors(base: np.ndarray, n: int, seed: int = 0, noise: float = 0.15) -> np.ndarray:
    """n normalised vectors: base[i % m] + w * base[b] + noise * (random unit vector); b, w seeded."""
    rng = np.random.default_rng(seed)
    m, dim = base.shape
    other = base[rng.integers(0, m, n)]
    weight = rng.uniform(0.2, 0.6, (n, 1)).astype(np.float32)
    jitter = rng.standard_normal((n, dim)).astype(np.float32)
    jitter /= np.linalg.norm(jitter, axis=1, keepdims=True)
    vectors = base[np.arange(n) % m] + weight * other + noise * jitter
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def make_queries(passages: list[Passage], n: int, seed: int = 1, labelled: bool = False) -> list[str]:
    """The labelled questions (when asked) plus 6-10 word windows of random passages, n in all."""
    rng = random.Random(seed)
    queries = [q for q, _ in LABELLED_QUERIES][:n] if labelled else []
    while len(queries) < n:
        words = rng.choice(passages).text.split()
        length = rng.randint(6, 10)
        start = rng.randrange(max(1, len(words) - length))
        queries.append(" ".join(words[start:start + length]))
    return queries


# -- measuring -----------------------------------------------------------------------------------------


@dataclass
class Case:
    """One index to measure."""

    label: str
    size: int
    embedder: str
    retriever: ChromaRetriever
    ids: list[str]
    matrix: np.ndarray  # the stored embeddings, in `ids` order
    q_emb: np.ndarray
    texts: list[str] | None  # query texts when search() can run end to end
    embed_s: float
    add_s: float


def stored_embeddings(retriever: ChromaRetriever, ids: list[str]) -> np.ndarray:
    """The embeddings chroma holds, in `ids` order (paged gets)."""
    position = {pid: i for i, pid in enumerate(ids)}
    matrix = None
    page = 5000
    for offset in range(0, len(ids), page):
        got = retriever.collection.get(limit=page, offset=offset, include=["embeddings"])
        emb = np.asarray(got["embeddings"], dtype=np.float32)
        if matrix is None:
            matrix = np.zeros((len(ids), emb.shape[1]), dtype=np.float32)
        matrix[[position[i] for i in got["ids"]]] = emb
    assert matrix is not None
    return matrix


def exact_topk(queries: np.ndarray, matrix: np.ndarray, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores) of the k best rows of `matrix` per query row, best first."""
    scores = queries @ matrix.T
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    top_scores = np.take_along_axis(scores, top, axis=1)
    order = np.argsort(-top_scores, axis=1)
    return np.take_along_axis(top, order, axis=1), np.take_along_axis(top_scores, order, axis=1)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - t0, result


def measure(case: Case, n_single: int) -> dict[str, float]:
    col, q_emb, matrix = case.retriever.collection, case.q_emb, case.matrix
    col.query(query_embeddings=q_emb[:1], n_results=K)  # warm up: loads the index
    n_single = min(n_single, len(q_emb))
    single = [timed(col.query, query_embeddings=q_emb[i:i + 1], n_results=K)[0] * 1e3 for i in range(n_single)]
    batches = [q_emb[i:i + BATCH] for i in range(0, len(q_emb) - BATCH + 1, BATCH)]
    batch_ms, found_ids = [], []
    for b in batches:
        dt, res = timed(col.query, query_embeddings=b, n_results=K, include=["distances"])
        batch_ms.append(dt * 1e3)
        found_ids.extend(res["ids"])
    exact_single = [timed(exact_topk, q_emb[i:i + 1], matrix)[0] * 1e3 for i in range(n_single)]
    exact_ms, exact_scores = [], []
    for b in batches:
        dt, (_, scores) = timed(exact_topk, b, matrix)
        exact_ms.append(dt * 1e3)
        exact_scores.append(scores)
    scores = np.concatenate(exact_scores)
    position = {pid: i for i, pid in enumerate(case.ids)}
    recall3 = recall1 = 0.0
    for row, hit_ids in enumerate(found_ids):  # tie-tolerant recall against exact search
        got = matrix[[position[h] for h in hit_ids]] @ q_emb[row]
        recall3 += min(K, int((got >= scores[row, K - 1] - 1e-5).sum())) / K
        recall1 += float(len(got) > 0 and got.max() >= scores[row, 0] - 1e-5)
    out = {
        "single_p50": pct(single, 50), "single_p95": pct(single, 95),
        "batch_p50": pct(batch_ms, 50), "batch_p95": pct(batch_ms, 95),
        "batch_qps": BATCH * len(batch_ms) / (sum(batch_ms) / 1e3),
        "exact_single_p50": pct(exact_single, 50), "exact_batch_p50": pct(exact_ms, 50),
        "exact_qps": BATCH * len(exact_ms) / (sum(exact_ms) / 1e3),
        "recall3": recall3 / len(found_ids), "recall1": recall1 / len(found_ids),
        "e2e_single_p50": float("nan"), "e2e_batch_p50": float("nan"),
    }
    if case.texts is not None:
        texts = case.texts
        out["e2e_single_p50"] = pct([timed(case.retriever.search, [t])[0] * 1e3 for t in texts[:32]], 50)
        out["e2e_batch_p50"] = pct([timed(case.retriever.search, texts[i:i + BATCH])[0] * 1e3
                                    for i in range(0, len(texts) - BATCH + 1, BATCH)], 50)
    return out


def reopen(case: Case, cfg: RetrievalConfig, path: Path, ef_search: int) -> ChromaRetriever:
    """The same collection with another ef_search (chroma applies it when the collection is reloaded)."""
    case.retriever.client.close()
    cfg = cfg.model_copy(update={"hnsw_ef_search": ef_search})
    client = make_chroma_client(cfg, path)
    collection = client.get_collection(cfg.collection, embedding_function=None)
    collection.modify(configuration={"hnsw": {"ef_search": ef_search}})
    client.close()
    client = make_chroma_client(cfg, path)
    collection = client.get_collection(cfg.collection, embedding_function=None)
    assert collection.configuration_json["hnsw"]["ef_search"] == ef_search
    return ChromaRetriever(client, collection, case.retriever.embedder, K)


# -- building ------------------------------------------------------------------------------------------


def text_case(label: str, passages: list[Passage], cfg: RetrievalConfig, path: Path, n_queries: int,
              labelled: bool) -> Case:
    logging.info("%s: building %d passages with %s", label, len(passages), cfg.embedder)
    retriever = build_index(passages, cfg, corpus_sha256=passages_sha256(passages), path=path, progress=False)
    ids = [p.id for p in passages]
    texts = make_queries(passages, n_queries, labelled=labelled)
    q_emb = retriever.embedder.embed_queries(texts)
    stats = retriever.build_stats
    return Case(label, len(passages), cfg.embedder, retriever, ids, stored_embeddings(retriever, ids), q_emb,
                texts, stats.embed_s, stats.add_s)


def vector_case(label: str, vectors: np.ndarray, q_emb: np.ndarray, cfg: RetrievalConfig, path: Path,
                embedder_name: str) -> Case:
    """An index of bare vectors (ids only): the HNSW graph alone."""
    logging.info("%s: adding %d vectors", label, len(vectors))
    client = make_chroma_client(cfg, path)
    collection = client.create_collection(cfg.collection, embedding_function=None, configuration={"hnsw": {
        "space": "cosine", "ef_construction": cfg.hnsw_ef_construction, "max_neighbors": cfg.hnsw_max_neighbors,
        "ef_search": cfg.hnsw_ef_search}})
    ids = [f"v{i}" for i in range(len(vectors))]
    step = min(cfg.add_batch_size, client.get_max_batch_size())
    t0 = time.perf_counter()
    for i in range(0, len(vectors), step):
        collection.add(ids=ids[i:i + step], embeddings=vectors[i:i + step])
    add_s = time.perf_counter() - t0
    retriever = ChromaRetriever(client, collection, HashingEmbedder(), K)
    return Case(label, len(vectors), embedder_name, retriever, ids, stored_embeddings(retriever, ids), q_emb,
                None, float("nan"), add_s)


def run(args: argparse.Namespace) -> None:
    sample = read_corpus(args.sample).passages
    sizes = sorted(int(s) for s in args.sizes.split(",") if s.strip())
    base = dict(embedder_device="cpu", hnsw_ef_search=args.ef_search, hnsw_max_neighbors=args.max_neighbors,
                hnsw_ef_construction=args.ef_construction)
    real_cfg = RetrievalConfig(embedder=args.embedder, embed_batch_size=args.embed_batch_size,
                               collection="bench_real", **base)
    rows_build, rows_query, rows_sweep, rows_label = [], [], [], []
    real_embeddings: np.ndarray | None = None
    real_queries: np.ndarray | None = None
    with tempfile.TemporaryDirectory(prefix="scope-bench-") as tmp:
        cases: list[tuple[Case, RetrievalConfig, Path]] = []
        for size in sizes:
            if size <= len(sample):
                path = Path(tmp) / f"real{size}"
                case = text_case(f"real sample {size:,}", sample[:size], real_cfg, path, args.queries, True)
                cases.append((case, real_cfg, path))
                if size == len(sample):
                    real_embeddings, real_queries = case.matrix, case.q_emb
                qs = [(q, a) for q, a in LABELLED_QUERIES if int(a) < size]
                if qs:
                    rows_label.append([f"{size:,}", args.embedder, str(len(qs))] +
                                      [f"{recall_at_k(case.retriever, qs, k):.3f}" for k in (1, 3, 5)])
                continue
            cfg = RetrievalConfig(embedder="hashing", embed_batch_size=1024, collection="bench_text", **base)
            path = Path(tmp) / f"text{size}"
            cases.append((text_case(f"synthetic text {size:,}", synthetic_corpus(sample, size), cfg, path,
                                    args.queries, False), cfg, path))
            if real_embeddings is None:  # the sample's embeddings, for derived vectors
                embedder = make_embedder(real_cfg)
                real_embeddings = embedder.embed_documents([p.text for p in sample])
                real_queries = embedder.embed_queries(make_queries(sample, args.queries, labelled=True))
            vcfg = cfg.model_copy(update={"collection": "bench_vectors"})
            path = Path(tmp) / f"vectors{size}"
            cases.append((vector_case(f"{args.embedder}-derived vectors {size:,}", derived_vectors(real_embeddings, size),
                                      real_queries, vcfg, path, args.embedder), vcfg, path))

        for case, cfg, path in cases:
            rows_build.append([case.label, case.embedder, f"{case.size / case.embed_s:,.0f}" if case.embed_s == case.embed_s
                               else "-", f"{case.size / case.add_s:,.0f}", f"{case.add_s:.1f}"])
            m = measure(case, args.single)
            rows_query.append(query_row(case, cfg.hnsw_ef_search, m))
            if case.size == sizes[-1] and case.size > len(sample) and args.sweep:
                for ef in [int(x) for x in args.sweep.split(",")]:
                    case.retriever = reopen(case, cfg, path, ef)
                    m = measure(case, min(args.single, 100))
                    rows_sweep.append([case.label, str(ef), f"{m['single_p50']:.2f}", f"{m['batch_p50']:.1f}",
                                       f"{m['batch_qps']:,.0f}", f"{m['exact_qps']:,.0f}", f"{m['recall3']:.4f}",
                                       f"{m['recall1']:.4f}"])
            case.retriever.client.close()

    print(f"\n### Index build (M={args.max_neighbors}, ef_construction={args.ef_construction}; "
          f"{os.cpu_count()} CPU cores, shared)\n")
    table(["corpus", "embedder", "embed passages/s", "chroma add passages/s", "chroma add s"], rows_build)
    print(f"\n### Queries (k={K}, {args.queries} queries, batches of {BATCH}; times in ms)\n")
    table(["corpus", "embedder", "ef_search", "chroma single p50 / p95", "chroma batch64 p50 / p95",
           "chroma batched q/s", "exact single p50", "exact batch64 p50", "exact batched q/s", "recall@3 vs exact",
           "recall@1 vs exact", "search() single p50", "search() batch64 p50"], rows_query)
    if rows_sweep:
        print("\n### ef_search sweep on the largest size\n")
        table(["corpus", "ef_search", "chroma single p50", "chroma batch64 p50", "chroma batched q/s",
               "exact batched q/s", "recall@3 vs exact", "recall@1 vs exact"], rows_sweep)
    if rows_label:
        print("\n### Labelled questions on the real sample (scope_lib.retrieval.recall)\n")
        table(["passages", "embedder", "questions", "recall@1", "recall@3", "recall@5"], rows_label)


def query_row(case: Case, ef_search: int, m: dict[str, float]) -> list[str]:
    def ms(x: float, digits: int = 1) -> str:
        return "-" if x != x else f"{x:.{digits}f}"

    return [case.label, case.embedder, str(ef_search), f"{m['single_p50']:.2f} / {m['single_p95']:.2f}",
            f"{m['batch_p50']:.1f} / {m['batch_p95']:.1f}", f"{m['batch_qps']:,.0f}", f"{m['exact_single_p50']:.2f}",
            f"{m['exact_batch_p50']:.1f}", f"{m['exact_qps']:,.0f}", f"{m['recall3']:.4f}", f"{m['recall1']:.4f}",
            ms(m["e2e_single_p50"]), ms(m["e2e_batch_p50"])]


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    if "--scale" in sys.argv:  # every backend at 1M passages: benchmarks/retrieval_scale.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import retrieval_scale

        at = sys.argv.index("--scale")
        sys.argv[at:at + 2] = ["--passages", sys.argv[at + 1]] if len(sys.argv) > at + 1 else ["--passages", "1000000"]
        retrieval_scale.main()
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,100000", help="corpus sizes, comma separated")
    parser.add_argument("--embedder", default="minilm-offline", choices=["hashing", "minilm-offline"],
                        help="embedder of the real sample (synthetic text always uses hashing)")
    parser.add_argument("--queries", type=int, default=256, help="queries per corpus")
    parser.add_argument("--single", type=int, default=200, help="single queries timed")
    parser.add_argument("--sample", type=Path, default=default_sample(), help="wiki18_sample.jsonl")
    parser.add_argument("--embed-batch-size", type=int, default=16, help="MiniLM batch (small is fastest on CPU)")
    parser.add_argument("--ef-search", type=int, default=RetrievalConfig().hnsw_ef_search)
    parser.add_argument("--ef-construction", type=int, default=RetrievalConfig().hnsw_ef_construction)
    parser.add_argument("--max-neighbors", type=int, default=RetrievalConfig().hnsw_max_neighbors)
    parser.add_argument("--sweep", default="32,64,128,256", help="ef_search values tried on the largest size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "chromadb", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(args)


if __name__ == "__main__":
    main()
