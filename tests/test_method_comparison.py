"""The four methods side by side (`evaluation.method_comparison`, `scope compare-methods`; issue 49 items 2-4):
SCOPE, SPICE, SSP and SCORE each trained with its shuffled-reward control at the smallest budget (one iteration, one
optimiser step per role) on the tiny model with real TRL updates, a scripted engine playing every protocol (SPICE's
and SCORE's scripts from their own tests; SSP's Proposer finds no valid question, as on the smoke model), then every
answering checkpoint scored on one held-out set. The engine plants one signal: SCOPE's trained Solver (its adapter,
by name) names every entity of a held-out task, every other checkpoint answers as M0 does; so SCOPE's rubric gain
over M0 and over its control lies above 0 and every other method's gain is exactly 0. On the gold-answer slice
(M0 writing SPICE tasks on the held-out documents, every second attempt valid) a second signal is planted: SPICE's
answering checkpoint answers every question right, every other checkpoint wrong, so SPICE's verdict on its home
measure is learned while its rubric-score verdict is not. The short-form benchmarks (NQ,
HotpotQA, four items each) are answered beside them. A second call with every run DONE trains nothing, evaluates
nothing and writes the same table."""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml
from scripted_engine import ScriptedEngine
from test_learning_check import PlantedEngine
from test_score_method import score_script
from test_spice_method import spice_script
from training_helpers import FAST, REPO, load_policy

from scope_lib.evaluation.evaluate import Policy
from scope_lib.evaluation.gold_slice import empty_reason, gold_folder, gold_slice
from scope_lib.evaluation.held_out import CheckComponents, HeldOutSet
from scope_lib.evaluation.learning_check import learning_verdict
from scope_lib.evaluation.method_comparison import (
    GOLD_LABEL,
    HOME_GROUND,
    JSON_NAME,
    MARKDOWN_NAME,
    MethodComparison,
    Yardstick,
    answering_checkpoint,
    compare_methods,
    evaluate_methods,
    gold_report,
    gold_text_lines,
    gold_values,
    home_label,
    home_verdict,
    load_spec,
    method_params,
    paired_comparisons,
    read_comparison,
    yardstick_measures,
)
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.runs import RunError, read_jsonl
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.loop import run

DIALECT = get_dialect("qwen2.5")
METHODS = ("scope", "spice", "ssp", "score")
#: The yardstick, small: 6 held-out tasks from 40 reserved documents, K = 2.
CHECK = {"learning_check.held_out_documents": 40, "learning_check.tasks": 6, "learning_check.samples": 2,
         "learning_check.batch_size": 8, "learning_check.eval_batch_tasks": 6, "learning_check.bootstrap_samples": 1000}
#: What each method's params file adds for the scripted engine (SCORE's reports and evaluations need more room).
EXTRA = {"score": {"challenger.max_new_tokens_per_turn": 400, "solver.max_new_tokens_per_turn": 160}}
FIXTURE = REPO / "tests" / "fixtures" / "method_comparison" / JSON_NAME


def nested(dotted: dict) -> dict:
    out: dict = {}
    for key, value in dotted.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def dotted(params, key: str):
    return functools.reduce(getattr, key.split("."), params)


def write_spec(folder: Path) -> Path:
    """The repository's compare-smoke spec, its methods' files each the repository's smoke params of the method with
    the scripted engine's budgets (FAST; the model sections, which FAST resets, come from the spec)."""
    spec = yaml.safe_load((REPO / "params" / "compare-smoke.yaml").read_text())
    per_method = {k: v for k, v in FAST.items() if k not in ("model.tiny", "model.warm_start")}
    for method, file in spec["compare"]["methods"].items():
        data = {"inherit": str(REPO / "params" / file), **nested({**per_method, **EXTRA.get(method, {})})}
        (folder / f"{method}.yaml").write_text(yaml.safe_dump(data))
        spec["compare"]["methods"][method] = f"{method}.yaml"
    spec["inherit"] = str(REPO / "params" / "smoke.yaml")
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return folder / "spec.yaml"


