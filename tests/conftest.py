"""Shared fixtures. Real data comes from ../shared/data (or $SCOPE_DATA_DIR); tests that need it skip,
saying why, when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_tiny import shared_data_dir, tiny_corpus, tiny_model_dir  # noqa: F401  (session fixtures)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real public samples (Wikipedia passages, QA sets, open-ended prompts)."""
    path = shared_data_dir()
    if not (path / "wiki18_sample.jsonl").is_file():
        pytest.skip(f"real data not found at {path} (set SCOPE_DATA_DIR or put ../shared/data beside the repo)")
    return path


@pytest.fixture(scope="session")
def wiki_sample(shared_data: Path) -> Path:
    """1000 wiki-18 passages (ids "0".."999")."""
    return shared_data / "wiki18_sample.jsonl"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No test may reach a model hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")




@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def minilm_embedder():
    """The real offline MiniLM embedder, shared by the tests that index the 1000-passage sample with it (each
    back end's recall test): it remembers the embeddings it computed, so the sample is embedded once per
    session (~40 s on 2 CPU cores) instead of once per back end. Its outputs are MiniLM's own."""
    import numpy as np

    from scope_lib.retrieval import MiniLMOfflineEmbedder

    class Remembering(MiniLMOfflineEmbedder):
        def __init__(self):
            super().__init__(device="cpu", batch_size=16)
            self._seen: dict[tuple[bool, str], np.ndarray] = {}

        def _embed(self, texts, query):
            missing = list(dict.fromkeys(t for t in texts if (query, t) not in self._seen))
            if missing:
                for text, row in zip(missing, super()._embed(missing, query)):
                    self._seen[(query, text)] = row
            return np.stack([self._seen[(query, t)] for t in texts]) if texts else super()._embed([], query)

    return Remembering()

