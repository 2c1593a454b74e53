"""Rule verification of short answers against a gold answer (SPICE §2.3, SSP App. A.2): no model, no judge.

SPICE rewards the Reasoner with 1[â = a*] "conditioned on a rule-based verifier" built on Math-Verify (§2.5); SSP's
Solver reward is 1[a = a*] (eq. 6; the paper asks an LLM judge, these rules are the judge-free stand-in). One home
for what both compare:

    normalize_answer("The  Eiffel Tower!")          # "eiffel tower": case, punctuation, articles, whitespace
    extract_boxed(r"so \\boxed{\\frac{1}{2}}.")        # "\\frac{1}{2}": the last \\boxed{} outside thinking
    parse_number("1,000")                           # 1000.0 (a number, or None)
    numbers_match(3.1416, 3.14, decimals=2)         # |p − g| <= max(0.5·10^−2, 1e−6·|g|)
    expressions_match("x(2x+3)-5", "2x^2+3x-5")     # Math-Verify's symbolic equivalence
    parse_boolean("yes")                            # True (a synonym), None for anything else
    parse_letter("(C) 42 km")                       # "C": a multiple-choice letter A-D
    split_list("apple, banana and cherry")          # ["apple", "banana", "cherry"]

Choices where the papers are silent (docs/methods.md):

- Text: SQuAD's normalisation (lower case, ASCII punctuation dropped, the articles a/an/the dropped, whitespace
  collapsed), the same rule as the short-form QA benchmarks' exact match (`evaluation.scorers`).
- Numbers: equal within an absolute tolerance of half a unit in the gold's last written decimal place (a gold of
  3.14 accepts 3.135 to 3.145, as "to 2 decimal places" asks) or a relative tolerance of 1e−6, whichever is larger.
  Integers (decimals=0 with `integer=True`) must match exactly. A trailing % is dropped (50% reads as 50).
- Expressions: Math-Verify (huggingface/Math-Verify, the verifier SPICE names) parses both sides as LaTeX (plain
  `**` powers are read as `^`) and compares them symbolically. Its own time limit (signal.alarm) applies in the
  main thread; elsewhere it cannot run, so the limit is off and only the length cap below bounds the work.
  Answers longer than MAX_MATH_CHARS characters are never sent to it.
- Booleans: BOOLEAN_SYNONYMS ("yes", "correct", ... for true).

Every function here is total over strings: malformed input gives None or False, never an exception.
"""

from __future__ import annotations

import logging
import math
import re
import string
import threading
from collections.abc import Sequence
from typing import Any

from scope_lib.protocol.parsing import strip_think

__all__ = [
    "BOOLEAN_SYNONYMS", "MAX_MATH_CHARS", "RELATIVE_TOLERANCE", "normalize_answer", "extract_boxed", "strip_latex",
    "parse_number", "is_plain_number", "decimals_of", "parses_as_math", "numbers_match", "parse_boolean", "parse_letter", "split_list",
    "expressions_match", "lists_match", "texts_match",
]

log = logging.getLogger(__name__)

#: Words read as a boolean answer (lower case, after normalisation). SPICE's gold is "true" or "false"; a
#: Reasoner's yes/no is the same verdict.
BOOLEAN_SYNONYMS: dict[str, bool] = {
    "true": True, "yes": True, "correct": True, "right": True, "t": True, "y": True,
    "false": False, "no": False, "incorrect": False, "wrong": False, "f": False, "n": False,
}
#: The longest answer Math-Verify is asked to parse (a bound on the symbolic work outside the main thread).
MAX_MATH_CHARS = 300
#: The relative tolerance of a numeric match (beside the gold's half-unit absolute tolerance).
RELATIVE_TOLERANCE = 1e-6
#: Math-Verify's own time limits (seconds) for parsing and comparing, in the main thread.
MATH_TIMEOUT_S = 3

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?|[+-]?\.\d+(?:[eE][+-]?\d+)?")
_LETTER = re.compile(r"(?:(?:option|answer|choice)\s*:?\s*)?(?:\(([A-D])\)(?:\s.*)?|([A-D])(?:[.):](?:\s.*)?)?)",
                     re.IGNORECASE | re.DOTALL)
_LIST_SPLIT = re.compile(r"\s*[;,\n]\s*")
_AND = re.compile(r"\s+and\s+|^and\s+", re.IGNORECASE)


