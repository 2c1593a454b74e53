"""The local evaluation judges' own LoRA adapter on M0 (`evaluation.judge_adapter`, `smoke.judge_adapter`; issue 33):
trained on the judge traces alone, cached, leaving M0's weights as they were, and used by the benchmark judge under
a model name of its own (cache and calibration never mix it with M0's replies)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures_tiny import count_calls, weights_hash
from transformers import AutoModelForCausalLM

from scope_lib.config import (
    JUDGE_ADAPTER_MODEL,
    JudgeAdapterConfig,
    ParamsError,
    WarmStartConfig,
    load_params,
)
from scope_lib.evaluation import evaluate as E
from scope_lib.models.engine import Sampling
from scope_lib.models.hf_engine import HFEngine
from scope_lib.smoke import judge_adapter as J
from scope_lib.smoke import warm_start

REPO = Path(__file__).resolve().parents[1]
#: Few teacher documents, so the tiny model's adapter trains in seconds.
WS = WarmStartConfig(documents=8, fact_max_tokens=6, seed=3)
CFG = JudgeAdapterConfig(enabled=True, lora_rank=4, threads=1)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, wiki_sample, tmp_path_factory):
    cache = tmp_path_factory.mktemp("judge_adapter")
    return J.judge_adapter_path(tiny_model_dir, wiki_sample, WS, CFG, cache_dir=cache), cache


def test_the_adapter_learns_the_judge_traces_only_and_leaves_m0_alone(adapter, tiny_model_dir, wiki_sample,
                                                                      monkeypatch):
    path, cache = adapter
    assert (path / "adapter_config.json").is_file() and path.name.startswith(f"{tiny_model_dir.name[:48]}-judge-")
    info = json.loads((path / J.ADAPTER_INFO).read_text())
    assert set(info["examples"]) == {"qa_judge", "criterion_grader"} and info["steps"] > 0
    for role, (no, yes) in info["verdicts"].items():   # both verdicts, about evenly
        assert no and yes and 0.3 <= yes / (no + yes) <= 0.7, role
    passes = info["examples"]["qa_judge"] * CFG.repeats["qa_judge"] + info["examples"]["criterion_grader"]
    assert info["steps"] == -(-passes // CFG.batch_size)   # qa_judge traces seen twice a pass, the grader's once
    assert not any(p.suffix == ".safetensors" and p.name != "adapter_model.safetensors" for p in path.iterdir())
    before = weights_hash(tiny_model_dir)
    builds = count_calls(monkeypatch, J, "train_judge_adapter")
    assert J.judge_adapter_path(tiny_model_dir, wiki_sample, WS, CFG, cache_dir=cache) == path and not builds
    assert weights_hash(tiny_model_dir) == before
    other = J.adapter_key(tiny_model_dir, wiki_sample, WS, CFG.model_copy(update={"repeats": {"qa_judge": 3}}))
    assert other != J.adapter_key(tiny_model_dir, wiki_sample, WS, CFG)
    assert J.adapter_key(tiny_model_dir, wiki_sample, WS, CFG.model_copy(update={"threads": 2})) == \
        J.adapter_key(tiny_model_dir, wiki_sample, WS, CFG)


def test_the_benchmark_judge_runs_m0_with_the_adapter_under_its_own_name(adapter, tiny_model_dir, tiny_tokenizer,
                                                                         wiki_sample, tmp_path):
    path, _ = adapter
    params = load_params(REPO / "params" / "smoke.yaml", {
        "run.runs_dir": str(tmp_path), "run.data_dir": str(wiki_sample.parent), "evaluation.judge_backend": "local",
        "evaluation.judge_adapter.enabled": True, "evaluation.judge_adapter.lora_rank": 4})
    with pytest.raises(ValueError, match=r"judge_adapter is on but was not built.*prepare\(params, judges=True\)"):
        E.make_benchmark_judge(params, HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tiny_tokenizer))
    params.use_local_model(JUDGE_ADAPTER_MODEL, path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tiny_tokenizer)
    judge = E.make_benchmark_judge(params, engine)
    assert judge.backend.adapter == E.JUDGE_ADAPTER_NAME
    settings = E.judge_settings(params, "nq")
    assert settings.model == f"{params.evaluation.short_form_judge.model}+{path.name}"
    prompt = [tiny_tokenizer.encode("Is the answer right?")]
    greedy = Sampling(max_new_tokens=4, temperature=0.0, logprobs=True)
    with_adapter = engine.generate(prompt, greedy, adapter=E.JUDGE_ADAPTER_NAME)[0]
    m0 = engine.generate(prompt, greedy, adapter=None)[0]
    assert with_adapter.logprobs != m0.logprobs   # the adapter changes what the judge says; M0 is still there


def test_prepare_builds_the_adapter_only_for_commands_that_judge(tiny_model_dir, wiki_sample, tmp_path,
                                                                 monkeypatch):
    built = []
    monkeypatch.setattr(warm_start, "_m0_folder", lambda params: str(tiny_model_dir))
    monkeypatch.setattr(J, "judge_adapter_path", lambda m0, corpus, ws, cfg, cache_dir=None: built.append(m0) or
                        tmp_path / "adapter")
    params = load_params(REPO / "params" / "smoke.yaml", {
        "run.runs_dir": str(tmp_path), "run.data_dir": str(wiki_sample.parent), "model.warm_start.enabled": False,
        "evaluation.judge_backend": "local", "evaluation.judge_adapter.enabled": True})
    with pytest.raises(ValueError, match=r"judge_adapter: the taught judge replies take up to 64 tokens; "
                                         r"evaluation.short_form_judge.max_tokens is 16"):
        warm_start.prepare(params, judges=True)
    assert built == []
    params.evaluation.short_form_judge.max_tokens = params.evaluation.open_ended_judge.max_tokens = 64
    warm_start.prepare(params)
    assert built == [] and params.local_model(JUDGE_ADAPTER_MODEL) is None   # training, a held-out build: no
    warm_start.prepare(params, judges=True)
    assert built == [str(tiny_model_dir)] and params.local_model(JUDGE_ADAPTER_MODEL) == str(tmp_path / "adapter")
    warm_start.prepare(params, judges=True)
    assert len(built) == 1


def test_the_adapter_needs_a_local_judge_and_a_rank_the_engine_serves(tmp_path):
    with pytest.raises(ParamsError, match="judge_adapter.enabled needs evaluation.judge_backend: local"):
        load_params(REPO / "params" / "smoke.yaml", {"evaluation.judge_adapter.enabled": True,
                                                     "evaluation.judge_backend": "openai"})
    with pytest.raises(ParamsError, match="judge_adapter.lora_rank 16 exceeds model.lora_rank 8"):
        load_params(REPO / "params" / "smoke.yaml", {"evaluation.judge_backend": "local",
                                                     "evaluation.judge_adapter.enabled": True,
                                                     "evaluation.judge_adapter.lora_rank": 16})

