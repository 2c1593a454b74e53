"""What this machine's CPU runs natively, and the dtype that follows from it (issue 31).

    cpu_description()                    # 'x86_64, AVX512 (AVX512-BF16)' -- stated with every CPU timing
    dtype_for("bfloat16", "cpu")         # 'float32' on a CPU without native bf16, else 'bfloat16'

bfloat16 on a CPU without native bf16 instructions (x86: AVX512-BF16 or AMX; Arm: the BF16 extension) is
emulated in software: on an AVX2-only EPYC, HF generation of a SmolLM2-shaped model ran at 16 tokens/s in bf16
against 52 in float32 (docs/benchmarks.md). So wherever a model is loaded for the CPU (HF, vLLM's CPU build,
Unsloth's CPU backend), `model.dtype` bfloat16 (the paper's, for GPUs) or auto becomes float32 there; on a CPU
with native bf16 and on a GPU it is kept.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

log = logging.getLogger(__name__)

#: The dtypes a CPU without native support computes in software.
EMULATED_ON_CPU = ("bfloat16",)


def _arm_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return set()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.lower().startswith("features"):
            return set(line.split(":", 1)[1].split())
    return set()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_runs_avx512_bf16() -> bool:
    """AVX-512 with BF16: what vLLM's CPU build needs for its `vllm._C` library (torch's own probe, the one vLLM
    asks)."""
    import torch

    return bool(is_x86() and torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())


def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 in hardware (x86: AVX512-BF16 or AMX tiles; Arm: the BF16 extension)."""
    import torch

    if is_x86():
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return "bf16" in _arm_flags()


def cpu_description() -> str:
    """The CPU as timings should name it: architecture, torch's vector capability, native bf16 or not."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.machine()}, {capability} ({'native bf16' if native_bf16() else 'no native bf16'})"


@functools.cache
def _say_once(dtype: str) -> None:
    log.info("model.dtype %s on a CPU without native %s (%s): float32 instead (emulated %s is 2-4x slower)",
             dtype, dtype, cpu_description(), dtype)


def dtype_for(dtype: str | None, device: str) -> str | None:
    """The dtype to load a model in on `device` ('cpu', 'cuda', ...): on a CPU without native bf16, 'bfloat16' and
    'auto' (a checkpoint saved in bf16 would stay bf16) become 'float32'; anything else is returned as it is."""
    if device != "cpu" or dtype not in (*EMULATED_ON_CPU, "auto", None) or native_bf16():
        return dtype
    if dtype in EMULATED_ON_CPU:
        _say_once(dtype)
    return "float32"
