"""`scope index check`: does the configured index answer correctly, before any GPU hour is spent?

    report = check_index(params)          # any backend: chroma, faiss, bm25, or a /retrieve server (http)
    print(report.table())
    report.raise_if_failed()              # IndexCheckError, one line naming the failed rows

Checks (each a row: passed, failed, or skipped with the reason):
- corpus: the configured corpus file is there and holds a passage (the canaries come from it);
- index: the index opens without building anything (missing, unfinished, or built for another embedder:
  fail); a server answers /health;
- fingerprint: the index was built from this corpus (sha256 and slice), with this embedder; a server that
  reports its fingerprint (ours does) is compared the same way;
- passages: the index is not empty;
- dimension: the embedder's query vectors have the index's dimension;
- canaries: queries derived from the corpus itself (a passage's title and its first words, passages spread
  evenly over the corpus) must find their passage in the top `canary_k`, with the corpus's exact text;
- results: every canary query gets min(k, passages) hits, no duplicated ids, no empty text, finite scores
  best first; a blank query gets none.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scope_lib.retrieval.api import IndexCheckError
from scope_lib.retrieval.corpus import GZIP_MAGIC, CorpusError, Passage, iter_passages, require_passages
from scope_lib.retrieval.embedders import make_embedder
from scope_lib.retrieval.http_client import HttpRetriever
from scope_lib.retrieval.index import cached_corpus_sha256, corpus_sha_cache, open_index

if TYPE_CHECKING:
    from scope_lib.config import Params
    from scope_lib.retrieval.corpus import Passage

log = logging.getLogger(__name__)

#: Words of a passage's text appended to its title to make its canary query.
CANARY_WORDS = 10


@dataclass
class CheckRow:
    """One check: passed True / False, or None when it could not run (detail says why)."""

    name: str
    passed: bool | None
    detail: str


@dataclass
class CheckReport:
    """The outcome of `check_index`: `passed` is False when any row failed."""

    backend: str
    index: str
    rows: list[CheckRow] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(row.passed is not False for row in self.rows)

    def add(self, name: str, passed: bool | None, detail: str) -> bool | None:
        self.rows.append(CheckRow(name, passed, detail))
        return passed

    def table(self) -> str:
        """A markdown table: check | result | detail, then PASS or FAIL."""
        lines = [f"index check: {self.backend} ({self.index})", "", "| check | result | detail |",
                 "|---|---|---|"]
        for row in self.rows:
            result = {True: "pass", False: "FAIL", None: "skip"}[row.passed]
            lines.append(f"| {row.name} | {result} | {row.detail.replace('|', '/').replace(chr(10), ' ')} |")
        lines += ["", "PASS" if self.passed else "FAIL: fix the rows marked FAIL before training"]
        return "\n".join(lines)

    def failure_line(self) -> str:
        """One line naming the failed rows and what to do (the table itself is shown once, by the caller)."""
        failed = "; ".join(f"{row.name}: {' '.join(row.detail.split())}" for row in self.rows if row.passed is False)
        return (f"the index check failed ({failed}): fix the rows marked FAIL in the table above "
                "(`scope index check --params P` prints it again)")

    def raise_if_failed(self) -> None:
        """IndexCheckError with `failure_line` when a row failed."""
        if not self.passed:
            raise IndexCheckError(self.failure_line())

    def __str__(self) -> str:
        return self.table()


def check_index(params: Params, *, n_canaries: int = 8, canary_k: int | None = None,
                min_canary_recall: float = 0.75, retriever: Any = None) -> CheckReport:
    """Check the index `params.retrieval` points at (see the module doc); never builds or changes it.

    `canary_k` defaults to max(top_k, 5); at least `min_canary_recall` of the canaries must be found (an
    approximate index may miss one), and a found canary's text must equal the corpus's. `retriever` checks
    an already open local index instead of opening it again."""
    cfg = params.retrieval
    where = cfg.server_url if cfg.backend == "http" else str(params.run_dir)
    report = CheckReport(cfg.backend, cfg.faiss_factory if cfg.backend == "faiss" else where)
    corpus = _check_corpus(report, Path(params.corpus_path), cfg.on_error, params.show_path)
    embedder = make_embedder(cfg) if cfg.backend != "bm25" else None

    # -- open ------------------------------------------------------------------------------------------
    health: dict[str, Any] | None = None
    try:
        if retriever is None:
            if cfg.backend == "http":
                retriever = HttpRetriever(cfg.server_url, cfg.timeout_s, retries=1, top_k=cfg.top_k)
                health = retriever.health()
            else:
                retriever = open_index(params, embedder=embedder)
        elif cfg.backend == "http" and hasattr(retriever, "health"):
            health = retriever.health()
    except Exception as exc:  # missing, unfinished, mismatched, unreachable: all reported, none raised
        name = "fingerprint" if type(exc).__name__ == "IndexMismatchError" else "index"
        report.add(name, False, f"{type(exc).__name__}: {exc}")
        return report
    describe = retriever.describe() if hasattr(retriever, "describe") else (health or {}).get("index", where)
    report.add("index", True, str(describe))

    # -- fingerprint -----------------------------------------------------------------------------------
    fingerprint = getattr(retriever, "fingerprint", None)
    if health is not None:
        fingerprint = health.get("fingerprint")
    if not isinstance(fingerprint, dict):
        report.add("fingerprint", None, "the server does not report a fingerprint (not a SCOPE server)")
    elif corpus is None:
        report.add("fingerprint", None, "no local corpus to compare with")
    else:
        wanted = {"scope_corpus_sha256": cached_corpus_sha256(corpus, corpus_sha_cache(params)),
                  "scope_max_passages": cfg.max_passages or 0}
        if embedder is not None:
            wanted.update(scope_embedder=embedder.name(), scope_embedder_model=embedder.model_id)
        diffs = [f"{k.removeprefix('scope_')}: index has {fingerprint.get(k)!r}, params want {v!r}"
                 for k, v in wanted.items() if fingerprint.get(k) != v]
        report.add("fingerprint", not diffs, "; ".join(diffs) if diffs else
                   f"corpus {wanted['scope_corpus_sha256'][:12]}..., "
                   f"embedder {fingerprint.get('scope_embedder', 'none')}")

    # -- passages --------------------------------------------------------------------------------------
    count = (health or {}).get("documents") if health is not None else _count(retriever)
    if count is None:
        report.add("passages", None, "the index does not report its size")
    else:
        report.add("passages", count > 0, f"{count:,} passages" if count else "the index is EMPTY")

    # -- dimension -------------------------------------------------------------------------------------
    dimension = getattr(retriever, "dimension", None) or _chroma_dimension(retriever)
    if embedder is None or dimension is None or health is not None:
        report.add("dimension", None, "no embedder (bm25)" if embedder is None else
                   "not visible through /retrieve" if health is not None else "the index does not say")
    else:
        try:
            got = int(embedder.embed_queries(["dimension check"]).shape[1])
            report.add("dimension", got == dimension, f"embedder {got}, index {dimension}")
        except Exception as exc:
            report.add("dimension", False, f"the embedder failed: {type(exc).__name__}: {exc}")

    # -- canaries and results --------------------------------------------------------------------------
    if corpus is None:
        report.add("canaries", None, "no corpus")
        return report
    canaries = corpus_canaries(corpus, n_canaries, cfg.max_passages)
    k = canary_k or max(cfg.top_k, 5)
    queries = [canary_query(p) for p in canaries]
    try:
        hits = retriever.search(queries + [""], k)
    except Exception as exc:
        report.add("canaries", False, f"search failed: {type(exc).__name__}: {exc}")
        return report
    _canary_rows(report, canaries, hits[:-1], k, min_canary_recall, count)
    report.add("blank query", hits[-1] == [], "no hits" if hits[-1] == [] else f"{len(hits[-1])} hits")
    return report


def _check_corpus(report: CheckReport, corpus: Path, on_error: str, show: Callable[[Path], str] = str) -> Path | None:
    """The corpus row: the file is there and holds a passage (the canaries come from it). None when not.
    `show`: how a path is printed (`Params.show_path`: without the machine's folders)."""
    if not corpus.exists():
        report.add("corpus", False, f"{corpus} not found: the canaries come from the corpus (`scope data fetch`)")
        return None
    try:
        require_passages(corpus, on_error)
    except CorpusError as exc:
        report.add("corpus", False, str(exc))
        return None
    report.add("corpus", True, show(corpus))
    return corpus


def canary_query(passage: Passage) -> str:
    """A query only this passage should answer best: its title and its first words."""
    return f"{passage.title} {' '.join(passage.text.split()[:CANARY_WORDS])}"


def _canary_rows(report: CheckReport, canaries: list[Passage], hits: list[list[Any]], k: int,
                 min_recall: float, count: int | None) -> None:
    found, wrong_text, problems = [], [], []
    expected = min(k, count) if count else k
    for passage, got in zip(canaries, hits, strict=True):
        ids = [h.id for h in got]
        match = next((h for h in got if h.id == passage.id), None)
        if match is not None:
            found.append(passage.id)
            if " ".join(match.text.split()) != " ".join(passage.text.split()) or match.title != passage.title:
                wrong_text.append(passage.id)
        if len(got) != expected:
            problems.append(f"{len(got)} hits for canary {passage.id} (expected {expected})")
        if len(set(ids)) != len(ids):
            problems.append(f"duplicated ids for canary {passage.id}: {ids}")
        if any(not h.text.strip() for h in got):
            problems.append(f"an empty passage text for canary {passage.id}")
        scores = [h.score for h in got]
        if any(not math.isfinite(s) for s in scores) or scores != sorted(scores, reverse=True):
            problems.append(f"scores not finite and best first for canary {passage.id}: {scores}")
    recall = len(found) / max(len(canaries), 1)
    missing = [p.id for p in canaries if p.id not in found]
    report.add("canaries", bool(canaries) and recall >= min_recall,
               f"{len(found)}/{len(canaries)} found in the top {k}"
               + (f"; missing ids {missing}" if missing else "") if canaries else "no passage read from the corpus")
    report.add("canary text", not wrong_text, "hit text equals the corpus" if not wrong_text else
               f"text differs from the corpus for ids {wrong_text}: the corpus changed after the build, or the "
               "index returns the wrong passages")
    if count == 0:  # nothing to judge the results by: say so instead of passing a row of empty result lists
        report.add("results", None, "not checked: the index is empty")
        return
    report.add("results", not problems, "; ".join(problems[:4]) if problems else
               f"{expected} distinct hits per query, finite scores best first")


def _count(retriever: Any) -> int | None:
    count = getattr(retriever, "count", None)
    try:
        return int(count()) if callable(count) else None
    except Exception:
        return None


def _chroma_dimension(retriever: Any) -> int | None:
    collection = getattr(retriever, "collection", None)
    if collection is None:
        return None
    try:
        got = collection.get(limit=1, include=["embeddings"])["embeddings"]
        return int(len(got[0])) if got is not None and len(got) else None
    except Exception:
        return None


def corpus_canaries(path: Path, n: int, max_passages: int | None = None) -> list[Passage]:
    """`n` passages spread evenly over the corpus: read at evenly spaced byte offsets of a plain file (O(n)
    reads, however large), or picked from the first passages of a slice or a gzip file."""
    with open(path, "rb") as f:
        gz = f.read(2) == GZIP_MAGIC
    if gz or max_passages is not None:
        stream = iter_passages(path, "skip", max_passages=min(max_passages or 100_000, 100_000))
        try:
            passages = list(stream)
        finally:
            stream.close()
        step = max(1, len(passages) // max(n, 1))
        return passages[::step][:n]
    size = path.stat().st_size
    out: list[Passage] = []
    seen: set[str] = set()
    with open(path, "rb") as f:
        for j in range(n):
            f.seek(int(size * j / n))
            if j:
                f.readline()  # skip to the start of the next line
            for _ in range(20):  # the next well-formed passage
                line = f.readline()
                if not line:
                    break
                try:
                    record = json.loads(line)
                    passage = Passage.from_contents(str(record["id"]), str(record["contents"]))
                except (ValueError, KeyError, TypeError):
                    continue
                if passage.text and passage.id not in seen:
                    seen.add(passage.id)
                    out.append(passage)
                    break
    return out


__all__ = ["CheckReport", "CheckRow", "canary_query", "check_index", "corpus_canaries"]
