"""scope_lib.protocol.spice: SPICE's task format (each invalid reason), the Reasoner's verification (equivalent and
non-equivalent answers of every type), the rewards against hand-computed values of eq. 1, Algorithm 1's
subsampling, the prompts, and the Challenger's format choice (Figure 9)."""

from __future__ import annotations

import json
import re

import pytest

from scope_lib.protocol import spice as S

approx = pytest.approx


def _task(**fields) -> S.TaskParse:
    return S.parse_task(json.dumps(fields))


# -- the task format -------------------------------------------------------------------------------------------------


def test_a_multiple_choice_task_parses():
    parsed = _task(answer_type="multiple_choice", question=" Which? ", options=["x", "y", "z", "w"], answer="C")
    assert parsed.valid and parsed.reason is None
    assert parsed.task == S.SpiceTask("Which?", "multiple_choice", "C", ("x", "y", "z", "w"))
    assert parsed.task.reasoner_text == "Which?\nA) x\nB) y\nC) z\nD) w"


def test_options_keyed_by_letter_labels_stripped_and_the_type_inferred():
    parsed = _task(question="Which?", options={"d": "w", "B": "y", "a": "A) x", "C": "(C) z"}, answer="(b)")
    assert parsed.task.answer_type == "multiple_choice"
    assert parsed.task.options == ("x", "y", "z", "w") and parsed.task.answer == "B"


@pytest.mark.parametrize("fields, answer_type, gold, decimals", [
    ({"answer_type": "Integer", "answer": 42}, "integer", 42, 0),
    ({"answer_type": "integer", "answer": "1,024"}, "integer", 1024, 0),
    ({"answer_type": "int", "answer": 7.0}, "integer", 7, 0),
    ({"answer_type": "float", "answer": 3.14}, "float", 3.14, 2),
    ({"answer_type": "Float", "answer": "0.250"}, "float", 0.25, 3),
    ({"answer_type": "expression", "answer": "2*x^2 + 3*x - 5"}, "expression", "2*x^2 + 3*x - 5", 0),
    ({"answer_type": "String", "answer": " gradient  descent "}, "string", "gradient descent", 0),
    ({"answer_type": "list", "answer": ["apple", "banana"]}, "list", ("apple", "banana"), 0),
    ({"answer_type": "list", "answer": "apple, banana"}, "list", ("apple", "banana"), 0),
    ({"answer_type": "boolean", "answer": False}, "boolean", False, 0),
    ({"answer_type": "bool", "answer": "True"}, "boolean", True, 0),
])
def test_free_form_tasks_parse_to_their_typed_gold(fields, answer_type, gold, decimals):
    task = _task(question="Q?", **fields).task
    assert task is not None and task.answer_type == answer_type
    assert task.answer == gold and type(task.answer) is type(gold) and task.decimals == decimals


def test_the_last_json_object_outside_thinking_is_read():
    reply = ('<think>draft {"question": "old", "answer": 1, "answer_type": "integer"}</think>\n'
             'Here it is:\n```json\n{"question": "Q1?", "answer": 2, "answer_type": "integer"}\n```\n'
             '{"question": "Q2?", "answer": 3, "answer_type": "integer", "extra": {"nested": [1]}} done {broken')
    task = S.parse_task(reply).task
    assert (task.question, task.answer) == ("Q2?", 3)
    assert S.parse_task('{"question": "Q?"}</think>{"question": "A?", "answer": "x", "answer_type": "string"}',
                        starts_in_think=True).task.question == "A?"


