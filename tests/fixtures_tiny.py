"""Session fixtures for the offline tiny model, registered in conftest.py with
``from fixtures_tiny import tiny_corpus, tiny_model_dir``.

The tokenizer is trained on the real wiki-18 sample when ../shared/data (or $SCOPE_DATA_DIR) has it, else on
a small synthetic corpus written here, so torch-path tests never skip for want of data. The model is built
once per test session into a temporary cache (about 3 s on one CPU core) and never downloaded.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_BUILT: dict[str, Path] = {}

_WORDS = ("the", "of", "and", "in", "was", "a", "river", "city", "born", "album", "film", "war", "king",
          "university", "football", "species", "church", "island", "party", "station", "season", "team",
          "village", "district", "series", "novel", "band", "school", "bridge", "railway", "language")


def weights_hash(path: Path) -> str:
    """sha256 over a saved model's weights (names and bytes, in name order)."""
    import hashlib

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def count_calls(monkeypatch, module, name: str) -> list:
    """Wrap `module.name` so every call appends its first argument to the returned list (and still runs)."""
    real = getattr(module, name)
    calls: list = []

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def shared_data_dir() -> Path:
    """$SCOPE_DATA_DIR (made absolute: tests and notebooks change directory), else ../shared/data."""
    env = os.environ.get("SCOPE_DATA_DIR")
    return Path(env).resolve() if env else REPO.parent / "shared" / "data"


def _shared_sample() -> Path:
    return shared_data_dir() / "wiki18_sample.jsonl"


def write_synthetic_corpus(path: Path, n_passages: int = 300, seed: int = 0) -> Path:
    """A small wiki-18 shaped JSONL ({"id", "contents"}, title on the first line) from a fixed word list."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for i in range(n_passages):
            title = " ".join(rng.choice(_WORDS).title() for _ in range(2))
            body = " ".join(rng.choice(_WORDS) for _ in range(60))
            fh.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{title} {body}.'}) + "\n")
    return path


#: The tiny model for vLLM tests: vLLM's CPU attention rejects the default's head size (64 / 4 heads = 16).
VLLM_TINY = {"hidden_size": 128, "num_heads": 2}   # head_dim 64


def build_tiny_once(corpus: Path, cache_dir: Path, **shape) -> Path:
    """The tiny model for `corpus` with the default TinyModelConfig (or `shape` over it), built at most once
    per process."""
    from scope_lib.config import TinyModelConfig
    from scope_lib.models.tiny import tiny_model_path

    key = str((corpus, sorted(shape.items())))
    if key not in _BUILT:
        _BUILT[key] = tiny_model_path(corpus, TinyModelConfig(**shape), cache_dir=cache_dir)
    return _BUILT[key]


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The corpus the tiny tokenizer is trained on: the real wiki-18 sample if present, else synthetic."""
    sample = _shared_sample()
    if sample.is_file():
        return sample
    return write_synthetic_corpus(tmp_path_factory.mktemp("tiny_corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_corpus: Path, tmp_path_factory) -> Path:
    """A directory holding the tiny Qwen3 + tokenizer; load it with from_pretrained (offline)."""
    return build_tiny_once(tiny_corpus, tmp_path_factory.mktemp("tiny_cache"))


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tiny_corpus: Path, tmp_path_factory) -> Path:
    """The tiny Qwen3 with head_dim 64 (`VLLM_TINY`), which vLLM's CPU attention supports."""
    return build_tiny_once(tiny_corpus, tmp_path_factory.mktemp("tiny_vllm_cache"), **VLLM_TINY)
