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
