"""Rubric specificity (Table 10, quantified) and judge agreement."""

from __future__ import annotations

import math

import pytest

from scope_lib.protocol.parsing import Rubric
from scope_lib.reports.analysis import (
    grader_agreement,
    rubric_overlap,
    rubric_specificity,
    starts_with_command_verb,
)

SOURCE = ("David Tuckman proposed a $150 million arena in Bellevue, Washington in 2001 and bought a CBA "
          "franchise for $125,000 in 2003, making the team the anchor tenant.")


@pytest.mark.parametrize("rubric, entity, number, date", [
    # Table 10: the Qwen3-4B rubrics restate the prompt, the 8B and 32B rubrics name source facts
    ("Identifies key events and motivations of Tuckman's initiative.", True, False, False),
    ("Accurately summarises financial details and project goals.", False, False, False),
    ("Synthesises essential information without omitting the $150 million project and 2001 proposal.",
     False, True, True),
    ("Correctly attributes the $125,000 franchise purchase to Tuckman in 2003.", True, True, True),
    ("Identifies the 1997 merger with Roche.", False, False, False),   # Roche, 1997 are not in the source
])
def test_rubric_specificity_against_the_source(rubric, entity, number, date):
    s = rubric_specificity(rubric, SOURCE)
    assert (s.entity, s.number, s.date) == (entity, number, date)
    assert s.specific == (entity or number or date)


def test_command_verbs():
    assert starts_with_command_verb("Identifies the arena cost.")
    assert not starts_with_command_verb("The response identifies the arena cost.")


def test_grader_agreement_and_kappa():
    assert grader_agreement([1, 0, 1, 1], [1, 0, 1, 1]) == {"pairs": 4, "agreement": 1.0, "kappa": 1.0}
    result = grader_agreement([1, 1, 0, 0], [1, 0, 1, 0])
    assert result["agreement"] == 0.5 and result["kappa"] == pytest.approx(0.0)
    assert grader_agreement([1, None], [1, 0])["agreement"] == 1.0      # None counts as 0
    assert math.isnan(grader_agreement([], [])["kappa"])
    with pytest.raises(ValueError, match="different numbers"):
        grader_agreement([1], [1, 0])


def test_rubric_overlap():
    a = [Rubric("Incorporates the $150 million arena cost.", "critical")]
    b = [Rubric("Provides the arena cost and its opening year.", "important")]
    c = [Rubric("Explains the poem's metre.", "bonus")]
    assert rubric_overlap(a, a) == 1.0
    assert 0 < rubric_overlap(a, b) < 1
    assert rubric_overlap(a, c) == 0.0


def test_thinking_stops_per_step_for_the_health_panel():
    import pandas as pd

    from scope_lib.reports.analysis import thinking_stops_per_step

    metrics = pd.DataFrame([
        {"role": "challenger", "iteration": 1, "step": 1, "stops_in_thinking": 3, "solver_stops_in_thinking": 1},
        {"role": "challenger", "iteration": 1, "step": 2, "stops_in_thinking": 0, "solver_stops_in_thinking": 4},
        {"role": "solver", "iteration": 1, "step": 1, "stops_in_thinking": 2}])
    table = thinking_stops_per_step(metrics)
    assert table.loc[("challenger", 1, 2)].tolist() == [0, 4] and table.loc[("solver", 1, 1)].tolist() == [2, 0]
    assert table.columns[0] == "stops inside thinking (the role's rollouts)"
    assert thinking_stops_per_step(metrics.drop(columns=["stops_in_thinking", "solver_stops_in_thinking"])) is None
    assert thinking_stops_per_step(pd.DataFrame()) is None


def test_learning_signals_figure_per_step_and_role():
    import pandas as pd

    from scope_lib.reports.analysis import learning_signals_figure

    metrics = pd.DataFrame([{"role": role, "global_step": k, "zero_spread_share": share, "entropy": 1.5 - k / 10,
                             "reward": 0.4 + k / 20}
                            for role in ("challenger", "solver") for k, share in enumerate([1.0, 0.75, 0.5], 1)])
    fig = learning_signals_figure(metrics)
    assert fig.layout.title.text == "Learning signals per GRPO step"
    assert [a.text for a in fig.layout.annotations][:3] == ["share of zero-spread groups",
                                                           "sampling entropy (nats/token)", "mean reward"]
    assert len(fig.data) == 6 and {t.name for t in fig.data} == {"challenger", "solver"}
    assert list(fig.data[1].y) == [1.0, 0.75, 0.5] and fig.layout.xaxis3.dtick == 1       # integer step axis
    assert fig.layout.xaxis3.title.text == "step (all iterations)"
    assert learning_signals_figure(metrics.drop(columns=["entropy"])).layout.annotations[1].text == "mean reward"
    assert learning_signals_figure(pd.DataFrame()) is None


def _steps(n: int = 3):
    """Training metrics of one iteration, n steps per role, as `training_metrics` returns them."""
    import pandas as pd

    return pd.DataFrame([{"role": role, "iteration": 1, "step": k, "global_step": k, "reward": 0.5 + k / 100,
                          "format": 0.9, "rubric_score": 0.4, "searches_per_rollout": 1.0 + k / 3,
                          "answer_tokens": 40 + k, "zero_spread_share": 0.5, "entropy": 1.0}
                         for role in ("challenger", "solver") for k in range(1, n + 1)])


