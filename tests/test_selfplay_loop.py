"""Algorithm 1 end to end over iterations: Stage 1, the task pool, Stage 3, with real GRPO updates of the tiny
model and a scripted engine that follows the protocol over the real Wikipedia sample."""

from __future__ import annotations

import pytest
from training_helpers import AlternatingEngine, fast_params, load_policy

from scope_lib.protocol import rewards
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.loop import open_run, run
from scope_lib.selfplay.methods.scope import build_pool, train_challenger
from scope_lib.selfplay.tasks import TaskEvaluation, solver_format

DIALECT = get_dialect("qwen2.5")


@pytest.fixture(scope="module")
def index_params(tmp_path_factory, wiki_sample):
    return fast_params(tmp_path_factory.mktemp("index"), wiki_sample.parent)


@pytest.fixture(scope="module")
def retriever(index_params):
    return build_or_open_index(index_params, progress=False)


def components(params, tiny_model_dir, retriever):
    policy = load_policy(params, tiny_model_dir)
    engine = AlternatingEngine(policy.tokenizer, DIALECT)
    return {"policy": policy, "engine": engine, "judge": Judge(engine, params.judge, seed=params.selfplay.seed),
            "retriever": retriever}


def records(run_dir, t, stage, name):
    path = run_dir / f"iter_{t:02d}" / stage / f"{name}.jsonl"
    return read_jsonl(path) if path.is_file() else []


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory, wiki_sample, tiny_model_dir, retriever):
    params = fast_params(tmp_path_factory.mktemp("runs"), wiki_sample.parent, **{"selfplay.iterations": 2})
    result = run(params, **components(params, tiny_model_dir, retriever))
    return params, result


def test_iterations_write_every_stage_with_the_papers_rewards(two_iterations):
    params, result = two_iterations
    run_dir = params.run_dir
    for t in (1, 2):
        for stage in ("challenger", "pool", "solver"):
            assert (run_dir / f"iter_{t:02d}" / stage / "DONE").is_file(), (t, stage)
        assert (run_dir / f"iter_{t:02d}" / "challenger" / "adapter" / "adapter_config.json").is_file()
        assert (run_dir / f"iter_{t:02d}" / "solver" / "adapter" / "adapter_config.json").is_file()
    # Stage 1: R_C = 0.5 r_fmt + 1[QG] f_diff(g-bar) (eq. 4, 5), F.1's format-0 rule
    rollouts = records(run_dir, 1, "challenger", "rollouts")
    assert len(rollouts) == params.challenger.batch_size * params.grpo.group_size
    for rec in rollouts:
        e = rec["evaluation"]
        difficulty = rewards.difficulty_reward(e["mean_score"]) if e["gates_passed"] and e["mean_score"] is not None \
            else 0.0
        expected = 0.0 if e["format_total"] == 0 else 0.5 * e["format_total"] + difficulty
        assert rec["reward"] == pytest.approx(expected)
    assert len({rec["reward"] for rec in rollouts}) > 1
    # Stage 3: R_S = L(a) g + 0.5 r_fmt + 0.1 r_search (eq. 6, 7; F.2)
    from scope_lib.selfplay.rollout import Trajectory

    solver = records(run_dir, 1, "solver", "rollouts")
    assert len(solver) == params.solver.batch_size * params.grpo.group_size
    for rec in solver:
        traj = Trajectory.from_record(rec["trajectory"])
        fmt = solver_format(traj, DIALECT)
        searches = DIALECT.count_searches(traj.turns)[0]
        n_answer = len(result.policy.tokenizer.encode(traj.answer, add_special_tokens=False)) if traj.answer else 0
        expected = rewards.solver_reward(rec["rubric_score"], n_answer, fmt.total, searches,
                                         length=rewards.LengthPenalty(params.solver.length_soft,
                                                                      params.solver.length_hard))
        assert rec["reward"] == pytest.approx(expected)
    metrics = records(run_dir, 1, "solver", "metrics")
    assert len(metrics) == params.selfplay.steps_per_role and metrics[0]["rubric_score"] is not None
    manifest = (run_dir / "manifest.json").read_text()
    for key in ("params_hash", "transformers", "trl", "git", "judge_models", "corpus"):
        assert key in manifest