INVALID = [
    ("no_json", "The question is: what? Answer: 4"),
    ("no_json", "<think>{\"question\": \"Q?\", \"answer\": 1, \"answer_type\": \"integer\"}</think> none"),
    ("no_json", '["question", "answer"]'),
    ("no_json", None),
    ("missing_field", {"answer": 1, "answer_type": "integer"}),
    ("missing_field", {"question": "Q?", "answer_type": "integer"}),
    ("missing_field", {"question": "Q?", "answer": 1}),
    ("missing_field", {"question": "Q?", "answer": "A", "answer_type": "multiple_choice"}),
    ("question_not_text", {"question": ["Q1?", "Q2?"], "answer": 1, "answer_type": "integer"}),
    ("empty_question", {"question": " ", "answer": 1, "answer_type": "integer"}),
    ("unknown_answer_type", {"question": "Q?", "answer": 1, "answer_type": "date"}),
    ("unknown_answer_type", {"question": "Q?", "answer": 1, "answer_type": 3}),
    ("wrong_option_count", {"question": "Q?", "options": ["x", "y", "z"], "answer": "A"}),
    ("wrong_option_count", {"question": "Q?", "options": ["x", "y", "z", "w", "v"], "answer": "A"}),
    ("wrong_option_count", {"question": "Q?", "options": {"A": "x", "B": "y", "C": "z", "E": "w"}, "answer": "A"}),
    ("wrong_option_count", {"question": "Q?", "options": "x, y, z, w", "answer": "A"}),
    ("empty_option", {"question": "Q?", "options": ["x", "", "z", "w"], "answer": "A"}),
    ("empty_option", {"question": "Q?", "options": ["x", ["y"], "z", "w"], "answer": "A"}),
    ("duplicate_options", {"question": "Q?", "options": ["Paris", "the paris.", "z", "w"], "answer": "A"}),
    ("not_a_letter", {"question": "Q?", "options": ["x", "y", "z", "w"], "answer": "E"}),
    ("not_a_letter", {"question": "Q?", "options": ["x", "y", "z", "w"], "answer": 1}),
    ("empty_answer", {"question": "Q?", "answer": "", "answer_type": "string"}),
    ("empty_answer", {"question": "Q?", "answer": [], "answer_type": "list"}),
    ("empty_answer", {"question": "Q?", "answer": None, "answer_type": "integer"}),
    ("empty_answer", {"question": "Q?", "answer": ",", "answer_type": "list"}),
    ("type_mismatch", {"question": "Q?", "answer": 42.5, "answer_type": "integer"}),
    ("type_mismatch", {"question": "Q?", "answer": "forty-two", "answer_type": "integer"}),
    ("type_mismatch", {"question": "Q?", "answer": [42], "answer_type": "integer"}),
    ("type_mismatch", {"question": "Q?", "answer": {"value": 42}, "answer_type": "integer"}),
    ("type_mismatch", {"question": "Q?", "answer": True, "answer_type": "integer"}),
    ("type_mismatch", {"question": "Q?", "answer": "22/7", "answer_type": "float"}),
    ("type_mismatch", {"question": "Q?", "answer": 42, "answer_type": "string"}),
    ("type_mismatch", {"question": "Q?", "answer": [["a"], "b"], "answer_type": "list"}),
    ("type_mismatch", {"question": "Q?", "answer": 3, "answer_type": "list"}),
    ("type_mismatch", {"question": "Q?", "answer": "yes", "answer_type": "boolean"}),
    ("type_mismatch", {"question": "Q?", "answer": ["x"], "answer_type": "expression"}),
    ("string_too_long", {"question": "Q?", "answer": "Newton's third law of motion", "answer_type": "string"}),
    ("unparsable_expression", {"question": "Q?", "answer": r"\frac{", "answer_type": "expression"}),
]


@pytest.mark.parametrize("reason, reply", INVALID)
def test_invalid_tasks_name_their_reason(reason, reply):
    parsed = S.parse_task(reply if isinstance(reply, str | None) else json.dumps(reply))
    assert not parsed.valid and parsed.task is None
    assert parsed.reason == reason, parsed.detail
    assert parsed.detail


def test_every_invalid_reason_has_a_case():
    assert {reason for reason, _ in INVALID} == set(S.INVALID_REASONS)


def test_a_string_of_three_words_is_valid_and_four_is_not():
    assert _task(question="Q?", answer="Newton third law", answer_type="string").valid
    assert _task(question="Q?", answer="Newton third law again", answer_type="string").reason == "string_too_long"


# -- the Reasoner's answer, verified ---------------------------------------------------------------------------------


def _gold(answer_type: str, answer, **extra) -> S.SpiceTask:
    task = _task(question="Q?", answer_type=answer_type, answer=answer, **extra).task
    assert task is not None
    return task


MCQ = _task(question="Q?", options=["x", "y", "z", "w"], answer="C").task

VERIFIED = [
    # (task, equivalent answers, non-equivalent answers)
    (MCQ, ["C", "(c)", "C) z", r"\text{C}", "Option C"], ["B", "z", "A cat", "CD"]),
    (_gold("integer", 1024), ["1024", "1,024", "1024.0", r"2^{10}", r"1024 \text{ bytes}"], ["1023", "1024.5", "a lot"]),
    (_gold("float", 3.14), ["3.14", "3.1416", "3.144", r"\frac{314}{100}", "22/7"], ["3.146", "3.1", "3.15", "pi"]),
    (_gold("expression", "2*x^2 + 3*x - 5"), ["x(2x+3)-5", "3x + 2x^2 - 5", r"2x^{2}+3x-5"],
     ["2x^2+3x+5", "2y^2+3y-5", "x+"]),
    (_gold("string", "Gradient descent"), ["gradient descent", "The gradient descent.", r"\text{Gradient Descent}"],
     ["gradient", "stochastic gradient descent", ""]),
    (_gold("list", ["Mercury", "Venus", "Earth"]), ["Mercury, Venus, Earth", "mercury, venus and earth",
                                                    '["Mercury", "Venus", "Earth"]'],
     ["Venus, Mercury, Earth", "Mercury, Venus", "Mercury, Venus, Earth, Mars"]),
    (_gold("boolean", True), ["true", "Yes", "TRUE.", "correct"], ["false", "no", "maybe", "1"]),
    (_gold("boolean", "false"), ["false", "No", "incorrect"], ["true", "yes", ""]),
]


