"""scope_lib.protocol.score: SCORE's Evaluator format (each invalid rubric reason and score problem, garbage never
crashes), the Solver's reward a(r)·(1 + Σ w_j s_j) and the search-count verifier against hand-computed values, the
conclusions and their TF-IDF consistency (exact cases: identical, disjoint, one shared word), REINFORCE's EMA
baseline, the meta-harness's schedule and parser, and the prompts."""

from __future__ import annotations

import math

import pytest

from scope_lib.protocol import prompts
from scope_lib.protocol import score as S
from scope_lib.protocol.dialects import DIALECTS

approx = pytest.approx
H = S.DEFAULT_HARNESS


def _reply(dims: str, reports: str = "") -> str:
    return f"<dimensions>{dims}</dimensions><report_evaluations>{reports}</report_evaluations>"


def _report(k, **scores) -> str:
    body = "".join(f'<score dim="{d}" value="{v}" reason="r"/>' for d, v in scores.items())
    return f'<report id="{k}"><verification>v</verification><scores>{body}</scores></report>'


# Figure 6, query 1's adaptive rubric, with weights within the default [0.1, 0.25]
DIMS = ('<dim name="factuality"/><dim name="citation_effectiveness" weight="0.2"/>'
        '<dim name="coherence" weight="0.15"/><dim name="completeness" weight="0.25"/>')


# -- the rubric -------------------------------------------------------------------------------------------------


def test_the_required_dimension_takes_the_weight_left():
    parsed = S.parse_rubric(_reply(DIMS))
    assert parsed.valid and parsed.reason is None
    assert parsed.rubric.dimensions == ("factuality", "citation_effectiveness", "coherence", "completeness")
    assert parsed.rubric.weights == approx((0.4, 0.2, 0.15, 0.25))          # 1 − (0.2 + 0.15 + 0.25) = 0.4
    assert sum(parsed.rubric.weights) == approx(1.0)


def test_names_are_read_in_the_pools_spelling_and_the_last_block_decides():
    reply = ("<dimensions><dim name='x'/></dimensions> revised: " + _reply(
        '<dim name="Factuality"/><dim name="Citation Effectiveness" weight=".2"/>'
        "<dim name='coherence' weight='0.15'/><dim name=\"instruction-following\" weight=\"0.25\"/>"))
    parsed = S.parse_rubric(reply)
    assert parsed.rubric.dimensions == ("factuality", "citation_effectiveness", "coherence", "instruction_following")


def test_several_required_dimensions_share_the_rest_equally():
    harness = S.Harness(k=4, must_include=("factuality", "coherence"), weight_min=0.1, weight_max=0.3)
    parsed = S.parse_rubric(_reply('<dim name="factuality"/><dim name="coherence"/>'
                                   '<dim name="insight" weight="0.3"/><dim name="diversity" weight="0.1"/>'), harness)
    assert parsed.rubric.weights == approx((0.3, 0.3, 0.3, 0.1))           # (1 − 0.4) / 2 each


INVALID_RUBRICS = [
    ("no_dimensions", "no xml at all"),
    ("no_dimensions", "<dimensions></dimensions>"),
    ("no_dimensions", "<think><dimensions><dim name='factuality'/></dimensions></think>"),
    ("unknown_dimension", _reply(DIMS.replace("coherence", "elegance"))),
    ("duplicate_dimension", _reply(DIMS.replace('"completeness"', '"coherence"'))),
    ("missing_required_dimension", _reply(DIMS.replace('"factuality"/', '"insight" weight="0.2"/'))),
    ("wrong_dimension_count", _reply(DIMS + '<dim name="insight" weight="0.1"/>')),
    ("missing_weight", _reply(DIMS.replace(' weight="0.15"', ""))),
    ("weight_not_a_number", _reply(DIMS.replace('"0.15"', '"high"'))),
    ("weight_out_of_range", _reply(DIMS.replace('"0.15"', '"0.5"'))),
]


@pytest.mark.parametrize("reason, reply", INVALID_RUBRICS)
def test_each_invalid_rubric_names_its_reason(reason, reply):
    parsed = S.parse_rubric(reply)
    assert not parsed.valid and parsed.reason == reason


def test_no_weight_left_for_the_required_dimension():
    harness = S.Harness(k=4, must_include=("factuality",), weight_min=0.1, weight_max=0.5)
    parsed = S.parse_rubric(_reply(DIMS.replace('"0.15"', '"0.5"').replace('"0.25"', '"0.3"')), harness)
    assert parsed.reason == "no_weight_left"                                 # 0.2 + 0.5 + 0.3 = 1


