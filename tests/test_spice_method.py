"""SPICE as a method of the library (`selfplay.methods.spice`, issue 48 item 3): one iteration end to end on the
tiny model with real GRPO updates of one shared adapter and a scripted engine that writes SPICE's JSON tasks and
boxed answers: the Challenger's format choice (Figure 9), attempts drawn until one is valid and subsampled with
their valid:invalid ratio (Algorithm 1, lines 5-6), the Reasoner trained on the K answers that scored the Challenger
(§2.5); the records, rewards and alarms; that a run opens no index (nothing of SPICE searches); a run whose tasks
are all invalid; and a run interrupted mid-stage that resumes with nothing lost or duplicated."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import defaultdict

import pytest
import torch
from scripted_engine import ScriptedEngine
from training_helpers import FAST, REPO, comparable, load_policy

from scope_lib.config import load_params
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.index import index_path
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.harness import NoIndex
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.loop import run

DIALECT = get_dialect("qwen2.5")
TASK = {"answer_type": "integer", "question": "What is six times seven?", "answer": 42}
#: Figure 9's reply choosing a free-form question with an integer answer.
FORMAT = {"suitable_for_mcq": False, "suitable_for_free_form": True, "best_answer_type": "Integer", "reason": "a count"}


def spice_script(valid_every: int):
    """(role, context) -> text: the Challenger picks Integer (Figure 9) and writes TASK on every `valid_every`-th
    attempt (else it declines with no JSON); the Reasoner boxes 42 or 7 in turn, so a valid task's pass rate over
    K = 2 is 1/2."""
    calls = {"challenger": 0, "reasoner": 0}

    def script(role: str, context: str) -> str | None:
        if "suitable_for_mcq" in context:
            return json.dumps(FORMAT)
        if "write one challenging exam question" in context:
            calls["challenger"] += 1
            return json.dumps(TASK) if calls["challenger"] % valid_every == 0 else "I would rather not."
        if "\\boxed{}" in context:
            calls["reasoner"] += 1
            return "\\boxed{42}" if calls["reasoner"] % 2 else "The answer is \\boxed{7}."
        return None

    return script


def spice_params(tmp_path, data_dir, **overrides):
    return load_params(REPO / "params" / "spice-smoke.yaml",
                       {"run.runs_dir": str(tmp_path), "run.data_dir": str(data_dir), **FAST,
                        "selfplay.iterations": 1, **overrides})


def run_spice(params, tiny_model_dir, script, engine_class=ScriptedEngine):
    """A SPICE run as `scope train` opens it: no index (`Method.uses_index`), the roles' retriever `NoIndex`, which
    raises if anything searches."""
    policy = load_policy(params, tiny_model_dir)
    engine = engine_class(policy.tokenizer, DIALECT, override=script)
    return run(params, policy=policy, engine=engine, judge=Judge(engine, params.judge, seed=0))


def test_spice_runs_one_iteration_with_its_rewards_on_one_shared_adapter(tmp_path, wiki_sample, tiny_model_dir):
    params = spice_params(tmp_path, wiki_sample.parent)
    assert (params.method, params.grpo.loss_type, params.grpo.scale_rewards, params.grpo.beta) == (
        "spice", "dr_grpo", "none", 0.0)
    assert (params.spice.attempts, params.spice.format_choice, params.spice.reasoner_samples) == (
        4, "challenger", "shared")
    result = run_spice(params, tiny_model_dir, spice_script(valid_every=3))
    assert list(result.policy.model.peft_config) == ["policy"]
    # nothing searches: no index built, opened or checked (the stand-in raises on a search); the corpus still named
    assert isinstance(result.retriever, NoIndex) and not index_path(params).exists()
    manifest = json.loads((params.run_dir / "manifest.json").read_text())
    assert manifest["index"] is None and manifest["judge_stage_calibration"] is None
    assert manifest["corpus"]["sha256"] == hashlib.sha256(params.corpus_path.read_bytes()).hexdigest()
    folder = params.run_dir / "iter_01"
    for stage in ("challenger", "solver"):
        assert (folder / stage / "DONE").is_file()
        assert (folder / stage / "adapter" / "adapter_config.json").is_file()
        assert read_jsonl(folder / stage / "metrics.jsonl")
    assert (params.run_dir / "manifest.json").is_file()
    # Figure 9: every document's format was the Challenger's choice
    formats = read_jsonl(folder / "challenger" / "formats.jsonl")
    assert len(formats) == params.selfplay.challenger_prompts
    assert {(f["answer_type"], f["chosen_by"]) for f in formats} == {("integer", "challenger")}
    # Algorithm 1, lines 5-6. Every 3rd attempt is valid; a step's first round is 2 documents x G = 2 attempts: the
    # 3rd is the second document's first, so it is done; the first document draws a second round (the 5th and 6th
    # attempts, the 6th valid). Its 4 attempts F F F T keep G = 2 with the ratio: round(2 x 1/4) = 1 valid (half
    # up), 1 invalid.
    attempts = read_jsonl(folder / "challenger" / "attempts.jsonl")
    by_document = defaultdict(list)
    for a in attempts:
        by_document[a["prompt_id"]].append(a)
    assert sorted(len(v) for v in by_document.values()) == [2, 4]
    for drawn in by_document.values():
        flags = [a["valid"] for a in drawn]
        kept = [a for a in drawn if a["kept"]]
        assert flags == ([False, False, False, True] if len(drawn) == 4 else [True, False])
        assert len(kept) == params.grpo.group_size and sum(a["valid"] for a in kept) == 1
    rows = read_jsonl(folder / "challenger" / "rollouts.jsonl")
    assert len(rows) == params.challenger.batch_size * params.grpo.group_size
    assert {r["id"] for r in rows} == {a["id"] for a in attempts if a["kept"]}
    assert {r["attempts"] for r in rows} == {2, 4}
    k = params.selfplay.solver_rollouts_train
    for r in rows:
        if r["valid"]:  # p = 1/2: Var = 1/4, r_C = exp(0) = 1
            assert r["task"]["answer"] == 42 and len(r["verified"]) == k and r["reward"] == pytest.approx(1.0)
        else:  # eq. 1's penalty, and why
            assert (r["reward"], r["invalid_reason"], r["task"]) == (-0.1, "no_json", None)
    answers = read_jsonl(folder / "challenger" / "solver_rollouts.jsonl")
    assert len(answers) == k * sum(r["valid"] for r in rows)
    summary = json.loads((folder / "challenger" / "DONE").read_text())
    assert (summary["attempts"], summary["valid"], summary["kept"], summary["kept_valid"]) == (6, 2, 4, 2)
    assert summary["invalid_reasons"] == {"no_json": 4} and summary["formats_chosen"] == len(formats)
    # §2.5: the Reasoner's groups are the K answers that scored the Challenger, one valid task per document
    reasoner = read_jsonl(folder / "solver" / "rollouts.jsonl")
    assert len(reasoner) == params.solver.batch_size * params.grpo.group_size
    assert {r["sampled_as"] for r in reasoner} == {a["id"] for a in answers}
    stage1 = {a["id"]: a for a in answers}
    for r in reasoner:
        assert r["verified"] == stage1[r["sampled_as"]]["verified"] and r["reward"] == float(r["verified"])
    assert json.loads((folder / "solver" / "DONE").read_text())["samples"] == "shared"
    assert not (params.run_dir / "health.jsonl").is_file() or "no_valid_task" not in (
        params.run_dir / "health.jsonl").read_text()


def test_a_spice_iteration_without_a_valid_task_says_so_and_goes_on(tmp_path, wiki_sample, tiny_model_dir):
    params = spice_params(tmp_path, wiki_sample.parent, **{"spice.format_choice": "apportioned"})
    result = run_spice(params, tiny_model_dir, spice_script(valid_every=10_000))
    alarms = [a["alarm"] for a in result.alarms]
    assert "no_valid_task" in alarms and "no_searches" not in alarms     # SPICE's roles never search
    assert "no_valid_task" in (params.run_dir / "health.jsonl").read_text()
    solver = json.loads((params.run_dir / "iter_01" / "solver" / "DONE").read_text())
    assert solver["skipped"] == "no valid task" and solver["steps"] == 0
    folder = params.run_dir / "iter_01" / "challenger"
    assert not (folder / "formats.jsonl").exists()   # apportioned: no question about the format
    rows = read_jsonl(folder / "rollouts.jsonl")
    assert rows and all(a["reward"] == -0.1 and a["invalid_reason"] == "no_json" for a in rows)
    # no attempt is ever valid: each document draws up to N = spice.attempts = 4, then stops
    attempts = read_jsonl(folder / "attempts.jsonl")
    assert len(attempts) == params.challenger.batch_size * params.spice.attempts
    assert sum(a["kept"] for a in attempts) == len(rows)


def test_spice_settings_enter_the_parameter_hash_only_when_changed():
    import yaml

    from scope_lib.selfplay.loop import science_yaml

    assert "spice" not in yaml.safe_load(science_yaml(load_params(None)))   # SCOPE's hash as before the section
    changed = yaml.safe_load(science_yaml(load_params(None, {"spice.attempts": 4})))
    assert changed["spice"]["attempts"] == 4


def test_shared_reasoner_samples_need_k_equal_to_g():
    from scope_lib.config import ParamsError
    from scope_lib.selfplay.methods.spice import check_params

    check_params(load_params(REPO / "params" / "spice-smoke.yaml"))                     # K = G = 2
    with pytest.raises(ParamsError, match="spice.reasoner_samples: fresh"):
        check_params(load_params(REPO / "params" / "spice-smoke.yaml", {"grpo.group_size": 4}))
    check_params(load_params(REPO / "params" / "spice-smoke.yaml", {"grpo.group_size": 4,
                                                                     "spice.reasoner_samples": "fresh"}))


def test_the_reasoner_takes_one_valid_task_per_document_with_its_answers_or_every_question_fresh(tmp_path):
    """`reasoner_tasks` on hand-written Stage 1 records: `shared` picks one kept valid task per document (seeded) with
    the K answers that scored it; `fresh` keeps every distinct valid question once, without answers."""
    from types import SimpleNamespace

    from scope_lib.runs import Stage
    from scope_lib.selfplay.methods.spice import reasoner_tasks

    def task(question):
        return {"question": question, "answer_type": "integer", "answer": 42, "options": [], "decimals": 0}

    rows = [{"id": "a1", "document_id": "d1", "valid": True, "task": task("Q1")},
            {"id": "a2", "document_id": "d1", "valid": True, "task": task("Q2")},
            {"id": "a3", "document_id": "d1", "valid": False, "task": None},
            {"id": "b1", "document_id": "d2", "valid": True, "task": task("Q1")},     # the same question again
            {"id": "c1", "document_id": "d3", "valid": False, "task": None}]
    stage = Stage(tmp_path / "iter_01" / "challenger")
    stage.records("rollouts").append(rows)
    stage.records("solver_rollouts").append(
        {"id": f"{t}/r{j}", "task_id": t, "trajectory": {"id": f"{t}/r{j}"}} for t in ("a1", "a2", "b1") for j in (0, 1))

    def tasks(samples):
        params = load_params(REPO / "params" / "spice-smoke.yaml", {"spice.reasoner_samples": samples})
        return reasoner_tasks(SimpleNamespace(params=params, stage=lambda t, name: Stage(tmp_path / "iter_01" / name)),
                              1)

    shared = tasks("shared")
    assert len(shared) == 2 and "b1" in shared and len({"a1", "a2"} & set(shared)) == 1   # one per document
    for task_id, item in shared.items():
        assert [a["id"] for a in item.answers] == [f"{task_id}/r0", f"{task_id}/r1"]
    assert tasks("shared") == shared                                                       # seeded
    fresh = tasks("fresh")
    assert list(fresh) == ["a1", "a2"] and all(item.answers == () for item in fresh.values())
    assert fresh["a1"].task.question == "Q1" and fresh["a1"].task.answer == 42


# -- resume -----------------------------------------------------------------------------------------------------------


def resume_script():
    """A script whose replies do not depend on what came before a step: the Challenger writes TASK on every second
    attempt (rounds and groups have G = 2 rows) unless the document's checksum is a multiple of 3 (never valid: it
    draws every round); the Reasoner alternates 42 and 7 (K = 2 answers per valid task)."""
    calls = {"challenger": 0, "reasoner": 0}

    def script(role: str, context: str) -> str | None:
        if "suitable_for_mcq" in context:
            return json.dumps(FORMAT)
        if "write one challenging exam question" in context:
            calls["challenger"] += 1
            valid = calls["challenger"] % 2 == 0 and zlib.crc32(context.encode()) % 3 != 0
            return json.dumps(TASK) if valid else "I would rather not."
        if "\\boxed{}" in context:
            calls["reasoner"] += 1
            return "\\boxed{42}" if calls["reasoner"] % 2 else "The answer is \\boxed{7}."
        return None

    return script


class Killed(ScriptedEngine):
    """Stops the process (KeyboardInterrupt, as a kill would) at the first Challenger attempt after the Challenger
    stage's first mid-stage checkpoint is complete."""

    run_dir = None

    def generate(self, prompt_token_ids, sampling, adapter=None):
        trainer = self.run_dir / "iter_01" / "challenger" / "trainer"
        checkpointed = any((c / "scope_checkpoint.json").is_file() for c in trainer.glob("checkpoint-*"))
        if checkpointed and any("write one challenging exam question" in self.tokenizer.decode(ids)
                                for ids in prompt_token_ids):
            raise KeyboardInterrupt("killed")
        return super().generate(prompt_token_ids, sampling, adapter)