@pytest.mark.parametrize("task, equivalent, different", VERIFIED, ids=[t.answer_type for t, _, _ in VERIFIED])
def test_equivalent_answers_verify_and_others_do_not(task, equivalent, different):
    for answer in equivalent:
        assert S.answer_matches(task, answer), answer
        assert S.verify_reply(task, f"<think>reasoning</think> So the answer is \\boxed{{{answer}}}."), answer
        assert S.reasoner_reward(S.verify_reply(task, f"\\boxed{{{answer}}}")) == 1.0
    for answer in different:
        assert not S.answer_matches(task, answer), answer
        assert S.reasoner_reward(S.verify_reply(task, f"\\boxed{{{answer}}}")) == 0.0


def test_every_answer_type_has_verification_cases():
    assert {t.answer_type for t, _, _ in VERIFIED} == set(S.ANSWER_TYPES)


def test_list_order_can_be_ignored():
    task = _gold("list", ["Mercury", "Venus", "Earth"])
    assert S.answer_matches(task, "Venus, Mercury, Earth", ordered_lists=False)
    assert not S.answer_matches(task, "Venus, Venus, Earth", ordered_lists=False)


def test_the_reasoner_must_box_its_answer():
    assert S.reasoner_answer(r"<think>\boxed{C}</think> I think C") is None
    assert not S.verify_reply(MCQ, "The answer is C.")
    assert not S.verify_reply(MCQ, r"<think>\boxed{C}</think> C")
    assert S.verify_reply(MCQ, r"\boxed{B} wait, no: \boxed{C}")       # the last box decides
    assert not S.answer_matches(MCQ, None)


# -- rewards (eq. 1) ------------------------------------------------------------------------------------------------


# exp(−(p(1−p) − 0.25)² / 0.02): p = 0 and 1: exp(−0.0625 / 0.02) = exp(−3.125) = 0.0439369336;
# p = 1/4: exp(−(0.1875 − 0.25)² / 0.02) = exp(−0.1953125) = 0.8225775624;
# p = 1/8: exp(−(0.109375 − 0.25)² / 0.02) = exp(−0.98876953125) = 0.3720341859
@pytest.mark.parametrize("verified, reward", [
    ([0, 0, 0, 0, 0, 0, 0, 0], 0.0439369336),
    ([1, 0, 1, 0, 0, 1, 1, 0], 1.0),
    ([1, 1, 1, 1, 1, 1, 1, 1], 0.0439369336),
    ([1, 0, 0, 0], 0.8225775624),
    ([0, 0, 0, 1, 0, 0, 0, 0], 0.3720341859),
])
def test_challenger_reward_is_the_gaussian_on_the_variance(verified, reward):
    assert S.challenger_reward([bool(v) for v in verified], valid=True) == approx(reward, abs=1e-9)


def test_an_invalid_task_costs_the_penalty_whatever_the_answers():
    assert S.challenger_reward([], valid=False) == -0.1
    assert S.challenger_reward([True, False], valid=False) == -0.1
    assert S.challenger_reward([], valid=False, invalid_penalty=0.0) == 0.0


def test_a_valid_task_without_answers_is_an_error():
    with pytest.raises(ValueError, match="K answers"):
        S.challenger_reward([], valid=True)


# -- Algorithm 1, line 6 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_valid, n_total, group, kept_valid", [
    (4, 10, 8, 3),     # 8·4/10 = 3.2 -> 3 valid, 5 invalid
    (5, 10, 4, 2),     # 2 and 2
    (1, 16, 8, 1),     # 0.5 rounds half up -> 1
    (1, 100, 8, 1),    # 0.08 -> 0, but one valid attempt is kept
    (9, 10, 8, 7),     # 7.2 -> 7 valid, 1 invalid
    (0, 10, 8, 0),
    (10, 10, 8, 8),
    (3, 9, 6, 2),
    (5, 20, 10, 3),    # 2.5 rounds half up -> 3 (not to even, not down)
])
def test_subsampling_keeps_the_valid_invalid_ratio(n_valid, n_total, group, kept_valid):
    flags = [i < n_valid for i in range(n_total)]
    picked = S.subsample_attempts(flags, group, seed=3)
    assert len(picked) == group and len(set(picked)) == group and picked == sorted(picked)
    assert sum(flags[i] for i in picked) == kept_valid
    assert S.subsample_attempts(flags, group, seed=3) == picked