def test_every_rubric_reason_has_a_case():
    assert {r for r, _ in INVALID_RUBRICS} | {"no_weight_left"} == set(S.RUBRIC_INVALID_REASONS)


# -- the K reports' scores ----------------------------------------------------------------------------------------


def test_all_reports_are_scored_from_one_reply():
    reply = _reply(DIMS, _report(1, factuality=3, citation_effectiveness=2, coherence=8, completeness=3)
                   + _report("report_2", factuality=7, citation_effectiveness=6, coherence=9, completeness="5/10"))
    parsed = S.parse_evaluation(reply, H, 2)
    assert parsed.valid
    assert [r.scores for r in parsed.reports] == [(3, 2, 8, 3), (7, 6, 9, 5)]
    assert parsed.problem_counts() == {}


def test_score_problems_score_zero_and_are_counted():
    reply = _reply(DIMS, _report(1, factuality="high", citation_effectiveness=11, coherence=8)
                   + _report(3, factuality=9, citation_effectiveness=9, coherence=9, completeness=9))
    parsed = S.parse_evaluation(reply, H, 3)
    assert parsed.reports[0].scores == (0, 0, 8, 0)
    assert parsed.reports[0].problems == ("score_not_a_number", "score_out_of_range", "score_missing")
    assert parsed.reports[1].scores == (0, 0, 0, 0) and parsed.reports[1].problems == ("report_missing",)
    assert parsed.reports[2].scores == (9, 9, 9, 9)
    assert parsed.problem_counts() == {"score_not_a_number": 1, "score_out_of_range": 1, "score_missing": 1,
                                       "report_missing": 1}


def test_an_invalid_rubric_zeroes_every_report():
    parsed = S.parse_evaluation(_reply("", _report(1, factuality=9)), H, 2)
    assert not parsed.valid
    assert [r.problems for r in parsed.reports] == [("rubric_invalid",), ("rubric_invalid",)]
    assert parsed.problem_counts() == {"no_dimensions": 1, "rubric_invalid": 2}


def test_every_score_problem_has_a_case():
    problems = _reply(DIMS, _report(1, factuality="high", citation_effectiveness=11, coherence=8))
    seen = set(S.parse_evaluation(problems, H, 2).problem_counts()) | set(S.parse_evaluation("", H, 1).problem_counts())
    assert seen - set(S.RUBRIC_INVALID_REASONS) == set(S.SCORE_PROBLEMS)


def test_a_harness_without_a_required_dimension_normalises_the_weights():
    harness = S.Harness(k=2, must_include=(), weight_min=0.0, weight_max=1.0)
    parsed = S.parse_rubric(_reply('<dim name="insight" weight="0.3"/><dim name="diversity" weight="0.1"/>'), harness)
    assert parsed.rubric.weights == approx((0.75, 0.25))
    assert "Select exactly 2 dimension(s)" in S.rubric_prompt("Q?", harness)


def test_a_rubric_chosen_before_the_reports_is_used_as_given():
    rubric = S.Rubric(("factuality", "insight"), (0.75, 0.25))
    parsed = S.parse_evaluation(_report(1, factuality=6, insight=2), H, 1, rubric=rubric)
    assert parsed.valid and parsed.reports[0].scores == (6, 2)


@pytest.mark.parametrize("garbage", [
    None, 42, b"<dimensions>", "", "<" * 5000, "<dimensions><dim name=", "<report id=1><score dim=x value=",
    "<dimensions><dim></dimensions><report_evaluations><report><scores><score/></scores></report>",
    "\x00\ud800 <dimensions><dim name='factuality'/></dimensions>",
    _reply(DIMS, '<report id="1"><score dim="factuality" value="nan"/><score dim="coherence" value="1e999"/>'
                 '</report>'),
])
def test_garbage_never_crashes_and_scores_zero(garbage):
    parsed = S.parse_evaluation(garbage, H, 2)
    assert len(parsed.reports) == 2
    assert all(s == 0 for r in parsed.reports for s in r.scores)
    assert parsed.problem_counts()


# -- the Solver's reward and the verifier (§3.5, Algorithm 1 line 23) --------------------------------------------