def test_the_pool_keeps_window_tasks_one_per_document(two_iterations):
    params, _ = two_iterations
    lo, hi = params.selfplay.difficulty_window
    for t in (1, 2):
        tasks = records(params.run_dir, t, "pool", "tasks")
        candidates = records(params.run_dir, t, "pool", "candidates")
        assert tasks, f"iteration {t}: no task in the pool"
        assert len(tasks) <= params.selfplay.target_tasks
        assert all(task["gates_passed"] and lo <= task["mean_score"] <= hi for task in tasks)
        assert len({task["document_id"] for task in tasks}) == len(tasks)
        kept = {c["id"] for c in candidates if c["kept"]}
        assert kept == {task["id"] for task in tasks}
        outside = [c for c in candidates if c["evaluation"]["mean_score"] is not None
                   and not lo <= c["evaluation"]["mean_score"] <= hi]
        assert all(not c["kept"] for c in outside)
        assert {TaskEvaluation.from_record(task).challenger_id for task in tasks} == kept


def test_ids_and_documents_never_repeat_across_iterations(two_iterations):
    params, _ = two_iterations
    files = [("challenger", "rollouts"), ("challenger", "solver_rollouts"), ("challenger", "metrics"),
             ("pool", "candidates"), ("pool", "tasks"), ("solver", "rollouts"), ("solver", "metrics")]
    for stage, name in files:
        ids = [rec["id"] for t in (1, 2) for rec in records(params.run_dir, t, stage, name)]
        assert ids and len(ids) == len(set(ids)), (stage, name)
        assert all(i.startswith(("i01", "i02", f"{stage}-01", f"{stage}-02")) for i in ids), ids[:3]
    spans = sorted(stage_summary(params, t, stage)["documents"] for t in (1, 2) for stage in ("challenger", "pool"))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))              # consecutive, never overlapping
    first = {c["evaluation"]["document_id"] for c in records(params.run_dir, 1, "pool", "candidates")}
    second = {c["evaluation"]["document_id"] for c in records(params.run_dir, 2, "pool", "candidates")}
    assert first and second and not first & second


def test_a_finished_run_continues_with_more_iterations(tmp_path, wiki_sample, tiny_model_dir, retriever):
    """Train one iteration, look at it, then ask for two: iteration 1 stays as it was and iteration 2 follows it
    (documents after iteration 1's). A run whose manifest an older version hashed with the count resumes too;
    any parameter that decides results still refuses."""
    import json

    from scope_lib.runs import params_hash
    from scope_lib.selfplay.loop import science_yaml

    one = fast_params(tmp_path, wiki_sample.parent, **{"selfplay.iterations": 1})
    run(one, **components(one, tiny_model_dir, retriever))
    first = {p: p.read_bytes() for p in (one.run_dir / "iter_01").rglob("*") if p.is_file()}
    two = fast_params(tmp_path, wiki_sample.parent, **{"selfplay.iterations": 2})
    run(two, **components(two, tiny_model_dir, retriever))
    assert first and {p: p.read_bytes() for p in first} == first
    assert all((two.run_dir / "iter_02" / stage / "DONE").is_file() for stage in ("challenger", "pool", "solver"))
    assert stage_summary(two, 1, "pool")["documents"][1] <= stage_summary(two, 2, "challenger")["documents"][0]
    manifest = two.run_dir / "manifest.json"
    older = json.loads(manifest.read_text())
    assert older["params_hash"] == params_hash(science_yaml(two)) == params_hash(science_yaml(one))
    older["params_hash"] = params_hash(science_yaml(two, counted_iterations=2))   # as the count was hashed before
    manifest.write_text(json.dumps(older))
    three = fast_params(tmp_path, wiki_sample.parent, **{"selfplay.iterations": 3})
    open_run(three, **components(three, tiny_model_dir, retriever))
    assert json.loads(manifest.read_text())["params_hash"] == params_hash(science_yaml(three))
    other = fast_params(tmp_path, wiki_sample.parent, **{"selfplay.iterations": 3, "grpo.learning_rate": 1e-3})
    with pytest.raises(RuntimeError, match="other parameters"):
        open_run(other, **components(other, tiny_model_dir, retriever))


