"""Rewards against hand-computed values of the paper's equations 1, 2, 4, 5, 6, 7 and Appendix F."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scope_lib.protocol.rewards import (
    FormatScore,
    LengthPenalty,
    challenger_format,
    challenger_reward,
    difficulty_reward,
    group_advantages,
    length_penalty,
    rubric_score,
    search_reward,
    solver_format,
    solver_reward,
)

approx = pytest.approx

# cos(pi/1024) = 1 - 4.70673e-6 (Taylor: (pi/1024)^2 / 2 = 4.706722e-6, next term ~ 3.7e-12)
ONE_STEP = 0.475 * 4.706722e-6  # 0.475 * (1 - cos(pi / 1024)) = 2.2357e-6


# -- eq. 1 ---------------------------------------------------------------------------------------------


def test_rubric_score_uniform_weights():
    assert rubric_score([1, 0, 1, 1]) == approx(0.75)
    assert rubric_score([1, 1, 1]) == 1.0
    assert rubric_score([0, 0]) == 0.0


def test_rubric_score_none_verdict_counts_zero():
    assert rubric_score([1, None, 1, None]) == approx(0.5)
    assert rubric_score([None]) == 0.0


def test_rubric_score_empty_is_zero():
    assert rubric_score([]) == 0.0
    assert rubric_score([], []) == 0.0


def test_rubric_score_weighted():
    # (1*1 + 0.3*1) / (1 + 0.7 + 0.3 + 1) = 1.3 / 3.0
    assert rubric_score([1, 0, 1, None], [1.0, 0.7, 0.3, 1.0]) == approx(1.3 / 3.0)
    # weight 0 drops a criterion
    assert rubric_score([0, 1], [0.0, 2.0]) == 1.0
    assert rubric_score([1, 1], [0.0, 0.0]) == 0.0


@pytest.mark.parametrize("weights", [[1.0, -0.5], [-1.0, 2.0]])
def test_rubric_score_negative_weight_raises(weights):
    with pytest.raises(ValueError, match=">= 0"):
        rubric_score([1, 0], weights)


def test_rubric_score_rejects_bad_input():
    with pytest.raises(ValueError):
        rubric_score([1, 0], [1.0])
    with pytest.raises(ValueError):
        rubric_score([2, 0])


@given(st.lists(st.sampled_from([0, 1, None]), min_size=1, max_size=12),
       st.lists(st.floats(0, 10), min_size=12, max_size=12))
def test_rubric_score_in_unit_interval(verdicts, weights):
    assert 0.0 <= rubric_score(verdicts, weights[: len(verdicts)]) <= 1.0


# -- eq. 2 ---------------------------------------------------------------------------------------------


def test_group_advantages_population_std():
    # mean 0.5, population std 0.5 -> (+-0.5) / 0.5
    adv = group_advantages([1.0, 0.0, 1.0, 0.0], eps=0.0)
    assert adv == approx([1.0, -1.0, 1.0, -1.0])
    # [0, 1, 2]: mean 1, pop std sqrt(2/3)
    assert group_advantages([0.0, 1.0, 2.0], eps=0.0) == approx([-1.2247449, 0.0, 1.2247449])


def test_group_advantages_degenerate_groups():
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_advantages([]) == []


# -- eq. 5 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g, expected", [(0.0, 0.0), (0.5, 1.0), (1.0, 0.0), (0.25, 0.5), (0.75, 0.5),
                                         (0.1, 0.2), (0.9, 0.2)])
def test_difficulty_reward_paper_target(g, expected):
    assert difficulty_reward(g) == approx(expected)


@pytest.mark.parametrize("g, expected", [
    (0.0, 0.0),          # 1 - 0.3/0.3
    (0.3, 1.0),
    (1.0, 0.0),          # 1 - 0.7/0.3 < 0
    (0.25, 1 - 0.05 / 0.3),  # 0.8333
    (0.75, 0.0),         # 1 - 0.45/0.3 < 0
    (0.45, 0.5),         # 1 - 0.15/0.3
    (0.6, 0.0),          # exactly 1 - 0.3/0.3
])
def test_difficulty_reward_asymmetric_target(g, expected):
    assert difficulty_reward(g, target=0.3) == approx(expected, abs=1e-12)


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1, 1.5])
def test_difficulty_reward_rejects_bad_target(target):
    with pytest.raises(ValueError, match="target"):
        difficulty_reward(0.5, target)


# -- eq. 7 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, expected", [
    (0, 1.0),
    (1024, 1.0),                      # |a| <= soft: no penalty
    (1025, 1.0 - ONE_STEP),           # 0.05 + 0.475 (1 + cos(pi/1024))
    (1536, 0.525),                    # midpoint: floor + (1 - floor)/2
    (2047, 0.05 + ONE_STEP),          # 0.05 + 0.475 (1 + cos(1023 pi/1024))
    (2048, 0.05),                     # |a| >= hard: floor
    (20480, 0.05),                    # 10 x hard
])
def test_length_penalty_edges(n, expected):
    assert length_penalty(n) == approx(expected, abs=1e-9)
    assert LengthPenalty()(n) == approx(expected, abs=1e-9)


def test_length_penalty_custom_limits():
    # soft 100, hard 300, floor 0.2: at 200 (midpoint) = 0.2 + 0.4 = 0.6; at 150: 0.2 + 0.4 (1 + cos(pi/4))
    assert length_penalty(200, 100, 300, 0.2) == approx(0.6)
    assert LengthPenalty(100, 300, 0.2)(150) == approx(0.2 + 0.4 * (1 + math.sqrt(0.5)))
    assert length_penalty(10_000, 100, 300, 0.0) == 0.0


def test_length_penalty_is_monotone_and_continuous():
    values = [length_penalty(n) for n in range(1000, 2100)]
    steps = [a - b for a, b in itertools.pairwise(values)]
    assert min(steps) >= 0.0
    assert max(steps) < 1.5e-3  # no sharp step: the steepest is 0.95 * (pi / 2) / 1024 = 1.46e-3


@pytest.mark.parametrize("args", [(-1,), (10, 100, 100), (10, 200, 100), (10, 100, 200, 1.5)])
def test_length_penalty_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        length_penalty(*args)


def test_length_penalty_dataclass_validates():
    with pytest.raises(ValueError):
        LengthPenalty(soft=2048, hard=1024)


# -- F.2 search reward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n, expected", [(0, 0.0), (1, 1 / 3), (2, 2 / 3), (3, 1.0), (7, 1.0)])
def test_search_reward(n, expected):
    assert search_reward(n) == approx(expected)


def test_search_reward_saturation():
    assert search_reward(1, saturation=2) == 0.5
    with pytest.raises(ValueError):
        search_reward(1, saturation=0)


# -- eq. 4 ---------------------------------------------------------------------------------------------


def test_challenger_reward_gate_pass():
    # 0.5 * 0.8 + 1.0 * f_diff(0.25) = 0.4 + 0.5
    assert challenger_reward(0.8, True, 0.25) == approx(0.9)
    assert challenger_reward(1.0, True, 0.5) == approx(1.5)  # the maximum


def test_challenger_reward_gate_fail_keeps_format_term_only():
    assert challenger_reward(0.8, False, 0.5) == approx(0.4)


def test_challenger_reward_format_zero_is_zero():
    assert challenger_reward(0.0, True, 0.5) == 0.0
    assert challenger_reward(FormatScore(0.0, 0.0, 0.0), True, 0.5) == 0.0


def test_challenger_reward_no_valid_solver_rollouts():
    assert challenger_reward(0.6, True, None) == approx(0.3)


def test_challenger_reward_when_the_rubrics_never_parsed():
    """Gates passed, rubric reply unparseable after the retry, so no ḡ: eq. 4 as written keeps the format term
    (the default); the authors' code gives 0 (`no_rubrics_reward="zero"`). Other outcomes do not change."""
    assert challenger_reward(0.6, True, None, rubrics_parsed=False) == approx(0.3)
    assert challenger_reward(0.6, True, None, rubrics_parsed=False, no_rubrics_reward="zero") == 0.0
    assert challenger_reward(0.6, False, None, rubrics_parsed=False, no_rubrics_reward="zero") == approx(0.3)
    assert challenger_reward(0.6, True, 0.5, no_rubrics_reward="zero") == approx(1.3)
    with pytest.raises(ValueError, match="no_rubrics_reward 'half'; choose one of format, zero"):
        challenger_reward(0.6, True, None, rubrics_parsed=False, no_rubrics_reward="half")


