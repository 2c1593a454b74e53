"""The generation engine interface: one contract, three back ends (`hf_engine`, `vllm_engine`, `openai_engine`).

    engine.generate(prompt_token_ids, Sampling(max_new_tokens=512, stop=("</search>",)), adapter="solver")
        -> [Completion(token_ids, text, logprobs, finish_reason), ...]     # one per prompt, in order

- `HFEngine`: transformers `generate` on CPU or GPU; the whole batch in one call (left padding).
- `VLLMEngine`: vLLM offline (GPU, or CPU through vLLM's CPU build; LoRA adapters served by name over one
  base model).
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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

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


def eos_ids(tokenizer, model=None, extra: Iterable[int] | None = None) -> set[int]:
    ids: set[int] = set(extra or ())
    if extra is None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen is not None:
            ids.update(int(i) for i in (gen if isinstance(gen, (list, tuple)) else [gen]))
    return ids


def strip_eos(ids: list[int], logprobs: list[float] | None, eos: set[int]):
    if ids and ids[-1] in eos:
        return ids[:-1], (logprobs[:-1] if logprobs is not None else None), True
    return ids, logprobs, False


def fit_budgets(prompt_token_ids: list[list[int]], max_new_tokens: int, max_model_len: int | None) -> list[int]:
    """Per prompt, the new tokens that fit: min(max_new_tokens, max_model_len - len(prompt)), never below 0.
    A batch asks for its largest budget; a long prompt in it must not be sent more than its context holds."""
    if max_model_len is None:
        return [max_new_tokens] * len(prompt_token_ids)
    return [max(0, min(max_new_tokens, max_model_len - len(p))) for p in prompt_token_ids]


def no_room_completion() -> Completion:
    """The completion of a prompt that already fills the context: nothing sampled."""
    return Completion(token_ids=[], text="", logprobs=[], finish_reason="length")