def test_solver_reward_by_hand():
    weights = (0.4, 0.2, 0.15, 0.25)
    # 1 + (0.4·3 + 0.2·2 + 0.15·8 + 0.25·3) / 10 = 1 + 3.55 / 10
    assert S.solver_reward(True, (3, 2, 8, 3), weights) == approx(1.355)
    assert S.solver_reward(True, (7, 6, 9, 5), weights) == approx(1.66)   # 1 + (2.8 + 1.2 + 1.35 + 1.25) / 10
    assert S.solver_reward(True, (10, 10, 10, 10), weights) == approx(2.0)
    assert S.solver_reward(True, (0, 0, 0, 0), weights) == 1.0
    assert S.solver_reward(False, (10, 10, 10, 10), weights) == 0.0       # a(r) = 0
    with pytest.raises(ValueError, match="2 scores for 4 weights"):
        S.solver_reward(True, (1, 2), weights)


def test_report_validity_is_a_complete_answer():
    assert S.report_valid("<think>plan</think><answer>The report.</answer>")
    assert not S.report_valid("<answer>unfinished")
    assert not S.report_valid("<answer> </answer>")
    assert not S.report_valid(None)


def test_the_verifier_zeroes_a_query_when_the_evaluator_searched_too_little():
    reply = _reply(DIMS, _report(1, factuality=3, citation_effectiveness=2, coherence=8, completeness=3)
                   + _report(2, factuality=7, citation_effectiveness=6, coherence=9, completeness=5))
    parsed = S.parse_evaluation(reply, H, 2)
    assert S.solver_rewards(parsed, [True, True], n_searches=2, required=2) == approx([1.355, 1.66])
    assert S.solver_rewards(parsed, [True, False], n_searches=3, required=2) == approx([1.355, 0.0])
    assert S.solver_rewards(parsed, [True, True], n_searches=1, required=2) == [0.0, 0.0]
    invalid = S.parse_evaluation("no rubric", H, 2)
    assert S.solver_rewards(invalid, [True, True], n_searches=5, required=1) == [0.0, 0.0]


def test_required_searches_and_the_check():
    assert S.required_searches(H) == 1
    assert S.required_searches(H, floor=3) == 3
    assert S.required_searches(S.Harness(4, ("factuality",), 0.1, 0.25, min_number_of_tool_call=4), 2) == 4
    assert S.search_verified(1, 1) and not S.search_verified(0, 1) and S.search_verified(0, 0)
    with pytest.raises(ValueError, match="whole number"):
        S.search_verified(-1, 0)


# -- conclusions and consistency (§3.5, App. E Algorithm 2, App. F.1) ------------------------------------------


@pytest.mark.parametrize("reply, conclusion", [
    ("<answer>## Background\nOld facts [1].\n\n## Conclusion\nDeadly force is allowed [2, 3] only at night."
     "\n\n## Sources\n[1] Penal Code</answer>", "Deadly force is allowed only at night."),
    ("<answer>Intro.\n\n**Summary**\nAI reshapes work.\n\n**Details**\nMore.</answer>", "AI reshapes work."),
    ("<answer>Intro.\n\nBottom line:\nIt depends.</answer>", "It depends."),
    ("<answer>First paragraph.\n\nLast paragraph, the\nconclusion.\n\nSources:\n- a web page</answer>",
     "Last paragraph, the conclusion."),
    ("<answer>Only one paragraph.</answer>", "Only one paragraph."),
    ("<answer># Report\nThe text, in one paragraph.\n\n## Conclusion\n</answer>", "The text, in one paragraph."),
    ("<think>## Conclusion\nhidden</think><answer>Visible.</answer>", "Visible."),
    ("no answer at all", ""),
    (None, ""),
])
def test_extract_conclusion(reply, conclusion):
    assert S.extract_conclusion(reply) == conclusion


def test_consistency_of_identical_and_disjoint_conclusions():
    assert S.pairwise_consistency(["red apple pie", "red apple pie"]) == approx(1.0)
    assert S.pairwise_consistency(["red apple", "blue sky"]) == approx(0.0)
    # pairs (1,2) = 1, (1,3) = 0, (2,3) = 0
    assert S.pairwise_consistency(["red apple", "red apple", "blue sky"]) == approx(1 / 3)
    assert S.pairwise_consistency(["Red, apple!", "red APPLE"]) == approx(1.0)       # lower case, punctuation
    assert S.pairwise_consistency(["red apple", "red apple", ""]) == approx(1 / 3)   # empty: 0 to every other
    assert S.pairwise_consistency(["", ""]) == 0.0 and S.pairwise_consistency(["a", "b"]) == 0.0  # no word


