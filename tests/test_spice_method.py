"""SPICE as a method of the library (`selfplay.methods.spice`, issue 48 item 3): one iteration end to end on the
tiny model with real GRPO updates of one shared adapter and a scripted engine that writes SPICE's JSON tasks and
boxed answers; the records, rewards and alarms, and a run whose tasks are all invalid."""

from __future__ import annotations

import json

import pytest
from scripted_engine import ScriptedEngine
from training_helpers import FAST, REPO, load_policy

from scope_lib.config import load_params
from scope_lib.protocol import spice
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.loop import run

DIALECT = get_dialect("qwen2.5")
TASK = {"answer_type": "integer", "question": "What is six times seven?", "answer": 42}


def spice_script(valid_every: int):
    """(role, context) -> text: the Challenger writes TASK on every `valid_every`-th call (else it declines with no
    JSON); the Reasoner boxes 42 or 7 in turn, so a valid task's pass rate is 1/2."""
    calls = {"challenger": 0, "reasoner": 0}

    def script(role: str, context: str) -> str | None:
        if "write one challenging exam question" in context:
            calls["challenger"] += 1
            return json.dumps(TASK) if calls["challenger"] % valid_every == 0 else "I would rather not."
        if "\\boxed{}" in context:
            calls["reasoner"] += 1
            return "\\boxed{42}" if calls["reasoner"] % 2 else "The answer is \\boxed{7}."
        return None

    return script


def spice_params(tmp_path, data_dir):
    return load_params(REPO / "params" / "spice-smoke.yaml",
                       {"run.runs_dir": str(tmp_path), "run.data_dir": str(data_dir), **FAST,
                        "selfplay.iterations": 1})


@pytest.fixture(scope="module")
def retriever(tmp_path_factory, wiki_sample):
    return build_or_open_index(spice_params(tmp_path_factory.mktemp("index"), wiki_sample.parent), progress=False)


def run_spice(params, tiny_model_dir, retriever, valid_every):
    policy = load_policy(params, tiny_model_dir)
    engine = ScriptedEngine(policy.tokenizer, DIALECT, override=spice_script(valid_every))
    return run(params, policy=policy, engine=engine, judge=Judge(engine, params.judge, seed=0), retriever=retriever)


def test_spice_runs_one_iteration_with_its_rewards_on_one_shared_adapter(tmp_path, wiki_sample, tiny_model_dir,
                                                                         retriever):
    params = spice_params(tmp_path, wiki_sample.parent)
    assert (params.method, params.grpo.loss_type, params.grpo.scale_rewards, params.grpo.beta) == (
        "spice", "dr_grpo", "none", 0.0)
    result = run_spice(params, tiny_model_dir, retriever, valid_every=2)
    assert list(result.policy.model.peft_config) == ["policy"]
    folder = params.run_dir / "iter_01"
    for stage in ("challenger", "solver"):
        assert (folder / stage / "DONE").is_file()
        assert (folder / stage / "adapter" / "adapter_config.json").is_file()
        assert read_jsonl(folder / stage / "metrics.jsonl")
    assert (params.run_dir / "manifest.json").is_file()
    k = params.selfplay.solver_rollouts_train
    attempts = read_jsonl(folder / "challenger" / "rollouts.jsonl")
    assert len(attempts) == params.challenger.batch_size * params.grpo.group_size
    assert {a["valid"] for a in attempts} == {True, False}
    for a in attempts:
        if a["valid"]:
            assert a["task"]["answer"] == 42 and len(a["verified"]) == k
            assert a["reward"] == pytest.approx(spice.challenger_reward(a["verified"], True))
        else:  # eq. 1's penalty, and why
            assert (a["reward"], a["invalid_reason"], a["task"]) == (-0.1, "no_json", None)
    answers = read_jsonl(folder / "challenger" / "solver_rollouts.jsonl")
    assert len(answers) == k * sum(a["valid"] for a in attempts)
    assert {r["verified"] for r in answers} == {True, False}
    summary = json.loads((folder / "challenger" / "DONE").read_text())
    assert 0 < summary["valid_rate"] < 1 and summary["invalid_reasons"] == {"no_json": summary["attempts"] -
                                                                              summary["valid"]}
    reasoner = read_jsonl(folder / "solver" / "rollouts.jsonl")
    assert reasoner and all(r["reward"] == (1.0 if r["verified"] else 0.0) for r in reasoner)
    assert all(r["answer"] in ("42", "7") for r in reasoner)
    assert not (params.run_dir / "health.jsonl").is_file() or "no_valid_task" not in (
        params.run_dir / "health.jsonl").read_text()


def test_a_spice_iteration_without_a_valid_task_says_so_and_goes_on(tmp_path, wiki_sample, tiny_model_dir, retriever):
    params = spice_params(tmp_path, wiki_sample.parent)
    result = run_spice(params, tiny_model_dir, retriever, valid_every=10_000)
    alarms = [a["alarm"] for a in result.alarms]
    assert "no_valid_task" in alarms and "no_searches" not in alarms     # SPICE's roles never search
    assert "no_valid_task" in (params.run_dir / "health.jsonl").read_text()
    solver = json.loads((params.run_dir / "iter_01" / "solver" / "DONE").read_text())
    assert solver["skipped"] == "no valid task" and solver["steps"] == 0
    attempts = read_jsonl(params.run_dir / "iter_01" / "challenger" / "rollouts.jsonl")
    assert attempts and all(a["reward"] == -0.1 and a["invalid_reason"] == "no_json" for a in attempts)