def script():
    spice, score = spice_script(valid_every=3), score_script()
    return lambda role, context: spice(role, context) or score(role, context)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, wiki_sample):
    folder = tmp_path_factory.mktemp("compare")
    overrides = {"run.runs_dir": str(folder / "runs"), "run.data_dir": str(wiki_sample.parent), **FAST, **CHECK}
    spec_path = write_spec(folder)
    spec = load_spec(spec_path, overrides)
    return spec_path, overrides, spec, build_or_open_index(spec, progress=False), folder


GOLD_QUESTION = re.compile(r"What is (\d+) times 7\?")


def gold_writer():
    """M0's SPICE Challenger on the held-out documents (the gold-answer slice's builder): the n-th attempt writes
    the integer task "What is n times 7?" (gold 7n) when n is even, else declines with no JSON."""
    attempts = [0]

    def write(role: str, context: str) -> str | None:
        if "write one challenging exam question" not in context:
            return None
        attempts[0] += 1
        n = attempts[0]
        return json.dumps({"answer_type": "integer", "question": f"What is {n} times 7?", "answer": 7 * n}) \
            if n % 2 == 0 else "I would rather not."

    return write


class GoldEngine(PlantedEngine):
    """The planted engine, and on a gold-slice question ("What is n times 7?") the adapters in `right` answer 7n,
    every other checkpoint (M0 included) 7n + 1."""

    def __init__(self, *args, right=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.right = set(right)

    def generate(self, prompt_token_ids, sampling, adapter=None):
        out = super().generate(prompt_token_ids, sampling, adapter)
        for i, ids in enumerate(prompt_token_ids):
            context = self.tokenizer.decode(ids)
            asked = GOLD_QUESTION.search(context)
            if asked and self.role(context) == "solver" and "<answer>" in out[i].text:
                n = 7 * int(asked.group(1)) + (0 if adapter in self.right else 1)
                out[i] = self._complete(f"<think>Multiply.</think>\n<answer>{n}</answer>", sampling)
        return out


def trainer(tiny_model_dir, retriever, trained: list):
    """`train(params)` for compare_methods: the loop `scope train` runs, on the tiny model's real policy and the
    scripted engine (a fresh one per run)."""
    def train(params):
        trained.append(params.run.name)
        policy = load_policy(params, tiny_model_dir)
        engine = PlantedEngine(policy.tokenizer, DIALECT, grader=script())
        run(params, policy=policy, engine=engine, judge=Judge(engine, params.judge, seed=0), retriever=retriever)

    return train


def lender(spec, retriever, passages, tokenizer, root: Path, engines: list):
    """`lend(checkpoints)`: the scripted engine serving every checkpoint under its name, SCOPE's trained Solver
    carrying the planted signal; M0 (adapter None) and the frozen grader on the same engine."""
    writer, scripted = gold_writer(), script()

    def lend(checkpoints):
        engine = GoldEngine(tokenizer, DIALECT, trained=(f"{spec.run.name}-scope-01-solver",),
                            right=(f"{spec.run.name}-spice-01-solver",),
                            grader=lambda role, context: writer(role, context) or scripted(role, context))
        engines.append(engine)
        policies = {ck.name: Policy(ck, engine, None if ck.kind == "base" else ck.name) for ck in checkpoints.values()}
        components = CheckComponents(engine, Judge(engine, spec.judge, seed=spec.selfplay.seed), retriever, DIALECT,
                                     passages)
        return {"components": components, "policies": policies, "model_id": "scripted", "root": root,
                "progress": False}

    return lend


@pytest.fixture(scope="module")
def compared(setup, tiny_model_dir, tiny_tokenizer, passages):
    spec_path, overrides, spec, retriever, folder = setup
    trained: list[str] = []
    comparison = compare_methods(spec_path, overrides, train=trainer(tiny_model_dir, retriever, trained),
                                 lend=lender(spec, retriever, passages, tiny_tokenizer, folder / "heldout", []))
    return comparison, trained


def test_every_method_and_its_control_train_under_the_spec_and_are_scored_on_one_yardstick(setup, compared):
    spec_path, overrides, spec, _, _ = setup
    comparison, trained = compared
    names = [f"{spec.run.name}-{m}{c}" for m in METHODS for c in ("", "-control")]
    assert trained == names                                  # each run once, in the spec's order
    for method in METHODS:
        params = method_params(spec, spec_path, method)
        control = method_params(spec, spec_path, method, control=True)
        # one M0, corpus, index, seed, held-out set and budget for all; each method's own settings kept
        assert (params.method, control.grpo.reward_control, params.grpo.reward_control) == (method, "shuffled", "none")
        for key in ("model.base", "retrieval.corpus", "selfplay.seed", "grpo.seed", "selfplay.iterations",
                    "selfplay.steps_per_role", "learning_check.held_out_documents"):
            assert dotted(params, key) == dotted(spec, key), key
        assert params.retrieval.index_dir == str(spec.run_dir / "index")
        assert params.model.shared_policy == (method != "scope")
    # what each run leaves to answer: SCOPE's Solver stage; a shared policy's newest stage (SCORE's Evaluator
    # trains the shared adapter after the Solver; SSP's Solver stage is skipped, no valid question)
    expected = {"scope": "solver", "spice": "solver", "ssp": "challenger", "score": "evaluator"}
    for method, stage in expected.items():
        ck = answering_checkpoint(method_params(spec, spec_path, method))
        assert ck is not None and ck.name == f"{spec.run.name}-{method}-01-{stage}"
        assert comparison.methods[method]["runs"]["trained"]["checkpoint"] == ck.name
    assert comparison.methods["ssp"]["runs"]["trained"]["alarms"].get("no_valid_task") == 1
    # the planted signal: SCOPE's trained Solver gains over M0 and over its control; the others answer as M0
    score = comparison.methods["scope"]["measures"]["score"]
    assert score["trained"]["ci95"][0] > 0 and score["over_control"]["ci95"][0] > 0
    assert score["control"]["gain"] == 0.0 and score["means"]["control"] == score["means"]["M0"]
    for method in ("spice", "ssp", "score"):
        entry = comparison.methods[method]["measures"]
        assert entry["score"]["trained"]["gain"] == 0.0 and entry["score"]["trained"]["ci95"] == [0.0, 0.0]
        assert entry["fact_recall"]["trained"]["gain"] == 0.0
    assert comparison.held_out["tasks"] == spec.learning_check.tasks == score["trained"]["tasks"]
    # home ground: the rubric score for SCOPE and SCORE, the gold-answer slice for SPICE and SSP
    for method in METHODS:
        entry = comparison.methods[method]
        home = [m for m, v in entry["measures"].items() if v["home"]]
        assert home == (["score"] if method in ("scope", "score") else ["gold"]) and entry["home_measure"] == \
            HOME_GROUND[method][0]
    # the gold-answer slice, by hand: 8 held-out documents in one batch; round 0's attempts 1-8 (even ones valid:
    # documents 2, 4, 6, 8), round 1 on documents 1, 3, 5, 7 (attempts 9-12: 10 and 12 valid): 6 questions, 12
    # attempts, 6 without JSON. SPICE's Solver answers all 6 right (K = 2 each), everyone else wrong.
    gold = comparison.gold_slice
    assert (gold["tasks"], gold["attempts"], gold["valid"], gold["documents"]) == (6, 12, 6, 8)
    assert gold["invalid_reasons"] == {"no_json": 6} and gold["answer_types"] == {"integer": 6} and not gold["empty"]
    assert [ex["gold"] for ex in gold["examples"]] == ["14", "70", "28"]
    assert gold["examples"][0]["answers"]["spice"] == {"answer": "14", "verified": 1.0}
    assert gold["examples"][0]["answers"]["M0"] == {"answer": "15", "verified": 0.0}
    spice_gold = comparison.methods["spice"]["measures"]["gold"]
    assert spice_gold["means"] == {"M0": 0.0, "trained": 1.0, "control": 0.0} and spice_gold["home"]
    assert (spice_gold["trained"]["gain"], spice_gold["trained"]["ci95"], spice_gold["trained"]["tasks"]) == \
        (1.0, [1.0, 1.0], 6)
    assert spice_gold["over_control"]["gain"] == 1.0 and spice_gold["control"]["gain"] == 0.0
    for method in ("scope", "ssp", "score"):
        assert comparison.methods[method]["measures"]["gold"]["trained"]["gain"] == 0.0
    # two verdicts by the check's rule: on the rubric score, and on the home measure. SCOPE's and SCORE's home is
    # the rubric score (the same verdict); SPICE's planted Solver gains 1 [1, 1] on its home slice over M0 and over
    # its control, so it learned there, with no grader gate (no judge scores the slice); SSP's gain 0 is not learned
    for method in ("scope", "score"):
        assert comparison.methods[method]["home_verdict"] == {"measure": "score",
                                                             **comparison.methods[method]["verdict"]}
    spice_home = comparison.methods["spice"]["home_verdict"]
    assert (spice_home["measure"], spice_home["outcome"], spice_home["gain"], spice_home["ci95"],
            spice_home["over_control_ci95"], spice_home["judge"]) == ("gold", "learned", 1.0, [1.0, 1.0], [1.0, 1.0],
                                                                      None)
    assert comparison.methods["spice"]["verdict"]["outcome"] != "learned"   # its rubric gain is exactly 0
    assert comparison.methods["ssp"]["home_verdict"]["outcome"] == "not learned"
    # the short-form benchmarks: EM and F1 of every checkpoint on the same 4 items; SPICE's Solver answers them as
    # M0 does (its planted signal is the slice's), so its gain is exactly 0
    assert set(comparison.benchmarks) == {"nq", "hotpotqa"}
    for key in ("nq_em", "nq_f1", "hotpotqa_em", "hotpotqa_f1"):
        entry = comparison.methods["spice"]["measures"][key]
        assert entry["trained"]["tasks"] == 4 and entry["trained"]["gain"] == 0.0
        assert all(0.0 <= v <= 1.0 for v in entry["means"].values())
    # cost: one optimiser step per role, tokens and seconds from the runs' metrics, this process's wall time
    for method in METHODS:
        run_ = comparison.methods[method]["runs"]["trained"]
        assert all(r["steps"] == 1 for r in run_["roles"].values()) and run_["generated_tokens"] > 0
        assert run_["wall_s"] > run_["step_s"] > 0
    assert set(comparison.methods["score"]["runs"]["trained"]["roles"]) == {"solver", "evaluator"}
    assert "report_valid_rate" in comparison.methods["score"]["runs"]["trained"]["roles"]["solver"]["validity"]
    # the table, written; the side-by-side answers: M0's and each trained method's first rollout
    written = spec.run_dir / JSON_NAME
    assert read_comparison(written).to_record() == json.loads(json.dumps(comparison.to_record()))
    text = (spec.run_dir / MARKDOWN_NAME).read_text()
    assert "| scope | rubric score | yes |" in text and "verified gold answers" in text
    assert "| spice | gold-answer pass rate | yes | 0.000 | 1.000 | 0.000 | +1.000 [+1.000, +1.000] |" in text
    assert "| spice | NQ EM |" in text and "6 question(s) from 12 attempt(s)" in text
    spice_row = next(line for line in text.splitlines() if line.startswith("| spice | verified gold answers"))
    assert spice_row.endswith(f"| {comparison.methods['spice']['verdict']['outcome']} | learned |")
    assert "- **spice** on its home measure, the gold-answer pass rate: learned: the gain +1.000" in text
    example = comparison.examples[0]
    assert list(example["answers"]) == ["M0", *METHODS] and example["rubrics"]
    assert "It is about" in example["answers"]["scope"]["answer"]


def test_a_second_call_with_every_run_done_trains_and_evaluates_nothing_and_writes_the_same_table(
        setup, compared, tiny_tokenizer, passages):
    spec_path, overrides, spec, retriever, folder = setup
    first, _ = compared
    trained: list[str] = []
    engines: list = []
    again = compare_methods(spec_path, overrides, train=lambda p: trained.append(p.run.name),
                            lend=lender(spec, retriever, passages, tiny_tokenizer, folder / "heldout", engines))
    assert trained == [] and sum(e.calls for e in engines) == 0
    assert json.dumps(again.to_record(), sort_keys=True) == json.dumps(first.to_record(), sort_keys=True)


def test_the_home_verdict_on_the_gold_slice_is_the_checks_rule_without_its_judge_gates(setup, compared,
                                                                                        tiny_tokenizer, passages):
    """SPICE's stored slice evaluations read back (no engine call): its Solver verifies all 6 questions, M0 none.
    Given its own Solver as the control (a control that gains as much), trained − control is 0 [0, 0]: not learned.
    With no control the gain 1 [1, 1] is not shown (it may be drift). The same comparisons under the check's judged
    rule are not shown (no grader probe, no judge-free measures): `judged=False` is what drops those gates."""
    spec_path, _, spec, retriever, folder = setup
    engines: list = []
    runs = {"spice": {kind: method_params(spec, spec_path, "spice", control=kind == "control")
                      for kind in ("trained", "control")}}
    ys = evaluate_methods(spec, runs, lender(spec, retriever, passages, tiny_tokenizer, folder / "heldout", engines))
    assert sum(e.calls for e in engines) == 0
    as_much = home_verdict(spec, ys, {"M0": "before", "trained": "spice", "control": "spice"}, "gold", None)
    assert (as_much["outcome"], as_much["gain"], as_much["control_gain"], as_much["over_control_ci95"]) == \
        ("not learned", 1.0, 1.0, [0.0, 0.0])
    m0_as_trained = home_verdict(spec, ys, {"M0": "before", "trained": "before", "control": "spice"}, "gold", None)
    assert m0_as_trained["outcome"] == "not learned" and "over 6 questions does not lie above 0" in \
        m0_as_trained["reason"]  # the slice's unit, not the held-out set's "tasks"
    alone = home_verdict(spec, ys, {"M0": "before", "trained": "spice"}, "gold", None)
    assert alone["outcome"] == "not shown" and "without a shuffled-reward control" in alone["reason"]
    keys = {"M0": "before", "trained": "spice", "control": "spice-control"}
    pairs = paired_comparisons(GOLD_LABEL, gold_values(ys, keys)[0], n_samples=100, seed=0)
    assert learning_verdict(pairs["trained"], pairs["control"]).outcome == "not shown"
    assert learning_verdict(pairs["trained"], pairs["control"], judged=False).outcome == "learned" == \
        home_verdict(spec, ys, keys, "gold", None)["outcome"]


def test_the_notebooks_fixture_has_the_shape_compare_methods_writes(compared):
    """Notebook 07 reads tests/fixtures/method_comparison/ by default (nbval runs it in CI): the same keys."""
    def keys(node, depth=0):
        if isinstance(node, dict) and depth < 4:
            return {k: keys(v, depth + 1) for k, v in node.items() if k not in ("alarms", "validity", "roles")}
        return None

    made = compared[0].to_record()
    if os.environ.get("SCOPE_WRITE_FIXTURES"):  # regenerate it: SCOPE_WRITE_FIXTURES=1 pytest this file
        FIXTURE.write_text(json.dumps(made, indent=2) + "\n")
    fixture = read_comparison(FIXTURE).to_record()
    assert keys(fixture["methods"]["scope"]) == keys(made["methods"]["scope"])
    assert keys(fixture["spec"]) == keys(made["spec"]) and keys(fixture["held_out"]) == keys(made["held_out"])
    assert keys(fixture["gold_slice"]) == keys(made["gold_slice"]) and fixture["benchmarks"] == made["benchmarks"]
    older = json.loads(json.dumps(made))  # written before home verdicts: refused, saying how to rewrite it
    del older["methods"]["spice"]["home_verdict"]
    with pytest.raises(RunError, match=r"none for spice\): run the same `scope compare-methods` again"):
        MethodComparison.from_record(older)


def test_the_compare_section_stays_out_of_training_runs_hashes_and_names_registered_methods(tmp_path):
    """A training run's parameter hash and params.yaml are what they were before `compare` existed (its runs still
    resume, their Judge probes are read back); a spec's params.yaml keeps it; a method that is not registered is
    refused before anything trains."""
    from scope_lib.config import ParamsError, load_params
    from scope_lib.selfplay.loop import science_yaml

    spec = load_params(REPO / "params" / "compare-smoke.yaml")
    assert list(spec.compare.methods) == list(METHODS)
    assert "compare" not in yaml.safe_load(science_yaml(spec)) and "compare" not in load_params(None).to_yaml()
    assert yaml.safe_load(spec.to_yaml())["compare"]["methods"]["spice"] == "spice-smoke.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"inherit": str(REPO / "params" / "compare-smoke.yaml"),
                                   "compare": {"methods": {"r-zero": "smoke.yaml"}}}))
    with pytest.raises(ParamsError, match="r-zero"):
        load_spec(bad)
    with pytest.raises(ParamsError, match="compare.methods is empty"):
        load_spec(REPO / "params" / "smoke.yaml")
    with pytest.raises(ParamsError, match="trains method 'scope', not 'spice'"):
        method_params(load_params(REPO / "params" / "compare-smoke.yaml", ["compare.methods.spice=smoke.yaml"]),
                      REPO / "params" / "compare-smoke.yaml", "spice")


