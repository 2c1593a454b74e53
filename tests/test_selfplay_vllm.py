"""Self-play on vLLM (issues 20 and 46): one iteration of `params/smoke-vllm.yaml` (the warm-started smoke model)
where vLLM's CPU build generates every Challenger, Solver and Judge call while TRL trains, the trained adapter is
published to the engine after every optimiser step (`AdapterSync`), and TRL's importance-sampling correction is
computed from vLLM's own log-probs. That run, in this process, is the reference for two others:

- the same `scope train` as a process of its own, killed with SIGKILL during Solver training and run again: it ends
  with the reference's records (nothing lost, nothing duplicated, the finished stages' files untouched) and its
  adapters, bit for bit;
- the same iteration against vLLM's OpenAI server (`engine.backend: openai`, started by `scope serve model`), each
  step's adapter loaded into the server at run time: it trains to the reference's records and metrics.

All three are `make test-slow` (marker `heavy`): each starts an engine or a server of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from training_helpers import comparable

from scope_lib.config import load_params
from scope_lib.models.loading import apply_torch_threads
from scope_lib.models.vllm_engine import VLLMEngine
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.loop import run
from scope_lib.smoke.warm_start import prepare

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (its CPU build) or the gpu extra")

pytestmark = pytest.mark.heavy

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "params" / "smoke-vllm.yaml"
#: Every record file of the iteration, as (stage, file).
RECORDS = [("challenger", "rollouts.jsonl"), ("challenger", "metrics.jsonl"), ("pool", "candidates.jsonl"),
           ("pool", "chunks.jsonl"), ("pool", "tasks.jsonl"), ("solver", "rollouts.jsonl"),
           ("solver", "metrics.jsonl")]


def settings(runs_dir: Path, data_dir: Path, **more) -> dict:
    return {"run.runs_dir": str(runs_dir), "run.data_dir": str(data_dir), **more}


def logprobs(record: dict) -> list[float]:
    """Take out the sampler's log-probs of a rollout record (what two engines may round differently)."""
    trajectory = record.get("trajectory")
    return trajectory.pop("logprobs", []) if isinstance(trajectory, dict) else []


def adapter(stage: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(stage / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, wiki_sample):
    """The iteration in this process on vLLM's in-process engine, with every generate call and every published
    adapter counted."""
    params = load_params(PARAMS, settings(tmp_path_factory.mktemp("reference"), wiki_sample.parent))
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

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VLLMEngine, "add_adapter", publishing)
        patch.setattr(VLLMEngine, "generate", generating)
        result = run(params)
    engine = result.engine
    try:
        facts = SimpleNamespace(params=params, run_dir=params.run_dir, published=published, asked=asked,
                                engine_type=type(engine), on_cpu=getattr(engine, "on_cpu", None),
                                calls=engine.calls,
                                judge_shares_engine=all(e is engine for e in result.judge.engines.values()))
    finally:
        engine.close()
    facts.distributed_left = torch.distributed.is_initialized()
    return facts


def test_a_smoke_iteration_generates_every_call_with_vllm(reference):
    assert reference.engine_type is VLLMEngine and reference.on_cpu and reference.calls == len(reference.asked)
    assert {None, "challenger", "solver"} <= set(reference.asked)     # the Judge (the base) and both roles, on vLLM
    assert reference.judge_shares_engine
    steps = reference.params.selfplay.steps_per_role
    for role in ("challenger", "solver"):
        stage = reference.run_dir / "iter_01" / role
        assert (stage / "DONE").is_file() and (stage / "adapter" / "adapter_config.json").is_file()
        # AdapterSync: a new version before every optimiser step's rollouts
        assert len([p for name, p in reference.published if name == role and "serving" not in p.parts]) == steps
        metrics = read_jsonl(stage / "metrics.jsonl")
        assert len(metrics) == steps
        # each step moved the adapter, and the next step's vLLM log-probs still equal the trainer's: vLLM served
        # the new version (a stale adapter would show as a gap), so TRL's ratio is 1
        assert all(m["grad_norm"] > 0 for m in metrics)
        assert all(m["importance_ratio"] == pytest.approx(1.0, abs=1e-4) for m in metrics)
        assert all(abs(m["sampler_logp_gap"]) < 1e-4 for m in metrics)
    assert not reference.distributed_left


