"""The LLM judge that scores benchmark answers (paper §4.1): a chat judge (messages in, text out) over any
OpenAI-compatible `/v1/chat/completions` endpoint, or over one of our own engines for offline runs.

    judge = BenchmarkJudge(ChatCompletionsBackend("https://api.openai.com", api_key_env="OPENAI_API_KEY"),
                           cache=JudgeCache("runs/x/eval/judge_cache.sqlite"))
    replies = judge.complete([JudgeRequest(messages, JudgeSettings("gpt-5-mini", 1.0), "qa@1a2b", tag="nq")])

- Every reply is cached on disk, keyed by the full request: model, messages, temperature, reasoning effort,
  reply budget, the judge prompt's version and the sample index. Re-running or re-scoring costs nothing; a
  new sample of the same request (a retry of an unparseable reply) uses the next sample index, so repeated
  samples at T = 1.0 stay distinct and replays are deterministic. Each reply is written as it arrives, so a
  run killed mid-way keeps every reply it paid for.
- The API key is read from the environment only, sent in the Authorization header, and never written to
  the cache, an artifact or a log line (every message goes through `engines.redact`).
- Tokens (prompt, completion, reasoning) and cost are accounted per tag (benchmark / scorer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from scope_lib.models.engine import Engine, Sampling
from scope_lib.models.retries import post_with_retries, redact
from scope_lib.runs import disk_full_error, is_disk_full, writing

log = logging.getLogger(__name__)

OPENAI_URL = "https://api.openai.com"


class JudgeUnavailable(RuntimeError):
    """The judge endpoint could not be used: unreachable, failing, or refusing our credentials or model."""


@dataclass(frozen=True)
class JudgeSettings:
    """Which judge model and how it samples (per benchmark group, §4.1)."""

    model: str
    temperature: float = 1.0
    reasoning_effort: str | None = None
    max_tokens: int = 16384


@dataclass
class JudgeRequest:
    """One judge call. `prompt_version` names the judge template and its content hash; `tag` says which
    benchmark and scorer the call is for (accounting only, not part of the cache key)."""

    messages: list[dict[str, str]]
    settings: JudgeSettings
    prompt_version: str
    sample_index: int = 0
    tag: str = ""

    @property
    def key(self) -> str:
        payload = {"model": self.settings.model, "messages": self.messages,
                   "temperature": self.settings.temperature, "reasoning_effort": self.settings.reasoning_effort,
                   "max_tokens": self.settings.max_tokens, "prompt_version": self.prompt_version,
                   "sample_index": self.sample_index}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


@dataclass
class JudgeReply:
    """The judge's text for one request, with its token counts. `error` is set (and `text` empty) when the
    endpoint rejected this one request; such replies are not cached."""

    text: str
    key: str
    cached: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    error: str | None = None


@dataclass
class Usage:
    """Judge cost of one tag: requests sent, replies served from the cache, tokens and USD."""

    requests: int = 0
    cached: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float | None = None

    def add(self, reply: JudgeReply, price: tuple[float, float] | None) -> None:
        if reply.cached:
            self.cached += 1
            return
        self.requests += 1
        self.errors += reply.error is not None
        self.prompt_tokens += reply.prompt_tokens
        self.completion_tokens += reply.completion_tokens
        self.reasoning_tokens += reply.reasoning_tokens
        if price is not None:
            cost = (reply.prompt_tokens * price[0] + reply.completion_tokens * price[1]) / 1e6
            self.cost_usd = (self.cost_usd or 0.0) + cost


# -- the cache ------------------------------------------------------------------------------------------


class JudgeCache:
    """Judge replies in SQLite, keyed by `JudgeRequest.key`. Safe to share between threads and runs."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:  # it is only a cache: keep the damaged file for inspection, rebuild
            if is_disk_full(exc):  # "database or disk is full": the file is fine, the disk is not
                raise disk_full_error(self.path, exc) from exc
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
            log.warning("judge cache %s is damaged (%s): moved to %s and rebuilt empty (replies are asked again)",
                        self.path, exc, aside)
            self.path.rename(aside)
            for suffix in ("-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=60)
        try:
            # WAL + NORMAL: a committed reply survives the process being killed; commits do not wait for the disk
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, model TEXT, prompt_version TEXT,"
                       " sample_index INTEGER, text TEXT, prompt_tokens INTEGER, completion_tokens INTEGER,"
                       " reasoning_tokens INTEGER, created REAL)")
            db.commit()
            problems = db.execute("PRAGMA quick_check").fetchall()
            if problems != [("ok",)]:
                raise sqlite3.DatabaseError(f"integrity check: {problems[0][0]}")
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def get(self, keys: Sequence[str]) -> dict[str, tuple[str, int, int, int]]:
        found: dict[str, tuple[str, int, int, int]] = {}
        with self._lock:
            for start in range(0, len(keys), 500):
                chunk = list(keys[start:start + 500])
                rows = self._db.execute(
                    f"SELECT key, text, prompt_tokens, completion_tokens, reasoning_tokens FROM replies "
                    f"WHERE key IN ({','.join('?' * len(chunk))})", chunk).fetchall()
                found.update({r[0]: (r[1], r[2], r[3], r[4]) for r in rows})
        return found

    def put(self, request: JudgeRequest, reply: JudgeReply) -> None:
        with self._lock, writing(self.path):  # SQLite's "database or disk is full" names no file
            self._db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (request.key, request.settings.model, request.prompt_version, request.sample_index,
                              reply.text, reply.prompt_tokens, reply.completion_tokens, reply.reasoning_tokens,
                              time.time()))
            self._db.commit()

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


