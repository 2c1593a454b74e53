"""SPICE, Self-Play In Corpus Environments (Meta FAIR, arXiv 2510.24684): its task format, verification and rewards.

One policy plays two roles. The Challenger reads a corpus document (no search) and writes a question with a gold
answer a* as JSON: multiple choice (4 options and a letter) or free form with a typed answer (§2.2, App. E). The
Reasoner answers closed-book (no document, no search) and boxes its final answer (§2.3). Answers are verified by
rule (`protocol.verification`; SPICE uses Math-Verify, §2.5).

    parsed = parse_task(challenger_reply)                # TaskParse: .task (SpiceTask) or .reason (INVALID_REASONS)
    reasoner_prompt(parsed.task)                         # the question (and options) + "put it in \\boxed{}"
    verified = [verify_reply(parsed.task, r) for r in reasoner_replies]     # 1[â_i = a*]
    challenger_reward(verified, parsed.valid)            # eq. 1: Gaussian on the pass rate's variance, or −0.1
    reasoner_reward(verified[i])                         # 1[â_i = a*]
    subsample_attempts(valid_flags, group_size, seed)    # Algorithm 1, line 6: G attempts, valid:invalid kept
    format_choice_prompt(document)                       # App. E, Figure 9: the Challenger picks the format first
    parse_format_choice(reply)                           # -> an answer type, or None (the reply chose none)

The task's JSON, our schema (the paper's prompts name other fields; docs/methods.md):

    {"answer_type": "multiple_choice", "question": "...", "options": ["...", "...", "...", "..."], "answer": "C"}
    {"answer_type": "integer" | "float" | "expression" | "string" | "list" | "boolean", "question": "...",
     "answer": <value>}

Other fields (the paper asks for quotes, a hardening process, a solution) are allowed and ignored. The JSON read is
the last top-level object outside thinking that decodes (a code fence around it is tolerated).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scope_lib.protocol import verification as V
from scope_lib.protocol.parsing import last_json_object, strip_think
from scope_lib.protocol.prompts import render_template
from scope_lib.protocol.rewards import difficulty_reward

__all__ = [
    "ANSWER_TYPES", "FREE_FORM_TYPES", "OPTION_LETTERS", "MAX_STRING_WORDS", "INVALID_PENALTY", "INVALID_REASONS",
    "ANSWER_TYPE_RULES", "SpiceTask", "TaskParse", "parse_task", "task_from_json", "reasoner_answer",
    "answer_matches", "verify_reply", "challenger_reward", "reasoner_reward", "subsample_attempts",
    "challenger_prompt", "reasoner_prompt", "format_choice_prompt", "parse_format_choice",
]

#: The task formats (§2.2, App. E): multiple choice, or free form with one of six answer types.
ANSWER_TYPES: tuple[str, ...] = ("multiple_choice", "integer", "float", "expression", "string", "list", "boolean")
FREE_FORM_TYPES: tuple[str, ...] = ANSWER_TYPES[1:]
#: A multiple-choice question's four option letters.
OPTION_LETTERS: tuple[str, ...] = ("A", "B", "C", "D")
#: A string answer's most words (App. E, the free-form prompt: "1-3 words maximum").
MAX_STRING_WORDS = 3
#: The Challenger's reward for an invalid task (§3.1: p = −0.1).
INVALID_PENALTY = -0.1
#: Why a Challenger reply is not a valid task (`TaskParse.reason`).
INVALID_REASONS: tuple[str, ...] = (
    "no_json",                 # no JSON object outside thinking
    "missing_field",           # question, answer, answer_type (or options) absent
    "question_not_text",       # the question is not a string (a list of questions, a number)
    "empty_question",          # the Challenger gave up: "" (App. E: "Return empty string if ...")
    "unknown_answer_type",     # answer_type not one of ANSWER_TYPES
    "wrong_option_count",      # a multiple-choice question without exactly 4 options
    "empty_option",            # an option with no text
    "duplicate_options",       # two options that normalise alike: the letter would be ambiguous
    "not_a_letter",            # a multiple-choice answer that is not A-D
    "empty_answer",            # the gold answer is empty
    "type_mismatch",           # the gold answer is not of its declared type
    "string_too_long",         # a string answer of more than MAX_STRING_WORDS words
    "unparsable_expression",   # an expression answer Math-Verify cannot read
)
_TYPE_ALIASES = {"mcq": "multiple_choice", "multiple_choice_question": "multiple_choice", "int": "integer",
                 "bool": "boolean"}

#: What each free-form answer type must look like: the rule the Challenger's prompt states and an example answer
#: (App. E, "Answer Precision").
ANSWER_TYPE_RULES: dict[str, tuple[str, Any]] = {
    "integer": ("The answer is a whole number written as digits (no decimals, fractions or ranges); the question "
                "says what is counted or in which unit.", 42),
    "float": ("The answer is a number in decimal notation (3.14, not 22/7); the question says to how many decimal "
              "places to give it, and in which unit.", 3.14),
    "expression": ("The answer is a simplified mathematical expression in standard notation, with every variable "
                   "defined in the question.", "2*x^2 + 3*x - 5"),
    "string": (f"The answer is a short text of 1 to {MAX_STRING_WORDS} words: a name, a term or an identifier, "
               "with no extra punctuation.", "gradient descent"),
    "list": ("The answer is a JSON list of short items; the question says in which order to list them "
             "(alphabetical, chronological, by size).", ["apple", "banana", "cherry"]),
    "boolean": ("The answer is true or false (a JSON boolean); the question is a claim that needs several facts "
                "to check, not a trivial yes/no question.", True),
}


@dataclass(frozen=True)
class SpiceTask:
    """A valid Challenger task (q, a*). `answer` is the gold in its type: a letter (multiple choice), an int, a
    float, an expression or string (text), a tuple of items (list) or a bool. `decimals`: the decimal places a
    float gold was written with (its tolerance, `verification.numbers_match`)."""

    question: str
    answer_type: str
    answer: str | int | float | bool | tuple[str, ...]
    options: tuple[str, ...] = ()
    decimals: int = 0

    @property
    def reasoner_text(self) -> str:
        """The question as the Reasoner sees it: the question, then "A) …" to "D) …" for multiple choice."""
        if not self.options:
            return self.question
        return self.question + "\n" + "\n".join(f"{k}) {o}" for k, o in zip(OPTION_LETTERS, self.options,
                                                                             strict=True))


@dataclass(frozen=True)
class TaskParse:
    """What a Challenger reply gave: a task, or the reason (one of INVALID_REASONS) and a detail saying why not."""

    task: SpiceTask | None
    reason: str | None = None
    detail: str = ""

    @property
    def valid(self) -> bool:
        return self.task is not None


def _invalid(reason: str, detail: str) -> TaskParse:
    assert reason in INVALID_REASONS, reason
    return TaskParse(None, reason, detail)


# -- the Challenger's reply --------------------------------------------------------------------------------------


def parse_task(reply: Any, *, starts_in_think: bool = False) -> TaskParse:
    """The Challenger's task from its reply (§2.2: valid when "formatted correctly and parsable"): the last JSON
    object outside thinking, checked by `task_from_json`. Total: any input gives a TaskParse."""
    if not isinstance(reply, str):
        return _invalid("no_json", f"the reply is {type(reply).__name__}, not text")
    obj = last_json_object(strip_think(reply, starts_in_think=starts_in_think))
    if obj is None:
        return _invalid("no_json", "no JSON object outside thinking")
    return task_from_json(obj)


def _answer_type(obj: dict) -> str | None:
    raw = obj.get("answer_type")
    if raw is None:
        return "multiple_choice" if "options" in obj else None
    if not isinstance(raw, str):
        return ""
    key = re.sub(r"[\s-]+", "_", raw.strip().lower())
    return _TYPE_ALIASES.get(key, key)


def task_from_json(obj: Any) -> TaskParse:
    """Check one decoded task object against the schema above; INVALID_REASONS says what failed first."""
    if not isinstance(obj, dict):
        return _invalid("no_json", f"the task is a JSON {type(obj).__name__}, not an object")
    for name in ("question", "answer"):
        if name not in obj:
            return _invalid("missing_field", f'no "{name}" field')
    answer_type = _answer_type(obj)
    if answer_type is None:
        return _invalid("missing_field", 'no "answer_type" field (and no "options")')
    question = obj["question"]
    if not isinstance(question, str):
        return _invalid("question_not_text", f"the question is a JSON {type(question).__name__}")
    if not question.strip():
        return _invalid("empty_question", "the question is empty")
    if answer_type not in ANSWER_TYPES:
        return _invalid("unknown_answer_type", f"answer_type {obj.get('answer_type')!r} is not one of "
                                               f"{', '.join(ANSWER_TYPES)}")
    answer = obj["answer"]
    if answer is None or (isinstance(answer, str | list) and not answer):
        return _invalid("empty_answer", "the answer is empty")
    if answer_type == "multiple_choice":
        return _multiple_choice(question.strip(), obj.get("options"), answer)
    return _free_form(question.strip(), answer_type, answer)


def _options(raw: Any) -> list[Any] | None:
    """The options in A-D order: a list, or an object keyed A-D (any case)."""
    if isinstance(raw, list):
        return raw
    if isinstance(raw, dict) and {str(k).strip().upper() for k in raw} == set(OPTION_LETTERS) and len(raw) == 4:
        by_letter = {str(k).strip().upper(): v for k, v in raw.items()}
        return [by_letter[k] for k in OPTION_LETTERS]
    return None


def _strip_label(option: str, letter: str) -> str:
    """An option without its own letter label ("B) 42 km" as option B reads "42 km")."""
    return re.sub(rf"^\(?{letter}[).:]\s+", "", option.strip(), flags=re.IGNORECASE)


def _multiple_choice(question: str, raw_options: Any, answer: Any) -> TaskParse:
    if raw_options is None:
        return _invalid("missing_field", 'a multiple-choice task without "options"')
    options = _options(raw_options)
    if options is None or len(options) != len(OPTION_LETTERS):
        count = len(raw_options) if isinstance(raw_options, list | dict) else "no list of"
        return _invalid("wrong_option_count", f"{count} options; a multiple-choice task has exactly 4 (A-D)")
    texts = [_strip_label(str(o), k) if isinstance(o, str | int | float) and not isinstance(o, bool) else ""
             for k, o in zip(OPTION_LETTERS, options, strict=True)]
    if any(not t.strip() for t in texts):
        return _invalid("empty_option", "an option has no text")
    normalised = [V.normalize_answer(t) or t.strip().lower() for t in texts]
    if len(set(normalised)) < len(normalised):
        return _invalid("duplicate_options", "two options read alike")
    letter = V.parse_letter(answer) if isinstance(answer, str) else None
    if letter is None:
        return _invalid("not_a_letter", f"answer {answer!r} is not one of A, B, C, D")
    return TaskParse(SpiceTask(question, "multiple_choice", letter, tuple(texts)))


def _free_form(question: str, answer_type: str, answer: Any) -> TaskParse:
    gold = _GOLD_READERS[answer_type](answer)
    if isinstance(gold, TaskParse):
        return gold
    value, decimals = gold
    return TaskParse(SpiceTask(question, answer_type, value, decimals=decimals))


def _mismatch(answer_type: str, answer: Any, why: str = "") -> TaskParse:
    return _invalid("type_mismatch", f"answer {answer!r} is not {answer_type}{': ' + why if why else ''}")


def _plain_number(answer: Any) -> float | None:
    """A gold number as JSON writes it, or as plain digits in a string ("1,000", "-2.5"); no LaTeX, no fractions."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int | float):
        return float(answer) if math.isfinite(answer) else None
    if isinstance(answer, str) and V.is_plain_number(answer):
        return V.parse_number(answer)
    return None


