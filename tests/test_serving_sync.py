"""The GPU path's glue, exercised on CPU: when rollouts come from a serving engine (vLLM in-process, or
`vllm serve` over HTTP) instead of the trained model, the trainer publishes its adapter once per optimiser step
(adapter-only sync), the engine sleeps while the trainer steps, and TRL corrects the gap between the sampler
and the trained model with its importance ratio. The serving engine here is a test double that generates with
the tiny model in this process and records what it was asked to do; the same with vLLM itself (its CPU build)
is tests/test_selfplay_vllm.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from servers import JSONHandler, loopback
from test_training import build_trainer, challenger_stage
from training_helpers import AlternatingEngine, fast_params, load_policy

from scope_lib.models.engine import EngineRequestError, Sampling
from scope_lib.models.openai_engine import OpenAIEngine
from scope_lib.models.vllm_engine import VLLMEngine
from scope_lib.selfplay.policy import serves_adapters
from scope_lib.selfplay.training import importance_ratio


class Serving(AlternatingEngine):
    """A serving engine double: generates like the scripted engine (log-probs from the trained tiny model, so the
    importance ratio has something to compare), records published adapters, sleeps and wakes."""

    def __init__(self, tokenizer, dialect, policy):
        super().__init__(tokenizer, dialect)
        self.policy, self.published, self.events = policy, [], []

    def add_adapter(self, name, path):
        self.published.append((name, path, load_file(str(path / "adapter_model.safetensors"))))
        self.events.append(f"publish {name}")

    def sleep(self, level=1):
        self.events.append("sleep")

    def wake_up(self):
        self.events.append("wake")

    def generate(self, prompt_token_ids, sampling, adapter=None):
        out = super().generate(prompt_token_ids, sampling, adapter)
        if adapter in ("challenger", "solver"):  # the sampler's log-probs of what it wrote (as vLLM returns them)
            for ids, completion in zip(prompt_token_ids, out, strict=True):
                completion.logprobs = _logprobs(self.policy, adapter, ids, completion.token_ids, sampling.temperature)
        return out


def _logprobs(policy, role, prompt, completion, temperature):
    if not completion:
        return []
    model = policy.model
    previous = model.active_adapter
    model.set_adapter(role)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    finally:
        model.set_adapter(previous)
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


@pytest.fixture(scope="module")
def params(tmp_path_factory, wiki_sample):
    return fast_params(tmp_path_factory.mktemp("runs"), wiki_sample.parent, **{"selfplay.steps_per_role": 2})


@pytest.mark.parametrize("dialect", ["qwen2.5", "qwen3"])
def test_adapter_sync_every_step_with_importance_correction(dialect, params, retriever, passages, tiny_model_dir,
                                                             tmp_path):
    policy = load_policy(params, tiny_model_dir)
    ctx, items = challenger_stage(policy, retriever, passages, tmp_path, dialect=dialect)
    serving = Serving(policy.tokenizer, ctx.dialect, policy)
    ctx.engine = serving
    ctx.judge.engines = dict.fromkeys(ctx.judge.engines, serving)
    assert serves_adapters(serving)
    session, trainer = build_trainer(ctx, items)
    assert trainer.use_vllm and trainer.vllm_generation.role == "challenger"
    trainer.train()
    published = [p for p in serving.published if p[0] == "challenger"]
    assert len(published) == 2                                           # once per optimiser step
    assert all((path / "adapter_config.json").is_file() or not path.exists() for _, path, _ in published)
    first, second = published[0][2], published[1][2]
    assert any(not torch.equal(first[k], second[k]) for k in first)      # step 2 serves the updated adapter
    events = [e for e in serving.events if e != "publish challenger"]
    assert events == ["wake", "sleep", "wake", "sleep"]                  # sleeps while the trainer steps
    metrics = list(session.metrics)
    # the sampler is the trained model itself here: TRL's ratio is 1 and the log-prob gap 0
    assert all(m["importance_ratio"] == pytest.approx(1.0, abs=1e-3) for m in metrics)
    assert all(m["sampler_logp_gap"] == pytest.approx(0.0, abs=1e-3) for m in metrics)


def test_importance_ratio_modes():
    gap = torch.tensor([[0.0, 2.0, -3.0], [0.1, 0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    truncated = importance_ratio(gap, mask, "token_truncate", None, 3.0)
    assert truncated[0].tolist() == pytest.approx([1.0, 3.0, torch.exp(torch.tensor(-3.0)).item()])
    masked = importance_ratio(gap, mask, "token_mask", None, 3.0)
    assert masked[0, 1] == 0.0 and masked[0, 0] == 1.0
    sequence = importance_ratio(gap, mask, "sequence_truncate", None, 3.0)
    assert sequence.shape == (2, 1) and sequence[1, 0] == pytest.approx(torch.exp(torch.tensor(0.2)).item())
    assert importance_ratio(gap, mask, "sequence_mask", 0.5, 3.0)[0, 0] == 0.0   # exp(-1) < 0.5


class _LoraServer(JSONHandler):
    """`vllm serve --enable-lora` with runtime loading: /v1/load_lora_adapter, /v1/unload_lora_adapter, and
    completions that echo which model served them."""

    def do_POST(self):
        body = self.read_json()
        state = self.server.state
        state["calls"].append((self.path, body))
        if self.path == "/v1/load_lora_adapter":
            state["loaded"].add(body["lora_name"])
            return self.reply(200, {"ok": True})
        if self.path == "/v1/unload_lora_adapter":
            if body["lora_name"] not in state["loaded"]:
                return self.reply(404, {"error": "not loaded"})
            state["loaded"].discard(body["lora_name"])
            return self.reply(200, {"ok": True})
        if self.path != "/v1/completions":
            return self.reply(404, {"error": f"no route {self.path}"})
        if body["model"] not in state["loaded"] | {"base"}:
            return self.reply(404, {"error": f"model {body['model']} not found"})
        return self.reply(200, {"choices": [{"text": body["model"], "token_ids": [5, 6], "finish_reason": "length"}]})


def test_runtime_lora_loading_over_http(tiny_tokenizer, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    with loopback(_LoraServer, {"calls": [], "loaded": set()}) as (url, state):
        engine = OpenAIEngine(url, "base", tiny_tokenizer, prompt_format="tokens", backoff_s=0.01)
        assert engine.add_adapter("solver", folder, version=3) == "solver@3"
        out = engine.generate([[1, 2, 3]], Sampling(max_new_tokens=2), adapter="solver")
        sent = [b for path, b in state["calls"] if path == "/v1/completions"]
        assert sent[-1]["model"] == "solver@3" and out[0].token_ids == [5, 6]
        engine.add_adapter("solver", folder, version=4)                   # the new version, then the old one out
        assert state["loaded"] == {"solver@4"}
        engine.generate([[1, 2, 3]], Sampling(max_new_tokens=2), adapter="solver")
        assert [b for p, b in state["calls"] if p == "/v1/completions"][-1]["model"] == "solver@4"
        engine.generate([[1, 2, 3]], Sampling(max_new_tokens=2))          # the base: the Judge
        assert [b for p, b in state["calls"] if p == "/v1/completions"][-1]["model"] == "base"
        with pytest.raises(FileNotFoundError, match="adapter_config"):
            engine.add_adapter("solver", tmp_path)
        engine.close()
        state["loaded"].clear()
        broken = OpenAIEngine(f"{url}/nothing", "base", tiny_tokenizer)
        with pytest.raises(EngineRequestError, match="enable-lora"):
            broken.add_adapter("solver", folder)


class _FakeLLM:
    """Stands in for vllm.LLM's sleep mode (the real one needs CUDA)."""

    def __init__(self):
        self.events = []
        self.llm_engine = type("E", (), {"model_config": type("C", (), {"max_model_len": 4096})()})()

    def sleep(self, level):
        self.events.append(f"sleep {level}")

    def wake_up(self):
        self.events.append("wake")


def test_vllm_engine_sleeps_and_wakes_once(tiny_tokenizer, tiny_model_dir, tmp_path):
    llm = _FakeLLM()
    engine = VLLMEngine(tiny_model_dir, tokenizer=tiny_tokenizer, llm=llm)
    assert engine.max_model_len == 4096 and not engine.sleeping
    engine.sleep()
    engine.sleep()
    engine.wake_up()
    engine.wake_up()
    assert llm.events == ["sleep 1", "wake"]
    (tmp_path / "adapter_config.json").write_text("{}")
    engine.add_adapter("solver", tmp_path)
    engine.add_adapter("solver", tmp_path)
    assert engine._adapters["solver"][0] == 2                             # a new id: vLLM reloads the weights
