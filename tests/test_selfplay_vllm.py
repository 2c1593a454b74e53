"""Self-play on vLLM (issue 20): one iteration of `params/smoke-vllm.yaml` (the warm-started smoke model) where
vLLM's CPU build generates every Challenger, Solver and Judge call while TRL trains, the trained adapter is
published to the engine after every optimiser step (`AdapterSync`), and TRL's importance-sampling correction is
computed from vLLM's own log-probs. Runs in this process (vLLM in-process, ~30 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scope_lib.config import load_params
from scope_lib.models.loading import apply_torch_threads
from scope_lib.models.vllm_engine import VLLMEngine
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.loop import run
from scope_lib.smoke.warm_start import prepare

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (its CPU build) or the gpu extra")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.heavy   # a whole self-play iteration on an engine of its own (~20 s): `make test-slow`
def test_a_smoke_iteration_generates_every_call_with_vllm(tmp_path, wiki_sample, monkeypatch):
    params = load_params(REPO / "params" / "smoke-vllm.yaml",
                         {"run.runs_dir": str(tmp_path), "run.data_dir": str(wiki_sample.parent)})
    assert params.engine.backend == "vllm" and params.model.finetuning == "lora"
    prepare(params)             # the warm-started smoke model (cached; the notebooks build the same one)
    apply_torch_threads(params)
    published, asked = [], []
    add_adapter, generate = VLLMEngine.add_adapter, VLLMEngine.generate

    def publishing(self, name, path):
        published.append((name, Path(path)))
        return add_adapter(self, name, path)

    def generating(self, prompts, sampling, adapter=None):
        asked.append(adapter)
        return generate(self, prompts, sampling, adapter)

    monkeypatch.setattr(VLLMEngine, "add_adapter", publishing)
    monkeypatch.setattr(VLLMEngine, "generate", generating)
    result = run(params)
    engine = result.engine
    try:
        assert isinstance(engine, VLLMEngine) and engine.on_cpu and engine.calls == len(asked)
        assert {None, "challenger", "solver"} <= set(asked)      # the Judge (the base) and both roles, on vLLM
        assert all(judge is engine for judge in result.judge.engines.values())
        steps = params.selfplay.steps_per_role
        for role in ("challenger", "solver"):
            stage = params.run_dir / "iter_01" / role
            assert (stage / "DONE").is_file() and (stage / "adapter" / "adapter_config.json").is_file()
            # AdapterSync: a new version before every optimiser step's rollouts
            assert len([p for name, p in published if name == role and "serving" not in p.parts]) == steps
            metrics = read_jsonl(stage / "metrics.jsonl")
            assert len(metrics) == steps
            # each step moved the adapter, and the next step's vLLM log-probs still equal the trainer's: vLLM
            # served the new version (a stale adapter would show as a gap), so TRL's ratio is 1
            assert all(m["grad_norm"] > 0 for m in metrics)
            assert all(m["importance_ratio"] == pytest.approx(1.0, abs=1e-4) for m in metrics)
            assert all(abs(m["sampler_logp_gap"]) < 1e-4 for m in metrics)
    finally:
        engine.close()
    assert not torch.distributed.is_initialized()