RESUME = {"selfplay.steps_per_role": 2, "run.checkpoint_steps": 1}


def test_a_spice_run_interrupted_mid_stage_resumes_with_nothing_lost_or_duplicated(tmp_path, wiki_sample,
                                                                                    tiny_model_dir, caplog):
    clean = spice_params(tmp_path / "clean", wiki_sample.parent, **RESUME)
    run_spice(clean, tiny_model_dir, resume_script())
    killed = spice_params(tmp_path / "killed", wiki_sample.parent, **RESUME)
    Killed.run_dir = killed.run_dir
    with pytest.raises(KeyboardInterrupt):
        run_spice(killed, tiny_model_dir, resume_script(), engine_class=Killed)
    stage = killed.run_dir / "iter_01" / "challenger"
    assert not (stage / "DONE").exists() and {r["step"] for r in read_jsonl(stage / "rollouts.jsonl")} == {1}
    with caplog.at_level("WARNING", logger="scope_lib.selfplay.training"):
        run_spice(killed, tiny_model_dir, resume_script())   # as a new process: fresh policy and engine
    assert "challenger: resuming at step 1 of 2" in caplog.text
    mine, theirs = killed.run_dir / "iter_01", clean.run_dir / "iter_01"
    for name in ("challenger/formats", "challenger/attempts", "challenger/rollouts", "challenger/solver_rollouts",
                 "solver/rollouts"):
        records = read_jsonl(mine / f"{name}.jsonl")
        assert records and len({r["id"] for r in records}) == len(records), name   # nothing duplicated
        assert comparable(mine / f"{name}.jsonl") == comparable(theirs / f"{name}.jsonl"), name   # nothing lost
    for stage_name in ("challenger", "solver"):
        metrics = [(m["id"], m["reward"], m["loss"]) for m in comparable(mine / stage_name / "metrics.jsonl")]
        assert metrics == [(m["id"], m["reward"], m["loss"]) for m in comparable(theirs / stage_name / "metrics.jsonl")]
    attempts = read_jsonl(mine / "challenger" / "attempts.jsonl")
    assert {a["step"] for a in attempts} == {1, 2} and any(not a["kept"] for a in attempts)
    from safetensors.torch import load_file

    a = load_file(str(mine / "solver" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(theirs / "solver" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)   # the same policy after the iteration
