"""A Search-R1 compatible retrieval server over any `Retriever` (`scope serve retrieval`).

    POST /retrieve  {"queries": ["...", ...], "topk": 3, "return_scores": true}
        -> {"result": [[{"document": {"id": "0", "contents": "\\"Title\\"\\ntext"}, "score": 0.83}, ...], ...]}
    GET  /health    -> {"status": "ok", "documents": 1000, "embedder": "scope-e5 (intfloat/e5-base-v2)",
                        "index": "faiss Flat (exact): ...", "fingerprint": {...}, "requests": 12, "searches": 4}

The API is the one Search-R1, verl, SSP, Dr. Zero and SCOPE's own code share, so their clients (and our
`HttpRetriever`) work against it, and many rollout workers can share one index of any back end (chroma,
faiss, bm25). Requests are batched ACROSS clients: one search thread runs the index, and every request that
arrives while a search runs joins the next one (one embed + one index call for all of them, each request
cut back to its own topk), so many training workers share one index without queueing one by one.

Bad requests get a 4xx that says what is wrong (malformed JSON or fields, a non-finite or huge topk, a query
that is not valid Unicode: 422; more than `max_queries` queries: 413); a failing retriever gets 503 with its
message; nothing a client sends produces a 500.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from scope_lib.retrieval.api import Hit, Retriever
from scope_lib.retrieval.index import build_or_open_index

if TYPE_CHECKING:
    from scope_lib.config import Params

log = logging.getLogger(__name__)

#: Most queries one request may carry (a rollout batch is far below this).
MAX_QUERIES = 4096
MAX_TOPK = 100
#: Longest query, in characters (a search query is a sentence; this bounds the embedder's work).
MAX_QUERY_CHARS = 8192
#: Most queries one merged search may hold (requests beyond it wait for the next search).
MAX_BATCH_QUERIES = 1024


#: A non-blank query (pydantic also rejects a string that is not valid Unicode, e.g. a lone surrogate).
Query = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUERY_CHARS, pattern=r"\S")]


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


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float and every string that is not valid Unicode replaced by a
    printable stand-in, so an error message that echoes a client's input can always be sent as JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_json_safe(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class SearchBatcher:
    """One search thread over a retriever: requests that arrive while a search runs are merged into the
    next one (up to `max_batch_queries` queries), searched at their largest topk and cut back to each
    request's own. If a merged search fails, each request is retried alone, so one bad request cannot fail
    the others. `requests` / `searches` count what it did."""

    def __init__(self, retriever: Retriever, max_batch_queries: int = MAX_BATCH_QUERIES) -> None:
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.requests = 0
        self.searches = 0
        self._queue: queue.Queue[tuple[list[str], int, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="scope-search", daemon=True)
        self._thread.start()

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        future: Future = Future()
        self._queue.put((queries, k, future))
        return future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            size = len(first[0])
            while size < self.max_batch_queries:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
                size += len(item[0])
            self._search(batch)

    def _search(self, batch: list[tuple[list[str], int, Future]]) -> None:
        self.requests += len(batch)
        k = max(k for _, k, _ in batch)
        try:
            self.searches += 1
            hits = self.retriever.search([q for queries, _, _ in batch for q in queries], k)
        except Exception as exc:
            if len(batch) == 1:
                batch[0][2].set_exception(exc)
                return
            self.requests -= len(batch)
            for item in batch:  # find the request that failed; the others still get their answer
                self._search([item])
            return
        start = 0
        for queries, own_k, future in batch:
            future.set_result([found[:own_k] for found in hits[start:start + len(queries)]])
            start += len(queries)


def create_app(retriever: Retriever, *, default_topk: int = 3, max_queries: int = MAX_QUERIES,
               embedder: str | None = None, max_batch_queries: int = MAX_BATCH_QUERIES) -> FastAPI:
    """The FastAPI app serving `retriever`. `embedder` names it in /health (default: the retriever's own
    description, when it has one)."""
    app = FastAPI(title="SCOPE retrieval", description="Search-R1 compatible /retrieve over a Retriever")
    batcher = SearchBatcher(retriever, max_batch_queries)
    app.state.batcher = batcher
    if embedder is None:
        inner = getattr(retriever, "embedder", None)
        embedder = inner.describe() if hasattr(inner, "describe") else (
            "none (lexical)" if hasattr(retriever, "embedder") else type(retriever).__name__)

    @app.exception_handler(RequestValidationError)
    def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content=_json_safe(jsonable_encoder({"detail": exc.errors()})))

    @app.post("/retrieve", response_model=RetrieveResponse)
    def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        if len(request.queries) > max_queries:
            raise HTTPException(413, f"{len(request.queries)} queries in one request; at most {max_queries}: "
                                     "split the batch")
        k = request.topk or default_topk
        try:
            hits = batcher.search(list(request.queries), k)
        except Exception as exc:  # the index or the embedder failed: the client may retry
            log.exception("retrieval failed for %d queries", len(request.queries))
            raise HTTPException(503, _json_safe(f"retrieval failed: {type(exc).__name__}: {exc}")) from exc
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
        body: dict[str, Any] = {"status": "ok", "documents": documents, "embedder": embedder,
                                "requests": batcher.requests, "searches": batcher.searches}
        if hasattr(retriever, "describe"):
            body["index"] = retriever.describe()
        if isinstance(getattr(retriever, "fingerprint", None), dict):
            body["fingerprint"] = _json_safe(jsonable_encoder(retriever.fingerprint))
        return body

    return app


def serve(params: Params, host: str = "127.0.0.1", port: int = 8000, *, force: bool = False) -> None:
    """`scope serve retrieval`: build or open the run's index (any local back end: chroma, faiss, bm25) and
    serve it until interrupted."""
    import uvicorn

    retriever = build_or_open_index(params, force=force)
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
        app.state.batcher.close()