def stage_summary(params, t, stage):
    from scope_lib.runs import Stage, iteration_dir

    return Stage(iteration_dir(params.run_dir, t) / stage).summary


def test_the_pool_is_deterministic_by_seed(tmp_path, wiki_sample, tiny_model_dir, retriever):
    def pool(folder, **overrides):
        params = fast_params(tmp_path / folder, wiki_sample.parent, **overrides)
        r = open_run(params, **components(params, tiny_model_dir, retriever))
        train_challenger(r, 1)
        build_pool(r, 1)
        return records(params.run_dir, 1, "pool", "candidates")

    first, again = pool("a"), pool("b")
    strip = [{k: v for k, v in c.items() if k != "trajectory"} for c in first]
    assert strip == [{k: v for k, v in c.items() if k != "trajectory"} for c in again]
    assert [c["trajectory"]["completion_ids"] for c in first] == [c["trajectory"]["completion_ids"] for c in again]
    other = pool("c", **{"selfplay.seed": 7})
    assert {c["evaluation"]["document_id"] for c in other} != {c["evaluation"]["document_id"] for c in first}


class WeightsEngine(AlternatingEngine):
    """The alternating scripted engine whose Challenger signs its task with a digest of its current weights: its
    tasks follow its weights, as a model's do (the scripted text alone would not see a Challenger trained apart)."""

    def __init__(self, policy):
        super().__init__(policy.tokenizer, DIALECT)
        self.policy = policy

    def _challenger(self, context: str) -> str:
        import hashlib

        text = super()._challenger(context)
        digest = hashlib.sha256()
        for _, weights in sorted(self.policy.state("challenger").items()):
            digest.update(weights.numpy().tobytes())
        return text.replace("</task>", f" (draft {digest.hexdigest()[:8]})</task>")


def test_the_control_differs_from_the_trained_run_in_the_solvers_rewards_alone(tmp_path, wiki_sample,
                                                                               tiny_model_dir, retriever):
    """`grpo.reward_control: shuffled`, the learning check's control (issue 47): with the same seeds its
    Challenger, Stage 1 and task pool are the trained run's, bit for bit; its Solver trains on each step's earned
    rewards permuted among the step's rows."""
    from safetensors.torch import load_file
    from training_helpers import comparable

    dirs = {}
    for control in ("none", "shuffled"):
        params = fast_params(tmp_path / control, wiki_sample.parent, **{
            "grpo.reward_control": control, "selfplay.challenger_steps": 1, "selfplay.steps_per_role": 2})
        policy = load_policy(params, tiny_model_dir)
        engine = WeightsEngine(policy)
        run(params, policy=policy, engine=engine, judge=Judge(engine, params.judge, seed=params.selfplay.seed),
            retriever=retriever)
        dirs[control] = params.run_dir / "iter_01"
    trained, control = dirs["none"], dirs["shuffled"]
    for stage, name in [("challenger", "rollouts"), ("challenger", "solver_rollouts"), ("pool", "candidates"),
                        ("pool", "tasks")]:
        assert comparable(control / stage / f"{name}.jsonl") == comparable(trained / stage / f"{name}.jsonl"), name
    assert comparable(trained / "pool" / "tasks.jsonl")                       # a pool to compare
    adapter = "adapter/adapter_model.safetensors"
    c_trained, c_control = load_file(trained / "challenger" / adapter), load_file(control / "challenger" / adapter)
    assert all(c_control[k].equal(v) for k, v in c_trained.items())           # the same Challenger C_1
    earned = {r["id"]: r["reward"] for r in read_jsonl(trained / "solver" / "rollouts.jsonl")}
    solver = read_jsonl(control / "solver" / "rollouts.jsonl")
    assert {r["id"]: r["reward"] for r in solver} == earned                  # the same rollouts earned the same ...
    steps = sorted({r["step"] for r in solver})
    assert steps == [1, 2]
    for step in steps:                                                        # ... GRPO got them permuted per step
        rows = [r for r in solver if r["step"] == step]
        assert sorted(r["trained_reward"] for r in rows) == sorted(r["reward"] for r in rows)
    assert any(r["trained_reward"] != r["reward"] for r in solver)
    s_trained, s_control = load_file(trained / "solver" / adapter), load_file(control / "solver" / adapter)
    assert any(not s_control[k].equal(v) for k, v in s_trained.items())      # so the Solvers differ


