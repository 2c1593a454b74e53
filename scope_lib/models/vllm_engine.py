"""`VLLMEngine`: vLLM offline, M0 with LoRA adapters served by name. The contract is in `scope_lib.models.engine`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scope_lib.models.engine import (
    Completion,
    FinishReason,
    Sampling,
    eos_ids,
    fit_budgets,
    no_room_completion,
    strip_eos,
)

log = logging.getLogger(__name__)


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
        self.eos_token_ids = eos_ids(tokenizer, None, eos_token_ids)
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
        completions: list[Completion] = [no_room_completion() for _ in prompt_token_ids]
        for i, out in zip(todo, outputs, strict=True):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = None
            if sampling.logprobs and sample.logprobs is not None:
                logprobs = [float(step[token].logprob) for token, step in zip(ids, sample.logprobs, strict=True)]
            ids, logprobs, had_eos = strip_eos(ids, logprobs, self.eos_token_ids)
            if sample.finish_reason == "length" and not had_eos:
                finish: FinishReason = "length"
            elif isinstance(sample.stop_reason, str):
                finish = "stop"
            else:
                finish = "eos"
            completions[i] = Completion(token_ids=ids, text=self.tokenizer.decode(ids), logprobs=logprobs,
                                        finish_reason=finish)
        return completions
