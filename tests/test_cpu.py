"""The dtype follows the CPU (issue 31): bfloat16, the paper's dtype for GPUs, is emulated in software on a CPU
without native bf16 (2-4x slower), so models loaded for such a CPU compute in float32; a CPU with AVX512-BF16 or
AMX, and a GPU, keep what the params say."""

from __future__ import annotations

import pytest

from scope_lib.models import cpu


@pytest.mark.parametrize("native", [True, False])
def test_dtype_for_follows_the_cpu(monkeypatch, native):
    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    emulated = "bfloat16" if native else "float32"
    assert cpu.dtype_for("bfloat16", "cpu") == emulated
    assert cpu.dtype_for("auto", "cpu") == ("auto" if native else "float32")
    assert cpu.dtype_for("float32", "cpu") == "float32"
    assert cpu.dtype_for("float16", "cpu") == "float16"
    for dtype in ("bfloat16", "auto", "float16", "float32"):
        assert cpu.dtype_for(dtype, "cuda") == dtype        # a GPU keeps the params' dtype


def test_the_cpu_is_described_with_its_capability():
    import torch

    text = cpu.cpu_description()
    assert torch.backends.cpu.get_cpu_capability() in text and ("native bf16" in text)
    if cpu.is_x86():
        assert cpu.native_bf16() == bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