def test_consistency_with_one_shared_word_by_hand():
    # two documents: idf(t) = ln((1 + 2) / (1 + df)) + 1; "alpha" in both: 1; "beta", "gamma": x = 1 + ln 1.5.
    # rows (1, x, 0) and (1, 0, x): cos = 1 / (1 + x²)
    x = 1 + math.log(1.5)
    assert S.pairwise_consistency(["alpha beta", "alpha gamma"]) == approx(1 / (1 + x * x))
    with pytest.raises(ValueError, match="K >= 2"):
        S.pairwise_consistency(["alone"])


def test_evaluator_reward_is_the_batch_mean():
    assert S.evaluator_reward([1.0, 1 / 3, 0.0]) == approx(4 / 9)
    assert S.evaluator_reward([0.25]) == 0.25
    with pytest.raises(ValueError):
        S.evaluator_reward([])


# -- REINFORCE's EMA baseline (§3.5, Algorithm 2 lines 10-11) ------------------------------------------------------


def test_ema_advantages_by_hand():
    # b0 = 0: A1 = 0.5, b1 = 0.3·0.5 = 0.15; A2 = 0.8 − 0.15 = 0.65, b2 = 0.7·0.15 + 0.3·0.8 = 0.345;
    # A3 = 0.2 − 0.345 = −0.145, b3 = 0.7·0.345 + 0.3·0.2 = 0.3015
    advantages, baseline = S.ema_advantages([0.5, 0.8, 0.2])
    assert advantages == approx([0.5, 0.65, -0.145])
    assert baseline == approx(0.3015)
    assert S.ema_step(0.8, 0.15) == approx((0.65, 0.345))
    resumed, _ = S.ema_advantages([0.2], baseline=0.345)                    # resuming from a stored baseline
    assert resumed == approx([-0.145])
    assert S.ema_advantages([0.4, 0.4], beta=0.0) == (approx([0.4, 0.0]), approx(0.4))
    with pytest.raises(ValueError, match="beta"):
        S.ema_step(1.0, 0.0, beta=1.5)


# -- the meta-harness (Algorithm 1 lines 35-39, Listing 3) ----------------------------------------------------------


def test_the_harness_refreshes_every_five_steps():
    assert [t for t in range(1, 16) if S.harness_refresh_due(t)] == [5, 10, 15]
    assert [S.harness_set_at(t) for t in (1, 5, 6, 10, 11)] == [0, 0, 5, 5, 10]
    assert [t for t in range(1, 7) if S.harness_refresh_due(t, period=2)] == [2, 4, 6]
    with pytest.raises(ValueError, match="step"):
        S.harness_refresh_due(0)


META_REPLY = """<think>the solver saturates coherence</think>
Here is the harness:
{"dimension_constraints": {"k": 5, "must_include": ["Factuality", "citation effectiveness"],
                           "weight_min": 0.05, "weight_max": 0.2},
 "process_constraints": {"require_gap_analysis": true, "require_verification": true, "citation_cross_check": true,
                         "min_number_of_tool_call": 3, "require_search": true},
 "notes": "Use <search>query</search> to check every statute cited."}"""


def test_a_meta_harness_reply_rewrites_the_constraints():
    parsed = S.parse_harness(META_REPLY, H)
    assert parsed.valid
    new = parsed.harness
    assert (new.k, new.must_include, new.weight_min, new.weight_max) == (
        5, ("factuality", "citation_effectiveness"), 0.05, 0.2)
    assert new.citation_cross_check and new.min_number_of_tool_call == 3 and S.required_searches(new) == 3
    assert new.notes.startswith("Use <search>") and new.pool == H.pool


def test_keys_left_out_keep_the_previous_values_and_a_pool_can_change():
    parsed = S.parse_harness('{"dimension_constraints": {"k": 3}, "dimension_pool": ["factuality", '
                             '{"name": "legal precision", "description": "cites the statute"}, "insight"]}', H)
    assert parsed.valid
    assert parsed.harness.k == 3 and parsed.harness.weight_max == H.weight_max
    assert parsed.harness.pool == (("factuality", S.DIMENSION_POOL["factuality"]),
                                   ("legal_precision", "cites the statute"),
                                   ("insight", S.DIMENSION_POOL["insight"]))
    rubric = S.parse_rubric(_reply('<dim name="factuality"/><dim name="legal precision" weight="0.2"/>'
                                   '<dim name="insight" weight="0.2"/>'), parsed.harness)
    assert rubric.rubric.weights == approx((0.6, 0.2, 0.2))


