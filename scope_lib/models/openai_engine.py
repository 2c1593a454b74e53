"""`OpenAIEngine`: any OpenAI-compatible `/v1/completions` server (`vllm serve`, `transformers serve`), with
runtime LoRA loading. The contract is in `scope_lib.models.engine`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal

from scope_lib.models.engine import (
    Completion,
    EngineRequestError,
    EngineUnavailable,
    FinishReason,
    Sampling,
    eos_ids,
    fit_budgets,
    no_room_completion,
    strip_eos,
)
from scope_lib.models.retries import post_with_retries, redact

log = logging.getLogger(__name__)


PromptFormat = Literal["auto", "tokens", "text"]


def _server_root(url: str) -> str:
    """A server's address without a trailing slash or `/v1`."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class OpenAIEngine:
    """An OpenAI-compatible `/v1/completions` server: `vllm serve` (a Judge or frozen Solver on other GPUs)
    or `transformers serve` (CPU).

    prompt_format:
      - "tokens": prompts are sent as token ids and vLLM's extensions ask for the sampled token ids
        (`return_token_ids`), stop strings kept in the text and special tokens kept. Nothing is
        re-tokenised.
      - "text": prompts are decoded to text and only standard fields are sent (servers that reject unknown
        fields or token prompts, e.g. `transformers serve`). When the reply carries no token ids, its text is
        tokenised here: the one place in the package where model output is re-tokenised, because the server
        returned only text. Logprobs are then dropped (they would not align with the re-tokenised ids).
      - "auto": the first request tries "tokens"; when the server rejects it (400/422) but accepts the same
        request as text, "text" is used for good. A request rejected either way raises.

    `base_url` may be a list of servers serving the same model (several `vllm serve`, one per GPU or node): each
    batch is cut into contiguous shares, one per server (a GRPO group's copies stay together, for the servers'
    prefix caches), and `add_adapter` registers the adapter on every server.

    `adapter` becomes the request's `model` (vLLM serves LoRA adapters under their names, `--lora-modules`).
    Requests run concurrently on a thread pool (safe inside Jupyter's running event loop); connection errors,
    timeouts, 429 and 5xx are retried with exponential backoff (longer after 429, never shorter than the
    server's Retry-After), then raise EngineUnavailable. Each request asks for at most what fits the context
    (`max_model_len`). Credentials are redacted from every error and log line. Each prompt gets the seed
    `seed + i`, so the G copies of a prompt in a GRPO group differ.
    """

    name = "openai"

    def __init__(self, base_url: str | list[str], model: str, tokenizer, api_key: str | None = None, concurrency: int = 32,
                 timeout_s: float = 600.0, max_retries: int = 3, prompt_format: PromptFormat = "auto",
                 backoff_s: float = 1.0, eos_token_ids: Iterable[int] | None = None,
                 max_model_len: int | None = None, max_wait_s: float = 120.0):
        import httpx

        if prompt_format not in ("auto", "tokens", "text"):
            raise ValueError(f"prompt_format must be auto, tokens or text, got {prompt_format!r}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url: give at least one server address")
        self.base_urls = [_server_root(u) for u in urls]
        self.base_url = self.base_urls[0]
        self.url = f"{self.base_url}/v1/completions"
        self.requests = [0] * len(self.base_urls)  # requests sent to each server (retries not counted)
        self.model = model
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.prompt_format: PromptFormat = prompt_format
        self.eos_token_ids = eos_ids(tokenizer, None, eos_token_ids)
        self.max_model_len = max_model_len
        self.max_wait_s = max_wait_s
        self._secrets = [api_key] if api_key else []
        self._adapter_names: dict[str, str] = {}
        self.adapter_tag = ""  # prefixed to served versions: several trainer ranks sharing servers set their own
        self._adapter_count = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
                                    limits=httpx.Limits(max_connections=concurrency,
                                                        max_keepalive_connections=concurrency))
        self._format_lock = threading.Lock()
        self.calls = 0

    def close(self) -> None:
        self._client.close()

    def add_adapter(self, name: str, path: str | os.PathLike, version: str | int | None = None) -> str:
        """Load a LoRA adapter folder into the server at run time (`vllm serve --enable-lora` with
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) under a new versioned name, then unload the version it replaces;
        `generate(adapter=name)` uses the newest version. Returns the served name."""
        if not Path(path, "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path}: no adapter_config.json; save the adapter with save_pretrained")
        self._adapter_count += 1
        served = f"{name}@{self.adapter_tag}{version if version is not None else self._adapter_count}"
        for base in self.base_urls:
            self._admin(base, "load_lora_adapter", {"lora_name": served, "lora_path": str(Path(path).resolve())})
        previous = self._adapter_names.get(name)
        self._adapter_names[name] = served
        if previous and previous != served:
            for base in self.base_urls:
                try:
                    self._admin(base, "unload_lora_adapter", {"lora_name": previous})
                except EngineRequestError as exc:  # the new version is live; an old one left loaded costs a slot
                    log.warning("%s: could not unload %s: %s", base, previous, redact(str(exc), self._secrets))
        return served

    def _admin(self, base: str, route: str, body: dict[str, Any]) -> None:
        import httpx

        url = f"{base}/v1/{route}"
        try:
            response = self._client.post(url, json=body)
        except httpx.TransportError as exc:
            raise EngineUnavailable(redact(f"{url}: {type(exc).__name__}: {exc}", self._secrets)) from None
        if response.status_code >= 400:
            raise EngineRequestError(redact(f"{url}: HTTP {response.status_code}: {response.text[:300]} (start the "
                                            "server with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
                                            self._secrets), status=response.status_code)

    def __enter__(self) -> OpenAIEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public ------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None = None) -> list[Completion]:
        self.calls += 1
        budgets = fit_budgets(prompt_token_ids, sampling.max_new_tokens, self.max_model_len)
        results: list[Completion | None] = [None if b else no_room_completion() for b in budgets]
        todo = [i for i, b in enumerate(budgets) if b]
        n = len(prompt_token_ids)
        server = [i * len(self.base_urls) // n for i in range(n)]  # contiguous shares, one per server
        if todo and self.prompt_format == "auto":  # probe with one prompt, then run the rest concurrently
            first = todo.pop(0)
            results[first] = self._probe(prompt_token_ids[first], budgets[first], sampling, adapter, first,
                                         server[first])
        if todo:
            abort = threading.Event()
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(todo))) as pool:
                futures = {pool.submit(self._one, prompt_token_ids[i], budgets[i], sampling, adapter, i, abort,
                                       server=server[i]): i
                           for i in todo}
                done, pending = wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None]
                if failed:
                    abort.set()
                    for f in pending:
                        f.cancel()
                    raise failed[0].exception()
                for f, i in futures.items():
                    results[i] = f.result()
        return [r for r in results if r is not None]

    # -- internals ---------------------------------------------------------------------------------
    def _probe(self, prompt: list[int], budget: int, sampling: Sampling, adapter: str | None,
               index: int, server: int = 0) -> Completion:
        """Try token-id prompts; fall back to text only when the server rejects token prompts and accepts the
        same request as text. A request that fails either way (e.g. a context-length 400) raises and leaves
        the format undecided."""
        try:
            completion = self._one(prompt, budget, sampling, adapter, index, None, fmt="tokens", server=server)
        except EngineRequestError as exc:
            if exc.status not in (400, 422):
                raise
            try:
                completion = self._one(prompt, budget, sampling, adapter, index, None, fmt="text", server=server)
            except EngineRequestError:
                raise exc from None
            log.info("%s rejected token-id prompts (%s); sending text prompts from now on", self.url,
                     redact(str(exc), self._secrets))
            with self._format_lock:
                self.prompt_format = "text"
            return completion
        with self._format_lock:
            self.prompt_format = "tokens"
        return completion

    def _body(self, prompt: list[int], budget: int, sampling: Sampling, adapter: str | None, index: int,
              fmt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._adapter_names.get(adapter, adapter) if adapter else self.model,
            "max_tokens": budget,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed + index
        if sampling.logprobs:
            body["logprobs"] = 0 if fmt == "tokens" else 1
        if fmt == "tokens":
            body.update(prompt=list(prompt), return_token_ids=True, return_tokens_as_token_ids=True,
                        include_stop_str_in_output=True, skip_special_tokens=False)
        else:
            body["prompt"] = self.tokenizer.decode(prompt)
        return body

    def _one(self, prompt: list[int], budget: int, sampling: Sampling, adapter: str | None, index: int,
             abort: threading.Event | None, fmt: str | None = None, server: int = 0) -> Completion:
        fmt = fmt or self.prompt_format
        with self._format_lock:
            self.requests[server] += 1
        reply = self._post(self._body(prompt, budget, sampling, adapter, index, fmt), abort, server)
        try:
            choice = reply["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EngineRequestError(redact(f"{self.url}: reply has no choices: {str(reply)[:300]}",
                                            self._secrets)) from None
        return self._completion(choice, sampling, fmt)

    def _post(self, body: dict[str, Any], abort: threading.Event | None, server: int = 0) -> dict[str, Any]:
        base = self.base_urls[server]
        url = f"{base}/v1/completions"
        status, payload, text = post_with_retries(
            self._client, url, body, max_retries=self.max_retries, base_s=self.backoff_s,
            max_wait_s=self.max_wait_s, secrets=self._secrets, abort=abort, unavailable=EngineUnavailable,
            hint=f"Check that the server is running and reachable at {base} (e.g. `curl "
                 f"{base}/v1/models`), that it serves model {body['model']!r}, and engine.base_url / "
                 "engine.judge_base_url in the params.")
        if payload is None:
            raise EngineRequestError(redact(f"{url}: HTTP {status} for model {body['model']!r}: {text[:500]}",
                                            self._secrets), status=status)
        return payload

    def _completion(self, choice: dict[str, Any], sampling: Sampling, fmt: str) -> Completion:
        text = choice.get("text") or ""
        logprob_block = choice.get("logprobs") or {}
        token_logprobs = logprob_block.get("token_logprobs") if isinstance(logprob_block, dict) else None
        ids = choice.get("token_ids")
        if ids is None and fmt == "tokens":
            tokens = logprob_block.get("tokens") if isinstance(logprob_block, dict) else None
            if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                ids = [int(t.split(":", 1)[1]) for t in tokens]
        logprobs: list[float] | None = None
        if ids is not None:
            ids = [int(i) for i in ids]
            if sampling.logprobs and token_logprobs is not None and len(token_logprobs) == len(ids):
                logprobs = [float(x) for x in token_logprobs]
            ids, logprobs, had_eos = strip_eos(ids, logprobs, self.eos_token_ids)
            text = self.tokenizer.decode(ids)
        else:
            had_eos = False
            ids = self.tokenizer.encode(text, add_special_tokens=False)  # the server returned only text
        stop_reason = choice.get("stop_reason")
        if isinstance(stop_reason, str) and stop_reason in sampling.stop and stop_reason not in text:
            text += stop_reason  # a server that drops the matched stop string; restore it for the parsers
            ids = ids + self.tokenizer.encode(stop_reason, add_special_tokens=False)
        if choice.get("finish_reason") == "length" and not had_eos:
            finish: FinishReason = "length"
        elif any(s in text for s in sampling.stop):
            finish = "stop"
        else:
            finish = "eos"
        return Completion(token_ids=ids, text=text, logprobs=logprobs, finish_reason=finish)