def test_the_specs_checkpoint_steps_reach_every_run_and_leave_its_parameter_hash_alone():
    """`run.checkpoint_steps` set in the spec reaches every method's run and control (a comparison stopped mid-stage
    resumes at its last step, whatever the method's own file says), and a run's parameter hash is the same with it
    or without it, so it can be set on a stopped comparison."""
    from scope_lib.config import load_params
    from scope_lib.selfplay.loop import science_yaml

    path = REPO / "params" / "compare-smoke.yaml"
    plain, saving = load_params(path), load_params(path, ["run.checkpoint_steps=1"])
    for method in METHODS:
        for control in (False, True):
            before = method_params(plain, path, method, control=control)
            after = method_params(saving, path, method, control=control)
            assert (before.run.checkpoint_steps, after.run.checkpoint_steps) == (0, 1), (method, control)
            assert science_yaml(before) == science_yaml(after), (method, control)
    assert load_params(REPO / "params" / "compare-smollm.yaml").run.checkpoint_steps == 1


def test_the_warm_start_is_left_to_the_runs_own_processes(tmp_path):
    """`compare_methods` prepares M0 (the warm start, built when not cached) only after every run has trained: a
    run's own `scope train` process builds it and gives the memory back when it ends, so the comparison's process,
    which lives through every run, never holds an SFT's memory beside a training run."""
    from scope_lib.evaluation.method_comparison import compare_methods

    calls = []

    class Stop(Exception):
        pass

    def train(params):
        calls.append(("train", params.run.name))
        raise Stop

    with pytest.raises(Stop):
        compare_methods(REPO / "params" / "compare-smoke.yaml", {"run.runs_dir": str(tmp_path)}, train=train,
                        prepare=lambda spec: calls.append(("prepare", spec.run.name)), write=False)
    assert calls == [("train", "compare-smoke-scope")]