# -- back ends -------------------------------------------------------------------------------------------


class JudgeBackend(Protocol):
    name: str

    def send(self, requests: list[JudgeRequest], on_reply) -> None:
        """Answer every request, calling on_reply(index, JudgeReply) as each reply arrives."""


class ChatCompletionsBackend:
    """Any OpenAI-compatible `/v1/chat/completions` endpoint: the OpenAI API, `vllm serve`, `transformers serve`.

    Requests run concurrently on a thread pool. Connection errors, timeouts, 429 and 5xx are retried with
    exponential backoff (four times longer after 429, never shorter than Retry-After); when retries run out the
    endpoint is taken to be gone (JudgeUnavailable). 401/403/404 mean wrong credentials or model: JudgeUnavailable
    at once. Any other 4xx rejects that one request (e.g. a prompt over the context): it comes back as a reply
    with `error` set, which the scorer counts as an unparseable reply.
    """

    name = "openai"

    def __init__(self, base_url: str | None = None, *, api_key_env: str = "OPENAI_API_KEY", concurrency: int = 16,
                 timeout_s: float = 600.0, max_retries: int = 5, backoff_s: float = 1.0, max_wait_s: float = 120.0,
                 token_field: str = "max_completion_tokens"):
        import httpx

        base = (base_url or OPENAI_URL).rstrip("/")
        self.base_url = base[:-3] if base.endswith("/v1") else base
        self.url = f"{self.base_url}/v1/chat/completions"
        self.api_key_env = api_key_env
        key = os.environ.get(api_key_env) or None
        self._secrets = [key] if key else []
        if key is None and self.base_url == OPENAI_URL:
            raise JudgeUnavailable(f"the judge endpoint {self.url} needs an API key: set the environment variable "
                                   f"{api_key_env} (evaluation.judge_api_key_env), or point "
                                   "evaluation.judge_base_url at a served judge")
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_wait_s = max_wait_s
        self.token_field = token_field
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
                                    limits=httpx.Limits(max_connections=concurrency,
                                                        max_keepalive_connections=concurrency))

    def close(self) -> None:
        self._client.close()

    def body(self, request: JudgeRequest) -> dict[str, Any]:
        s = request.settings
        body: dict[str, Any] = {"model": s.model, "messages": request.messages, "temperature": s.temperature,
                                self.token_field: s.max_tokens}
        if s.reasoning_effort is not None:
            body["reasoning_effort"] = s.reasoning_effort
        return body

    def send(self, requests: list[JudgeRequest], on_reply) -> None:
        if not requests:
            return
        abort = threading.Event()

        def one(index: int) -> None:
            on_reply(index, self._one(requests[index], abort))

        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            futures = [pool.submit(one, i) for i in range(len(requests))]
            for future in futures:
                try:
                    future.result()
                except BaseException:
                    abort.set()
                    for f in futures:
                        f.cancel()
                    raise

    def _one(self, request: JudgeRequest, abort: threading.Event) -> JudgeReply:
        body = self.body(request)
        status, payload, text = post_with_retries(
            self._client, self.url, body, max_retries=self.max_retries, base_s=self.backoff_s,
            max_wait_s=self.max_wait_s, secrets=self._secrets, abort=abort, unavailable=JudgeUnavailable,
            hint=f"Check that the judge is running and reachable at {self.base_url} (evaluation.judge_base_url) "
                 f"and serves model {body['model']!r}. Replies received so far are cached; re-running resumes.")
        if status in (401, 403, 404):
            raise JudgeUnavailable(redact(
                f"{self.url}: HTTP {status} for judge model {body['model']!r}: {text[:300]}. Check the key in "
                f"${self.api_key_env} and that the endpoint serves this model.", self._secrets))
        if payload is None:
            message = redact(f"HTTP {status}: {text[:300]}", self._secrets)
            log.warning("%s rejected one judge request: %s", self.url, message)
            return JudgeReply(text="", key=request.key, error=message)
        return self._reply(request, payload)

    @staticmethod
    def _reply(request: JudgeRequest, payload: dict[str, Any]) -> JudgeReply:
        try:
            message = payload["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            return JudgeReply(text="", key=request.key, error=f"reply has no choices: {str(payload)[:200]}")
        text = message.get("content") if isinstance(message, dict) else None
        usage = payload.get("usage") or {}
        details = usage.get("completion_tokens_details") or {}
        return JudgeReply(text=text if isinstance(text, str) else "", key=request.key,
                          prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          completion_tokens=int(usage.get("completion_tokens") or 0),
                          reasoning_tokens=int(details.get("reasoning_tokens") or 0))


class LocalEngineBackend:
    """One of our engines as the judge (the smoke run's offline judge is the tiny M0). Requests that share
    settings and sample index go out as ONE batched `generate` call; the sample index seeds it, so a new sample
    of an unparseable reply differs from the first. `reasoning_effort` has no meaning here and is ignored."""

    name = "local"

    def __init__(self, engine: Engine, adapter: str | None = None, seed: int = 0):
        self.engine = engine
        self.adapter = adapter
        self.seed = seed

    def send(self, requests: list[JudgeRequest], on_reply) -> None:
        tokenizer = self.engine.tokenizer
        limit = getattr(self.engine, "max_model_len", None)
        groups: dict[tuple[JudgeSettings, int], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.settings, r.sample_index), []).append(i)
        for (settings, sample_index), indices in groups.items():
            prompts = {i: tokenizer.encode(tokenizer.apply_chat_template(requests[i].messages, tokenize=False,
                                                                         add_generation_prompt=True),
                                           add_special_tokens=False, verbose=False) for i in indices}
            fits = [i for i in indices if limit is None or len(prompts[i]) < limit]
            for i in indices:
                if i not in fits:  # as a served model would: reject a prompt that leaves no room to answer
                    on_reply(i, JudgeReply(text="", key=requests[i].key, error=f"prompt of {len(prompts[i])} tokens "
                                           f"leaves no room in the judge's context of {limit}"))
            if not fits:
                continue
            sampling = Sampling(max_new_tokens=settings.max_tokens, temperature=settings.temperature,
                                seed=self.seed + sample_index, logprobs=False)
            completions = self.engine.generate([prompts[i] for i in fits], sampling, adapter=self.adapter)
            for i, completion in zip(fits, completions, strict=True):
                on_reply(i, JudgeReply(text=completion.text, key=requests[i].key, prompt_tokens=len(prompts[i]),
                                       completion_tokens=len(completion.token_ids)))


