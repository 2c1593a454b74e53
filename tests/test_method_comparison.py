"""The four methods side by side (`evaluation.method_comparison`, `scope compare-methods`; issue 49 items 2-4):
SCOPE, SPICE, SSP and SCORE each trained with its shuffled-reward control at the smallest budget (one iteration, one
optimiser step per role) on the tiny model with real TRL updates, a scripted engine playing every protocol (SPICE's
and SCORE's scripts from their own tests; SSP's Proposer finds no valid question, as on the smoke model), then every
answering checkpoint scored on one held-out set. The engine plants one signal: SCOPE's trained Solver (its adapter,
by name) names every entity of a held-out task, every other checkpoint answers as M0 does; so SCOPE's rubric gain
over M0 and over its control lies above 0 and every other method's gain is exactly 0. A second call with every run
DONE trains nothing, evaluates nothing and writes the same table."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from test_learning_check import PlantedEngine
from test_score_method import score_script
from test_spice_method import spice_script
from training_helpers import FAST, REPO, load_policy

from scope_lib.evaluation.evaluate import Policy
from scope_lib.evaluation.held_out import CheckComponents
from scope_lib.evaluation.method_comparison import (
    HOME_GROUND,
    JSON_NAME,
    MARKDOWN_NAME,
    answering_checkpoint,
    compare_methods,
    load_spec,
    method_params,
    read_comparison,
)
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.index import build_or_open_index
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
    def lend(checkpoints):
        engine = PlantedEngine(tokenizer, DIALECT, trained=(f"{spec.run.name}-scope-01-solver",), grader=script())
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
    # home ground: the rubric score for SCOPE and SCORE, no measure for SPICE and SSP
    for method in METHODS:
        entry = comparison.methods[method]
        home = [m for m, v in entry["measures"].items() if v["home"]]
        assert home == (["score"] if method in ("scope", "score") else []) and entry["home_measure"] == \
            HOME_GROUND[method][0]
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


def test_the_notebooks_fixture_has_the_shape_compare_methods_writes(compared):
    """Notebook 07 reads tests/fixtures/method_comparison/ by default (nbval runs it in CI): the same keys."""
    def keys(node, depth=0):
        if isinstance(node, dict) and depth < 4:
            return {k: keys(v, depth + 1) for k, v in node.items() if k not in ("alarms", "validity", "roles")}
        return None

    fixture = read_comparison(FIXTURE).to_record()
    made = compared[0].to_record()
    assert keys(fixture["methods"]["scope"]) == keys(made["methods"]["scope"])
    assert keys(fixture["spec"]) == keys(made["spec"]) and keys(fixture["held_out"]) == keys(made["held_out"])


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