def test_a_stopped_runs_wall_time_is_counted_and_the_resumed_call_adds_to_it(tmp_path):
    """A comparison stopped mid-run (SIGTERM: `Stopped`) kept no wall time for that run, so a resumed run's table
    showed only its last call's seconds: every call's time is summed."""
    from scope_lib.evaluation.method_comparison import WALL_NAME, compare_methods
    from scope_lib.runs import Stopped

    def stopped(params):
        time.sleep(0.3)
        raise Stopped("SIGTERM")

    spec = REPO / "params" / "compare-smoke.yaml"
    with pytest.raises(Stopped):
        compare_methods(spec, {"run.runs_dir": str(tmp_path)}, train=stopped, prepare=lambda s: None, write=False)
    wall_file = tmp_path / "compare-smoke" / WALL_NAME
    first = json.loads(wall_file.read_text())["compare-smoke-scope"]
    assert first >= 0.3
    with pytest.raises(Stopped):
        compare_methods(spec, {"run.runs_dir": str(tmp_path)}, train=stopped, prepare=lambda s: None, write=False)
    walls = json.loads(wall_file.read_text())
    assert list(walls) == ["compare-smoke-scope"] and walls["compare-smoke-scope"] >= first + 0.3


def slice_parts(setup, tokenizer, passages, tmp_path, override, crash_at=None, **gold):
    """The spec with `compare.gold` set (no benchmarks), a held-out set's folder of its own, and M0's components on
    a scripted engine whose Challenger follows `override` (dying at its `crash_at`-th call)."""
    from test_learning_check import CrashingEngine

    spec_path, overrides, _, retriever, _ = setup
    spec = load_spec(spec_path, {**overrides, "compare.benchmarks": [],
                                 **{f"compare.gold.{k}": v for k, v in gold.items()}})
    engine = CrashingEngine(tokenizer, DIALECT, grader=override, crash_at=crash_at) if crash_at else \
        ScriptedEngine(tokenizer, DIALECT, override=override)
    components = CheckComponents(engine, Judge(engine, spec.judge, seed=0), retriever, DIALECT, passages)
    return spec, HeldOutSet(tmp_path / "heldout", "key", [], {}, model="scripted"), components


