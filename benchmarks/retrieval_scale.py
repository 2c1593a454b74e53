"""Retrieval at scale: every back end and index type over 1 million passages, measured, not estimated.

    python benchmarks/retrieval_scale.py --passages 1000000            # ~20 min on 2 shared CPU cores
    python benchmarks/retrieval_scale.py --passages 20000 --in-process  # a quick look (no RSS isolation)

Vectors shaped like real embeddings, without embedding a million texts: the 1000 real wiki-18 sample passages
are embedded once with MiniLM (cached under ~/.cache/scope/bench), and passage i's vector is a Dirichlet
mixture of three sample embeddings plus Gaussian noise, normalised (seeded). Passage i's text is a sample
passage with 40% of its words replaced (seeded), titled "Synthetic i", so bm25 and the passage store see
text of the real length and vocabulary. Queries: the 36 labelled questions (MiniLM query embeddings) and
220 held-out mixtures, in batches of 64; exact top-3 (faiss Flat) is the reference for recall@3
(tie-tolerant: a hit counts when its exact score reaches the exact 3rd best).

Everything goes through the library's build and search path (passage store, embedding shards, faiss index,
FaissRetriever.search_embeddings / BM25Retriever.search); only the document embedder is replaced by the
derived vectors. Each index is built in a fresh process (build time, peak RSS growth) and opened in another
(serving RSS growth after a warm-up query, batched queries/s, recall). The plan's figures stand beside the
measured ones, and the plan extrapolates every row to 21M passages with E5-base (768-d).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scope_lib.config import Params, load_params  # noqa: E402
from scope_lib.retrieval.embedders import ScopeEmbedder  # noqa: E402

K = 3
BATCH = 64
WIKI18_PASSAGES = 21_015_324
DEFAULT_FACTORIES = ["Flat", "HNSW32,SQ8", "IVF1024,SQ8", "IVF1024,SQ4", "IVF1024,PQ48"]


class DerivedEmbedder(ScopeEmbedder):
    """Document i ("Synthetic i" title) -> row i of a precomputed matrix; queries are never embedded here
    (the benchmark searches with precomputed query embeddings)."""

    def __init__(self, vectors_path: str | None = None, batch_size: int = 4096) -> None:
        super().__init__(batch_size)
        self.vectors_path = vectors_path
        self._vectors = None

    @property
    def model_id(self) -> str:  # type: ignore[override]
        return "minilm-derived-mixtures-v1"

    @staticmethod
    def name() -> str:
        return "bench-derived"

    def _embed(self, texts: list[str], query: bool) -> np.ndarray:
        if query:
            raise RuntimeError("the benchmark searches with precomputed query embeddings")
        if self._vectors is None:
            self._vectors = np.load(self.vectors_path, mmap_mode="r")
        rows = [int(t.split("\n", 1)[0].strip('"').split()[-1]) for t in texts]
        return np.asarray(self._vectors[rows], dtype=np.float32)

    def get_config(self) -> dict:
        return {"vectors_path": self.vectors_path}


# -- data ----------------------------------------------------------------------------------------------


def sample_embeddings(sample_path: Path, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """MiniLM embeddings of the sample passages (contents) and of the labelled questions, cached."""
    from scope_lib.retrieval.corpus import read_corpus
    from scope_lib.retrieval.embedders import MiniLMOfflineEmbedder
    from scope_lib.retrieval.recall import LABELLED_QUERIES
    from scope_lib.retrieval.store import embedding_text

    cache.mkdir(parents=True, exist_ok=True)
    docs, queries = cache / "minilm_sample_contents.npy", cache / "minilm_labelled_queries.npy"
    if not docs.is_file() or not queries.is_file():
        embedder = MiniLMOfflineEmbedder("cpu", 16)
        logging.info("embedding the 1000 sample passages with MiniLM (once; cached in %s)", cache)
        np.save(docs, embedder.embed_documents([embedding_text(p) for p in read_corpus(sample_path).passages]))
        np.save(queries, embedder.embed_queries([q for q, _ in LABELLED_QUERIES]))
    return np.load(docs), np.load(queries)


def derive(base: np.ndarray, n: int, seed: int, noise: float = 0.25) -> np.ndarray:
    """n unit vectors: Dirichlet(1, .5, .5) mixtures of three random rows of `base`, plus noise."""
    rng = np.random.default_rng(seed)
    m, d = base.shape
    out = np.empty((n, d), np.float32)
    for start in range(0, n, 100_000):
        c = min(100_000, n - start)
        idx = rng.integers(0, m, (c, 3))
        w = rng.dirichlet([1.0, 0.5, 0.5], c).astype(np.float32)
        v = (base[idx] * w[:, :, None]).sum(1)
        g = rng.standard_normal((c, d)).astype(np.float32)
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        v = v / np.linalg.norm(v, axis=1, keepdims=True) + noise * g
        out[start:start + c] = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


def write_corpus(sample_path: Path, path: Path, n: int, seed: int = 0, replace: float = 0.4) -> None:
    from scope_lib.retrieval.corpus import read_corpus

    if path.is_file():
        return
    sample = read_corpus(sample_path).passages
    rng = np.random.default_rng(seed)
    words = [p.text.split() for p in sample]
    vocabulary = np.array([w for ws in words for w in ws], dtype=object)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i in range(n):
            base = np.array(words[i % len(sample)], dtype=object)
            mask = rng.random(len(base)) < replace
            base[mask] = vocabulary[rng.integers(0, len(vocabulary), int(mask.sum()))]
            f.write(json.dumps({"id": f"s{i}", "contents": f'"Synthetic {i}"\n' + " ".join(base)}) + "\n")
    tmp.rename(path)


def bench_params(work: Path, backend: str, factory: str = "Flat", **extra) -> Params:
    overrides = {"run.runs_dir": str(work), "run.name": "bench", "retrieval.corpus": str(work / "corpus.jsonl"),
                 "retrieval.backend": backend, "retrieval.faiss_factory": factory, "retrieval.embedder": "hashing",
                 "retrieval.shard_passages": 100_000, "retrieval.faiss_train_size": 65_536,
                 "retrieval.faiss_nprobe": 16, "retrieval.hnsw_ef_construction": 40, "retrieval.hnsw_ef_search": 128,
                 "retrieval.faiss_rerank": 0 if factory in ("Flat",) or factory.startswith("HNSW") else 32}
    overrides.update({f"retrieval.{k}": v for k, v in extra.items()})
    return load_params(overrides=overrides)


# -- workers (each in a fresh process unless --in-process) ----------------------------------------------


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_build(params: Params, vectors: str) -> dict:
    import faiss  # noqa: F401  (imported before the baseline)

    from scope_lib.retrieval.index import build_or_open_index
    base, started = rss(), time.perf_counter()
    retriever = build_or_open_index(params, progress=False, force=True, embedder=DerivedEmbedder(vectors))
    return {"build_s": time.perf_counter() - started, "build_peak": peak_rss() - base,
            "n": retriever.count()}


def worker_serve(params: Params, vectors: str, queries: str, exact: str | None, texts: str | None) -> dict:
    import faiss  # noqa: F401

    from scope_lib.retrieval.index import open_index
    base = rss()
    started = time.perf_counter()
    embedder = DerivedEmbedder(vectors) if params.retrieval.backend == "faiss" else None
    retriever = open_index(params, embedder=embedder)
    out: dict = {"open_s": time.perf_counter() - started}
    if params.retrieval.backend == "bm25":
        words = json.loads(Path(texts).read_text())
        retriever.search(words[:1], K)
        out["serving"] = rss() - base
        t0 = time.perf_counter()
        for i in range(0, len(words), BATCH):
            retriever.search(words[i:i + BATCH], K)
        out["qps"] = len(words) / (time.perf_counter() - t0)
        return out
    q = np.load(queries)
    retriever.search_embeddings(q[:1], K)
    out["serving"] = rss() - base
    found, t0 = [], time.perf_counter()
    for i in range(0, len(q), BATCH):
        found.extend(retriever.search_embeddings(q[i:i + BATCH], K))
    out["qps"] = len(q) / (time.perf_counter() - t0)
    ids = [[int(h.id[1:]) for h in hits] for hits in found]
    if exact is None:
        out["ids"] = ids
        out["scores"] = [[h.score for h in hits] for hits in found]
    else:
        ref = np.load(exact)  # exact 3rd-best score per query
        mat = np.load(vectors, mmap_mode="r")
        hit = [sum(float(mat[i] @ q[r]) >= ref[r] - 1e-5 for i in row) / K for r, row in enumerate(ids)]
        out["recall3"] = float(np.mean(hit))
    return out


def run_worker(kind: str, args: list[str], in_process: bool) -> dict:
    if in_process:
        params = Params.model_validate_json(Path(args[0]).read_text())
        rest = [a or None for a in args[1:]]
        return worker_build(params, args[1]) if kind == "build" else worker_serve(params, *rest)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, __file__, "_" + kind, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the benchmark ---------------------------------------------------------------------------------------


def run(n: int, work: Path, factories: list[str], backends: list[str], sample_path: Path, cache: Path,
        in_process: bool = False, base_vectors: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """Measure every factory (Flat first) and bm25 over n derived passages; `base_vectors` = (sample passage
    embeddings, labelled question embeddings) replaces the cached MiniLM ones (tests)."""
    from scope_lib.retrieval.corpus import iter_passages
    from scope_lib.retrieval.index import (
        _embeddings_dir,
        cached_corpus_sha256,
        passages_fingerprint,
        store_path,
    )
    from scope_lib.retrieval.plan import plan_index
    from scope_lib.retrieval.store import build_embeddings, build_passage_store, directory_bytes

    work.mkdir(parents=True, exist_ok=True)
    base, labelled = base_vectors if base_vectors is not None else sample_embeddings(sample_path, cache)
    vectors = work / "vectors.npy"
    if not vectors.is_file():
        np.save(vectors, derive(base, n, seed=0))
    queries = work / "queries.npy"
    np.save(queries, np.concatenate([labelled, derive(base, 220, seed=7)]).astype(np.float32))
    t0 = time.perf_counter()
    write_corpus(sample_path, work / "corpus.jsonl", n)
    timings = {"corpus_s": time.perf_counter() - t0}

    params = bench_params(work, "faiss")
    root = store_path(params)
    t0 = time.perf_counter()
    stream = iter_passages(params.corpus_path)
    sha = cached_corpus_sha256(params.corpus_path, root)
    passages, _ = build_passage_store(stream, root / "passages", passages_fingerprint(params.retrieval, sha),
                                      params.retrieval.shard_passages, progress=not in_process)
    timings["passages_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    embedder = DerivedEmbedder(str(vectors))
    build_embeddings(passages, embedder, _embeddings_dir(root, embedder), batch_size=4096,
                     progress=not in_process)
    timings["embeddings_s"] = time.perf_counter() - t0
    shared_disk = directory_bytes(root / "passages") + directory_bytes(root / "embeddings")

    rows = []
    exact_path = work / "exact3.npy"
    for factory in (factories if "faiss" in backends else []):
        p = bench_params(work, "faiss", factory)
        pfile = work / f"params-{len(rows)}.json"
        pfile.write_text(p.model_dump_json())
        build = run_worker("build", [str(pfile), str(vectors)], in_process)
        exact = None if factory == "Flat" else str(exact_path)
        if factory != "Flat" and not exact_path.exists():
            raise RuntimeError("put Flat first: it is the exact reference")
        serve = run_worker("serve", [str(pfile), str(vectors), str(queries), exact or "", ""], in_process)
        if factory == "Flat":
            np.save(exact_path, np.array([s[K - 1] for s in serve.pop("scores")], dtype=np.float32))
            serve.pop("ids")
            serve["recall3"] = 1.0
        plan = plan_index(p, measure=False, factories=[factory]).configured
        index_dir = next(store_path(p).glob(f"faiss/{factory.replace(',', '_')}-*"))
        rows.append({"backend": "faiss", "index": factory, "rerank": p.retrieval.faiss_rerank, **build, **serve,
                     "disk": directory_bytes(index_dir), "plan_ram_gb": plan.index_ram_gb,
                     "plan_peak_gb": plan.build_peak_gb})
        logging.info("%s", rows[-1])
    if "bm25" in backends:
        p = bench_params(work, "bm25")
        pfile = work / "params-bm25.json"
        pfile.write_text(p.model_dump_json())
        texts = work / "query_texts.json"
        texts.write_text(json.dumps(bm25_queries(work / "corpus.jsonl", 256)))
        build = run_worker("build", [str(pfile), str(vectors)], in_process)
        serve = run_worker("serve", [str(pfile), str(vectors), str(queries), "", str(texts)], in_process)
        plan = plan_index(p, measure=False).configured
        rows.append({"backend": "bm25", "index": "BM25", "rerank": 0, **build, **serve, "recall3": None,
                     "disk": directory_bytes(next(store_path(p).glob("bm25/*"))), "plan_ram_gb": plan.index_ram_gb,
                     "plan_peak_gb": plan.build_peak_gb})
        logging.info("%s", rows[-1])
    return {"n": n, "dimension": int(base.shape[1]), "rows": rows, "timings": timings, "shared_disk": shared_disk}


def bm25_queries(corpus: Path, n: int, seed: int = 1) -> list[str]:
    """6-10 word windows of passages spread over the corpus."""
    rng = np.random.default_rng(seed)
    lines = corpus.read_text().splitlines() if corpus.stat().st_size < 50e6 else None
    out = []
    with corpus.open() as f:
        size = corpus.stat().st_size
        for _ in range(n):
            if lines is not None:
                line = lines[int(rng.integers(len(lines)))]
            else:
                f.seek(int(rng.integers(size)))
                f.readline()
                line = f.readline() or lines_first(corpus)
            words = json.loads(line)["contents"].split("\n", 1)[1].split()
            length = int(rng.integers(6, 11))
            start = int(rng.integers(max(1, len(words) - length)))
            out.append(" ".join(words[start:start + length]))
    return out


def lines_first(corpus: Path) -> str:
    with corpus.open() as f:
        return f.readline()


def extrapolate(result: dict, embed_dim: int = 768, n_target: int = WIKI18_PASSAGES) -> list[dict]:
    """Each measured row's plan at 21M passages with E5-base (768-d), and a rough batched q/s."""
    from scope_lib.retrieval.plan import faiss_cost

    out = []
    n, d = result["n"], result["dimension"]
    for row in result["rows"]:
        if row["backend"] != "faiss":
            entries = row["plan_ram_gb"] * n_target / n
            out.append({**row, "ram_21m_gb": entries, "qps_21m": row["qps"] * n / n_target})
            continue
        factory = re.sub(r"IVF\d+", "IVF16384", row["index"])  # ~4 sqrt(n) lists at 21M
        cost = faiss_cost(factory, embed_dim, 200_000, 40)
        ram = (n_target * cost.per_vector + cost.fixed) / 1e9
        if factory == "Flat":
            qps = row["qps"] * (n / n_target) * (d / embed_dim)  # a scan of every vector
        elif factory.startswith("IVF"):
            nlist = int(re.match(r"IVF(\d+)", row["index"]).group(1))
            qps = row["qps"] * (d / embed_dim) * ((n / nlist) / (n_target / 16384))  # vectors scanned per list
        else:
            qps = row["qps"] * (d / embed_dim) * np.log(n) / np.log(n_target)  # graph depth ~ log n
        out.append({**row, "index_21m": factory, "ram_21m_gb": ram, "qps_21m": qps,
                    "vectors_21m_gb": n_target * embed_dim * 4 / 1e9})
    return out