def _integer_gold(answer: Any) -> tuple[int, int] | TaskParse:
    value = _plain_number(answer)
    if value is None:
        return _mismatch("integer", answer)
    if not value.is_integer():
        return _mismatch("integer", answer, "it has a fractional part")
    return int(value), 0


def _float_gold(answer: Any) -> tuple[float, int] | TaskParse:
    value = _plain_number(answer)
    if value is None:
        return _mismatch("float", answer, "write it in decimal notation")
    return value, V.decimals_of(answer)


def _expression_gold(answer: Any) -> tuple[str, int] | TaskParse:
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return _mismatch("expression", answer)
    text = str(answer).strip()
    if not V.parses_as_math(text):
        return _invalid("unparsable_expression", f"Math-Verify cannot read {text!r} as an expression")
    return text, 0


def _string_gold(answer: Any) -> tuple[str, int] | TaskParse:
    if not isinstance(answer, str):
        return _mismatch("string", answer)
    text = " ".join(answer.split())
    if not text:
        return _invalid("empty_answer", "the answer is empty")
    if len(text.split()) > MAX_STRING_WORDS:
        return _invalid("string_too_long", f"{len(text.split())} words; a string answer has at most "
                                           f"{MAX_STRING_WORDS}")
    return text, 0


def _list_gold(answer: Any) -> tuple[tuple[str, ...], int] | TaskParse:
    if isinstance(answer, list) and any(isinstance(v, list | dict) or v is None for v in answer):
        return _mismatch("list", answer, "its items must be plain values")
    if not isinstance(answer, list | str):
        return _mismatch("list", answer)
    items = V.split_list(answer)
    if not items:
        return _invalid("empty_answer", "the list is empty")
    return tuple(items), 0