def test_challenger_reward_weights_and_target():
    # 0.2 * 0.5 + 2.0 * f_diff(0.45; 0.3) = 0.1 + 2 * 0.5
    assert challenger_reward(0.5, True, 0.45, format_weight=0.2, difficulty_weight=2.0,
                             target=0.3) == approx(1.1)


def test_challenger_reward_accepts_format_score_object():
    fmt = FormatScore(1.0, 0.5, 1.0)  # total 2.5/3
    assert challenger_reward(fmt, True, 0.0) == approx(0.5 * 2.5 / 3)


# -- eq. 6 ---------------------------------------------------------------------------------------------


def test_solver_reward_worked_example():
    # A Solver rollout with 3 turns: <think> in all 3, a valid search in both non-final turns, an answer of
    # 1536 tokens that meets 3 of its 4 rubrics.
    #   g        = 3/4                                  = 0.75
    #   L(1536)  = 0.05 + 0.95/2 (1 + cos(pi/2))        = 0.525
    #   r_fmt    = (3/3 + 2/2 + 1) / 3                  = 1.0
    #   r_search = min(2/3, 1)                          = 0.6667
    #   R_S      = 1.0*0.525*0.75 + 0.5*1.0 + 0.1*2/3   = 0.39375 + 0.5 + 0.066667 = 0.960417
    turns = ["<think>plan</think><search>a</search>", "<think>more</think><search>b</search>",
             "<think>done</think><answer>text</answer>"]
    fmt = solver_format(turns, 2, "text")
    assert fmt.total == 1.0
    g = rubric_score([1, 1, 0, 1])
    assert solver_reward(g, 1536, fmt.total, 2) == approx(0.9604167, abs=1e-6)
    # No-LP ablation: L = 1 -> 0.75 + 0.5 + 0.066667
    assert solver_reward(g, 1536, fmt.total, 2, length=None) == approx(1.3166667, abs=1e-6)