INVALID_HARNESSES = [
    ("no_json", "keep it as it is"),
    ("no_json", '{"dimension_constraints": [1, 2]}'),
    ("not_a_number", '{"dimension_constraints": {"weight_min": "low"}}'),
    ("not_a_boolean", '{"process_constraints": {"require_search": "yes"}}'),
    ("bad_pool", '{"dimension_pool": ["factuality", "Factuality"]}'),
    ("unknown_required_dimension", '{"dimension_constraints": {"must_include": ["elegance"]}}'),
    ("bad_k", '{"dimension_constraints": {"k": 0}}'),
    ("bad_k", '{"dimension_constraints": {"k": 2.5}}'),
    ("bad_k", '{"dimension_constraints": {"k": 99}}'),
    ("bad_weights", '{"dimension_constraints": {"weight_min": 0.3, "weight_max": 0.2}}'),
    ("no_weight_left", '{"dimension_constraints": {"k": 6, "weight_min": 0.2, "weight_max": 0.3}}'),
    ("bad_tool_calls", '{"process_constraints": {"min_number_of_tool_call": -1}}'),
]


@pytest.mark.parametrize("reason, reply", INVALID_HARNESSES)
def test_a_rejected_meta_harness_reply_keeps_the_previous_harness(reason, reply):
    parsed = S.parse_harness(reply, H)
    assert parsed.reason == reason and parsed.harness is H


def test_every_harness_reason_has_a_case():
    assert {r for r, _ in INVALID_HARNESSES} == set(S.HARNESS_INVALID_REASONS)


@pytest.mark.parametrize("garbage", [None, 7, "", "{", "{{{{" * 1000, "[1, 2]", '{"notes": {"a": 1}}'])
def test_meta_harness_garbage_never_crashes(garbage):
    assert isinstance(S.parse_harness(garbage, H).harness, S.Harness)


def test_the_harness_round_trips_through_its_json():
    again = S.parse_harness(S.harness_json(S.parse_harness(META_REPLY, H).harness), H)
    assert again.valid and again.harness == S.parse_harness(META_REPLY, H).harness


def test_the_default_harness_leaves_the_required_dimension_the_largest_share():
    extra = H.k - len(H.must_include)
    assert 1 - extra * H.weight_max >= H.weight_max and extra * H.weight_min < 1
    assert set(H.must_include) <= set(H.pool_names) and H.pool_names == tuple(S.DIMENSION_POOL)


# -- prompts (App. H, Listings 3-5) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_prompts_render_in_every_dialect(dialect):
    d = DIALECTS[dialect]
    solver = S.solver_prompt("What does §9.42 permit?", 10, d.search_example, d.results_description)
    assert d.search_example in solver and "<answer>" in solver and "What does §9.42 permit?" in solver
    evaluator = S.evaluator_prompt("Q?", ["report one", "report two"], H, d.search_example, d.results_description, 10)
    assert '<report id="1">\nreport one\n</report>' in evaluator and '<report id="2">' in evaluator
    assert "Search at least 1 time(s)" in evaluator and "within [0.1, 0.25]" in evaluator
    assert d.search_example in evaluator


def test_prompt_options():
    d = DIALECTS["search_r1"] if "search_r1" in DIALECTS else next(iter(DIALECTS.values()))
    rubric = S.Rubric(("factuality", "insight"), (0.75, 0.25))
    solver = S.solver_prompt("Q?", 3, d.search_example, d.results_description, rubric=rubric)
    assert "factuality (weight 0.75)" in solver and "insight (weight 0.25)" in solver
    evaluator = S.evaluator_prompt("Q?", ["r"], H, d.search_example, d.results_description, 3, rubric=rubric)
    assert "already chosen" in evaluator and "The dimension pool" not in evaluator
    assert "<dimensions>" in S.rubric_prompt("Q?") and "- readability:" in S.rubric_prompt("Q?")
    meta = S.meta_harness_prompt({"solver_reward_mean": 1.4, "step": 5}, H)
    assert '"solver_reward_mean": 1.4' in meta and '"min_number_of_tool_call": 1' in meta
    with pytest.raises(ValueError):
        S.evaluator_prompt("Q?", "one text", H, d.search_example, d.results_description, 3)


def test_scores_templates_are_method_templates():
    names = {"score_solver", "score_rubric", "score_evaluator", "score_meta_harness"}
    assert names <= set(prompts.METHOD_TEMPLATE_NAMES) and not names & set(prompts.TEMPLATE_NAMES)