def test_the_pool_stops_before_the_learning_checks_held_out_documents(tmp_path, wiki_sample, tiny_model_dir,
                                                                     retriever):
    """With `learning_check.held_out_documents` the task pool runs out of documents where the reserved tail
    begins: no candidate is written on a held-out document, however many tasks it still wants."""
    from scope_lib.retrieval.corpus import held_out_documents
    from scope_lib.runs import Stage, iteration_dir

    params = fast_params(tmp_path, wiki_sample.parent, **{"learning_check.held_out_documents": 990,
                                                          "selfplay.target_tasks": 50,
                                                          "selfplay.max_candidate_batches": None})
    r = open_run(params, **components(params, tiny_model_dir, retriever))
    assert r.training_documents == 10
    Stage(iteration_dir(params.run_dir, 1) / "challenger").mark_done({"documents": [0, 6]})  # Stage 1 used 0..5
    summary = build_pool(r, 1)
    assert summary["stopped"] == "documents ran out" and summary["documents"] == [6, 10]
    held_out = {p.id for p in held_out_documents(r.passages, 990, params.selfplay.seed)}
    written = {c["evaluation"]["document_id"] for c in records(params.run_dir, 1, "pool", "candidates")}
    assert len(written) == 4 and not written & held_out
    manifest = (params.run_dir / "manifest.json").read_text()
    assert '"reward_control": "none"' in manifest and '"documents": 990' in manifest


def test_without_co_evolution_the_challenger_stays_at_iteration_1(tmp_path, wiki_sample, tiny_model_dir, retriever):
    """§5's ablation: C_1 frozen; the Solver keeps training on fresh tasks from it."""
    params = fast_params(tmp_path, wiki_sample.parent, **{"selfplay.iterations": 2, "selfplay.co_evolution": False})
    parts = components(params, tiny_model_dir, retriever)
    result = run(params, **parts)
    second = params.run_dir / "iter_02"
    assert '"frozen_at": 1' in (second / "challenger" / "DONE").read_text()
    assert not (second / "challenger" / "rollouts.jsonl").exists() and not (second / "challenger" / "adapter").exists()
    assert records(params.run_dir, 2, "pool", "candidates")                # fresh tasks from C_1
    assert records(params.run_dir, 2, "solver", "rollouts")                 # the Solver keeps training
    frozen = load_policy(params, tiny_model_dir)
    frozen.load_role("challenger", params.run_dir / "iter_01" / "challenger" / "adapter")
    now = result.policy.state("challenger")
    assert all(v.equal(now[n]) for n, v in frozen.state("challenger").items())   # still exactly C_1
    assert (params.run_dir / "iter_02" / "solver" / "adapter").is_dir()


def test_with_co_evolution_the_challenger_trains_every_iteration(two_iterations):
    params, _ = two_iterations
    from safetensors.torch import load_file

    first = load_file(str(params.run_dir / "iter_01" / "challenger" / "adapter" / "adapter_model.safetensors"))
    second = load_file(str(params.run_dir / "iter_02" / "challenger" / "adapter" / "adapter_model.safetensors"))
    assert records(params.run_dir, 2, "challenger", "rollouts")
    assert any(not first[k].equal(second[k]) for k in first)