def normalize_answer(text: Any) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace (the standard QA rule)."""
    if not isinstance(text, str):
        return ""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def texts_match(prediction: Any, gold: Any) -> bool:
    """Exact match after `normalize_answer` (LaTeX text macros and $ signs removed first); empty never matches."""
    pred, ref = normalize_answer(strip_latex(prediction)), normalize_answer(strip_latex(gold))
    return bool(ref) and pred == ref


# -- the Reasoner's final answer ------------------------------------------------------------------------------


def extract_boxed(text: Any, *, starts_in_think: bool = False) -> str | None:
    r"""The content of the LAST ``\boxed{…}`` outside thinking, braces balanced, stripped; None when there is none
    (or it never closes, or it is empty). SPICE's Reasoner puts its final answer there (§2.3, Figure 8)."""
    if not isinstance(text, str):
        return None
    visible = strip_think(text, starts_in_think=starts_in_think)
    start = visible.rfind("\\boxed")
    while start >= 0:
        content = _braced(visible, start + len("\\boxed"))
        if content is not None and content.strip():
            return content.strip()
        start = visible.rfind("\\boxed", 0, start)
    return None


def _braced(text: str, pos: int) -> str | None:
    """The text inside the brace group that opens at `pos` (after optional spaces), or None."""
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    for i in range(pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1:i]
    return None


def strip_latex(text: Any) -> str:
    r"""`text` without LaTeX dressing a plain answer wears: ``\text{…}``-style macros (their content kept), ``$``
    signs and ``\,`` / ``\!`` / ``\ `` spacing."""
    if not isinstance(text, str):
        return ""
    previous = None
    while previous != text:
        previous, text = text, _TEXT_MACRO.sub(r"\1", text)
    for spacing in ("\\,", "\\!", "\\;", "\\ "):
        text = text.replace(spacing, " ")
    return text.replace("\\$", "").replace("$", "").strip()


# -- numbers ----------------------------------------------------------------------------------------------------


def parse_number(text: Any) -> float | None:
    r"""The number `text` states, or None. Plain decimals first ("1,000", "-3.5", "1.5e3", "50%" → 50); then
    Math-Verify for LaTeX (``\frac{1}{2}``, ``1.5 \times 10^{3}``, ``2^{10}``). A unit in ``\text{…}`` after the
    number is dropped ("42 \text{ m}"), and so are the unit words Math-Verify knows ("42 meters"). A JSON number is
    taken as is (a bool is not a number)."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text) if math.isfinite(text) else None
    if not isinstance(text, str):
        return None
    for plain in (strip_latex(text), strip_latex(_TEXT_MACRO.sub(" ", text))):  # with, then without \text units
        plain = plain.removesuffix("%").strip().replace("{,}", ",")
        if _NUMBER.fullmatch(plain):
            value = float(plain.replace(",", ""))
            return value if math.isfinite(value) else None
    return _math_number(text.replace("\\$", "").replace("$", ""))


def is_plain_number(text: Any) -> bool:
    """Whether `text` is a number in plain decimal notation ("42", "-2.5", "1,000", "1.5e3"): no LaTeX, no fraction."""
    return isinstance(text, str) and _NUMBER.fullmatch(text.strip()) is not None


def decimals_of(text: Any) -> int:
    """Decimal places written in a gold number ("3.140" → 3, "42" → 0, 2.5 → 1; an exponent counts: "1.5e-3" → 4)."""
    raw = repr(text) if isinstance(text, float) else strip_latex(text)
    m = re.fullmatch(r"[+-]?[\d,]*(?:\.(\d+))?(?:[eE]([+-]?\d+))?", raw.strip())
    if not m:
        return 0
    places = len(m.group(1) or "") - int(m.group(2) or 0)
    return max(0, places)


def numbers_match(prediction: float | None, gold: float | None, decimals: int = 0, *, integer: bool = False) -> bool:
    """Whether `prediction` equals `gold` within the tolerance: exact for an integer gold (`integer=True`); else
    |p − g| <= max(0.5·10^−decimals, RELATIVE_TOLERANCE·|g|), where `decimals` is how many the gold was written with."""
    if prediction is None or gold is None:
        return False
    if integer:
        return float(prediction).is_integer() and int(prediction) == int(gold)
    tolerance = max(0.5 * 10.0 ** -decimals, RELATIVE_TOLERANCE * abs(gold))
    return abs(prediction - gold) <= tolerance + 1e-12 * max(1.0, abs(gold))


# -- booleans, letters, lists --------------------------------------------------------------------------------------


def parse_boolean(text: Any) -> bool | None:
    """A JSON bool as is; a text whose normalised form is one of BOOLEAN_SYNONYMS; else None."""
    if isinstance(text, bool):
        return text
    return BOOLEAN_SYNONYMS.get(normalize_answer(strip_latex(text)))


def parse_letter(text: Any) -> str | None:
    """The multiple-choice letter (A–D, upper case) an answer gives: "C", "(c)", "C)", "C. 42 km", "Option C",
    "Answer: C". A bare word that merely starts with a letter ("A cat") gives None."""
    if not isinstance(text, str):
        return None
    m = _LETTER.fullmatch(strip_latex(text).strip())
    return (m.group(1) or m.group(2)).upper() if m else None


def split_list(value: Any) -> list[str] | None:
    """The items of a list answer: a JSON list's items as text, or a text split on commas, semicolons, "and" and
    line breaks, and its last item on "and" ("a, b and c"; a single item "X and Y" is two items), LaTeX ``\\{…\\}``
    and brackets around it dropped. Empty items are dropped; None when nothing is left."""
    if isinstance(value, list | tuple):
        items = [str(v).strip() for v in value if not isinstance(v, list | tuple | dict)]
    elif isinstance(value, str):
        text = strip_latex(value).strip()
        text = text.replace("\\{", "").replace("\\}", "")
        text = text.strip("[](){}").strip()
        parts = _LIST_SPLIT.split(text)
        parts = parts[:-1] + _AND.split(parts[-1])  # "a, b and c": the last item holds the "and"
        items = [part.strip().strip("\"'") for part in parts]
    else:
        return None
    items = [i for i in items if i]
    return items or None


# -- expressions (Math-Verify) ----------------------------------------------------------------------------------


def _math_parse(text: str) -> list:
    """Math-Verify's parse of `text` as LaTeX (plain `**` powers read as `^`): [] when it does not parse."""
    text = strip_latex(text)
    if not text or len(text) > MAX_MATH_CHARS:
        return []
    from math_verify import LatexExtractionConfig, parse  # a heavy import (sympy), only when math is compared

    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        parsed = parse(f"${text.replace('**', '^')}$", extraction_config=[LatexExtractionConfig()],
                       fallback_mode="no_fallback", parsing_timeout=timeout)
        return parsed if parsed and not isinstance(parsed[0], str) else []
    except Exception as exc:  # a parser failure is "not an expression", never a crash
        log.debug("math-verify could not parse %r: %s", text, exc)
        return []