def scope_train(runs_dir: Path, data_dir: Path, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "scope_lib.cli", "train", str(PARAMS)]
    for key, value in settings(runs_dir, data_dir).items():
        argv += ["-o", f"{key}={value}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def complete_lines(path: Path) -> list[str]:
    """The lines of a record file that were whole when it was read (a write cut by SIGKILL has no newline)."""
    if not path.is_file():
        return []
    text = path.read_text()
    return [line for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def test_a_vllm_run_killed_during_solver_training_resumes_to_the_same_records(reference, tmp_path, wiki_sample):
    runs = tmp_path / "runs"
    run_dir = runs / reference.run_dir.name
    solver = run_dir / "iter_01" / "solver"
    killed = scope_train(runs, wiki_sample.parent, tmp_path / "killed.log")
    deadline = time.monotonic() + 600
    while not (complete_lines(solver / "metrics.jsonl") and not (solver / "DONE").exists()):
        assert killed.poll() is None, f"ended before it could be killed:\n{(tmp_path / 'killed.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, "Solver training never began"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (solver / "DONE").exists()   # killed mid-stage
    # the stages finished before the kill: their records must come through the resume untouched (the Solver stage,
    # without `run.checkpoint_steps`, restarts from its first step and writes its records again)
    done = {stage for stage in ("challenger", "pool") if (run_dir / "iter_01" / stage / "DONE").is_file()}
    assert done == {"challenger", "pool"}
    before = {(stage, name): complete_lines(run_dir / "iter_01" / stage / name) for stage, name in RECORDS
              if stage in done}

    resumed = scope_train(runs, wiki_sample.parent, tmp_path / "resumed.log")
    assert resumed.wait(timeout=600) == 0, (tmp_path / "resumed.log").read_text()[-4000:]
    for stage, name in RECORDS:
        mine, theirs = run_dir / "iter_01" / stage / name, reference.run_dir / "iter_01" / stage / name
        ids = [r["id"] for r in read_jsonl(mine)]
        assert len(ids) == len(set(ids)), f"duplicated ids in {stage}/{name}"
        assert comparable(mine) == comparable(theirs), f"{stage}/{name}"
        if stage in done:
            assert complete_lines(mine) == before[stage, name], f"{stage}/{name} changed after its stage was DONE"
    for role in ("challenger", "solver"):
        mine, theirs = adapter(run_dir / "iter_01" / role), adapter(reference.run_dir / "iter_01" / role)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), role


def test_a_smoke_iteration_against_a_served_vllm_trains_to_the_same_records(reference, tmp_path, wiki_sample):
    """`engine.backend: openai` against `scope serve model` on loopback: every call of both roles and the Judge goes
    over HTTP, each step's adapter is loaded into the server as a new version."""
    from servers import free_port, server_process

    from scope_lib.models.openai_engine import OpenAIEngine

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "scope_lib.cli", "serve", "model", "--params", str(PARAMS), "--port", str(port),
            "-o", f"run.data_dir={wiki_sample.parent}"]
    loaded = []
    add_adapter = OpenAIEngine.add_adapter

    def loading(self, name, path, version=None):
        served = add_adapter(self, name, path, version)
        loaded.append(served)
        return served

    with server_process(argv, f"{url}/health", tmp_path / "vllm.log", timeout_s=300), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(OpenAIEngine, "add_adapter", loading)
        params = load_params(PARAMS, settings(tmp_path / "runs", wiki_sample.parent, **{
            "engine.backend": "openai", "engine.base_url": url}))
        prepare(params)
        result = run(params)
        assert isinstance(result.engine, OpenAIEngine) and result.engine.calls > 0
    steps = params.selfplay.steps_per_role
    assert len(loaded) >= 2 * steps      # every optimiser step's adapter loaded into the server
    for stage, name in RECORDS:
        mine, theirs = params.run_dir / "iter_01" / stage / name, reference.run_dir / "iter_01" / stage / name
        if name == "metrics.jsonl":
            continue
        # the same tokens, rewards and verdicts; the sampler's log-probs of a trained adapter agree to float noise
        # (the server applies the loaded adapter, the in-process engine its own copy of it)
        mine, theirs = comparable(mine), comparable(theirs)
        assert [logprobs(r) for r in mine] == [pytest.approx(logprobs(r), abs=1e-4) for r in theirs], f"{stage}/{name}"
        assert mine == theirs, f"{stage}/{name}"
    for role in ("challenger", "solver"):
        mine = read_jsonl(params.run_dir / "iter_01" / role / "metrics.jsonl")
        theirs = read_jsonl(reference.run_dir / "iter_01" / role / "metrics.jsonl")
        assert [m["reward"] for m in mine] == [m["reward"] for m in theirs]
        assert [m["grad_norm"] for m in mine] == pytest.approx([m["grad_norm"] for m in theirs], rel=1e-4)
        assert all(m["importance_ratio"] == pytest.approx(1.0, abs=1e-4) for m in mine)