def print_tables(result: dict) -> None:
    n = result["n"]
    print(f"\n### {n:,} passages, {result['dimension']}-d MiniLM-derived vectors ({os.cpu_count()} shared CPU "
          f"cores; k={K}, {256} queries in batches of {BATCH})\n")
    print("| backend | index | rerank | build s | build peak RSS GB | serving RSS GB (plan) | index disk GB | "
          "batched q/s | recall@3 vs exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        recall = "-" if r["recall3"] is None else f"{r['recall3']:.3f}"
        print(f"| {r['backend']} | `{r['index']}` | {r['rerank'] or '-'} | {r['build_s']:.0f} | "
              f"{r['build_peak'] / 1e9:.2f} | {r['serving'] / 1e9:.2f} ({r['plan_ram_gb']:.2f}) | "
              f"{r['disk'] / 1e9:.2f} | {r['qps']:,.0f} | {recall} |")
    print(f"\nShared by every faiss index: passages + float32 embeddings on disk, {result['shared_disk'] / 1e9:.2f} GB; "
          f"{json.dumps({k: round(v, 1) for k, v in result['timings'].items()})}")
    print("\n### Extrapolated to 21,015,324 passages (wiki-18) with E5-base, 768-d (the plan's figures)\n")
    print("| backend | index | index RAM GB | rough batched q/s (2 cores) |")
    print("|---|---|---|---|")
    for r in extrapolate(result):
        print(f"| {r['backend']} | `{r.get('index_21m', r['index'])}` | {r['ram_21m_gb']:.1f} | {r['qps_21m']:,.1f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_build", "_serve"):
        kind, rest = sys.argv[1][1:], [a or None for a in sys.argv[2:]]
        logging.basicConfig(level=logging.WARNING)
        params = Params.model_validate_json(Path(rest[0]).read_text())
        out = worker_build(params, rest[1]) if kind == "build" else worker_serve(params, *rest[1:])
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=1_000_000)
    parser.add_argument("--factories", default="|".join(DEFAULT_FACTORIES),
                        help="faiss factory strings separated by '|', Flat first (the exact reference)")
    parser.add_argument("--backends", default="faiss,bm25")
    parser.add_argument("--workdir", type=Path, help="keep the corpus, vectors and indexes here (default: a temp dir)")
    parser.add_argument("--sample", type=Path, default=Path(os.environ.get("SCOPE_DATA_DIR") or REPO.parent / "shared" / "data")
                        / "wiki18_sample.jsonl")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "scope" / "bench")
    parser.add_argument("--in-process", action="store_true", help="no fresh process per index (quick; RSS less clean)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("httpx", "chromadb", "sentence_transformers", "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    factories = args.factories.split("|")
    with tempfile.TemporaryDirectory(prefix="scope-scale-") as tmp:
        result = run(args.passages, args.workdir or Path(tmp), factories, args.backends.split(","), args.sample,
                     args.cache, args.in_process)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print_tables(result)


if __name__ == "__main__":
    main()