def test_solver_reward_length_floor_and_weights():
    # 1.0 * 0.05 * 1.0 + 0.5 * (2/3) + 0.1 * 1 = 0.05 + 0.33333 + 0.1
    assert solver_reward(1.0, 4096, 2 / 3, 5) == approx(0.4833333, abs=1e-6)
    # custom limits and weights: 2.0 * L(150; 100, 200, 0.0) * 0.5 + 0 + 0.5 * min(1/2, 1)
    # L(150) = 0.5 (1 + cos(pi/2)) = 0.5 -> 0.5 + 0.25
    assert solver_reward(0.5, 150, 0.0, 1, accuracy_weight=2.0, search_weight=0.5,
                         length=LengthPenalty(100, 200, 0.0), search_saturation=2) == approx(0.75)


def test_solver_reward_rejects_out_of_range_rubric():
    with pytest.raises(ValueError):
        solver_reward(1.5, 10, 1.0, 0)


# -- format scores (F.1, F.2) -----------------------------------------------------------------------------


def test_challenger_format_components():
    turns = ["<think>a</think>\n<search>first</search>", "<search>second</search>",
             "<think>check</think>\n<task>Compare X and Y.</task>"]
    fmt = challenger_format(turns, 3, 2, 0, "Compare X and Y.")
    assert (fmt.think, fmt.tool, fmt.structure) == (approx(2 / 3), approx(2 / 3), 1.0)
    assert fmt.total == approx((2 / 3 + 2 / 3 + 1) / 3)


