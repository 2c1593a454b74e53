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

Fairness: a request is searched in slices, and every search takes one slice from each waiting request in turn
(round robin, query by query) up to a budget the batcher sizes to about `SLICE_TARGET_S` of index work. A request
that has not been searched yet goes first, alone unless more fits the budget; so a one-query client waits for the
search running when it arrives, then its own (benchmark: benchmarks/retrieval_fairness.py). A search that only
found cached embeddings never grows the budget (a fresh batch after cached traffic would otherwise run in slices
sized for the cache). The app loads the embedder's model and runs one search before it serves (`warm_up`): the
model loads on first use (12 s on a slow 2-core CPU), and the first clients of a fresh server waited for that load
whatever their size (issue 46: the warm-up query was answered from the embedding cache, so the model still loaded
inside the first client's search). /health answers 503 "stalled" when one search has run longer than `STALL_S` or
the search thread died.

Bad requests get a 4xx that says what is wrong (malformed JSON or fields, a non-finite or huge topk, a query
that is not valid Unicode: 422; more than `max_queries` queries, more than `max_request_chars` characters of
queries or a body over `MAX_BODY_BYTES`: 413; no Content-Length: 411). An error echoes at most
`ECHO_CHARS` characters of the input. A failing retriever gets 503 with its message; nothing a client sends
produces a 500.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
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
#: Most characters of queries one request may carry: its work bound (1,024 sentence-long queries).
MAX_REQUEST_CHARS = 262_144
#: Largest request body (JSON escapes can make a body up to ~6x its characters).
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Index work per merged search the batcher aims at: what a one-query client waits at most behind others.
SLICE_TARGET_S = 0.1
#: Most characters of queries in one merged search, whatever the measured speed: bounds one slice's work when
#: the index gets slower at once (an embedding cache that stops hitting, a loaded machine) before the batcher
#: measures it; 16,384 characters keep a rollout batch of short queries in one search.
MAX_SLICE_CHARS = 16_384
#: The first slice's budget, before the batcher has measured the index: one long query, or a rollout batch of
#: short ones (doubled after each quick search).
INITIAL_SLICE_CHARS = 512
#: A search running longer than this makes /health answer "stalled".
STALL_S = 30.0
#: Characters of a client's input an error message may echo.
ECHO_CHARS = 80


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


def _short(value: Any) -> Any:
    """What an error may echo of a client's input: a short prefix, never the whole of a large input."""
    if isinstance(value, str):
        return value if len(value) <= ECHO_CHARS else value[:ECHO_CHARS] + f"... ({len(value):,} characters)"
    if isinstance(value, list | tuple):
        return f"<a list of {len(value):,} item(s)>" if len(value) > 3 else [_short(v) for v in value]
    if isinstance(value, dict):
        return f"<an object with {len(value):,} key(s)>"
    return value


class _Job:
    """One request inside the batcher: its queries, how many were handed to a search, its results."""

    def __init__(self, queries: list[str], k: int) -> None:
        self.queries, self.k, self.future = queries, k, Future()
        self.taken = 0
        self.results: list[list[Hit] | None] = [None] * len(queries)
        self.pending = len(queries)


class SearchBatcher:
    """One search thread over a retriever. Every search merges the waiting requests round robin, one query of
    each in turn, while the next query fits a budget of characters sized to about `target_s` of index work
    (doubled while searches of embedded, not cached, text are quicker than half the target, scaled down when
    slower; at most `MAX_SLICE_CHARS`) and `max_batch_queries`; a search holds at least one query. A request
    larger than that is finished over several searches. Requests not yet searched go first (and, so that a stream
    of them cannot starve a large request, the search after one that left the large requests out starts with
    those), so a new request waits for the running search and then its own. A merged search runs at the largest
    topk and each request is cut back to its own. If a merged search fails, each request's slice is retried
    alone, so one bad request cannot fail the others. `requests` / `searches` count what it did; `busy_for` says
    how long the running search has taken."""

    def __init__(self, retriever: Retriever, max_batch_queries: int = MAX_BATCH_QUERIES,
                 target_s: float = SLICE_TARGET_S) -> None:
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.target_s = target_s
        self.budget_chars = INITIAL_SLICE_CHARS  # grows (or shrinks) with the measured speed of the index
        self.requests = 0
        self.searches = 0
        self._new: deque[_Job] = deque()  # requests not searched yet: they go first
        self._jobs: deque[_Job] = deque()  # requests part searched, round robin
        self._skipped = False  # the last search started with new requests and left the part searched ones out
        self._cond = threading.Condition()
        self._closed = False
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="scope-search", daemon=True)
        self._thread.start()

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        job = _Job(list(queries), k)
        if not job.queries:
            return []
        with self._cond:
            self._new.append(job)
            self._cond.notify()
        return job.future.result()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def busy_for(self) -> float:
        """Seconds the running search has taken (0 when idle)."""
        since = self._busy_since
        return time.monotonic() - since if since is not None else 0.0

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _next_batch(self) -> list[tuple[_Job, int, int]]:
        """(job, start, end) slices of the waiting requests, new ones first, then round robin, while the next
        query fits the budget (lock held)."""
        slices: dict[_Job, list[int]] = {}
        chars = queries = 0
        new_first = bool(self._new) and not self._skipped
        waiting_old = bool(self._jobs)
        for queue in ((self._new, self._jobs) if new_first else (self._jobs, self._new)):
            while queue and queries < self.max_batch_queries:
                job = queue[0]
                i = job.taken
                if queries and chars + len(job.queries[i]) > self.budget_chars:
                    break
                queue.popleft()
                job.taken += 1
                chars += len(job.queries[i])
                queries += 1
                slices.setdefault(job, [i, i])[1] = i + 1
                if job.taken < len(job.queries):
                    self._jobs.append(job)
        self._skipped = new_first and waiting_old and not any(s[0] > 0 for s in slices.values())
        return [(job, start, end) for job, (start, end) in slices.items()]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._new and not self._closed:
                    self._cond.wait()
                if self._closed and not self._jobs and not self._new:
                    return
                batch = self._next_batch()
            self._search(batch)

    def _search(self, batch: list[tuple[_Job, int, int]]) -> None:
        k = max(job.k for job, _, _ in batch)
        queries = [q for job, start, end in batch for q in job.queries[start:end]]
        embedder = getattr(self.retriever, "embedder", None)
        cached_before = getattr(embedder, "n_chars_cached", 0)
        self._busy_since = started = time.monotonic()
        try:
            self.searches += 1
            hits = self.retriever.search(queries, k)
        except Exception as exc:
            self._busy_since = None
            if len(batch) == 1:
                self._fail(batch[0][0], exc)
                return
            for piece in batch:  # find the request that failed; the others still get their answer
                if not piece[0].future.done():
                    self._search([piece])
            return
        self._busy_since = None
        elapsed, chars = time.monotonic() - started, sum(len(q) for q in queries)
        cached = getattr(embedder, "n_chars_cached", 0) - cached_before
        log.debug("search %d: %d queries (%d chars, %d cached) from %d requests in %.3f s; budget %d chars",
                  self.searches, len(queries), chars, cached, len(batch), elapsed, self.budget_chars)
        self._adapt(elapsed, chars, max(0, chars - cached))
        at = 0
        for job, start, end in batch:
            if job.future.done():  # failed in an earlier slice
                continue
            for i in range(start, end):
                job.results[i] = hits[at + i - start][:job.k]
            at += end - start
            job.pending -= end - start
            if job.pending == 0:
                self.requests += 1
                job.future.set_result(job.results)

    def _adapt(self, elapsed: float, chars: int, embedded: int) -> None:
        """Size the budget from a search of `chars` characters, `embedded` of them embedded (not cached), that
        took `elapsed` seconds: a slow search shrinks it to what fits the target; a quick one doubles it only
        when at least half the budget was embedded (a small or cached search says little about the next one)."""
        if elapsed > self.target_s:
            self.budget_chars = max(256, min(self.budget_chars, int(chars * self.target_s / elapsed)))
        elif elapsed < self.target_s / 2 and 2 * embedded >= self.budget_chars:
            self.budget_chars = min(self.budget_chars * 2, MAX_SLICE_CHARS)

    def _fail(self, job: _Job, exc: Exception) -> None:
        with self._cond:
            for queue in (self._new, self._jobs):
                if job in queue:
                    queue.remove(job)
        self.requests += 1
        if not job.future.done():
            job.future.set_exception(exc)