def test_the_notebook_04_tables_read_a_finished_run(two_iterations):
    from scope_lib.reports.analysis import (
        example_tasks,
        gate_pass_by_task_type,
        iteration_summary,
        pool_candidates,
        thinking_stops_per_step,
        time_split,
        training_metrics,
    )

    params, _ = two_iterations
    metrics = training_metrics(params.run_dir)
    assert sorted(metrics.groupby("role").size().to_dict().items()) == [("challenger", 2), ("solver", 2)]
    stops = thinking_stops_per_step(metrics)   # the health panel's count per step (the scripted policy plans none)
    assert len(stops) == 4 and list(stops.index.names) == ["role", "iteration", "step"]
    assert stops.columns.tolist() == ["stops inside thinking (the role's rollouts)",
                                      "stops inside thinking (Stage 1's Solver rollouts)"]
    assert (stops.iloc[:, 0] == 0).all()
    assert metrics[metrics.role == "solver"]["global_step"].tolist() == [1, 2]
    candidates = pool_candidates(params.run_dir)
    assert set(candidates["iteration"]) == {1, 2} and candidates["kept"].any()
    gates = gate_pass_by_task_type(candidates)
    assert gates["gate pass rate"].between(0, 1).all() and len(gates) >= 2
    summary = iteration_summary(params.run_dir)
    assert summary["iteration"].tolist() == [1, 2] and summary["pool tasks"].gt(0).all()
    assert summary["solver rubric score"].notna().all()
    split = time_split(metrics)
    assert {"generation", "judge", "update", "overhead"} <= set(split.columns) and (split["update"] > 0).all()
    examples = example_tasks(params.run_dir)
    assert [e["iteration"] for e in examples] == [1, 2]
    assert all(e["task"] and e["rubrics"] for e in examples)
    assert any(e["verdicts"] and len(e["verdicts"]) == len(e["rubrics"]) for e in examples)


def test_solver_reward_figure_is_plotlys_export_of_the_run(two_iterations, tmp_path):
    """The README's static copy of notebook 04's Solver figure, exported by plotly (kaleido + Chromium): one line
    per component, one point per step; a run without Solver steps is refused with a clear error."""
    import xml.etree.ElementTree as ET
    from pathlib import Path

    from scope_lib.reports.analysis import training_metrics, write_solver_reward_figure

    if not Path("/usr/bin/chromium").is_file():
        pytest.skip("no /usr/bin/chromium for plotly's static export: `make chromium` installs it (make test does)")
    params, _ = two_iterations
    path = write_solver_reward_figure(params.run_dir, tmp_path / "fig" / "solver.svg")
    root = ET.fromstring(path.read_text())
    svg = "{http://www.w3.org/2000/svg}"
    traces = [g for g in root.iter(f"{svg}g") if "trace" in (g.get("class") or "").split()
              and "scatter" in (g.get("class") or "")]
    solver = training_metrics(params.run_dir).query("role == 'solver'")
    drawn = [c for c in ("reward", "rubric_score", "format", "search_reward", "length_multiplier")
             if solver[c].notna().any()]
    assert len(traces) == len(drawn) >= 2
    assert all(len([p for p in t.iter(f"{svg}path") if "point" in (p.get("class") or "")]) == len(solver)
               for t in traces)
    texts = {t.text for t in root.iter(f"{svg}text")}
    assert "Solver: reward components per GRPO step" in texts and set(drawn) <= texts
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no Solver training step"):
        write_solver_reward_figure(tmp_path / "empty", tmp_path / "none.svg")


def test_training_refuses_an_index_that_fails_its_check(tmp_path, wiki_sample):
    """`scope index check` runs before any training: an index that answers nothing stops the run."""
    from scope_lib.retrieval.api import IndexCheckError

    class Silent:
        def search(self, queries, k=None):
            return [[] for _ in queries]

    params = fast_params(tmp_path, wiki_sample.parent)
    with pytest.raises(IndexCheckError, match="canaries"):
        open_run(params, retriever=Silent())
    assert not (params.run_dir / "manifest.json").exists()


