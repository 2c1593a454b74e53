"""Notebooks 02, 04 and 05 on every method's run (`reports.methods`, issue 48 item 5): the report of each method
reads its run folder and draws its own quantities: SPICE's attempts by validity reason, the Reasoner's pass rates and
eq. 1's Gaussian rewards, gold answers; SSP's rule-filter reasons, RAG verification, the 1 - p rewards and the replay
buffer; SCORE's rubric reasons, the verifier's zeroed queries, the Evaluator's stage among the training steps and the
harness. SPICE and SSP run one scripted iteration each (the engines of their method tests, real GRPO updates on the
tiny model); SCORE's run is the smoke run that notebook 04 itself trains when papermill executes it."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace

import nbformat
import pytest
from plotly.basedatatypes import BaseFigure
from test_spice_method import run_spice, spice_params, spice_script
from test_ssp_method import run_ssp, ssp_params
from training_helpers import REPO

from scope_lib.config import load_params
from scope_lib.reports.analysis import training_metrics
from scope_lib.reports.methods import REPORTS, report_for
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.methods import METHODS


@pytest.fixture(scope="module")
def retriever(tmp_path_factory, wiki_sample):
    return build_or_open_index(spice_params(tmp_path_factory.mktemp("index"), wiki_sample.parent), progress=False)


@pytest.fixture(scope="module")
def spice_run(tmp_path_factory, wiki_sample, tiny_model_dir):
    params = spice_params(tmp_path_factory.mktemp("spice"), wiki_sample.parent)
    run_spice(params, tiny_model_dir, spice_script(valid_every=3))   # SPICE opens no index
    return params


@pytest.fixture(scope="module")
def ssp_run(tmp_path_factory, wiki_sample, tiny_model_dir, retriever):
    params = ssp_params(tmp_path_factory.mktemp("ssp"), wiki_sample.parent)
    run_ssp(params, tiny_model_dir, retriever)
    return params


@pytest.fixture(scope="module")
def score_notebook(tmp_path_factory, shared_data):
    """Notebook 04 executed by papermill on params/score-smoke.yaml: it trains the run itself (`loop.run`), then
    draws it. Returns (params, executed notebook)."""
    from scope_lib.reports.export import run_notebooks

    runs = tmp_path_factory.mktemp("score-runs")
    overrides = [f"run.runs_dir={runs}"]
    with pytest.MonkeyPatch.context() as m:  # the kernel inherits them
        m.setenv("HF_HUB_OFFLINE", "1")
        m.setenv("TRANSFORMERS_OFFLINE", "1")
        [executed] = run_notebooks(REPO / "params" / "score-smoke.yaml", overrides, notebooks=["04"], html=False,
                                   reports_dir=runs / "reports")
    return load_params(REPO / "params" / "score-smoke.yaml", {"run.runs_dir": str(runs)}), executed


def table(items, index: int = 0):
    """The section's index-th table (a DataFrame among its notes and figures)."""
    return [i for i in items if hasattr(i, "columns")][index]


def titles(items) -> list[str]:
    return [i.layout.title.text for i in items if isinstance(i, BaseFigure)]


def counts(frame) -> dict[str, int]:
    """A reason table (iterations x reasons) summed over the iterations."""
    return {k: int(v) for k, v in frame.sum().items() if v}


def test_every_method_has_a_report_with_a_line_for_each_section_that_does_not_apply():
    assert set(REPORTS) == set(METHODS)
    for name, report in REPORTS.items():
        assert set(report.method.roles) <= set(report.role_names) or name == "scope"
        for section in ("learning_check", "gate_probes", "coevolution", "held_out_matrix", "self_judge",
                        "leave_one_out"):
            note = report.skip(section)
            assert (note is None) == (name == "scope"), (name, section)
            assert note is None or ("\n" not in note and name.upper() in note)


def test_spice_draws_validity_verification_gaussian_rewards_and_gold_answers(spice_run):
    R = report_for(spice_run)
    folder = spice_run.run_dir / "iter_01" / "challenger"
    attempts = read_jsonl(folder / "attempts.jsonl")
    checks = R.task_checks(spice_run)
    # the gates' place: every attempt's validity, as the records say (2 valid, 4 without JSON)
    assert counts(table(checks)) == dict(Counter(a["invalid_reason"] or "valid" for a in attempts)) == {
        "valid": 2, "no_json": 4}
    # the Reasoner's pass rate p = 1/2 on both valid tasks: Var = 1/4, r_C = exp(0) = 1 (eq. 1); p = 0 gives 0.0439
    rates = R.pass_rates(spice_run.run_dir)
    assert list(rates["pass rate p"]) == [0.5, 0.5] and list(rates["reward r_C"]) == pytest.approx([1.0, 1.0])
    [gaussian] = [f for f in checks if isinstance(f, BaseFigure) and "Gaussian reward (eq. 1)" in f.layout.title.text]
    curve = dict(zip(gaussian.data[-1].x, gaussian.data[-1].y, strict=True))  # eq. 1's curve drawn beside the records
    assert [curve[p] for p in (0.5, 0.0, 1.0, 0.25)] == pytest.approx(
        [1.0, math.exp(-3.125), math.exp(-3.125), math.exp(-0.1953125)])
    # training steps of both roles, under the paper's names; SPICE never searches
    M = R.metrics(spice_run.run_dir)
    assert sorted(M["role"].unique()) == ["challenger", "solver"]
    assert titles(R.reward_figures(M)) == ["Challenger: reward components per GRPO step",
                                          "Reasoner: reward components per GRPO step"]
    assert all("never searches" in i for i in R.search_figures(M))
    # gold answers instead of rubrics
    examples = R.examples(spice_run.run_dir)
    assert len(examples) == 2 and all("GOLD ANSWER: 42" in e and "What is six times seven?" in e for e in examples)
    assert all(e.count("-> verified") == 1 and e.count("-> wrong") == 1 for e in examples)  # K = 2 answers, p = 1/2
    # notebook 05 evaluates base and the weights that answer: the Reasoner stage's, the newest to train the policy
    assert [c.name for c in R.checkpoints(spice_run)] == ["base", f"{spice_run.run.name}-01-solver"]