def _boolean_gold(answer: Any) -> tuple[bool, int] | TaskParse:
    if isinstance(answer, bool):
        return answer, 0
    if isinstance(answer, str) and answer.strip().lower() in ("true", "false"):
        return answer.strip().lower() == "true", 0
    return _mismatch("boolean", answer, 'write true or false')


_GOLD_READERS = {"integer": _integer_gold, "float": _float_gold, "expression": _expression_gold,
                 "string": _string_gold, "list": _list_gold, "boolean": _boolean_gold}


# -- the Reasoner's answer -----------------------------------------------------------------------------------------


def reasoner_answer(reply: Any, *, starts_in_think: bool = False) -> str | None:
    r"""The Reasoner's final answer â: the last ``\boxed{…}`` outside thinking (§2.3), or None."""
    return V.extract_boxed(reply, starts_in_think=starts_in_think)


def answer_matches(task: SpiceTask, answer: Any, *, ordered_lists: bool = True) -> bool:
    """1[â = a*] by rule, per answer type: the option letter; an integer exactly; a float within its tolerance; an
    expression by Math-Verify; a string after normalisation; a list item by item (in order unless
    `ordered_lists=False`); a boolean through its synonyms. No answer (None) is wrong."""
    if answer is None:
        return False
    kind, gold = task.answer_type, task.answer
    if kind == "multiple_choice":
        return V.parse_letter(answer) == gold
    if kind == "integer":
        return V.numbers_match(V.parse_number(answer), float(gold), integer=True)
    if kind == "float":
        return V.numbers_match(V.parse_number(answer), float(gold), task.decimals)
    if kind == "expression":
        return V.expressions_match(answer, gold)
    if kind == "string":
        return V.texts_match(answer, gold)
    if kind == "list":
        return V.lists_match(V.split_list(answer), list(gold), ordered=ordered_lists)
    if kind == "boolean":
        return V.parse_boolean(answer) is gold
    raise ValueError(f"unknown answer type {kind!r}; choose one of {', '.join(ANSWER_TYPES)}")