def test_a_slice_m0_writes_no_question_for_is_empty_and_says_why(setup, tiny_tokenizer, passages, tmp_path):
    """The tiny model and SmolLM2 write no valid SPICE task today: the slice is empty, nothing crashes, and the
    measure, the home column and the report say why with the attempts' reasons counted (8 documents x 2 attempts,
    no JSON in any)."""
    spec, held_out, components = slice_parts(setup, tiny_tokenizer, passages, tmp_path, lambda role, context:
                                              "No question." if "challenging exam question" in context else None,
                                              tasks=4, documents=8, attempts=2)
    gold = gold_slice(spec, held_out, components, progress=False)
    assert gold.tasks == [] and components.engine.calls == 2          # one call per round
    assert (gold.summary["attempts"], gold.summary["invalid_reasons"]) == (16, {"no_json": 16})
    why = "empty: M0 wrote no valid question in 16 attempt(s) on 8 held-out document(s) (no_json ×16)"
    assert empty_reason(gold.summary) == why
    ys = Yardstick(held_out, {}, {}, gold)
    entry = yardstick_measures(spec, ys, {"M0": "before", "trained": "spice"}, "gold")["gold"]
    assert entry["means"] == {} and entry["trained"] is None and entry["note"] == why and entry["home"]
    assert home_label({"home_measure": "gold", "measures": {"gold": entry}}) == f"gold-answer pass rate ({why})"
    report = gold_report(spec, ys, ["spice"])
    assert report["empty"] == why and report["examples"] == [] and why in gold_text_lines(report)
    # the home verdict on an empty slice, or on none asked: not shown, saying why
    assert home_verdict(spec, ys, {"M0": "before", "trained": "spice"}, "gold", None) == {
        "measure": "gold", "learned": False, "outcome": "not shown",
        "reason": f"not shown: the gold-answer slice has no paired interval ({why})"}
    assert home_verdict(spec, Yardstick(held_out, {}, {}), {}, "gold", None)["reason"] == \
        "not shown: no gold-answer slice asked (compare.gold.tasks is 0)"
    again = gold_slice(spec, held_out, None, progress=False)            # read back: no model
    assert again.summary == gold.summary


