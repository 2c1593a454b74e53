"""Generation engines: one interface, three back ends.

    engine.generate(prompt_token_ids, Sampling(max_new_tokens=512, stop=("</search>",)), adapter="solver")
        -> [Completion(token_ids, text, logprobs, finish_reason), ...]     # one per prompt, in order

- `HFEngine`: transformers `generate` on CPU or GPU; the whole batch in one call (left padding).
- `VLLMEngine`: vLLM offline (GPU only; LoRA adapters served by name over one base model).
- `OpenAIEngine`: any OpenAI-compatible `/v1/completions` server (`vllm serve`, `transformers serve`).

Contract, the same for every engine (the rollout code relies on it):

- `token_ids` are the tokens the model sampled, never re-tokenised text (the one exception is a server that
  only returns text, see `OpenAIEngine`). `text == tokenizer.decode(token_ids)`.
- A stop string ends the completion right after the token that completes it; that token is kept, so `text`
  contains the stop string (it ends with it unless the last token runs past it, e.g. "</search>\\n" as one
  BPE token). `finish_reason` is then "stop".
- An end-of-sequence token (eos, e.g. <|im_end|>) is NOT in `token_ids`; `finish_reason` is "eos". The caller
  appends the end of turn itself (the chat template does, between turns).
- `finish_reason` "length": `max_new_tokens` were sampled without a stop or eos.
- `logprobs[i]` is log p(token_ids[i]) under the sampling distribution before top-p truncation:
  log_softmax(logits / temperature) (raw logits when temperature == 0), the quantity TRL's GRPO computes.
  None when `Sampling.logprobs` is False (or the server returns none).
- `calls` counts `generate()` calls: one per rollout turn or Judge stage, whatever the batch size.
- Every request is capped per prompt at what fits the context: at most `max_model_len - len(prompt)` new
  tokens (`fit_budgets`). A prompt that leaves no room gets an empty completion with finish "length"; a
  served model is never sent a request it must reject.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from scope_lib.config import Params

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class Sampling:
    """How to sample one batch. temperature 0 = greedy. `seed` makes a call reproducible."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"Sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"Sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))


@dataclass
class Completion:
    """One sampled continuation (see the module docstring for the exact contract)."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: FinishReason


@runtime_checkable
class Engine(Protocol):
    """What rollouts and the Judge need from a generator."""

    tokenizer: Any
    name: str
    calls: int

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None = None) -> list[Completion]: ...


class EngineUnavailable(RuntimeError):
    """A served model could not be reached (or kept failing) after the allowed retries."""


class EngineRequestError(RuntimeError):
    """The server rejected a request (a 4xx other than 429): retrying would not help."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


# -- shared helpers --------------------------------------------------------------------------------


def _eos_ids(tokenizer, model=None, extra: Iterable[int] | None = None) -> set[int]:
    ids: set[int] = set(extra or ())
    if extra is None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen is not None:
            ids.update(int(i) for i in (gen if isinstance(gen, (list, tuple)) else [gen]))
    return ids


