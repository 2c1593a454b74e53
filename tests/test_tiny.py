"""scope_lib.models.tiny: the offline tiny model is deterministic, loads offline, and speaks the protocol."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures_tiny import count_calls, weights_hash, write_synthetic_corpus
from transformers import AutoModelForCausalLM, AutoTokenizer

from scope_lib.config import TinyModelConfig, validate_params
from scope_lib.models import cpu, tiny
from scope_lib.models.loading import ModelNotPrepared, load_model_and_tokenizer, model_source
from scope_lib.protocol.dialects import get_dialect

SMALL = dict(vocab_size=400, hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=512)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    return write_synthetic_corpus(tmp_path_factory.mktemp("corpus") / "c.jsonl", n_passages=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_build_is_deterministic_by_seed(small_corpus, tmp_path):
    a = tiny.build_tiny_model(tmp_path / "a", small_corpus, TinyModelConfig(seed=0, **SMALL))
    b = tiny.build_tiny_model(tmp_path / "b", small_corpus, TinyModelConfig(seed=0, **SMALL))
    c = tiny.build_tiny_model(tmp_path / "c", small_corpus, TinyModelConfig(seed=1, **SMALL))
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "chat_template.jinja").read_text() == (b / "chat_template.jinja").read_text()
    assert weights_hash(a) == weights_hash(b)
    assert weights_hash(a) != weights_hash(c)
    info = json.loads((a / "scope_tiny.json").read_text())
    assert info["config"]["seed"] == 0 and info["vocab_size"] <= SMALL["vocab_size"]


def test_loads_offline_as_qwen3(tiny_model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = TinyModelConfig()
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer) <= cfg.vocab_size
    assert model.config.hidden_size == cfg.hidden_size and model.config.num_hidden_layers == cfg.num_layers
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    im_end, eot = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.padding_side == "left"
    assert set(model.generation_config.eos_token_id) == {im_end, eot}
    assert model.generation_config.pad_token_id == eot
    assert sorted(tokenizer.all_special_tokens) == sorted(tiny.SPECIAL_TOKENS)
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode("hello world")])).logits
    assert logits.shape[-1] == len(tokenizer) and torch.isfinite(logits).all()


@pytest.mark.parametrize("tag", tiny.PROTOCOL_TAGS)
def test_tags_are_single_non_special_tokens(tokenizer, tag):
    ids = tokenizer.encode(f"x{tag}y {tag}\n{tag}", add_special_tokens=False)
    tag_id = tokenizer.convert_tokens_to_ids(tag)
    assert tokenizer.encode(tag, add_special_tokens=False) == [tag_id]
    assert ids.count(tag_id) == 3
    assert tag_id not in tokenizer.all_special_ids


def test_decode_round_trips_and_keeps_tags(tokenizer):
    text = ('<think>Who was Évan Morris?</think>\n<search>Evan Morris lobbyist</search>'
            '<information>Doc 1: 1977 – 2015 “quoted” 東京</information><answer>Genentech</answer>')
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    with_end = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    assert with_end[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(with_end, skip_special_tokens=True) == text


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "<search>q</search>"},
                {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                        "<|im_start|>assistant\n<search>q</search><|im_end|>\n"
                        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    closed = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert closed.endswith("Q<|im_end|>\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5
    # the rollout code derives environment turns from this template
    tail = get_dialect("qwen2.5").environment_text(tokenizer, [{"role": "user", "content": "<information>i"
                                                                                          "</information>"}])
    assert tail == "<|im_end|>\n<|im_start|>user\n<information>i</information><|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_path_builds_once_atomically(small_corpus, tmp_path, monkeypatch):
    builds = count_calls(monkeypatch, tiny, "build_tiny_model")
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = TinyModelConfig(**SMALL)
    first = tiny.tiny_model_path(small_corpus, cfg)
    second = tiny.tiny_model_path(small_corpus, cfg)
    assert first == second and len(builds) == 1
    assert first.parent == tmp_path / "cache" / "tiny"
    assert builds[0] != first  # built elsewhere, then renamed into place
    # no temp dirs left; the build's lock file stays (tests/test_runs.py: one build for several processes)
    assert sorted(p.name for p in first.parent.iterdir()) == [f".{first.name}.lock", first.name]
    other = tiny.tiny_model_path(small_corpus, TinyModelConfig(seed=5, **SMALL))
    assert other != first and len(builds) == 2
    explicit = tiny.tiny_model_path(small_corpus, cfg, cache_dir=tmp_path / "elsewhere")
    assert explicit.parent == tmp_path / "elsewhere" and explicit.name == first.name


def test_cache_key_follows_corpus_content(small_corpus, tmp_path):
    cfg = TinyModelConfig(**SMALL)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(small_corpus.read_bytes())
    assert tiny.cache_key(copy, cfg) == tiny.cache_key(small_corpus, cfg)
    with copy.open("a") as fh:
        fh.write(json.dumps({"id": "x", "contents": "one more passage"}) + "\n")
    assert tiny.cache_key(copy, cfg) != tiny.cache_key(small_corpus, cfg)


def test_load_model_and_tokenizer(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(tmp_path))
    params = validate_params({"model": {"base": "tiny", "tiny": SMALL},
                              "retrieval": {"corpus": str(small_corpus)}})
    model, tok = load_model_and_tokenizer(model_source(params), dtype="float32", device="cpu")
    assert model.dtype == torch.float32 and model.device.type == "cpu" and not model.training
    # the hub-id / local-path branch (real from_pretrained) on the cached directory
    path = tiny.tiny_model_path(small_corpus, TinyModelConfig(**SMALL))
    assert model_source(params) == str(path)
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)   # a CPU with bf16 in hardware loads bf16
    model2, tok2 = load_model_and_tokenizer(path, dtype="bfloat16", device="cpu", padding_side="right")
    assert model2.dtype == torch.bfloat16 and tok2.padding_side == "right" and tok.padding_side == "left"
    assert torch.equal(model.get_input_embeddings().weight.to(torch.bfloat16),
                       model2.get_input_embeddings().weight)
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)  # one without (AVX2 only) computes in float32 instead
    for dtype in ("bfloat16", "auto"):
        assert load_model_and_tokenizer(path, dtype=dtype, device="cpu")[0].dtype == torch.float32
    with pytest.raises(tiny.TinyModelError, match="model_source"):
        load_model_and_tokenizer("tiny", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer(path, dtype="float64", device="cpu")


def test_the_loader_never_builds_a_warm_start(small_corpus, tmp_path, monkeypatch):
    """A warm-started tiny model is prepared above the loader (smoke.warm_start.prepare); the loader refuses to
    guess it and loads whatever folder was recorded for the name."""
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(tmp_path))
    params = validate_params({"model": {"base": "tiny", "tiny": SMALL, "warm_start": {"enabled": True}},
                              "retrieval": {"corpus": str(small_corpus)}})
    with pytest.raises(ModelNotPrepared, match="prepare"):
        model_source(params)
    assert not any(tmp_path.iterdir())  # nothing was built
    params.use_local_model("tiny", tmp_path / "prepared")
    assert model_source(params) == str(tmp_path / "prepared")
    assert model_source(params, "judge") == str(tmp_path / "prepared")  # the Judge is M0 too
    assert params.model_copy().local_model("tiny") == str(tmp_path / "prepared")


def test_corpus_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(tiny.TinyModelError, match="not found"):
        tiny.corpus_fingerprint(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "0", "contents": "fine"}) + "\n\n{not json\n")
    with pytest.raises(tiny.TinyModelError, match=r"bad\.jsonl:3"):
        tiny.corpus_fingerprint(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(tiny.TinyModelError, match="no passages"):
        tiny.build_tiny_model(tmp_path / "out", empty, TinyModelConfig(**SMALL))
    with pytest.raises(tiny.TinyModelError, match="hidden_size"):
        tiny.build_tiny_model(tmp_path / "out", bad, TinyModelConfig(**{**SMALL, "num_heads": 3}))