def test_subsampling_is_seeded_and_keeps_everything_when_few():
    flags = [True] * 20 + [False] * 20
    draws = {tuple(S.subsample_attempts(flags, 8, seed=s)) for s in range(5)}
    assert len(draws) > 1
    assert S.subsample_attempts([True, False, True], 8) == [0, 1, 2]
    with pytest.raises(ValueError, match="group_size"):
        S.subsample_attempts(flags, 0)


# -- prompts (App. E) ----------------------------------------------------------------------------------------------

DOC = "(Title: Lake Ohrid) Lake Ohrid straddles the border of North Macedonia and Albania."


@pytest.mark.parametrize("answer_type", S.ANSWER_TYPES)
def test_challenger_prompt_renders_each_format_and_its_example_parses(answer_type):
    text = S.challenger_prompt(DOC, answer_type)
    assert "$" not in text and DOC in text and "<think>" in text and "JSON" in text
    assert "search" not in text.lower()          # the SPICE Challenger reads; it does not search
    example = re.search(r"^Example: (\{.*\})$", text, re.MULTILINE).group(1)
    parsed = S.parse_task(example)
    assert parsed.valid and parsed.task.answer_type == answer_type
    if answer_type != "multiple_choice":
        assert S.ANSWER_TYPE_RULES[answer_type][0] in text


def test_challenger_prompt_refuses_unknown_types_and_empty_documents():
    with pytest.raises(ValueError, match="unknown SPICE answer type"):
        S.challenger_prompt(DOC, "date")
    with pytest.raises(ValueError, match="document"):
        S.challenger_prompt("  ", "integer")


def test_reasoner_prompt_is_closed_book_and_asks_for_a_box():
    text = S.reasoner_prompt(MCQ)
    assert text.startswith("Q?\nA) x\nB) y\nC) z\nD) w\n")
    assert "\\boxed{}" in text and "only the letter" in text and "$" not in text
    free = S.reasoner_prompt(_gold("integer", 3))
    assert free == "Q?\n\nPlease reason step by step, and put your final answer within \\boxed{}."


# -- the format choice (App. E, Figure 9) ---------------------------------------------------------------------------


@pytest.mark.parametrize("reply, chosen", [
    ('{"suitable_for_mcq": true, "suitable_for_free_form": false, "best_answer_type": null, "reason": "r"}',
     "multiple_choice"),
    ('{"suitable_for_mcq": false, "suitable_for_free_form": true, "best_answer_type": "Integer", "reason": "r"}',
     "integer"),
    ('<think>a formula fits</think>{"suitable_for_mcq": false, "suitable_for_free_form": true, '
     '"best_answer_type": "Expression"}', "expression"),
    ('{"suitable_for_mcq": false, "suitable_for_free_form": true, "best_answer_type": "string"}', "string"),
    ('{"suitable_for_mcq": true, "suitable_for_free_form": true, "best_answer_type": "Integer"}', None),   # both
    ('{"suitable_for_mcq": false, "suitable_for_free_form": false, "best_answer_type": null}', None),     # neither
    ('{"suitable_for_mcq": false, "suitable_for_free_form": true, "best_answer_type": null}', None),      # no type
    ('{"suitable_for_mcq": false, "suitable_for_free_form": true, "best_answer_type": "Essay"}', None),   # unknown
    ('{"suitable_for_mcq": "true", "suitable_for_free_form": false}', None),   # a string is not a JSON true
    ("Multiple choice suits it best.", None),
    (None, None),
])
def test_the_format_choice_reads_figure_9s_reply(reply, chosen):
    assert S.parse_format_choice(reply) == chosen


def test_the_format_choice_prompt_shows_the_document_and_figure_9s_fields():
    text = S.format_choice_prompt("The bridge was finished in 1932.")
    assert "The bridge was finished in 1932." in text
    for field in ("suitable_for_mcq", "suitable_for_free_form", "best_answer_type", "Integer", "Expression", "String"):
        assert field in text
    with pytest.raises(ValueError, match="non-empty document"):
        S.format_choice_prompt("  ")