# -- the judge -------------------------------------------------------------------------------------------


@dataclass
class BenchmarkJudge:
    """Cached, accounted judge calls over one back end."""

    backend: Any
    cache: JudgeCache | None = None
    prices: dict[str, tuple[float, float]] = field(default_factory=dict)
    usage: dict[str, Usage] = field(default_factory=dict)
    sent: int = 0          # requests that reached the back end (cache misses)

    def complete(self, requests: list[JudgeRequest]) -> list[JudgeReply]:
        """Replies in request order: cached ones from disk, the rest from the back end (written to the cache as
        they arrive). Identical requests in one batch are sent once."""
        replies: list[JudgeReply | None] = [None] * len(requests)
        keys = [r.key for r in requests]
        hits = self.cache.get(keys) if self.cache is not None else {}
        todo: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            if key in hits:
                text, p, c, rt = hits[key]
                replies[i] = JudgeReply(text=text, key=key, cached=True, prompt_tokens=p, completion_tokens=c,
                                        reasoning_tokens=rt)
            else:
                todo.setdefault(key, []).append(i)
        unique = [requests[indices[0]] for indices in todo.values()]
        lock = threading.Lock()

        def on_reply(j: int, reply: JudgeReply) -> None:
            indices = todo[unique[j].key]
            with lock:
                self.sent += 1
                replies[indices[0]] = reply
                for k in indices[1:]:
                    replies[k] = JudgeReply(text=reply.text, key=reply.key, cached=True, error=reply.error)
            if self.cache is not None and reply.error is None:
                self.cache.put(unique[j], reply)

        self.backend.send(unique, on_reply)
        done = [r for r in replies if r is not None]
        if len(done) != len(requests):
            raise JudgeUnavailable(f"judge back end {self.backend.name!r} answered {len(done)} of {len(requests)}")
        for request, reply in zip(requests, done, strict=True):
            self.usage.setdefault(request.tag, Usage()).add(reply, self.prices.get(request.settings.model))
        return done

    def usage_table(self) -> list[dict[str, Any]]:
        return [{"tag": tag, **asdict(u)} for tag, u in sorted(self.usage.items())]

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()
        if self.cache is not None:
            self.cache.close()