def test_a_slice_build_killed_mid_way_resumes_with_nothing_lost_or_duplicated(setup, tiny_tokenizer, passages,
                                                                             tmp_path):
    """16 documents in two batches of 8, one attempt each, every second attempt valid: killed in batch 2's engine
    call, the build keeps batch 1 (4 questions) and draws batch 2 alone, once. The resumed process's Challenger
    starts its count again, so batch 2's 4 valid tasks repeat batch 1's questions: the slice, read back from disk,
    refuses them as duplicates."""
    parts = {"tasks": 100, "documents": 16, "attempts": 1}
    spec, held_out, crashing = slice_parts(setup, tiny_tokenizer, passages, tmp_path, gold_writer(), crash_at=2,
                                           **parts)
    with pytest.raises(KeyboardInterrupt):
        gold_slice(spec, held_out, crashing, progress=False)
    folder = gold_folder(spec, held_out)[0]
    first = read_jsonl(folder / "attempts.jsonl")
    assert len(first) == 8 and not (folder / "DONE").exists()
    _, _, components = slice_parts(setup, tiny_tokenizer, passages, tmp_path, gold_writer(), **parts)
    gold = gold_slice(spec, held_out, components, progress=False)
    attempts = read_jsonl(folder / "attempts.jsonl")
    assert components.engine.calls == 1 and attempts[:8] == first       # batch 1 kept, batch 2 drawn once
    assert len(attempts) == len({a["id"] for a in attempts}) == 16
    assert len(gold.tasks) == gold.summary["valid"] == 4 and len({t.task for t in gold.tasks}) == 4
    assert gold.summary["invalid_reasons"] == {"no_json": 8, "duplicate_question": 4}
    assert [t.gold.answer for t in gold.tasks] == [14, 28, 42, 56]