def _drawn_ticks(axis, low: float, high: float) -> list[float]:
    """The tick values plotly draws on a linear axis from its tick0 and dtick."""
    ticks, value = [], float(axis.tick0)
    while value <= high:
        if value >= low:
            ticks.append(value)
        value += float(axis.dtick)
    return ticks


@pytest.mark.parametrize("span, step", [(0, 1), (2, 1), (10, 1), (11, 2), (24, 5), (99, 10), (400, 50)])
def test_whole_number_tick_steps(span, step):
    from scope_lib.reports.analysis import whole_number_step

    assert whole_number_step(span) == step


@pytest.mark.parametrize("n_steps", [2, 3, 24])
def test_step_and_iteration_axes_tick_at_whole_numbers(n_steps):
    """Every figure whose x axis counts steps or iterations ticks at whole numbers (plotly's own ticks put 1.2,
    1.4, … between two steps) and prints them without decimals."""
    import pandas as pd

    from scope_lib.reports.analysis import (
        iteration_figure,
        learning_signals_figure,
        reward_components_figure,
        step_figure,
    )

    metrics = _steps(n_steps)
    summary = pd.DataFrame([{"iteration": 1, "solver rubric score": 0.5}])
    figures = {"reward components": reward_components_figure(metrics, "solver"),
               "searches per step": step_figure(metrics, "solver", "searches_per_rollout", "t", "searches"),
               "rubric score per iteration": iteration_figure(summary, "solver rubric score", "t", "g"),
               "learning signals": learning_signals_figure(metrics)}
    for name, fig in figures.items():
        axes = [fig.layout[key] for key in fig.layout if key.startswith("xaxis")]
        assert axes, name
        for axis in axes:
            assert axis.tickformat == "d" and axis.dtick is not None and float(axis.dtick).is_integer(), (name, axis)
            low, high = (1, 1) if "iteration" in name else (1, n_steps)
            ticks = _drawn_ticks(axis, low, high)
            assert ticks and all(t.is_integer() for t in ticks) and len(ticks) <= 10, (name, ticks)
            assert ticks[0] == low, (name, ticks)
    assert step_figure(metrics[metrics["role"] == "challenger"], "solver", "answer_tokens", "t", "a") is None
    assert iteration_figure(summary.assign(**{"solver rubric score": None}), "solver rubric score", "t", "g") is None


def test_training_result_line():
    import pandas as pd

    from scope_lib.reports.analysis import training_result

    metrics = _steps(3)
    candidates = pd.DataFrame({"kept": [True, False, True, False, False]})
    assert training_result(metrics, candidates, 0) == "pool 2 of 5 candidates, R_S 0.51 → 0.53 over 3 Solver steps, 0 alarms"
    assert training_result(pd.DataFrame(), pd.DataFrame(), 1) == "no candidate tasks, no Solver step, 1 alarm"


def test_evaluation_result_line():
    """Notebook 05's line: the last checkpoint's scores per benchmark, EM beside the judged score, an untrusted
    judge said so."""
    from scope_lib.evaluation.benchmarks import BENCHMARKS
    from scope_lib.reports.analysis import evaluation_result

    def summary(checkpoint, benchmark, value, trusted, em=None):
        scorers = {"scope_paper": {"value": value, "trusted": trusted}}
        if em is not None:
            scorers["official"] = {"metrics": {"em": em, "f1": em}}
        return {"checkpoint": checkpoint, "benchmark": benchmark, "scorers": scorers}

    short, open_ended = "nq", next(n for n, b in BENCHMARKS.items() if b.kind != "short_form")
    summaries = [summary("base", short, 0.5, True, 0.0), summary("iter_01", short, 1.0, False, 0.0),
                 summary("iter_01", open_ended, None, None)]
    line = evaluation_result(summaries)
    assert line == (f"iter_01: {BENCHMARKS['nq'].column} EM 0.00, judged 1.00 (judge untrusted); "
                    f"{BENCHMARKS[open_ended].column} not scored")
    assert evaluation_result(summaries, "base") == f"base: {BENCHMARKS['nq'].column} EM 0.00, judged 0.50"
    assert evaluation_result([]) == "nothing evaluated"


def test_replay_result_line():
    import pandas as pd

    from scope_lib.reports.analysis import replay_result

    index = pd.MultiIndex.from_tuples([("base", "base"), ("base", "iter_01"), ("iter_01", "base")],
                                      names=["search", "answer"])
    scores = pd.DataFrame({"NQ": [10.0, 13.0, 9.0], "HotpotQA": [20.0, 19.0, float("nan")]}, index=index)
    assert replay_result(scores) == ("2 replay pair(s) on 2 benchmark(s); largest change +3.0 points against "
                                     "base → base: search base → answer iter_01 on NQ")
    assert replay_result(scores.iloc[:1]) == "only base's own evaluation: no second checkpoint to swap in"