def _math_number(text: str) -> float | None:
    parsed = _math_parse(text)
    if not parsed:
        return None
    try:
        value = complex(parsed[0].evalf())
    except (TypeError, ValueError, AttributeError):
        return None
    if value.imag != 0 or not math.isfinite(value.real):
        return None
    return value.real


def parses_as_math(text: Any) -> bool:
    """Whether Math-Verify reads `text` as a mathematical expression (at most MAX_MATH_CHARS characters)."""
    return isinstance(text, str) and bool(_math_parse(text))


def expressions_match(prediction: Any, gold: Any) -> bool:
    """Whether two expressions are mathematically equivalent by Math-Verify ("x(2x+3)-5" and "2x^2+3x-5"; an
    equation "y = 2x+1" and its right side); when either side does not parse, their normalised texts must match."""
    pred, ref = strip_latex(prediction), strip_latex(gold)
    if not pred or not ref:
        return False
    parsed_pred, parsed_gold = _math_parse(pred), _math_parse(ref)
    if not parsed_pred or not parsed_gold:
        return " ".join(pred.lower().split()) == " ".join(ref.lower().split())
    from math_verify import verify

    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        return bool(verify(parsed_gold, parsed_pred, timeout_seconds=timeout))
    except Exception as exc:  # a comparison that fails is no match
        log.debug("math-verify could not compare %r and %r: %s", pred, ref, exc)
        return False


def lists_match(prediction: Sequence[str] | None, gold: Sequence[str] | None, *, ordered: bool = True) -> bool:
    """Whether two lists hold the same items (numbers compared as numbers, other items by `texts_match`): in the
    same order (`ordered=True`, the default: SPICE's Challenger is told to state the order a list answer takes),
    or as multisets."""
    if not prediction or not gold or len(prediction) != len(gold):
        return False
    if ordered:
        return all(_items_match(p, g) for p, g in zip(prediction, gold, strict=True))
    left = list(prediction)
    for g in gold:
        hit = next((i for i, p in enumerate(left) if _items_match(p, g)), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def _items_match(prediction: str, gold: str) -> bool:
    gold_number = parse_number(gold) if _NUMBER.fullmatch(strip_latex(gold).strip()) else None
    if gold_number is not None:
        return numbers_match(parse_number(prediction), gold_number, decimals_of(gold))
    return texts_match(prediction, gold)