def _first_stop_end(tokenizer, ids: list[int], stops: tuple[str, ...]) -> int | None:
    """The number of tokens up to and including the one that completes the first stop string, or None."""
    if not stops or not ids:
        return None

    def has_stop(n: int) -> bool:
        text = tokenizer.decode(ids[:n])
        return any(s in text for s in stops)

    if not has_stop(len(ids)):
        return None
    lo, hi = 1, len(ids)  # smallest prefix whose text holds a stop string (containment grows with the prefix)
    while lo < hi:
        mid = (lo + hi) // 2
        if has_stop(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _strip_eos(ids: list[int], logprobs: list[float] | None, eos: set[int]):
    if ids and ids[-1] in eos:
        return ids[:-1], (logprobs[:-1] if logprobs is not None else None), True
    return ids, logprobs, False


def fit_budgets(prompt_token_ids: list[list[int]], max_new_tokens: int, max_model_len: int | None) -> list[int]:
    """Per prompt, the new tokens that fit: min(max_new_tokens, max_model_len - len(prompt)), never below 0.
    A batch asks for its largest budget; a long prompt in it must not be sent more than its context holds."""
    if max_model_len is None:
        return [max_new_tokens] * len(prompt_token_ids)
    return [max(0, min(max_new_tokens, max_model_len - len(p))) for p in prompt_token_ids]


def _no_room() -> Completion:
    """The completion of a prompt that already fills the context: nothing sampled."""
    return Completion(token_ids=[], text="", logprobs=[], finish_reason="length")


def _model_len(model) -> int | None:
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


# -- secrets ----------------------------------------------------------------------------------------

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


# -- HF transformers -------------------------------------------------------------------------------


class _SampledLogprobs:
    """A logits processor that records log p(sampled token) without keeping every step's logits.

    At step t it sees the token sampled at step t-1 (the last input id) and the previous step's
    log-softmax, so memory is one (batch, vocab) row, not (steps, batch, vocab). Placed before the
    temperature/top-p warpers, it sees the model's raw logits.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature if temperature > 0 else 1.0
        self.previous = None
        self.steps: list[Any] = []

    def __call__(self, input_ids, scores):
        import torch

        if self.previous is not None:
            self.steps.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_ids):
        """Per-step logprobs, (batch, steps), after the last step's sampled tokens are known."""
        import torch

        if self.previous is not None:
            self.steps.append(self.previous.gather(1, last_ids[:, None]).squeeze(1))
            self.previous = None
        return torch.stack(self.steps, dim=1) if self.steps else None


class _InGenerated:
    """A stopping criterion applied to the generated tokens only. transformers' StopStringCriteria looks at the
    end of the whole sequence, so a stop string straddling the prompt's end (a prompt ending in a newline, one
    sampled newline, the stop "\\n\\n") would end a row that never wrote it. Left padding aligns every prompt's
    end at `width`."""

    def __init__(self, inner, width: int):
        self.inner, self.width = inner, width

    def __call__(self, input_ids, scores, **kwargs):
        return self.inner(input_ids[:, self.width:], scores, **kwargs)


class HFEngine:
    """transformers generation: the whole batch in one `model.generate` (or `max_batch_size` chunks).

    `model` may be a PeftModel: `adapter` names the LoRA adapter to use for this call; None runs the base
    model with adapters disabled (the Judge and the reference policy). The active adapter, training mode and
    `requires_grad` flags are restored afterwards, so generation can sit inside a training loop.
    """

    name = "hf"

    def __init__(self, model, tokenizer, device: str | None = None, max_batch_size: int | None = None,
                 eos_token_ids: Iterable[int] | None = None, max_model_len: int | None = None):
        import torch

        if device is not None:
            model.to(device)
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or _model_len(model)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.eos_token_ids = _eos_ids(tokenizer, model, eos_token_ids)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids)
        self._stop_cache: dict[tuple[str, ...], Any] = {}
        self.calls = 0

    # -- public ------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None = None) -> list[Completion]:
        import torch

        self.calls += 1
        if not prompt_token_ids:
            return []
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("HFEngine.generate: every prompt needs at least one token")
        budgets = fit_budgets(prompt_token_ids, sampling.max_new_tokens, self.max_model_len)
        results: list[Completion | None] = [None if b else _no_room() for b in budgets]
        order = sorted((i for i, b in enumerate(budgets) if b), key=lambda i: -len(prompt_token_ids[i]))
        size = self.max_batch_size or max(1, len(order))
        chunks = [order[i:i + size] for i in range(0, len(order), size)]
        devices = ([self.device.index if self.device.index is not None else torch.cuda.current_device()]
                   if self.device.type == "cuda" else [])
        was_training = self.model.training
        # A seeded call must not disturb the global RNG; an unseeded one must advance it (or two unseeded
        # calls would sample the same thing).
        rng = torch.random.fork_rng(devices=devices) if sampling.seed is not None else nullcontext()
        with self._adapter(adapter), rng:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            self.model.eval()
            try:
                for chunk in chunks:
                    completions = self._generate_chunk([prompt_token_ids[i] for i in chunk],
                                                       [budgets[i] for i in chunk], sampling)
                    for i, completion in zip(chunk, completions, strict=True):
                        results[i] = completion
            finally:
                self.model.train(was_training)
        return [r for r in results if r is not None]

    # -- internals ---------------------------------------------------------------------------------
    def _generate_chunk(self, prompts: list[list[int]], budgets: list[int], sampling: Sampling) -> list[Completion]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        greedy = sampling.temperature == 0
        config = GenerationConfig(
            max_new_tokens=max(budgets),
            do_sample=not greedy,
            temperature=1.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            # 0 disables the global default top-k of 50 when sampling; greedy ignores it (50 avoids a warning)
            top_k=50 if greedy else 0,
            repetition_penalty=1.0,
            num_beams=1,
            num_return_sequences=1,
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=False,
        )
        recorder = _SampledLogprobs(sampling.temperature) if sampling.logprobs else None
        kwargs: dict[str, Any] = {}
        if sampling.stop:
            kwargs["stopping_criteria"] = StoppingCriteriaList([_InGenerated(self._stop_criteria(sampling.stop),
                                                                             width)])
        if recorder is not None:
            kwargs["logits_processor"] = LogitsProcessorList([recorder])
        sequences = self.model.generate(input_ids=input_ids.to(self.device),
                                        attention_mask=attention_mask.to(self.device),
                                        generation_config=config, **kwargs)
        generated = sequences[:, width:]
        step_logprobs = recorder.finish(generated[:, -1]) if recorder is not None and generated.shape[1] else None
        generated_rows = generated.tolist()
        logprob_rows = step_logprobs.tolist() if step_logprobs is not None else None
        return [self._completion(ids[:budgets[row]],
                                 logprob_rows[row][:budgets[row]] if logprob_rows is not None else None, sampling)
                for row, ids in enumerate(generated_rows)]

    def _stop_criteria(self, stops: tuple[str, ...]):
        """transformers' StopStringCriteria for these stops (its vocabulary preprocessing is cached here)."""
        from transformers import StopStringCriteria

        if stops not in self._stop_cache:
            self._stop_cache[stops] = StopStringCriteria(tokenizer=self.tokenizer, stop_strings=list(stops))
        return self._stop_cache[stops]

    def _completion(self, ids: list[int], logprobs: list[float] | None, sampling: Sampling) -> Completion:
        finish: FinishReason = "length"
        end = len(ids)
        # The first eos ends the sequence; padding follows it (the pad token counts as an end: for Qwen and the
        # tiny model it is <|endoftext|>, itself an eos).
        for pos, token in enumerate(ids):
            if token in self.eos_token_ids or token == self.pad_token_id:
                end, finish = pos, "eos"
                break
        stop_end = _first_stop_end(self.tokenizer, ids[:end], sampling.stop)
        if stop_end is not None:
            end, finish = stop_end, "stop"
        ids = ids[:end]
        logprobs = logprobs[:end] if logprobs is not None else None
        return Completion(token_ids=ids, text=self.tokenizer.decode(ids), logprobs=logprobs,
                          finish_reason=finish)

    @contextmanager
    def _adapter(self, adapter: str | None) -> Iterator[None]:
        """Activate `adapter` (or disable every adapter for None) for one call, then restore the model.

        Handles a peft PeftModel (what TRL trains) and adapters loaded into a transformers model
        (`model.load_adapter` / `add_adapter`)."""
        model = self.model
        configs = getattr(model, "peft_config", None) or {}
        is_peft_model = hasattr(model, "disable_adapter") and hasattr(model, "base_model") and bool(configs)
        integrated = bool(getattr(model, "_hf_peft_config_loaded", False))
        if adapter is None:
            if is_peft_model:
                with model.disable_adapter():
                    yield
            elif integrated:
                model.disable_adapters()
                try:
                    yield
                finally:
                    model.enable_adapters()
            else:
                yield
            return
        if not (is_peft_model or integrated):
            raise ValueError(f"adapter {adapter!r} requested but the model has no LoRA adapters "
                             "(wrap it with peft.get_peft_model / PeftModel.from_pretrained)")
        if adapter not in configs:
            raise ValueError(f"unknown adapter {adapter!r}; the model has: {', '.join(configs)}")
        previous = model.active_adapter if is_peft_model else model.active_adapters()
        trainable = {name: p.requires_grad for name, p in model.named_parameters()}
        model.set_adapter(adapter)
        try:
            yield
        finally:
            model.set_adapter(previous)
            for name, p in model.named_parameters():
                if name in trainable:
                    p.requires_grad_(trainable[name])


