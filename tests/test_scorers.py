"""scope_lib.evaluation.scorers and evaluation.score_items: every scorer against hand-computed values, the parsers of judge
replies, EM/F1 normalisation, and what happens to judge replies that never parse (retried, then dropped or scored
worst, always counted)."""

from __future__ import annotations

import json
import re

import pytest

from scope_lib.config import load_params
from scope_lib.evaluation import scorers as S
from scope_lib.evaluation.benchmarks import BENCHMARKS, Item
from scope_lib.evaluation.evaluate import Answered, score_items
from scope_lib.evaluation.judge import BenchmarkJudge, JudgeReply


def item(benchmark, messages=None, **reference):
    return Item("x1", benchmark, messages or [{"role": "user", "content": "Q?"}], reference,
                reference.pop("meta", {}) if "meta" in reference else {})


# -- EM / F1 / normalisation ------------------------------------------------------------------------------


def test_normalisation_and_exact_match():
    assert S.normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert S.normalize_answer("An apple, a day") == "apple day"
    assert S.normalize_answer("Zürich") == "zürich"            # non-ASCII letters stay
    assert S.normalize_answer(None) == ""
    assert S.exact_match("the eiffel-tower", ["Eiffeltower"]) == 1.0   # hyphen is punctuation: dropped
    assert S.exact_match("Paris", ["London", "paris."]) == 1.0          # max over gold answers
    assert S.exact_match("", ["Paris"]) == 0.0
    assert S.exact_match("eleven", ["11", "eleven"]) == 1.0 and S.exact_match("11", ["eleven"]) == 0.0


