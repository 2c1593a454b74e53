"""A real `scope train` killed with SIGKILL during Stage 2 (the task pool) and during Stage 3 (Solver GRPO)
resumes and ends with the same records as an uninterrupted run of the same seeds: nothing lost, nothing
duplicated. Stage 1 (and for the Stage 3 test, the pool) is prepared in-process with the scripted engine, so
the pool has tasks; the `scope train` processes then use the real tiny model."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from training_helpers import FAST, AlternatingEngine, comparable, fast_params, load_policy

from scope_lib.protocol.dialects import get_dialect
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.loop import open_run
from scope_lib.selfplay.methods.scope import build_pool, train_challenger

REPO = Path(__file__).resolve().parents[1]
#: Turn budgets that fit the scripted protocol text (in-process Stage 1) and keep the random model's turns short.
TOKENS = {"challenger.max_new_tokens_per_turn": 112, "solver.max_new_tokens_per_turn": 112}
POOL_KILL = {**TOKENS, "selfplay.steps_per_role": 1, "selfplay.max_candidate_batches": 3}
SOLVER_KILL = {**TOKENS, "selfplay.steps_per_role": 2, "selfplay.max_candidate_batches": 2}


@pytest.fixture()
def cache_env(tmp_path, tiny_model_dir):
    """The subprocesses find the session's tiny model in their cache (no rebuild)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny").symlink_to(Path(tiny_model_dir).parent, target_is_directory=True)
    # one thread each: the uninterrupted and the killed run share the machine's cores
    return {**os.environ, "SCOPE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def prepare(runs_dir, data_dir, tiny_model_dir, settings, *, pool: bool):
    """Stage 1 (and the task pool) done in-process; returns the params."""
    params = fast_params(runs_dir, data_dir, **settings)
    policy = load_policy(params, tiny_model_dir)
    engine = AlternatingEngine(policy.tokenizer, get_dialect("qwen2.5"))
    r = open_run(params, engine=engine, judge=Judge(engine, params.judge, seed=params.selfplay.seed), policy=policy)
    train_challenger(r, 1)
    if pool:
        assert build_pool(r, 1)["tasks"] > 0
    return params


def command(runs_dir, data_dir, settings) -> list[str]:
    overrides = {**FAST, **settings, "run.runs_dir": str(runs_dir), "run.data_dir": str(data_dir)}
    args = [sys.executable, "-m", "scope_lib.cli", "train", str(REPO / "params" / "smoke.yaml")]
    for key, value in overrides.items():
        args += ["-o", f"{key}={value}"]
    return args


def start(runs_dir, data_dir, settings, env, log_name) -> subprocess.Popen:
    log = open(Path(runs_dir) / log_name, "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command(runs_dir, data_dir, settings), stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=REPO)


def finish(process: subprocess.Popen, runs_dir, log_name, timeout=600) -> None:
    code = process.wait(timeout=timeout)
    assert code == 0, (Path(runs_dir) / log_name).read_text()[-4000:]


def kill_when(process, condition, runs_dir, log_name, timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"`scope train` ended before it could be killed:\n{(Path(runs_dir) / log_name).read_text()[-3000:]}")
        assert time.monotonic() < deadline, "the condition to kill on never came"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


def lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def resumed_and_uninterrupted(tmp_path, wiki_sample, tiny_model_dir, env, settings, *, pool: bool, kill_on):
    """Prepare a run, copy it, run the copy uninterrupted while the original is killed (on `kill_on(run_dir)`)
    and resumed. Returns (resumed run dir, uninterrupted run dir)."""
    data = wiki_sample.parent
    killed_root, clean_root = tmp_path / "killed", tmp_path / "clean"
    params = prepare(killed_root, data, tiny_model_dir, settings, pool=pool)
    shutil.copytree(killed_root, clean_root, symlinks=True)
    run_dir = params.run_dir
    clean = start(clean_root, data, settings, env, "clean.log")
    killed = start(killed_root, data, settings, env, "killed.log")
    kill_when(killed, lambda: kill_on(run_dir), killed_root, "killed.log")
    resumed = start(killed_root, data, settings, env, "resumed.log")
    finish(resumed, killed_root, "resumed.log")
    finish(clean, clean_root, "clean.log")
    return run_dir, clean_root / run_dir.name


@pytest.mark.slow
@pytest.mark.heavy
def test_kill_during_the_task_pool_then_resume(tmp_path, wiki_sample, tiny_model_dir, cache_env):
    def mid_pool(run_dir):
        pool = run_dir / "iter_01" / "pool"
        return lines(pool / "chunks.jsonl") >= 1 and not (pool / "DONE").exists()

    resumed, clean = resumed_and_uninterrupted(tmp_path, wiki_sample, tiny_model_dir, cache_env, POOL_KILL,
                                               pool=False, kill_on=mid_pool)
    for name in ("candidates", "chunks", "tasks"):
        mine, theirs = resumed / "iter_01" / "pool" / f"{name}.jsonl", clean / "iter_01" / "pool" / f"{name}.jsonl"
        assert lines(mine) == lines(theirs)
        ids = [r["id"] for r in read_jsonl(mine)]
        assert len(ids) == len(set(ids)), f"duplicated ids in {name}"
        assert comparable(mine) == comparable(theirs), name
    assert lines(resumed / "iter_01" / "pool" / "chunks.jsonl") == POOL_KILL["selfplay.max_candidate_batches"]
    assert (resumed / "iter_01" / "solver" / "DONE").is_file()


@pytest.mark.slow
@pytest.mark.heavy
def test_kill_during_solver_training_then_resume(tmp_path, wiki_sample, tiny_model_dir, cache_env):
    def mid_training(run_dir):
        solver = run_dir / "iter_01" / "solver"
        return lines(solver / "metrics.jsonl") >= 1 and not (solver / "DONE").exists()

    resumed, clean = resumed_and_uninterrupted(tmp_path, wiki_sample, tiny_model_dir, cache_env, SOLVER_KILL,
                                               pool=True, kill_on=mid_training)
    mine, theirs = resumed / "iter_01" / "solver", clean / "iter_01" / "solver"
    assert comparable(mine / "rollouts.jsonl") == comparable(theirs / "rollouts.jsonl")
    ids = [r["id"] for r in read_jsonl(mine / "rollouts.jsonl")]
    assert len(ids) == len(set(ids)) == SOLVER_KILL["selfplay.steps_per_role"] * 4
    metrics = [(m["id"], m["reward"]) for m in comparable(mine / "metrics.jsonl")]
    assert metrics == [(m["id"], m["reward"]) for m in comparable(theirs / "metrics.jsonl")]
    from safetensors.torch import load_file

    a = load_file(str(mine / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(theirs / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)   # the same Solver S_1


MID_STAGE = {**TOKENS, "selfplay.steps_per_role": 3, "selfplay.max_candidate_batches": 2, "run.checkpoint_steps": 1}


@pytest.mark.slow
@pytest.mark.heavy
def test_kill_at_step_k_of_a_grpo_stage_resumes_at_step_k_with_the_same_adapter(tmp_path, wiki_sample,
                                                                                  tiny_model_dir, cache_env):
    """run.checkpoint_steps: a Solver stage killed (SIGKILL) after a checkpoint resumes at that step, with the
    optimiser, scheduler and RNG restored, and ends with the uninterrupted run's adapter, bit for bit."""
    def after_a_checkpoint(run_dir):
        solver = run_dir / "iter_01" / "solver"
        return any((c / "scope_checkpoint.json").is_file() for c in (solver / "trainer").glob("checkpoint-*")) \
            and not (solver / "DONE").exists()

    resumed, clean = resumed_and_uninterrupted(tmp_path, wiki_sample, tiny_model_dir, cache_env, MID_STAGE,
                                               pool=True, kill_on=after_a_checkpoint)
    log = (tmp_path / "killed" / "resumed.log").read_text()
    assert "solver: resuming at step" in log and "optimiser, scheduler and RNG restored" in log, log[-3000:]
    assert "restarts from its first step" not in log
    mine, theirs = resumed / "iter_01" / "solver", clean / "iter_01" / "solver"
    ids = [r["id"] for r in read_jsonl(mine / "rollouts.jsonl")]
    assert len(ids) == len(set(ids)) == MID_STAGE["selfplay.steps_per_role"] * 4
    assert comparable(mine / "rollouts.jsonl") == comparable(theirs / "rollouts.jsonl")
    metrics = [(m["id"], m["reward"], m["loss"]) for m in comparable(mine / "metrics.jsonl")]
    assert metrics == [(m["id"], m["reward"], m["loss"]) for m in comparable(theirs / "metrics.jsonl")]
    from safetensors.torch import load_file

    a = load_file(str(mine / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(theirs / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical S_1
    assert not (mine / "trainer").exists()  # checkpoints are scratch: gone once the stage is DONE
