"""GPU tests (`pytest -m gpu`): one vLLM engine serving the Judge (base) and both roles (LoRA adapters) with sleep
mode, and a smoke-sized SCOPE iteration on one GPU with vLLM rollouts and adapter-only sync. Models are
random-initialised with real shapes (no weights can be downloaded). They skip without CUDA and vLLM; the shaped
model builder itself is checked on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from scope_lib.models.gpu_plan import KNOWN, Architecture
from scope_lib.models.random_models import build_shaped_model

REPO = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
needs_gpu = pytest.mark.skipif(not GPU, reason="needs CUDA and the GPU extra: vLLM sleep mode and GPU memory (vLLM itself runs on CPU: test_vllm.py)")


def test_shaped_models_have_the_real_vocabulary_and_shapes(tmp_path, tiny_corpus, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setitem(KNOWN, "test/shape", Architecture(2, 96, 256, 4, 2, 24, 4096, tied_embeddings=True))
    path = build_shaped_model("test/shape", tmp_path / "m", tiny_corpus, dtype="float32")
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert len(tok) == model.config.vocab_size == 4096
    assert model.config.num_key_value_heads == 2 and model.config.head_dim == 24
    assert "<search>" in tok.get_vocab() and tok.apply_chat_template([{"role": "user", "content": "q"}],
                                                                       tokenize=False, add_generation_prompt=True)
    assert build_shaped_model("test/shape", tmp_path / "m", tiny_corpus) == path      # reused
    with pytest.raises(ValueError, match="no architecture"):
        build_shaped_model("nobody/model", tmp_path / "x", tiny_corpus)


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory, tiny_corpus):
    return build_shaped_model("Qwen/Qwen3-1.7B", tmp_path_factory.mktemp("shaped") / "qwen3-1.7b", tiny_corpus)


@pytest.mark.gpu
@needs_gpu
def test_one_vllm_engine_serves_the_judge_and_both_roles(qwen3_small, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scope_lib.models.engine import Sampling
    from scope_lib.models.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(qwen3_small)
    engine = VLLMEngine(qwen3_small, tokenizer=tok, enable_lora=True, max_loras=3, max_lora_rank=16,
                        gpu_memory_utilization=0.4, max_model_len=4096, enable_sleep_mode=True)
    base = AutoModelForCausalLM.from_pretrained(qwen3_small, dtype=torch.bfloat16)
    peft = get_peft_model(base, LoraConfig(r=16, target_modules="all-linear", init_lora_weights=False))
    peft.save_pretrained(tmp_path / "a")
    engine.add_adapter("solver", tmp_path / "a")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Where is Paris?"}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    sampling = Sampling(max_new_tokens=16, temperature=0.0)
    judge, solver = engine.generate([prompt], sampling), engine.generate([prompt], sampling, adapter="solver")
    assert judge[0].token_ids != solver[0].token_ids and judge[0].logprobs
    engine.sleep()
    free_after_sleep = torch.cuda.mem_get_info()[0]
    assert engine.generate([prompt], sampling)[0].token_ids == judge[0].token_ids   # woken by generate
    assert free_after_sleep > torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
@needs_gpu
def test_a_smoke_iteration_on_one_gpu_with_vllm_rollouts(qwen3_small, tmp_path, wiki_sample):
    from scope_lib.config import load_params
    from scope_lib.runs import read_jsonl
    from scope_lib.selfplay.loop import run

    params = load_params(REPO / "params" / "smoke.yaml", {
        "run.runs_dir": str(tmp_path), "run.data_dir": str(wiki_sample.parent), "model.base": str(qwen3_small),
        "model.warm_start.enabled": False, "model.dialect": "qwen2.5", "model.dtype": "bfloat16", "model.max_model_len": 4096,
        "engine.backend": "vllm", "engine.device": "cuda", "engine.gpu_memory_utilization": 0.4,
        "grpo.gradient_checkpointing": True})
    result = run(params)
    metrics = read_jsonl(params.run_dir / "iter_01" / "challenger" / "metrics.jsonl")
    assert len(metrics) == params.selfplay.steps_per_role
    assert all(m["importance_ratio"] is not None for m in metrics)   # vLLM's log-probs were corrected for
    assert (params.run_dir / "iter_01" / "challenger" / "adapter" / "adapter_config.json").is_file()
    assert result.engine.calls > 0
