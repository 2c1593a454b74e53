"""`retrieval.backend: http`: a client for any Search-R1 style ``POST /retrieve`` server (ours is
`scope_lib.retrieval.server`, started with `scope serve retrieval`; the authors' and Search-R1's work too).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

from scope_lib.retrieval.api import Hit, RetrievalError, RetrieverUnavailable, asked_queries

log = logging.getLogger(__name__)


class HttpRetriever:
    """Client for any server with the Search-R1 API (`POST /retrieve`), ours or the authors'.

    Request ``{"queries": [...], "topk": k, "return_scores": true}``; response ``{"result": [[{"document":
    {"id", "contents"}, "score"}, ...], ...]}`` (`contents` = quoted title, newline, text). Connection
    errors, timeouts and 429/5xx answers are retried `retries` times with exponential backoff.
    """

    RETRY_STATUS = frozenset({429, 500, 502, 503, 504})

    def __init__(self, server_url: str, timeout_s: float = 30.0, retries: int = 3, *, top_k: int = 3,
                 backoff_s: float = 0.5) -> None:
        self.server_url = server_url.rstrip("/")
        self.retries = retries
        self.top_k = top_k
        self.backoff_s = backoff_s
        self._client = httpx.Client(timeout=timeout_s)

    def search(self, queries: list[str], k: int | None = None) -> list[list[Hit]]:
        k = k or self.top_k
        asked, results = asked_queries(queries)
        if not asked:
            return results
        payload = {"queries": [queries[i] for i in asked], "topk": k, "return_scores": True}
        body = self._post("/retrieve", payload)
        lists = body.get("result") if isinstance(body, dict) else None
        if not isinstance(lists, list) or len(lists) != len(asked):
            raise RetrievalError(f"{self.server_url}/retrieve answered {len(asked)} queries with "
                                 f"{type(lists).__name__ if not isinstance(lists, list) else len(lists)} result "
                                 "lists; expected one list per query under 'result'")
        for row, items in zip(asked, lists, strict=True):
            results[row] = [_hit_from_item(item) for item in items]
        return results

    def health(self) -> dict[str, Any]:
        """The server's /health answer (ours reports status, documents, embedder)."""
        response = self._request("GET", "/health", None)
        return response.json()

    def _post(self, route: str, payload: dict[str, Any]) -> Any:
        response = self._request("POST", route, payload)
        try:
            return response.json()
        except json.JSONDecodeError as exc:
            raise RetrievalError(f"{self.server_url}{route} answered with invalid JSON: {exc}") from exc

    def _request(self, method: str, route: str, payload: dict[str, Any] | None) -> httpx.Response:
        url = self.server_url + route
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.request(method, url, json=payload)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                log.debug("retrieval request to %s failed (%s); attempt %d", url, last, attempt + 1)
                continue
            if response.status_code in self.RETRY_STATUS:
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise RetrievalError(f"{url} rejected the request: HTTP {response.status_code}: "
                                     f"{response.text[:500]}")
            return response
        raise RetrieverUnavailable(
            f"cannot get an answer from the retrieval server at {url} after {self.retries + 1} attempts "
            f"({last}). Start one with `scope serve retrieval --params PARAMS`, or check "
            "retrieval.server_url.")

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hit_from_item(item: Any) -> Hit:
    """One result item: {"document": {...}, "score": s} (return_scores) or the document itself."""
    if not isinstance(item, dict):
        raise RetrievalError(f"unexpected /retrieve result item {item!r:.200}")
    document = item.get("document", item)
    score = float(item.get("score", 0.0) or 0.0)
    doc_id = str(document.get("id", ""))
    if "contents" in document:
        return Hit.from_contents(doc_id, str(document["contents"]), score)
    return Hit(id=doc_id, title=str(document.get("title", "")), text=str(document.get("text", "")), score=score)