def test_f1_and_substring_accuracy():
    assert S.f1_score("Eiffel tower in Paris", ["the Eiffel Tower"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert S.f1_score("Paris", ["Lyon", "paris france"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert S.f1_score("", ["Paris"]) == 0.0
    # yes / no / noanswer must match exactly on either side
    assert S.f1_score("yes", ["no"]) == 0.0
    assert S.f1_score("yes it is", ["yes"]) == 0.0
    assert S.f1_score("no", ["No."]) == 1.0
    assert S.substring_match("It was the Eiffel Tower.", ["Eiffel Tower"]) == 1.0
    assert S.exact_match("It was the Eiffel Tower.", ["Eiffel Tower"]) == 0.0
    assert S.substring_match("anything", ["The"]) == 0.0       # a gold that normalises to "" never matches


def test_qa_metrics_scorer():
    score = S.QAMetrics().combine(item("nq", golden_answers=["Eiffel Tower", "La tour Eiffel"]), "the eiffel tower", {})
    assert score.value == 1.0 and score.metrics == {"em": 1.0, "f1": 1.0, "acc": 1.0}
    scores = [score, S.QAMetrics().combine(item("nq", golden_answers=["Paris"]), "Paris France", {})]
    assert S.QAMetrics().summary_metrics(scores) == pytest.approx({"em": 0.5, "f1": (1 + 2 / 3) / 2, "acc": 1.0})


# -- reply parsers ----------------------------------------------------------------------------------------


def test_json_and_verdict_parsers():
    assert S.parse_criteria_met('{"explanation": "ok", "criteria_met": true}') is True
    assert S.parse_criteria_met('```json\n{"criteria_met": "false"}\n```') is False
    assert S.parse_criteria_met('<think>{"criteria_met": true}</think>{"criteria_met": false}') is False
    assert S.parse_criteria_met('{"criteria_met": "maybe"}') is None
    assert S.parse_criteria_met("garbage") is None and S.parse_criteria_met(None) is None
    assert S.parse_wildbench_score('{"strengths": "a", "weaknesses": "b", "score": "7"}') == 7
    assert S.parse_wildbench_score('{"score": 11}') is None and S.parse_wildbench_score('{"score": "7.5"}') is None
    assert S.parse_arena_verdict("first [[A>B]] then, on reflection, [[b>>a]]") == "B>>A"   # the last one wins
    assert S.parse_arena_verdict("Verdict: [A=B]") == "A=B"
    assert S.parse_arena_verdict("[[A>>>B]]") is None and S.parse_arena_verdict("no verdict") is None


def test_numbered_lines_are_count_checked():
    parse = S.parse_numbered
    assert parse("1: Mostly\n2. completely\n3) Not at all", 3, S.coverage_level) == {1: 4, 2: 5, 3: 1}
    assert parse("**1: Mostly**\n2: Barely", 2, S.coverage_level) == {1: 4, 2: 2}
    assert parse("1: Mostly\n2: Barely", 3, S.coverage_level) is None          # one missing
    assert parse("1: Mostly\n1: Barely\n2: Barely", 2, S.coverage_level) is None  # repeated
    assert parse("1: Mostly\n2: Barely\n3: Barely", 2, S.coverage_level) is None  # extra
    assert parse("1: Mostly\n2: Somewhat", 2, S.coverage_level) is None          # unknown label
    assert parse("Mostly\nBarely", 2, S.coverage_level) is None                  # unnumbered: alignment unknown
    assert parse("1: 2\n2: 0", 2, S.ingredient_level) == {1: 2, 2: 0}


# -- open-ended scorers against hand-computed values -------------------------------------------------------


def _hb(points):
    return item("healthbench", rubrics=[{"criterion": f"c{k}", "points": p, "tags": []} for k, p in enumerate(points)])


def test_healthbench_negative_criteria_and_clipping():
    items = [_hb([5, 3, -4, 2]), _hb([2, -1]), _hb([4, 4])]
    met = [[True, False, True, True], [False, True], [True, True]]
    official, paper = S.HealthBenchScorer("official"), S.HealthBenchScorer("scope_paper")
    o = [official.combine(i, "a", {f"c{k}": v for k, v in enumerate(m)}) for i, m in zip(items, met)]
    p = [paper.combine(i, "a", {f"c{k}": v for k, v in enumerate(m)}) for i, m in zip(items, met)]
    assert [s.value for s in o] == pytest.approx([(5 - 4 + 2) / 10, -1 / 2, 1.0])   # no per-item clip
    assert [s.value for s in p] == pytest.approx([0.3, 0.0, 1.0])                   # clipped per item
    assert official.aggregate(o) == pytest.approx((0.3 - 0.5 + 1.0) / 3)
    assert paper.aggregate(p) == pytest.approx((0.3 + 0.0 + 1.0) / 3)
    assert official.aggregate([o[1]]) == 0.0                                         # the final mean is clipped
    # a dropped criterion leaves numerator and denominator
    assert official.combine(items[0], "a", {"c0": True, "c2": False, "c3": True}).value == pytest.approx(7 / 7)
    unit = official.units(items[0], "my reply")[2]
    assert unit.worst is True and "[" not in unit.key and 'points="-4"' in unit.messages[0]["content"]
    assert "my reply" in unit.messages[0]["content"] and "user: Q?" in unit.messages[0]["content"]


def test_researchrubrics_compliance_over_positive_weights():
    it = item("researchrubrics", rubrics=[{"criterion": "a", "weight": 4.0, "axis": "Explicit"},
                                          {"criterion": "b", "weight": 2.0, "axis": "Implicit"},
                                          {"criterion": "c", "weight": -3.0, "axis": "Explicit"}])
    official, paper = S.ResearchRubricsScorer("official"), S.ResearchRubricsScorer("scope_paper")
    assert official.combine(it, "r", {"c0": True, "c1": False, "c2": True}).value == pytest.approx(1 / 6)
    assert official.combine(it, "r", {"c0": False, "c1": False, "c2": True}).value == pytest.approx(-0.5)
    assert paper.combine(it, "r", {"c0": False, "c1": False, "c2": True}).value == 0.0
    text = official.units(it, "REPORT")[2].messages[0]["content"]
    assert "REPORT" in text and 'weight="-3"' in text and "Q?" not in text        # the judge does not see the task
    assert "Q?" in paper.units(it, "REPORT")[0].messages[0]["content"]


def test_researchqa_batches_and_levels():
    it = item("researchqa", rubric=[{"rubric_item": f"point {k}"} for k in range(10)])
    official, paper = S.ResearchQAScorer("official", 8), S.ResearchQAScorer("scope_paper", None)
    units = official.units(it, "ans")
    assert [u.key for u in units] == ["b0", "b1"] and "exactly 8 line" in units[0].messages[0]["content"]
    assert "1. point 8" in units[1].messages[0]["content"]
    verdicts = {"b0": units[0].parse("\n".join(f"{k}: Mostly" for k in range(1, 9))),
                "b1": units[1].parse("1: Completely\n2: Not at all")}
    assert official.combine(it, "ans", verdicts).value == pytest.approx((8 * 0.75 + 1 + 0) / 10)
    assert official.combine(it, "ans", {"b1": verdicts["b1"]}).value == pytest.approx(0.5)   # batch 0 dropped
    assert len(paper.units(it, "ans")) == 1


def test_wildbench_scope_and_wb_score():
    items = [item("wildbench", checklist=["x"], meta={"primary_tag": "Creative Writing", "secondary_tags": ["Brainstorming"]}),
             item("wildbench", checklist=[], meta={"primary_tag": "Data Analysis",
                                                   "secondary_tags": ["Information seeking", "Planning"]})]
    official, paper = S.WildBenchScorer("official"), S.WildBenchScorer("scope_paper")
    o = [official.combine(i, "a", {"score": s}) for i, s in zip(items, (8.0, 3.0))]
    p = [paper.combine(i, "a", {"score": s}) for i, s in zip(items, (8.0, 3.0))]
    assert official.aggregate(o) == pytest.approx(0.1)            # WB-Score 10 = (5.5 - 5) x 2 x 10
    assert paper.aggregate(p) == pytest.approx((7 / 9 + 2 / 9) / 2)
    # categories: Creative (8) -> 6 x 0.5; Math & Data, Info/Advice, Planning (3) -> -4 x (1 + 0.75 + 1.25)
    assert official.summary_metrics(o)["task_macro"] == pytest.approx((3 - 4 - 3 - 5) / 4.75 / 10)  # weights sum to 4.75


def test_arena_hard_strong_verdicts_position_swap_and_pooling():
    it = item("arena_hard_cw", baseline_answer="BASELINE")
    official, paper = S.ArenaHardScorer("official"), S.ArenaHardScorer("scope_paper")
    g1, g2 = official.units(it, "MODEL")
    a_then_b = lambda u: re.search(r"\[Assistant A\]\n(.*?)\n\[End of Assistant A\].*\[Assistant B\]\n(.*?)\n",  # noqa: E731
                                   u.messages[1]["content"], re.S).groups()
    assert a_then_b(g1) == ("BASELINE", "MODEL") and a_then_b(g2) == ("MODEL", "BASELINE")
    assert g1.worst == "A>>B" and g2.worst == "B>>A" and g1.messages[0]["role"] == "system"
    # game 1: baseline much better (model 0,0,0); game 2: model better (1)  -> [1, 0, 0, 0]
    first = official.combine(it, "MODEL", {"game1": "A>>B", "game2": "A>B"})
    assert first.parts["scores"] == [1.0, 0.0, 0.0, 0.0] and first.value == 0.25
    # game 1: "B>A" = model better (1); game 2: tie (0.5)  -> [0.5, 1]
    second = official.combine(it, "MODEL", {"game1": "B>A", "game2": "A=B"})
    half = official.combine(it, "MODEL", {"game2": "A>>B"})               # game 1 invalid
    assert half.value is None                                           # official drops the question
    assert official.aggregate([first, second, half]) == pytest.approx(2.5 / 6)           # pooled
    p = [paper.combine(it, "M", v) for v in ({"game1": "A>>B", "game2": "A>B"}, {"game1": "B>A", "game2": "A=B"},
                                              {"game2": "A>>B"})]
    assert p[2].value == 1.0                                             # the valid game alone
    assert paper.aggregate(p) == pytest.approx((0.25 + 0.75 + 1.0) / 3)  # mean per question, then over questions


DRB_CRITERIA = {"dimension_weight": {"comprehensiveness": 0.4, "insight": 0.3, "instruction_following": 0.2,
                                     "readability": 0.1},
                "criterions": {"comprehensiveness": [{"criterion": "c1", "explanation": "e", "weight": 0.5},
                                                     {"criterion": "c2", "explanation": "e", "weight": 0.5}],
                               "insight": [{"criterion": "i1", "explanation": "e", "weight": 1.0}],
                               "instruction_following": [{"criterion": "f1", "explanation": "e", "weight": 1.0}],
                               "readability": [{"criterion": "r1", "explanation": "e", "weight": 1.0}]}}


def _race_reply(pairs):
    return json.dumps({d: [{"criterion": k, "report_1": t, "report_2": r} for k, (t, r) in enumerate(v, 1)]
                       for d, v in pairs.items()})


def test_drb_race_relative_and_absolute():
    scorer = S.DRBRaceScorer()
    pairs = {"comprehensiveness": [(8, 6), (6, 6)], "insight": [(5, 5)], "instruction_following": [(9, 3)],
             "readability": [(4, 8)]}
    with_ref = item("drb", criteria=DRB_CRITERIA, reference_article="REF")
    [unit] = scorer.units(with_ref, "ANSWER")
    assert "<report_2>\nREF" in unit.messages[0]["content"]
    got = unit.parse(_race_reply(pairs))
    assert scorer.combine(with_ref, "ANSWER", {"race": got}).value == pytest.approx(6.5 / (6.5 + 5.3))
    no_ref = item("drb", criteria=DRB_CRITERIA, reference_article=None)
    [unit] = scorer.units(no_ref, "ANSWER")
    got = unit.parse(json.dumps({d: [{"criterion": k, "report_1": t} for k, (t, _) in enumerate(v, 1)]
                                 for d, v in pairs.items()}))
    score = scorer.combine(no_ref, "ANSWER", {"race": got})
    assert score.value == pytest.approx(0.65) and score.parts["mode"] == "absolute"
    missing_one = dict(pairs, comprehensiveness=[(8, 6)])
    assert S.parse_race(_race_reply(missing_one), {d: len(v) for d, v in pairs.items()}, True) is None
    assert scorer.combine(item("drb", criteria=None), "a", {}).reason == "no criteria for this task"


def test_holistic_ratings_sqa_and_plan_scorers():
    drb = S.DRBHolisticScorer()
    [unit] = drb.units(item("drb"), "a")
    got = unit.parse('{"depth": 5, "structure": 3, "relevance": 1, "accuracy": 4, "completeness": 2}')
    assert drb.combine(item("drb"), "a", {"rating": got}).value == pytest.approx((1 + 0.5 + 0 + 0.75 + 0.25) / 5)
    assert unit.parse('{"depth": 5, "structure": 3}') is None and unit.parse('{"depth": 6, "structure": 3, '
                                                                             '"relevance": 1, "accuracy": 4, '
                                                                             '"completeness": 2}') is None
    sqa = S.SQAIngredientScorer()
    it = item("sqa_cs_v2", ingredients=[{"criterion": "a", "weight": 0.5}, {"criterion": "b", "weight": 0.3},
                                        {"criterion": "c", "weight": 0.2}])
    [unit] = sqa.units(it, "ans")
    assert sqa.combine(it, "ans", {"ingredients": unit.parse("1: 2\n2: 1\n3: 0")}).value == pytest.approx(0.65)
    assert sqa.units(item("sqa_cs_v2", ingredients=None), "a") == []
    assert S.SQAQualityScorer().combine(item("sqa_cs_v2"), "a", {"rating": {"score": 4.0}}).value == 0.75
    plan = S.ResearchPlanGenScorer("official")
    it = item("researchplangen", goal="GOAL", rubric=["r1", "r2", "r3"])
    assert "user: GOAL" in plan.units(it, "p")[0].messages[0]["content"]
    assert plan.combine(it, "p", {"c0": True, "c1": False, "c2": True}).value == pytest.approx(2 / 3)


def test_every_benchmark_has_both_scorers_and_a_source():
    assert len(BENCHMARKS) == 15
    for spec in BENCHMARKS.values():
        assert set(spec.scorers) == {"scope_paper", "official"}, spec.name
        assert spec.differences and spec.source.describe() and spec.local_files


# -- invalid judge replies through score_items --------------------------------------------------------------


class ScriptedBackend:
    """A judge back end answering from a function of (request, how often this exact request was seen)."""

    name = "scripted"

    def __init__(self, answer):
        self.answer = answer
        self.requests = []

    def send(self, requests, on_reply):
        for i, r in enumerate(requests):
            self.requests.append(r)
            on_reply(i, JudgeReply(self.answer(r), r.key, prompt_tokens=10, completion_tokens=2))


def _criterion(request):
    return re.search(r'<criterion points="[^"]*">\n(.*?)\n</criterion>', request.messages[0]["content"], re.S).group(1)


@pytest.mark.parametrize("policy", ["drop", "worst"])
def test_invalid_replies_are_retried_then_handled_by_the_declared_policy(policy):
    params = load_params(None, {"evaluation.judge_invalid": policy, "evaluation.judge_parse_retries": 2,
                                "evaluation.bootstrap_samples": 50})
    # c1 (positive) and c2 (negative) never get a parseable reply; c0 and c3 are met
    backend = ScriptedBackend(lambda r: "I am not sure." if _criterion(r) in ("c1", "c2")
                              else '{"explanation": "x", "criteria_met": true}')
    judge = BenchmarkJudge(backend)
    it = Item("hb1", "healthbench", [{"role": "user", "content": "help"}],
              {"rubrics": [{"criterion": f"c{k}", "points": p} for k, p in enumerate([5, 3, -4, 2])]})
    records, summary = score_items(params, "healthbench", [Answered(it, 0, "reply", "answer", "t1")], judge,
                                   scorers=["official"])
    # 4 units once, then the 2 invalid ones in each of 2 retry rounds, each retry a new sample index
    assert len(backend.requests) == 4 + 2 + 2
    assert sorted(r.sample_index for r in backend.requests) == [0, 0, 0, 0, 1, 1, 2, 2]
    s = records[0]["scores"]["official"]
    assert s["n_invalid"] == 2 and summary["official"]["n_invalid_units"] == 2
    assert summary["official"]["invalid_policy"] == policy
    bad = [u for u in s["units"] if u["invalid"]]
    assert [u["key"] for u in bad] == ["c1", "c2"] and all(len(u["replies"]) == 3 for u in bad)
    if policy == "drop":   # c1 and c2 leave the score: (5 + 2) / (5 + 2)
        assert s["value"] == pytest.approx(1.0)
    else:                  # worst: positive c1 not met, negative c2 met: (5 - 4 + 2) / 10
        assert s["value"] == pytest.approx(0.3)
        assert [u["verdict"] for u in bad] == [False, True]
    assert judge.usage["/healthbench/official"].requests == 8


def test_an_item_with_nothing_parseable_is_dropped_and_counted():
    params = load_params(None, {"evaluation.judge_parse_retries": 1, "evaluation.bootstrap_samples": 0})
    judge = BenchmarkJudge(ScriptedBackend(lambda r: "<score>1</score>" if "Paris" in r.messages[0]["content"]
                                           else "no idea"))
    answered = [Answered(Item(f"q{k}", "nq", [{"role": "user", "content": q}], {"golden_answers": [g]}), 0, a,
                         "answer", f"t{k}") for k, (q, g, a) in enumerate([("Capital of France?", "Paris", "Paris"),
                                                                           ("Capital of Peru?", "Lima", "Quito")])]
    records, summary = score_items(params, "nq", answered, judge)
    assert [r["scores"]["scope_paper"]["value"] for r in records] == [1.0, None]
    assert summary["scope_paper"] | {} and summary["scope_paper"]["n_dropped"] == 1
    assert summary["scope_paper"]["value"] == 1.0 and summary["scope_paper"]["ci95"] is None
    assert [r["scores"]["official"]["value"] for r in records] == [1.0, 0.0]   # EM needs no judge
    assert summary["official"]["judge"] is None and summary["official"]["n_units"] == 0


def test_exact_match_alone_needs_no_judge_and_no_judges_adapter():
    """`compare-methods` scores its benchmarks by exact match and F1 only (`scorers=["official"]`, no judge); with
    SmolLM2's `evaluation.judge_adapter` on, asking for the judge's settings anyway stopped the comparison at its
    last step for an adapter it never uses."""
    params = load_params(None, {"evaluation.judge_backend": "local", "evaluation.judge_adapter.enabled": True,
                                "evaluation.bootstrap_samples": 0})
    answered = [Answered(Item("q0", "nq", [{"role": "user", "content": "Capital of France?"}],
                              {"golden_answers": ["Paris"]}), 0, "Paris", "answer", "t0")]
    records, summary = score_items(params, "nq", answered, None, scorers=["official"])
    assert records[0]["scores"]["official"]["value"] == 1.0 and summary["official"]["judge"] is None
    with pytest.raises(ValueError, match="judge_adapter is on but was not built"):   # a judged scorer still needs it
        score_items(params, "nq", answered, None, scorers=["scope_paper"])