def test_ssp_draws_filter_reasons_rag_verification_one_minus_p_and_the_replay_buffer(ssp_run):
    R = report_for(ssp_run)
    folder = ssp_run.run_dir / "iter_01"
    proposals = read_jsonl(folder / "challenger" / "rollouts.jsonl")
    checks = R.task_checks(ssp_run)
    filters, rag, outcomes, buffer = (table(checks, i) for i in range(4))
    # the rule filters' reasons and each proposal's outcome, as the records say
    assert counts(filters) == dict(Counter(p["filter_reason"] or "passed the filters" for p in proposals))
    assert counts(outcomes) == dict(Counter(p["invalid_reason"] or "valid" for p in proposals))
    assert {"answer_in_question", "rag_rejected", "valid"} <= set(counts(outcomes))
    checked = [p for p in proposals if p["rag_verified"] is not None]
    assert (int(rag["RAG checked"].sum()), int(rag["RAG passed"].sum())) == (
        len(checked), sum(p["rag_verified"] for p in checked))
    # eq. 7: each valid question's reward is 1 - the Solver's success rate (drawn as the records give them)
    [scatter] = [f for f in checks if isinstance(f, BaseFigure) and "1 - p" in f.layout.title.text]
    points = list(zip(scatter.data[0].x, scatter.data[0].y, strict=True))
    assert points and all(y == pytest.approx(1 - x) for x, y in points)
    assert sorted(points) == sorted((p["success_rate"], p["reward"]) for p in proposals if p["valid"])
    # the replay buffer the Solver stage stored
    summary = json.loads((folder / "solver" / "DONE").read_text())["replay"]
    assert buffer.iloc[0]["buffer records"] == len(read_jsonl(folder / "solver" / "replay_buffer.jsonl"))
    assert (buffer.iloc[0]["buffer size"], buffer.iloc[0]["new questions"]) == (summary["buffer"], summary["new"])
    examples = R.examples(ssp_run.run_dir)
    assert examples and all("GROUND TRUTH:" in e and "RAG ANSWER:" in e for e in examples)
    assert "Proposer records" in R.opening(ssp_run, R.metrics(ssp_run.run_dir), 0)


def test_notebook_02_reads_ssps_prompts_and_checks_back_from_the_records(ssp_run, tiny_tokenizer):
    R = report_for(ssp_run)
    components = SimpleNamespace(params=ssp_run, tokenizer=tiny_tokenizer)  # what the sections read of them
    proposer, solver = R.prompt_sections(components)
    assert "the Proposer's prompt" in proposer and "You write search questions backwards" in proposer
    assert "the Solver's prompt" in solver and "Answer the question below" in solver
    batch = R.explore(components, n_documents=8)
    proposals = read_jsonl(ssp_run.run_dir / "iter_01" / "challenger" / "rollouts.jsonl")
    [per_iteration] = R.rollout_sections(batch)
    assert per_iteration.loc[1].to_dict() == {"records": len(proposals), "valid": sum(p["valid"] for p in proposals)}
    [outcomes] = R.format_sections(batch)
    assert counts(outcomes) == dict(Counter(p["invalid_reason"] or "valid" for p in proposals))
    assert R.probe_sections(ssp_run) == [R.skip("gate_probes")]
    summary = R.explore_summary(ssp_run, batch)
    assert summary.result == f"{sum(p['valid'] for p in proposals)} of {len(proposals)} Proposer records valid (SSP)"


def test_notebook_04_runs_on_a_score_run_and_draws_its_evaluator_rubrics_and_harness(score_notebook):
    params, executed = score_notebook
    nb = nbformat.read(str(executed), as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert [o for o in outputs if o.output_type == "error"] == []
    text = json.dumps([o for o in outputs])
    for expected in ("Evaluator: reward components per GRPO step", "Solver: reward components per GRPO step",
                     "SCORE: why each rubric was valid or not", "The meta-harness", R_CHECK_LINE):
        assert expected in text, expected
    # the Evaluator trains in its own stage folder (iter_NN/evaluator): SCOPE's reader would miss its steps
    R = report_for(params)
    M = R.metrics(params.run_dir)
    assert len(M) == 2 and len(training_metrics(params.run_dir)) == 1
    assert sorted(M["role"]) == ["challenger", "solver"]
    checks = R.task_checks(params)
    rubrics = read_jsonl(params.run_dir / "iter_01" / "rubric" / "rollouts.jsonl")
    evaluations = read_jsonl(params.run_dir / "iter_01" / "solver" / "evaluations.jsonl")
    assert counts(table(checks)) == dict(Counter(r["invalid_reason"] or "valid" for r in rubrics))
    assert counts(table(checks, 1)) == dict(Counter(e["zero_reason"] or "not zeroed" for e in evaluations))
    assert list(table(checks, 2)["consistency C_q"]) == [e["consistency"] for e in evaluations]
    harness = table(checks, -1)
    assert list(harness["refreshed"]) == [False] and list(harness["k"]) == [4]
    # the shared actor's newest weights are the Evaluator stage's (it trains after the Solver in each step)
    assert [c.name for c in R.checkpoints(params)] == ["base", "score-smoke-01-evaluator"]


#: The line notebook 04 prints for SCORE instead of SCOPE's learning check.
R_CHECK_LINE = "SCORE: the learning check here is SCOPE's"