@dataclass
class Asked:
    """What the judge said to one unit over its samples: the parsed verdict (None = invalid after every retry)
    and every reply, request key and transport error, in order."""

    verdict: Any = None
    replies: list[str] = field(default_factory=list)
    request_keys: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def history(self) -> dict[str, list[str]]:
        return {"replies": self.replies, "request_keys": self.request_keys, "errors": self.errors}


def ask_with_retries(judge: BenchmarkJudge, settings: JudgeSettings, jobs: Sequence[tuple[Hashable, Any, str]],
                     retries: int) -> dict[Hashable, Asked]:
    """Ask the judge every job (slot, unit, tag) in one batch per round; a reply that does not parse
    (`unit.parse(text)` is None) or that the endpoint rejected is asked again with the next sample index, up to
    `retries` more rounds. `unit` has `messages`, `prompt_version` and `parse` (`scorers.Unit`); `tag` is what
    its cost is accounted under."""
    asked: dict[Hashable, Asked] = {slot: Asked() for slot, _, _ in jobs}
    pending = list(jobs)
    for sample_index in range(retries + 1):
        if not pending:
            break
        requests = [JudgeRequest(unit.messages, settings, unit.prompt_version, sample_index, tag)
                    for _, unit, tag in pending]
        replies = judge.complete(requests)
        still = []
        for (slot, unit, tag), reply in zip(pending, replies, strict=True):
            a = asked[slot]
            a.replies.append(reply.text)
            a.request_keys.append(reply.key)
            if reply.error:
                a.errors.append(reply.error)
            parsed = unit.parse(reply.text) if reply.error is None else None
            if parsed is None:
                still.append((slot, unit, tag))
            else:
                a.verdict = parsed
        pending = still
    return asked