def test_challenger_format_malformed_searches():
    turns = ["<think>a</think><search>x</search>", "<think>b</think><search></search>",
             "<think>c</think><search>y</search>", "<think>d</think><task>T</task>"]
    # paper (default): malformed ones are neither counted nor subtracted -> 2/2
    assert challenger_format(turns, 2, 2, 1, "T").tool == 1.0
    # the authors' code: (2 - 1) / 2
    assert challenger_format(turns, 2, 2, 1, "T", subtract_malformed=True).tool == 0.5
    assert challenger_format(turns, 2, 0, 3, "T", subtract_malformed=True).tool == 0.0


def test_challenger_format_clamps_and_edges():
    assert challenger_format(["<task>t</task>"], 1, 4, 0, "t").tool == 1.0
    assert challenger_format(["<task>t</task>"], 0, 0, 0, "t").tool == 1.0  # nothing expected
    no_task = challenger_format(["<think>x</think>no task"], 1, 0, 0, None)
    assert (no_task.think, no_task.tool, no_task.structure) == (1.0, 0.0, 0.0)
    assert challenger_format(["x"], 1, 0, 0, "   ").structure == 0.0
    assert challenger_format([], 2, 0, 0, None).total == 0.0


def test_solver_format_components():
    turns = ["<think>a</think><search>x</search>", "no think <search>y</search>", "<think>z</think>plain"]
    fmt = solver_format(turns, 1, None)
    assert (fmt.think, fmt.tool, fmt.answer) == (approx(2 / 3), 0.5, 0.0)


def test_solver_format_single_turn_tool_is_zero():
    fmt = solver_format(["<think>easy</think><answer>Paris</answer>"], 0, "Paris")
    assert (fmt.think, fmt.tool, fmt.answer) == (1.0, 0.0, 1.0)
    assert fmt.total == approx(2 / 3)


def test_a_lone_closer_earns_think_credit_only_when_the_template_opened_thinking():
    turns = ["reasoning...</think>\n<answer>x</answer>"]
    assert solver_format(turns, 0, "x").think == 0.0          # the model never wrote <think>
    assert challenger_format(["</think><task>T</task>"], 0, 0, 0, "T").think == 0.0
    # the chat template opened <think> in the prompt; the completion holds only the closer
    assert solver_format(turns, 0, "x", starts_in_think=True).think == 1.0
    assert challenger_format(["</think><task>T</task>"], 0, 0, 0, "T", starts_in_think=True).think == 1.0


@pytest.mark.parametrize(("g", "tent", "spice", "ssp"), [
    (0.5, 1.0, 1.0, 0.5), (0.0, 0.0, math.exp(-0.0625 / 0.02), 1.0), (1.0, 0.0, math.exp(-0.0625 / 0.02), 0.0),
    (0.25, 0.5, math.exp(-((0.1875 - 0.25) ** 2) / 0.02), 0.75)])
def test_challenger_reward_shapes(g, tent, spice, ssp):
    """Hand-computed f_diff for the paper's tent and the related methods' shapes (related-methods.md)."""
    assert difficulty_reward(g) == approx(tent)
    assert difficulty_reward(g, shape="rzero") == approx(tent)          # the tent at tau = 1/2
    assert difficulty_reward(g, shape="spice") == approx(spice)
    assert difficulty_reward(g, shape="ssp") == approx(ssp)
    assert challenger_reward(1.0, True, g, shape="ssp") == approx(0.5 + ssp)


def test_rzero_differs_from_the_tent_off_centre():
    assert difficulty_reward(0.3, target=0.3) == 1.0
    assert difficulty_reward(0.3, target=0.3, shape="rzero") == approx(0.6)
    with pytest.raises(ValueError, match="tent, rzero, spice, ssp"):
        difficulty_reward(0.5, shape="gaussian")
