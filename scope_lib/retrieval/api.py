"""The retrieval API every backend shares: `Hit`, the `Retriever` protocol, build statistics and the errors.

    hits = retriever.search(["who founded Montanism?", "Horse Mesa Dam"], k=3)   # one list of Hit per query

Light on purpose (no chromadb, faiss or torch): commands that only print or plan import it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)


REBUILD_HINT = ("Rebuild it with `scope index build --params PARAMS --rebuild` (or "
                "`build_or_open_index(params, rebuild=True)`), or use another `retrieval.collection` / run "
                "directory to keep the old index.")


class RetrievalError(RuntimeError):
    """Retrieval failed; the message says where and what to do."""


class IndexMismatchError(RetrievalError):
    """An existing index was built from another corpus, embedder or HNSW setting than the params ask for."""


class RetrieverUnavailable(RetrievalError):
    """A retrieval or chroma server could not be reached."""


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


def asked_queries(queries: list[str]) -> tuple[list[int], list[list[Hit]]]:
    """Every backend's first step of `search`: the positions of the queries that ask something (a blank query
    gets no hits) and one empty hit list per query, to be filled at those positions."""
    return [i for i, q in enumerate(queries) if q and q.strip()], [[] for _ in queries]


def dense_search(retriever, queries: list[str], k: int | None = None) -> list[list[Hit]]:
    """`search` of an embedding index (chroma, faiss): blank queries get no hits; the others are embedded in
    one call and searched in one `search_embeddings` call."""
    asked, results = asked_queries(queries)
    if not asked:
        return results
    embeddings = retriever.embedder.embed_queries([queries[i] for i in asked])
    return retriever.search_embeddings(embeddings, k or retriever.top_k, into=results, rows=asked)


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


class IndexCheckError(RetrievalError):
    """`scope index check` failed; the message names the failed rows in one line (the table is shown apart)."""


class IndexTooLargeError(RetrievalError):
    """The memory plan says the build would not fit in `retrieval.memory_budget_gb` (or the free RAM)."""


#: What `build_or_open_index` returns: a local index behind the `Retriever` interface.
LocalRetriever = Any  # ChromaRetriever | FaissRetriever | BM25Retriever