def verify_reply(task: SpiceTask, reply: Any, *, starts_in_think: bool = False, ordered_lists: bool = True) -> bool:
    """Whether a Reasoner reply's boxed answer matches the gold (`reasoner_answer`, then `answer_matches`)."""
    return answer_matches(task, reasoner_answer(reply, starts_in_think=starts_in_think), ordered_lists=ordered_lists)


# -- rewards (eq. 1, §2.3) ----------------------------------------------------------------------------------------


def challenger_reward(verified: Sequence[bool], valid: bool, *, invalid_penalty: float = INVALID_PENALTY) -> float:
    """r_C (eq. 1): exp(−(Var − 0.25)² / (2·0.01)) over the Reasoner's K verified answers, Var = p(1 − p) the
    variance of the 0/1 outcomes at pass rate p (`rewards.difficulty_reward`, shape "spice"); `invalid_penalty`
    (p = −0.1, §3.1) for an invalid task. A valid task needs at least one answer."""
    if not valid:
        return float(invalid_penalty)
    outcomes = [bool(v) for v in verified]
    if not outcomes:
        raise ValueError("a valid SPICE task needs the Reasoner's K answers for its reward (eq. 1); got none")
    return difficulty_reward(sum(outcomes) / len(outcomes), shape="spice")


def reasoner_reward(verified: bool) -> float:
    """r_R = 1[â = a*] (§2.3)."""
    return 1.0 if verified else 0.0