# -- vLLM (offline, GPU) ---------------------------------------------------------------------------

_VLLM_MISSING = ("VLLMEngine needs vLLM, which runs on CUDA GPUs only and is not installed here. Install the "
                 "GPU extra (`pip install -e '.[gpu]' -c constraints.txt`, or environment.yml) on a GPU machine, "
                 "or set engine.backend: hf (CPU/GPU) or openai (a served model).")


class VLLMEngine:
    """vLLM's offline `LLM`: one engine serves the base model (Judge, reference) and LoRA adapters
    (Challenger, Solver) registered by name with `add_adapter`. Logprobs are vLLM's "processed" logprobs
    (after temperature, like TRL's colocate mode), so they follow the same definition as HFEngine's.

    Each prompt gets its own seed (`seed + i`), so the G copies of a prompt in a GRPO group differ.

    Sharing one GPU with the trainer: `sleep()` (level 1 offloads the weights to CPU memory and frees the KV
    cache; the base never changes, so nothing is re-sent) while the trainer steps, `wake_up()` before the next
    rollout; `generate` wakes a sleeping engine itself. `llm` takes an existing engine (e.g. Unsloth's
    `fast_inference` one, which shares the trainer's weights) instead of building one.
    """

    name = "vllm"

    def __init__(self, model: str | os.PathLike, *, tokenizer=None, enable_lora: bool = False, max_loras: int = 2,
                 max_lora_rank: int = 64, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, seed: int = 0, dtype: str = "auto",
                 eos_token_ids: Iterable[int] | None = None, enable_sleep_mode: bool = False, llm: Any = None,
                 **llm_kwargs: Any):
        if llm is None:
            try:
                import vllm
            except ImportError as exc:
                raise ImportError(_VLLM_MISSING) from exc
            kwargs: dict[str, Any] = dict(
                model=str(model), enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                max_model_len=max_model_len, seed=seed, dtype=dtype, logprobs_mode="processed_logprobs",
                enable_sleep_mode=enable_sleep_mode)
            if enable_lora:
                kwargs.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
            kwargs.update(llm_kwargs)
            llm = vllm.LLM(**kwargs)
        self.llm = llm
        self.sleeping = False
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.tokenizer = tokenizer
        generation_eos = None
        try:
            from transformers import GenerationConfig

            generation_eos = GenerationConfig.from_pretrained(str(model)).eos_token_id
        except (OSError, ValueError):
            pass
        self.eos_token_ids = _eos_ids(tokenizer, None, eos_token_ids)
        if eos_token_ids is None and generation_eos is not None:
            self.eos_token_ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        self._adapters: dict[str, tuple[int, str]] = {}
        self._next_adapter_id = 1
        self.max_model_len = max_model_len or self.llm.llm_engine.model_config.max_model_len
        self.calls = 0

    def add_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Register (or replace) a LoRA adapter saved with `save_pretrained`; a new id makes vLLM reload it."""
        if not Path(path, "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path}: no adapter_config.json; save the adapter with save_pretrained")
        self._adapters[name] = (self._next_adapter_id, str(path))
        self._next_adapter_id += 1

    def sleep(self, level: int = 1) -> None:
        """Free the GPU for the trainer: level 1 keeps the weights in CPU memory (the base never changes)."""
        if not self.sleeping:
            self.llm.sleep(level=level)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # hand back what the trainer freed before vLLM claims its share
            except ImportError:
                pass
            self.llm.wake_up()
            self.sleeping = False

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None = None) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.calls += 1
        if not prompt_token_ids:
            return []
        self.wake_up()
        lora = None
        if adapter is not None:
            if adapter not in self._adapters:
                raise ValueError(f"unknown adapter {adapter!r}; registered: {', '.join(self._adapters) or 'none'} "
                                 "(call add_adapter(name, path) first)")
            from vllm.lora.request import LoRARequest

            adapter_id, path = self._adapters[adapter]
            lora = LoRARequest(adapter, adapter_id, path)
        budgets = fit_budgets(prompt_token_ids, sampling.max_new_tokens, self.max_model_len)
        todo = [i for i, b in enumerate(budgets) if b]
        params = [SamplingParams(
            max_tokens=budgets[i], temperature=sampling.temperature, top_p=sampling.top_p,
            stop=list(sampling.stop) or None, include_stop_str_in_output=True,
            logprobs=0 if sampling.logprobs else None, skip_special_tokens=False,
            seed=None if sampling.seed is None else sampling.seed + i)
            for i in todo]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_token_ids[i])) for i in todo],
                                    params, lora_request=lora, use_tqdm=False) if todo else []
        completions: list[Completion] = [_no_room() for _ in prompt_token_ids]
        for i, out in zip(todo, outputs, strict=True):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = None
            if sampling.logprobs and sample.logprobs is not None:
                logprobs = [float(step[token].logprob) for token, step in zip(ids, sample.logprobs, strict=True)]
            ids, logprobs, had_eos = _strip_eos(ids, logprobs, self.eos_token_ids)
            if sample.finish_reason == "length" and not had_eos:
                finish: FinishReason = "length"
            elif isinstance(sample.stop_reason, str):
                finish = "stop"
            else:
                finish = "eos"
            completions[i] = Completion(token_ids=ids, text=self.tokenizer.decode(ids), logprobs=logprobs,
                                        finish_reason=finish)
        return completions


# -- OpenAI-compatible HTTP ------------------------------------------------------------------------

PromptFormat = Literal["auto", "tokens", "text"]


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

    `adapter` becomes the request's `model` (vLLM serves LoRA adapters under their names, `--lora-modules`).
    Requests run concurrently on a thread pool (safe inside Jupyter's running event loop); connection errors,
    timeouts, 429 and 5xx are retried with exponential backoff (longer after 429, never shorter than the
    server's Retry-After), then raise EngineUnavailable. Each request asks for at most what fits the context
    (`max_model_len`). Credentials are redacted from every error and log line. Each prompt gets the seed
    `seed + i`, so the G copies of a prompt in a GRPO group differ.
    """

    name = "openai"

    def __init__(self, base_url: str, model: str, tokenizer, api_key: str | None = None, concurrency: int = 32,
                 timeout_s: float = 600.0, max_retries: int = 3, prompt_format: PromptFormat = "auto",
                 backoff_s: float = 1.0, eos_token_ids: Iterable[int] | None = None,
                 max_model_len: int | None = None, max_wait_s: float = 120.0):
        import httpx

        if prompt_format not in ("auto", "tokens", "text"):
            raise ValueError(f"prompt_format must be auto, tokens or text, got {prompt_format!r}")
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.url = f"{self.base_url}/v1/completions"
        self.model = model
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.prompt_format: PromptFormat = prompt_format
        self.eos_token_ids = _eos_ids(tokenizer, None, eos_token_ids)
        self.max_model_len = max_model_len
        self.max_wait_s = max_wait_s
        self._secrets = [api_key] if api_key else []
        self._adapter_names: dict[str, str] = {}
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
        served = f"{name}@{version if version is not None else self._adapter_count}"
        self._admin("load_lora_adapter", {"lora_name": served, "lora_path": str(Path(path).resolve())})
        previous = self._adapter_names.get(name)
        self._adapter_names[name] = served
        if previous and previous != served:
            try:
                self._admin("unload_lora_adapter", {"lora_name": previous})
            except EngineRequestError as exc:  # the new version is live; an old one left loaded costs a slot
                log.warning("%s: could not unload %s: %s", self.base_url, previous, redact(str(exc), self._secrets))
        return served

    def _admin(self, route: str, body: dict[str, Any]) -> None:
        import httpx

        url = f"{self.base_url}/v1/{route}"
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
        results: list[Completion | None] = [None if b else _no_room() for b in budgets]
        todo = [i for i, b in enumerate(budgets) if b]
        if todo and self.prompt_format == "auto":  # probe with one prompt, then run the rest concurrently
            first = todo.pop(0)
            results[first] = self._probe(prompt_token_ids[first], budgets[first], sampling, adapter, first)
        if todo:
            abort = threading.Event()
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(todo))) as pool:
                futures = {pool.submit(self._one, prompt_token_ids[i], budgets[i], sampling, adapter, i, abort): i
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
               index: int) -> Completion:
        """Try token-id prompts; fall back to text only when the server rejects token prompts and accepts the
        same request as text. A request that fails either way (e.g. a context-length 400) raises and leaves
        the format undecided."""
        try:
            completion = self._one(prompt, budget, sampling, adapter, index, None, fmt="tokens")
        except EngineRequestError as exc:
            if exc.status not in (400, 422):
                raise
            try:
                completion = self._one(prompt, budget, sampling, adapter, index, None, fmt="text")
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
             abort: threading.Event | None, fmt: str | None = None) -> Completion:
        fmt = fmt or self.prompt_format
        reply = self._post(self._body(prompt, budget, sampling, adapter, index, fmt), abort)
        try:
            choice = reply["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EngineRequestError(redact(f"{self.url}: reply has no choices: {str(reply)[:300]}",
                                            self._secrets)) from None
        return self._completion(choice, sampling, fmt)

    def _post(self, body: dict[str, Any], abort: threading.Event | None) -> dict[str, Any]:
        status, payload, text = post_with_retries(
            self._client, self.url, body, max_retries=self.max_retries, base_s=self.backoff_s,
            max_wait_s=self.max_wait_s, secrets=self._secrets, abort=abort, unavailable=EngineUnavailable,
            hint=f"Check that the server is running and reachable at {self.base_url} (e.g. `curl "
                 f"{self.base_url}/v1/models`), that it serves model {body['model']!r}, and engine.base_url / "
                 "engine.judge_base_url in the params.")
        if payload is None:
            raise EngineRequestError(redact(f"{self.url}: HTTP {status} for model {body['model']!r}: {text[:500]}",
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
            ids, logprobs, had_eos = _strip_eos(ids, logprobs, self.eos_token_ids)
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


# -- factory ---------------------------------------------------------------------------------------


def apply_torch_threads(params: Params) -> None:
    """`engine.torch_threads`: how many CPU threads torch uses in this process (notebooks, `scope` commands)."""
    if params.engine.torch_threads:
        import torch

        torch.set_num_threads(params.engine.torch_threads)

Role = Literal["policy", "judge"]


def model_name(params: Params, role: Role = "policy") -> str:
    """The model a role runs: M0 for the policy; `judge.model` or M0 for the Judge."""
    return params.model.base if role == "policy" else (params.judge.model or params.model.base)


def model_source(params: Params, role: Role = "policy", name: str | None = None) -> str:
    """Where a model's weights and tokenizer load from: a hub id or local path ('tiny' is built or reused
    from the cache). `name` defaults to the role's model."""
    from scope_lib.tiny import tiny_model_path

    name = name or model_name(params, role)
    return str(tiny_model_path(params.corpus_path, params.model.tiny)) if name == "tiny" else name


def load_tokenizer(params: Params, role: Role = "policy"):
    """The role's tokenizer alone (no weights), left-padded: for token budgets and formatting."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_source(params, role))
    tokenizer.padding_side = "left"
    return tokenizer


def make_engine(params: Params, role: Role = "policy", model=None, tokenizer=None,
                name: str | None = None) -> Engine:
    """The engine for a role from `params.engine`: the policy (Challenger/Solver rollouts) or the Judge.

    hf: uses `model`/`tokenizer` when given (e.g. the PeftModel being trained), else loads M0 (or
    `judge.model` for the Judge). vllm: one offline engine; in LoRA mode it serves the base and the adapters,
    so pass the policy engine to the Judge too instead of making a second one. openai: a served model at
    `engine.base_url` (policy) or `engine.judge_base_url` (Judge; falls back to `base_url`). `name` picks
    another model for the role (e.g. `judge.rubric_model`).
    """
    from scope_lib.tiny import load_model_and_tokenizer

    if role not in ("policy", "judge"):
        raise ValueError(f"role must be 'policy' or 'judge', got {role!r}")
    cfg = params.engine
    backend = cfg.backend if role == "policy" else (cfg.judge_backend or cfg.backend)
    name = name or model_name(params, role)

    if backend == "hf":
        if model is None:
            model, loaded_tokenizer = load_model_and_tokenizer(
                name, dtype=params.model.dtype, device=cfg.device, tiny_cfg=params.model.tiny,
                corpus_path=params.corpus_path)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("make_engine(backend='hf'): pass the tokenizer together with the model")
        return HFEngine(model, tokenizer, max_model_len=params.model.max_model_len,
                        max_batch_size=cfg.max_batch_size)
    if backend == "vllm":
        return VLLMEngine(
            model_source(params, role, name), tokenizer=tokenizer,
            enable_lora=role == "policy" and params.model.finetuning == "lora", max_loras=cfg.max_loras,
            max_lora_rank=params.model.lora_rank, enable_prefix_caching=cfg.enable_prefix_caching,
            gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=params.model.max_model_len, seed=params.selfplay.seed, dtype=params.model.dtype,
            enable_sleep_mode=cfg.sleep_mode)
    if backend == "openai":
        url = cfg.base_url if role == "policy" else (cfg.judge_base_url or cfg.base_url)
        key = "engine.base_url" if role == "policy" else "engine.judge_base_url (or engine.base_url)"
        if not url:
            raise ValueError(f"{key} must be set for the 'openai' backend (the server's address, e.g. "
                             "http://127.0.0.1:8000)")
        if tokenizer is None:
            tokenizer = load_tokenizer(params, role)
        return OpenAIEngine(url, model_source(params, role, name), tokenizer,
                            api_key=os.environ.get(cfg.api_key_env), concurrency=cfg.concurrency,
                            timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries,
                            max_model_len=params.model.max_model_len)
    raise ValueError(f"unknown engine backend {backend!r}; choose hf, vllm or openai")
