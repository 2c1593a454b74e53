"""HTTP calls to served models: retries with backoff (honouring Retry-After) and secrets kept out of messages.
Used by the OpenAI-compatible engine and the benchmark judge.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


_SECRET_PATTERNS = (
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{6,}"),
    re.compile(r"(?i)((?:api[-_]?key|authorization|x-api-key|access[-_]?token)[\"']?\s*[:=]\s*[\"']?)"
               r"(?:bearer\s+)?[^\s\"',;}]{6,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"),
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with credentials replaced by "***": the given secrets (e.g. the API key) wherever they appear,
    and anything shaped like a bearer token, an api-key/authorization header or an `sk-` key. Every error
    message and log line of the HTTP engine goes through it, so a server that echoes request headers cannot
    leak the key into logs or executed notebooks."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + "***", text)
    return text


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date); None when absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return None
    return max(0.0, seconds)


def backoff_s(attempt: int, base_s: float, max_wait_s: float, response=None) -> float:
    """Wait before retry `attempt` (0 = the first retry): exponential from `base_s`, four times longer after
    HTTP 429 (a rate limit clears slower than a restart), never shorter than the server's Retry-After, at most
    `max_wait_s`."""
    factor = 4.0 if response is not None and response.status_code == 429 else 1.0
    delay = base_s * factor * 2 ** attempt
    hinted = retry_after_s(response.headers.get("retry-after")) if response is not None else None
    return min(max(delay, hinted or 0.0), max_wait_s)


def post_with_retries(client, url: str, body: dict[str, Any], *, max_retries: int, base_s: float,
                      max_wait_s: float, secrets: Iterable[str] = (), abort: threading.Event | None = None,
                      unavailable: type[Exception] = RuntimeError, hint: str = ""):
    """POST `body` as JSON until the server gives an answer that retrying cannot change: returns (status,
    JSON payload or None, text) for a 2xx with a JSON body or any 4xx but 429. Connection errors, timeouts,
    429, 5xx and 2xx bodies that are not JSON are retried with `backoff_s`; when every attempt failed, raises
    `unavailable` naming the last error and then `hint` (what to check), credentials redacted. `abort` (set
    when another request of the batch failed) stops early with `unavailable` too."""
    import httpx

    last, delay = "", 0.0
    for attempt in range(max_retries + 1):
        if abort is not None and abort.is_set():
            raise unavailable(f"{url}: batch aborted after another request failed")
        if attempt:
            time.sleep(delay)
        try:
            response = client.post(url, json=body)
        except httpx.TransportError as exc:
            last, delay = f"{type(exc).__name__}: {exc}", backoff_s(attempt, base_s, max_wait_s)
            continue
        status = response.status_code
        if status == 429 or status >= 500:
            last, delay = f"HTTP {status}: {response.text[:300]}", backoff_s(attempt, base_s, max_wait_s, response)
            log.info("%s: %s; retrying in %.1f s", url, redact(last[:120], secrets), delay)
            continue
        if status >= 400:
            return status, None, response.text
        try:
            return status, response.json(), response.text
        except ValueError:
            last, delay = f"reply is not JSON: {response.text[:200]!r}", backoff_s(attempt, base_s, max_wait_s)
    raise unavailable(redact(f"{url}: no usable reply after {max_retries + 1} attempt(s); last error: {last}. {hint}",
                             secrets))