def subsample_attempts(valid: Sequence[bool], group_size: int, seed: int | str = 0) -> list[int]:
    """Algorithm 1, line 6: the indices of `group_size` (G) of a document's Challenger attempts, keeping their
    valid:invalid ratio: round(G·V/N) valid ones (half up), at least one when any is valid (the paper's iteration
    aims for a valid task per document; it is silent on rounding), the rest invalid; fewer of a kind than asked
    are made up from the other. All attempts when there are at most G. Seeded; returned in order."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a whole number >= 1, got {group_size!r}")
    flags = [bool(v) for v in valid]
    if len(flags) <= group_size:
        return list(range(len(flags)))
    good = [i for i, v in enumerate(flags) if v]
    bad = [i for i, v in enumerate(flags) if not v]
    n_good = min(len(good), math.floor(group_size * len(good) / len(flags) + 0.5))
    if good and n_good == 0:
        n_good = 1
    n_bad = min(len(bad), group_size - n_good)
    n_good = group_size - n_bad
    rng = random.Random(f"{seed}/spice/subsample")
    return sorted(rng.sample(good, n_good) + rng.sample(bad, n_bad))


# -- prompts (App. E) ------------------------------------------------------------------------------------------------


def challenger_prompt(document: str, answer_type: str) -> str:
    """The Challenger's prompt: the document, how to build a hard self-contained question, and the JSON format of
    `answer_type` (multiple choice, or one free-form type with its rule and an example answer)."""
    if not isinstance(document, str) or not document.strip():
        raise ValueError("the SPICE Challenger needs a non-empty document")
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"unknown SPICE answer type {answer_type!r}; choose one of {', '.join(ANSWER_TYPES)}")
    if answer_type == "multiple_choice":
        rules = render_template("spice_format_multiple_choice")
    else:
        rule, example = ANSWER_TYPE_RULES[answer_type]
        rules = render_template("spice_format_free_form", answer_type=answer_type, type_rule=rule,
                                answer_example=json.dumps(example))
    return render_template("spice_challenger", document=document, format_rules=rules)


def reasoner_prompt(task: SpiceTask) -> str:
    r"""The Reasoner's prompt (Figure 8): the question alone (with its options), reason step by step, the final
    answer in \boxed{}; for multiple choice, only the letter."""
    note = (" For this multiple-choice question, put only the letter of the correct option in \\boxed{}."
            if task.answer_type == "multiple_choice" else "")
    return render_template("spice_reasoner", question=task.reasoner_text, choice_instruction=note)


def format_choice_prompt(document: str) -> str:
    """Figure 9's question to the Challenger before it writes (App. E, "Question Format Selection"): which format
    suits the document, multiple choice or free form, and for free form which answer type (Integer, Expression or
    String, the three Figure 9 names)."""
    if not isinstance(document, str) or not document.strip():
        raise ValueError("the SPICE Challenger needs a non-empty document")
    return render_template("spice_format_choice", document=document)


def parse_format_choice(reply: Any, *, starts_in_think: bool = False) -> str | None:
    """The answer type a Figure 9 reply chose: "multiple_choice" when only `suitable_for_mcq` is true; the free-form
    type `best_answer_type` names (any of FREE_FORM_TYPES, any case) when only `suitable_for_free_form` is true.
    None when the reply has no such JSON object, both or neither flag is true (Figure 9: "Exactly ONE"), or the
    free-form type is missing or unknown."""
    if not isinstance(reply, str):
        return None
    obj = last_json_object(strip_think(reply, starts_in_think=starts_in_think))
    if not isinstance(obj, dict):
        return None
    mcq, free = obj.get("suitable_for_mcq") is True, obj.get("suitable_for_free_form") is True
    if mcq == free:
        return None
    if mcq:
        return "multiple_choice"
    raw = obj.get("best_answer_type")
    if not isinstance(raw, str):
        return None
    key = re.sub(r"[\s-]+", "_", raw.strip().lower())
    kind = _TYPE_ALIASES.get(key, key)
    return kind if kind in FREE_FORM_TYPES else None