class BodyLimit:
    """ASGI middleware: a POST body must state its length (411 otherwise) and stay within `limit` bytes (413),
    checked before any of it is read."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            status, detail = None, None
            if length is None or not length.isdigit():
                status, detail = 411, "send the body with a Content-Length header"
            elif int(length) > self.limit:
                status, detail = 413, (f"a body of {int(length):,} bytes; at most {self.limit:,}: split the batch")
            if status is not None:
                await JSONResponse(status_code=status, content={"detail": detail})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def warm_up(retriever: Retriever) -> float:
    """Load the embedder's model (`warm_up()`, past its embedding cache) and run one search before serving, so that
    what loads on first use (the model, an index's pages) is not waited for by the first clients. Seconds it took;
    a failure is logged, not raised (each request then gets the 503 that says why)."""
    started = time.monotonic()
    try:
        load = getattr(getattr(retriever, "embedder", None), "warm_up", None)
        if callable(load):
            load()
        retriever.search(["warm up"], 1)
    except Exception as exc:
        log.warning("retrieval warm-up search failed (%s: %s); requests will get 503 until it works",
                    type(exc).__name__, exc)
    seconds = time.monotonic() - started
    log.info("retrieval warm-up search: %.2f s", seconds)
    return seconds


def create_app(retriever: Retriever, *, default_topk: int = 3, max_queries: int = MAX_QUERIES,
               embedder: str | None = None, max_batch_queries: int = MAX_BATCH_QUERIES,
               max_request_chars: int = MAX_REQUEST_CHARS, max_body_bytes: int = MAX_BODY_BYTES,
               slice_target_s: float = SLICE_TARGET_S, stall_s: float = STALL_S) -> FastAPI:
    """The FastAPI app serving `retriever`, warmed up (`warm_up`) before it exists. `embedder` names it in /health
    (default: the retriever's own description, when it has one)."""
    warm_up(retriever)
    app = FastAPI(title="SCOPE retrieval", description="Search-R1 compatible /retrieve over a Retriever")
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    batcher = SearchBatcher(retriever, max_batch_queries, slice_target_s)
    app.state.batcher = batcher
    if embedder is None:
        inner = getattr(retriever, "embedder", None)
        embedder = inner.describe() if hasattr(inner, "describe") else (
            "none (lexical)" if hasattr(retriever, "embedder") else type(retriever).__name__)

    @app.exception_handler(RequestValidationError)
    def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{**e, "input": _short(e.get("input"))} if "input" in e else e for e in exc.errors()]
        return JSONResponse(status_code=422, content=_json_safe(jsonable_encoder({"detail": errors[:10]})))

    @app.post("/retrieve", response_model=RetrieveResponse)
    def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        if len(request.queries) > max_queries:
            raise HTTPException(413, f"{len(request.queries)} queries in one request; at most {max_queries}: "
                                     "split the batch")
        chars = sum(len(q) for q in request.queries)
        if chars > max_request_chars:
            raise HTTPException(413, f"{chars:,} characters of queries in one request; at most "
                                     f"{max_request_chars:,}: split the batch")
        k = request.topk or default_topk
        try:
            hits = batcher.search(list(request.queries), k)
        except Exception as exc:  # the index or the embedder failed: the client may retry
            log.exception("retrieval failed for %d queries", len(request.queries))
            raise HTTPException(503, _json_safe(_short(f"retrieval failed: {type(exc).__name__}: {exc}"))) from exc
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
        busy = batcher.busy_for
        if not batcher.alive or busy > stall_s:
            why = "the search thread died" if not batcher.alive else f"one search has run for {busy:.0f} s"
            raise HTTPException(503, f"stalled: {why}; restart `scope serve retrieval`")
        body: dict[str, Any] = {"status": "ok", "documents": documents, "embedder": embedder,
                                "requests": batcher.requests, "searches": batcher.searches,
                                "busy_s": round(busy, 3)}
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
                      max_queries: int = MAX_QUERIES, **app_options: Any) -> Iterator[str]:
    """Serve `retriever` from a thread for the duration of a `with` block; yields the base URL. Port 0
    picks a free port. For notebooks and tests; `serve` is the long-running command."""
    import socket
    import time

    import uvicorn

    if port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    app = create_app(retriever, default_topk=default_topk, max_queries=max_queries, **app_options)
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
