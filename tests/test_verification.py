"""scope_lib.protocol.verification: the rule verifier SPICE and SSP share, on equivalent and non-equivalent answers
of each kind, with hand-computed tolerances."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from scope_lib.protocol import verification as V

# -- normalisation and text --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, normalised", [
    ("The  Eiffel Tower!", "eiffel tower"),
    ("an Apple, a pear", "apple pear"),
    ("Newton's Third Law", "newtons third law"),
    ("  TCP/IP ", "tcpip"),
    (None, ""),
])
def test_normalize_answer(text, normalised):
    assert V.normalize_answer(text) == normalised


@pytest.mark.parametrize("prediction, gold, same", [
    ("the Eiffel tower.", "Eiffel Tower", True),
    (r"\text{Gradient Descent}", "gradient descent", True),
    ("$Paris$", "Paris", True),
    ("Eiffel", "Eiffel Tower", False),
    ("Parisian", "Paris", False),
    ("", "", False),            # empty never matches
    ("the", "a", False),        # nothing left after the articles
])
def test_texts_match(prediction, gold, same):
    assert V.texts_match(prediction, gold) is same


# -- the boxed answer ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, boxed", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{2}", "2"),                                   # the last one
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),                             # nested braces
    (r"<think>\boxed{9}</think> \boxed{ C }", "C"),                       # thinking hidden, stripped
    (r"<think>\boxed{9}</think> no box", None),
    (r"\boxed{3} and \boxed{4", "3"),                                     # an unclosed last box is skipped
    (r"\boxed {x+1}", "x+1"),
    (r"\boxed{}", None),
    ("42", None),
    (None, None),
])
def test_extract_boxed(reply, boxed):
    assert V.extract_boxed(reply) == boxed


def test_extract_boxed_when_the_chat_template_opened_thinking():
    assert V.extract_boxed(r"\boxed{1}</think>\boxed{2}", starts_in_think=True) == "2"
    assert V.extract_boxed(r"\boxed{1}</think>", starts_in_think=True) is None


# -- numbers --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("-3.5", -3.5), ("1,000", 1000.0), ("1.5e3", 1500.0), ("50%", 50.0), (".5", 0.5),
    (r"\frac{1}{2}", 0.5), (r"1.5 \times 10^{3}", 1500.0), (r"42 \text{ m}", 42.0), (r"\$42", 42.0), (7, 7.0),
    ("forty-two", None), ("42 or 43", None), ("x + 1", None), ("", None), (True, None), (float("nan"), None),
])
def test_parse_number(text, value):
    assert V.parse_number(text) == value


@pytest.mark.parametrize("text, places", [("3.140", 3), ("42", 0), (2.5, 1), ("1.5e-3", 4), (1e-05, 5), ("1,000", 0)])
def test_decimals_of_a_gold(text, places):
    assert V.decimals_of(text) == places


@pytest.mark.parametrize("prediction, gold, decimals, integer, same", [
    # integers: exact
    (42.0, 42, 0, True, True), (42.5, 42, 0, True, False), (41.0, 42, 0, True, False),
    # gold 3.14 (2 places): tolerance max(0.5·10^-2, 1e-6·3.14) = 0.005
    (3.1416, 3.14, 2, False, True), (3.144, 3.14, 2, False, True), (3.145, 3.14, 2, False, True),
    (3.146, 3.14, 2, False, False), (3.1, 3.14, 2, False, False),
    # gold 0.001 (3 places): tolerance 0.0005
    (0.0014, 0.001, 3, False, True), (0.0016, 0.001, 3, False, False),
    # gold 1234567 (0 places): tolerance max(0.5, 1e-6·1234567 = 1.234567)
    (1234568.2, 1234567, 0, False, True), (1234569.0, 1234567, 0, False, False),
    (None, 1.0, 0, False, False),
])
def test_numbers_match_with_the_documented_tolerance(prediction, gold, decimals, integer, same):
    assert V.numbers_match(prediction, gold, decimals, integer=integer) is same


# -- booleans, letters, lists -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("true", True), ("Yes", True), ("CORRECT.", True), (True, True), (r"\text{True}", True),
    ("false", False), ("no", False), ("Incorrect", False), (False, False),
    ("maybe", None), ("1", None), ("", None), (None, None),
])
def test_parse_boolean_synonyms(text, value):
    assert V.parse_boolean(text) is value


@pytest.mark.parametrize("text, letter", [
    ("C", "C"), ("c", "C"), ("(C)", "C"), ("C)", "C"), ("C.", "C"), ("C. 42 km", "C"), ("(B) foo", "B"),
    ("Option D", "D"), ("Answer: A", "A"), (r"\text{B}", "B"),
    ("A cat", None), ("E", None), ("CD", None), ("", None), (3, None),
])
def test_parse_letter(text, letter):
    assert V.parse_letter(text) == letter


@pytest.mark.parametrize("value, items", [
    ("apple, banana and cherry", ["apple", "banana", "cherry"]),
    ("apple, banana, and cherry", ["apple", "banana", "cherry"]),
    ("apple; banana", ["apple", "banana"]),
    ('["apple", "banana"]', ["apple", "banana"]),
    (r"\{1, 2\}", ["1", "2"]),
    (["x", 2], ["x", "2"]),
    ("Procter and Gamble", ["Procter", "Gamble"]),     # documented: a lone "X and Y" is two items
    ("", None), ([], None), (5, None),
])
def test_split_list(value, items):
    assert V.split_list(value) == items


@pytest.mark.parametrize("prediction, gold, ordered, same", [
    (["Mercury", "Venus", "Earth"], ["mercury", "venus", "earth"], True, True),
    (["Venus", "Mercury", "Earth"], ["Mercury", "Venus", "Earth"], True, False),    # order matters by default
    (["Venus", "Mercury", "Earth"], ["Mercury", "Venus", "Earth"], False, True),
    (["Venus", "Venus", "Earth"], ["Mercury", "Venus", "Earth"], False, False),     # multisets, not sets
    (["3.0", "x"], ["3", "X"], True, True),                                         # numbers as numbers
    (["Mercury", "Venus"], ["Mercury", "Venus", "Earth"], True, False),
    (None, ["Mercury"], True, False),
])
def test_lists_match(prediction, gold, ordered, same):
    assert V.lists_match(prediction, gold, ordered=ordered) is same


# -- expressions (Math-Verify) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction, gold", [
    ("x(2x+3)-5", "2*x**2 + 3*x - 5"),
    ("(x+1)^2", "x^2+2x+1"),
    (r"\frac{n(n+1)}{2}", "n^2/2 + n/2"),
    ("y = 2x + 1", "2x+1"),
    (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}"),
    (r"\pi r^2", "r^2 \\pi"),
])
def test_equivalent_expressions_match(prediction, gold):
    assert V.expressions_match(prediction, gold)


@pytest.mark.parametrize("prediction, gold", [
    ("x^2+1", "x^2-1"),
    ("2x", "2y"),
    ("n(n-1)/2", "n(n+1)/2"),
    ("", "x"),
    ("x+", "x"),                # unparsable: compared as text, and the texts differ
])
def test_different_expressions_do_not_match(prediction, gold):
    assert not V.expressions_match(prediction, gold)


def test_unparsable_expressions_fall_back_to_their_texts():
    assert not V.parses_as_math("x+") and not V.parses_as_math(r"\frac{")
    assert V.expressions_match("x+", "x+")
    assert V.parses_as_math("2*x^2 + 3*x - 5")


def test_overlong_answers_are_never_sent_to_math_verify():
    long = "+".join(["x"] * (V.MAX_MATH_CHARS // 2 + 1))
    assert len(long) > V.MAX_MATH_CHARS and not V.parses_as_math(long)


def test_math_verify_runs_outside_the_main_thread():
    # its signal-based time limit cannot run in a worker thread: there the limit is off
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(V.expressions_match, "x(x+1)", "x^2+x").result()
        assert not pool.submit(V.expressions_match, "x(x+1)", "x^2+1").result()
        assert pool.submit(V.parse_number, r"\frac{3}{4}").result() == 0.75
