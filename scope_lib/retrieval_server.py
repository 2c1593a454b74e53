"""A Search-R1 compatible retrieval server over any `Retriever` (`scope serve retrieval`).

    POST /retrieve  {"queries": ["...", ...], "topk": 3, "return_scores": true}
        -> {"result": [[{"document": {"id": "0", "contents": "\\"Title\\"\\ntext"}, "score": 0.83}, ...], ...]}
    GET  /health    -> {"status": "ok", "documents": 1000, "embedder": "scope-e5 (intfloat/e5-base-v2)"}

The API is the one Search-R1, verl, SSP, Dr. Zero and SCOPE's own code share, so their clients (and our
`HttpRetriever`) work against it, and many rollout workers can share one index. Bad requests get a 4xx that
says what is wrong (malformed JSON or fields: 422; more than `max_queries` queries: 413); a failing
retriever gets 503 with its message; nothing a client sends produces a 500. Searches run one at a time
(each is already one batched embed + one batched index query).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from scope_lib.retrieval import Hit, Retriever

if TYPE_CHECKING:
    from scope_lib.config import Params

log = logging.getLogger(__name__)

#: Most queries one request may carry (a rollout batch is far below this).
MAX_QUERIES = 4096
MAX_TOPK = 100

Query = Annotated[str, StringConstraints(min_length=1, pattern=r"\S")]


class RetrieveRequest(BaseModel):
    """The Search-R1 request. Unknown fields are ignored (clients send extras), types are strict."""

    model_config = ConfigDict(extra="ignore", strict=True)

    queries: list[Query] = Field(min_length=1, description="Search queries; each non-blank.")
    topk: int | None = Field(None, ge=1, le=MAX_TOPK, description="Passages per query; None = server default.")
    return_scores: bool = Field(True, description="Wrap each document as {document, score}.")


class Document(BaseModel):
    id: str
    contents: str


class ScoredDocument(BaseModel):
    document: Document
    score: float


class RetrieveResponse(BaseModel):
    result: list[list[ScoredDocument]] | list[list[Document]]


def _document(hit: Hit) -> dict[str, Any]:
    return {"id": hit.id, "contents": hit.contents}


def create_app(retriever: Retriever, *, default_topk: int = 3, max_queries: int = MAX_QUERIES,
               embedder: str | None = None) -> FastAPI:
    """The FastAPI app serving `retriever`. `embedder` names it in /health (default: the retriever's own
    description, when it has one)."""
    app = FastAPI(title="SCOPE retrieval", description="Search-R1 compatible /retrieve over a Retriever")
    lock = threading.Lock()
    if embedder is None:
        inner = getattr(retriever, "embedder", None)
        embedder = inner.describe() if hasattr(inner, "describe") else type(retriever).__name__

    @app.post("/retrieve", response_model=RetrieveResponse)
    def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        if len(request.queries) > max_queries:
            raise HTTPException(413, f"{len(request.queries)} queries in one request; at most {max_queries}: "
                                     "split the batch")
        k = request.topk or default_topk
        try:
            with lock:
                hits = retriever.search(list(request.queries), k)
        except Exception as exc:  # the index or the embedder failed: the client may retry
            log.exception("retrieval failed for %d queries", len(request.queries))
            raise HTTPException(503, f"retrieval failed: {type(exc).__name__}: {exc}") from exc
        if request.return_scores:
            return {"result": [[{"document": _document(h), "score": h.score} for h in found] for found in hits]}
        return {"result": [[_document(h) for h in found] for found in hits]}

    @app.get("/health")
    def health() -> dict[str, Any]:
        count = getattr(retriever, "count", None)
        try:
            documents = count() if callable(count) else None
        except Exception as exc:
            raise HTTPException(503, f"index unavailable: {type(exc).__name__}: {exc}") from exc
        return {"status": "ok", "documents": documents, "embedder": embedder}

    return app


def serve(params: Params, host: str = "127.0.0.1", port: int = 8000) -> None:
    """`scope serve retrieval`: build or open the run's chroma index and serve it until interrupted."""
    import uvicorn

    from scope_lib.retrieval import build_or_open_index

    retriever = build_or_open_index(params)
    app = create_app(retriever, default_topk=params.retrieval.top_k)
    log.info("serving %s on http://%s:%d/retrieve", retriever.describe(), host, port)
    uvicorn.run(app, host=host, port=port, log_level="info")


@contextmanager
def background_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0,
                      default_topk: int = 3, timeout_s: float = 30.0,
                      max_queries: int = MAX_QUERIES) -> Iterator[str]:
    """Serve `retriever` from a thread for the duration of a `with` block; yields the base URL. Port 0
    picks a free port. For notebooks and tests; `serve` is the long-running command."""
    import socket
    import time

    import uvicorn

    if port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    app = create_app(retriever, default_topk=default_topk, max_queries=max_queries)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"retrieval server on {host}:{port} did not start within {timeout_s:.0f} s")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