def test_grpo_seed_makes_a_replicate_on_the_same_documents():
    """`grpo.seed` shifts every stage's sampling seed (a replicate for the learning check's second seed); the
    documents, held-out tail included, follow `selfplay.seed` alone; the default shifts nothing."""
    from scope_lib.config import validate_params
    from scope_lib.retrieval.corpus import Passage, document_range, held_out_documents
    from scope_lib.selfplay.harness import stage_seed

    first = validate_params({"selfplay": {"seed": 7}})
    second = validate_params({"selfplay": {"seed": 7}, "grpo": {"seed": 43}})
    assert [stage_seed(first, 1, s) for s in ("challenger", "pool", "solver")] == [8, 9, 10]
    seeds = {(p.grpo.seed, t, s): stage_seed(p, t, s) for p in (first, second) for t in (1, 2)
             for s in ("challenger", "pool", "solver")}
    assert len(set(seeds.values())) == len(seeds)  # no stage of either run shares a seed
    passages = [Passage(str(i), f"t{i}", "x") for i in range(50)]
    for p in (first, second):  # documents and the held-out tail: selfplay.seed's
        assert document_range(passages, 0, 10, p.selfplay.seed) == document_range(passages, 0, 10, 7)
        assert held_out_documents(passages, 5, p.selfplay.seed) == held_out_documents(passages, 5, 7)


def test_a_shared_policy_trains_one_adapter_on_both_roles_and_resumes_from_the_newest(tmp_path, wiki_sample,
                                                                                      tiny_model_dir, retriever):
    """`model.shared_policy` (issue 48, item 2): one LoRA adapter plays both roles; Stage 1 and Stage 3 each train
    it and save it in their folder; a new process restores the newest finished stage's weights (Stage 3's) into it."""
    import torch
    from safetensors.torch import load_file

    from scope_lib.selfplay.loop import science_yaml

    params = fast_params(tmp_path, wiki_sample.parent, **{"model.shared_policy": True, "selfplay.iterations": 1})
    parts = components(params, tiny_model_dir, retriever)
    policy = parts["policy"]
    assert list(policy.model.peft_config) == ["policy"]
    assert policy.state("challenger").keys() == policy.state("solver").keys()      # one set of weights, two names
    run(params, **parts)
    folder = params.run_dir / "iter_01"
    assert stage_summary(params, 1, "solver")["steps"] == params.selfplay.steps_per_role
    challenger = load_file(folder / "challenger" / "adapter" / "adapter_model.safetensors")
    solver = load_file(folder / "solver" / "adapter" / "adapter_model.safetensors")
    assert challenger.keys() == solver.keys()
    assert any(not torch.equal(challenger[k], solver[k]) for k in challenger)     # Stage 3 trained Stage 1's further
    final = policy.state("challenger")
    resumed = open_run(params, **components(params, tiny_model_dir, retriever)).policy
    restored = resumed.state("solver")
    assert all(torch.equal(restored[k], final[k]) for k in final)
    assert "shared_policy" in (params.run_dir / "params.yaml").read_text()
    assert "shared_policy" in science_yaml(params)                                 # a shared run hashes apart


def test_the_params_method_picks_a_registered_method_and_an_unknown_one_is_refused(tmp_path, wiki_sample):
    from scope_lib.config import ParamsError
    from scope_lib.selfplay.methods import METHODS, method_for

    params = fast_params(tmp_path, wiki_sample.parent)
    assert params.method == "scope" and method_for(params) is METHODS["scope"]
    assert [s.name for s in method_for(params).stages] == ["challenger", "pool", "solver"]
    params.method = "nope"
    with pytest.raises(ParamsError, match="method: 'nope' .* choose one of scope, spice"):
        open_run(params)                                    # before anything loads


def test_every_registered_method_has_rules_for_each_role_its_stages_train():
    """A method's stages name the roles they train; `Method.role_rules` gives each one's rules, and a role the method
    does not have is refused naming the ones it has."""
    from scope_lib.selfplay.methods import METHODS

    assert set(METHODS) == {"scope", "spice", "ssp", "score"}
    for method in METHODS.values():
        trained = {s.trains for s in method.stages if s.trains}
        assert trained and trained == set(method.roles)
        assert all(method.role_rules(role) is method.roles[role] for role in trained)
        with pytest.raises(ValueError, match=f"{method.name.upper()} has no role 'nobody'; it trains "):
            method.role_rules("nobody")
