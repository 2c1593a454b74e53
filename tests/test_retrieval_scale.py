"""The retrieval-at-scale benchmark's code path, at a small size (the 1M run is `benchmarks/retrieval_scale.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def test_scale_benchmark_runs_every_backend_at_small_size(wiki_sample, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import retrieval_scale

    from scope_lib.retrieval.corpus import read_corpus
    from scope_lib.retrieval.embedders import HashingEmbedder
    from scope_lib.retrieval.recall import LABELLED_QUERIES

    embedder = HashingEmbedder()
    base = embedder.embed_documents([p.contents for p in read_corpus(wiki_sample).passages])
    labelled = embedder.embed_queries([q for q, _ in LABELLED_QUERIES])
    result = retrieval_scale.run(3000, tmp_path, ["Flat", "IVF16,SQ8"], ["faiss", "bm25"], wiki_sample,
                                 tmp_path / "cache", in_process=True, base_vectors=(base, labelled))
    rows = {r["index"]: r for r in result["rows"]}
    assert list(rows) == ["Flat", "IVF16,SQ8", "BM25"]
    assert rows["Flat"]["recall3"] == 1.0 and rows["IVF16,SQ8"]["recall3"] >= 0.9
    assert all(r["n"] == 3000 and r["qps"] > 0 and r["disk"] > 0 for r in rows.values())
    assert rows["IVF16,SQ8"]["plan_ram_gb"] < rows["Flat"]["plan_ram_gb"] / 3
    vectors = np.load(tmp_path / "vectors.npy")
    assert vectors.shape == (3000, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    retrieval_scale.print_tables(result)
    out = capsys.readouterr().out
    assert "| faiss | `IVF16,SQ8` | 32 |" in out and "Extrapolated to 21,015,324 passages" in out
