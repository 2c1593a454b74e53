"""The bm25 back end (`retrieval.backend: bm25`): lexical BM25 with bm25s, no embedder.

The lexical baseline of retrieval-augmented RL work. Passages (their wiki-18 `contents`, title included) are
lower-cased, split into words and stripped of English stop words; the index is bm25s's sparse score matrix
(Lucene BM25, `retrieval.bm25_k1`, `retrieval.bm25_b`), saved beside the passage store and memory-mapped when
opened, so the resident memory is what the searches touch. A query with no indexed word gets no hits (BM25
scores every passage 0 for it), never arbitrary passages.
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

from scope_lib.retrieval.api import BuildStats, Hit, asked_queries
from scope_lib.retrieval.store import (
    PassageStore,
    StageStats,
    embedding_text,
    read_json,
    slug,
    write_json_atomic,
)

if TYPE_CHECKING:
    from scope_lib.config import RetrievalConfig
    from scope_lib.retrieval.api import BuildStats, Hit

log = logging.getLogger(__name__)

BM25_FORMAT_VERSION = 1
STOPWORDS = "en"


def _bm25s() -> Any:
    try:
        import bm25s
    except ImportError as exc:  # pragma: no cover - a main dependency
        raise ImportError("retrieval.backend 'bm25' needs the bm25s package (pip install bm25s)") from exc
    return bm25s


def bm25_settings(cfg: RetrievalConfig) -> dict[str, Any]:
    return {"scope_bm25_format": BM25_FORMAT_VERSION, "scope_bm25_k1": cfg.bm25_k1, "scope_bm25_b": cfg.bm25_b,
            "scope_bm25_method": "lucene", "scope_bm25_stopwords": STOPWORDS, "scope_bm25_text": "contents"}


def bm25_key(cfg: RetrievalConfig) -> str:
    return slug(json.dumps(bm25_settings(cfg), sort_keys=True), f"bm25_k1-{cfg.bm25_k1}_b-{cfg.bm25_b}")


def _tokenizer() -> Any:
    from bm25s.tokenization import Tokenizer

    return Tokenizer(lower=True, stopwords=STOPWORDS)


def build_bm25_index(passages: PassageStore, cfg: RetrievalConfig, directory: str | os.PathLike, *,
                     progress: bool = True) -> StageStats:
    """Tokenise the passage store shard by shard and write the bm25s index atomically (a temporary
    directory renamed into place); a complete index with the same settings is reused."""
    bm25s = _bm25s()
    directory = Path(directory)
    wanted = {**bm25_settings(cfg), "scope_passages": passages.fingerprint, "scope_n_passages": passages.n_passages}
    manifest = read_json(directory / "manifest.json")
    if manifest is not None and manifest.get("status") == "complete" and manifest.get("fingerprint") == wanted:
        return StageStats(n_skipped=passages.n_passages)
    started = time.perf_counter()
    tokenizer = _tokenizer()
    ids: list[np.ndarray] = []
    with tqdm(total=passages.n_passages, desc="bm25 tokenising", unit="passage", disable=not progress) as bar:
        for s in range(len(passages.shard_counts)):
            texts = [embedding_text(p) for p in passages.iter_shard(s)]
            for row in tokenizer.tokenize(texts, update_vocab=True, return_as="ids", show_progress=False):
                ids.append(np.asarray(row, dtype=np.int32))
            bar.update(len(texts))
    model = bm25s.BM25(k1=cfg.bm25_k1, b=cfg.bm25_b, method="lucene")
    model.index((ids, tokenizer.get_vocab_dict()), show_progress=progress)
    del ids
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save(str(tmp), show_progress=False)
    write_json_atomic(tmp / "manifest.json", {"fingerprint": wanted, "status": "complete",
                                              "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return StageStats(action="built", n_done=passages.n_passages, seconds=time.perf_counter() - started)


class BM25Retriever:
    """Batched BM25 search (one bm25s call per batch); hit text read from the passage store by offset."""

    embedder = None  # lexical: nothing is embedded

    def __init__(self, model: Any, passages: PassageStore, cfg: RetrievalConfig, fingerprint: dict[str, Any],
                 build_stats: BuildStats | None = None, location: str = "") -> None:
        self.model, self.passages, self.cfg, self.top_k = model, passages, cfg, cfg.top_k
        self._fingerprint = fingerprint
        self.build_stats = build_stats or BuildStats()
        self.location = location

    def search(self, queries: list[str], k: int | None = None) -> list[list[Hit]]:
        k = k or self.top_k
        asked, results = asked_queries(queries)
        if not asked:
            return results
        tokens = _tokenizer().tokenize([queries[i] for i in asked], update_vocab=True, return_as="string",
                                       show_progress=False)
        k_index = min(k, self.passages.n_passages)
        found, scores = self.model.retrieve(tokens, k=k_index, show_progress=False, return_as="tuple")
        wanted = [(row, [(int(i), float(s)) for i, s in zip(ids, sc, strict=True) if s > 0])
                  for row, ids, sc in zip(asked, found, scores, strict=True)]
        passages = iter(self.passages.get([i for _, pairs in wanted for i, _ in pairs]))
        for row, pairs in wanted:
            results[row] = []
            for _, score in pairs:
                p = next(passages)
                results[row].append(Hit(id=p.id, title=p.title, text=p.text, score=score))
        return results

    def count(self) -> int:
        return self.passages.n_passages

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)

    def describe(self) -> str:
        """'bm25 (k1 1.5, b 0.75): 1,000 passages'."""
        return f"bm25 (k1 {self.cfg.bm25_k1}, b {self.cfg.bm25_b}): {self.count():,} passages"

    def close(self) -> None:
        self.passages.close()


def open_bm25(root: Path, cfg: RetrievalConfig, passages: PassageStore,
              build_stats: BuildStats | None = None) -> BM25Retriever:
    """The complete bm25 index for `cfg` under `root`, memory-mapped (FileNotFoundError when not built)."""
    bm25s = _bm25s()
    directory = root / "bm25" / bm25_key(cfg)
    manifest = read_json(directory / "manifest.json")
    if manifest is None or manifest.get("status") != "complete":
        raise FileNotFoundError(f"no complete bm25 index at {directory}")
    model = bm25s.BM25.load(str(directory), mmap=True, show_progress=False)
    fingerprint = {**passages.fingerprint, **bm25_settings(cfg), "scope_n_passages": passages.n_passages}
    return BM25Retriever(model, passages, cfg, fingerprint, build_stats, str(directory))


__all__ = ["BM25Retriever", "bm25_key", "build_bm25_index", "open_bm25"]
