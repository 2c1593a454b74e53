"""Total parsers over model text (paper App. F, H): tasks, answers, rubrics, scores and thinking.

Every public function here accepts ANY value and never raises: garbage gives None (or 0, False, "").
All scanning is linear in the text length (no backtracking regexes over the whole reply).

Conventions
-----------
Thinking. A ``<think>…</think>`` block is reasoning, not output: tasks, answers, rubrics and scores are
read only from the text outside thinking. Blocks pair the way a non-greedy ``<think>.*?</think>`` does
(the first ``</think>`` after an opener closes it). An opener that is never closed makes everything after
it thinking (a reply truncated mid-thought has no visible output).

Qwen3 and other native thinkers. A chat template may put ``<think>`` into the prompt, so the completion
starts inside a thinking block and holds only the closer: pass ``starts_in_think=True`` then (rollouts
record it per trajectory from the rendered prompt). Without it, a ``</think>`` that appears before any
``<think>`` still hides the text before it (it was reasoning, not output), but it is not a thinking block:
it earns no think credit (F.1/F.2), so a model cannot collect the think reward by writing a lone closer.

Tags. The protocol tags the policies write (``<think>``, ``<task>``, ``<answer>``) match as written, in
lower case, as in F.1/F.2; ``<task>``/``<answer>`` may carry attributes. The Judge's tags (``<score>``,
``<rubrics>``, ``<rubric>``) match in any letter case and may carry attributes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PRIORITIES", "DEFAULT_PRIORITY", "Rubric", "extract_task", "extract_answer", "parse_rubrics", "rubric_identity",
    "parse_score", "parse_correct_wrong", "strip_think", "count_think_blocks", "has_think", "starts_with_think",
    "ends_in_think",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_THINK_TAG = re.compile(r"</?think>")

#: Rubric priority levels of the rubric-writer prompt (App. H, Figure 12).
PRIORITIES: tuple[str, ...] = ("critical", "important", "bonus")
#: Priority given to a rubric whose priority is missing or not one of PRIORITIES: the middle level, so a
#: sloppy attribute neither drops a criterion nor inflates it (uniform weights, the paper's default, ignore it).
DEFAULT_PRIORITY = "important"


@dataclass(frozen=True)
class Rubric:
    """One rubric criterion c_k of eq. 1 with the priority the Judge gave it (critical/important/bonus)."""

    text: str
    priority: str = DEFAULT_PRIORITY


# -- thinking ----------------------------------------------------------------------------------------


def _scan_think(text: str, starts_in_think: bool = False) -> tuple[list[str], int, bool]:
    """Split text into its visible pieces. Returns (visible pieces, number of complete think blocks, whether the
    text ends inside an open think block)."""
    pieces: list[str] = []
    blocks = 0
    inside = starts_in_think
    pos = 0
    for match in _THINK_TAG.finditer(text):
        if inside:
            if match.group() == THINK_CLOSE:
                blocks += 1
                inside = False
                pos = match.end()
            continue  # an opener inside thinking is part of the thought
        if match.group() == THINK_OPEN:
            pieces.append(text[pos:match.start()])
            inside = True
        elif blocks == 0 and not pieces and pos == 0:
            # a </think> before any <think>: the text before it was reasoning (hidden), but without an opener
            # it is no block (starts_in_think=True when the chat template opened one)
            pos = match.end()
        # any later stray </think> stays in the visible text
    if not inside:
        pieces.append(text[pos:])
    return pieces, blocks, inside


def strip_think(text: Any, *, starts_in_think: bool = False) -> str:
    """The text outside thinking: complete blocks and an unclosed trailing block removed."""
    if not isinstance(text, str):
        return ""
    return "".join(_scan_think(text, starts_in_think)[0])


def count_think_blocks(text: Any, *, starts_in_think: bool = False) -> int:
    """Complete thinking blocks (an empty ``<think></think>`` counts; an unclosed one does not; a lone leading
    ``</think>`` counts only when the chat template opened the block, ``starts_in_think=True``)."""
    if not isinstance(text, str):
        return 0
    return _scan_think(text, starts_in_think)[1]


def has_think(text: Any, *, starts_in_think: bool = False) -> bool:
    """True when the text holds at least one complete thinking block (F.1/F.2 think component)."""
    return count_think_blocks(text, starts_in_think=starts_in_think) > 0


def ends_in_think(text: Any, *, starts_in_think: bool = False) -> bool:
    """True when the text ends inside an open thinking block: an opener (or, with ``starts_in_think=True``, the
    chat template's) that no ``</think>`` has closed yet. Whatever the model writes next is still thinking."""
    if not isinstance(text, str):
        return False
    return _scan_think(text, starts_in_think)[2]


def starts_with_think(text: Any, *, starts_in_think: bool = False) -> bool:
    """True when the text opens (after whitespace) with a complete thinking block, or, with
    ``starts_in_think=True``, begins inside one that a later ``</think>`` closes."""
    if not isinstance(text, str):
        return False
    first_close = text.find(THINK_CLOSE)
    if first_close < 0:
        return False
    if starts_in_think:
        return True
    first_open = text.find(THINK_OPEN)
    if first_open < 0 or first_close < first_open:
        return False  # a lone closer: no opener was written
    return not text[:first_open].strip()  # only whitespace before a block that closes


# -- elements ----------------------------------------------------------------------------------------


def _elements(text: str, name: str, *, ignore_case: bool = False) -> list[tuple[str, str]]:
    """Complete ``<name …>content</name>`` elements as (attributes, content), in order of their closers.

    Each closer pairs with the nearest unpaired opener before it, so ``<a>x<a>y</a>`` yields "y".
    """
    flags = re.IGNORECASE if ignore_case else 0
    tags = re.compile(rf"<{name}(?P<attrs>\s[^<>]*)?>|</{name}\s*>", flags)
    out: list[tuple[str, str]] = []
    open_end: int | None = None
    attrs = ""
    for match in tags.finditer(text):
        if match.group().startswith("</"):
            if open_end is not None:
                out.append((attrs, text[open_end:match.start()]))
                open_end = None
        else:
            open_end = match.end()
            attrs = match.group("attrs") or ""
    return out


def _last_nonempty(text: Any, name: str, starts_in_think: bool) -> str | None:
    if not isinstance(text, str):
        return None
    visible = strip_think(text, starts_in_think=starts_in_think)
    for _attrs, content in reversed(_elements(visible, name)):
        content = content.strip()
        if content:
            return content
    return None


def extract_task(text: Any, *, starts_in_think: bool = False) -> str | None:
    """The Challenger's task q: the last complete, non-empty ``<task>…</task>`` outside thinking, stripped.

    Whatever the model wrote inside (``<question>`` sub-elements included) is kept as is.
    """
    return _last_nonempty(text, "task", starts_in_think)


def extract_answer(text: Any, *, starts_in_think: bool = False) -> str | None:
    """The Solver's answer a: the last complete, non-empty ``<answer>…</answer>`` outside thinking."""
    return _last_nonempty(text, "answer", starts_in_think)


# -- judge replies -----------------------------------------------------------------------------------

_ATTR = re.compile(r"""([A-Za-z_][\w:.-]*)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'=<>`]+))""")
_SCORE_BODY = re.compile(r"\s*([01])\s*")


def _attributes(raw: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for m in _ATTR.finditer(raw):
        value = next((v for v in m.groups()[1:] if v is not None), "")
        found.setdefault(m.group(1).lower(), value)
    return found


def parse_rubrics(text: Any, min_rubrics: int = 3, max_rubrics: int = 10, *,
                  starts_in_think: bool = False, distinct: bool = False) -> list[Rubric] | None:
    """The rubrics 𝒢 in the LAST complete ``<rubrics>…</rubrics>`` block outside thinking (App. H, Fig. 12).

    Each ``<rubric priority="…">text</rubric>`` with non-empty text is one rubric (single or double quotes,
    other attributes and any whitespace allowed; whitespace inside the text is collapsed). A missing or
    unknown priority becomes DEFAULT_PRIORITY. With `distinct` (not in the paper), a rubric whose text repeats an
    earlier one's (`rubric_identity`: letter case, spacing and closing punctuation aside) is dropped, the first
    kept with its priority, before counting. Returns None unless min_rubrics ≤ count ≤ max_rubrics.
    """
    if not isinstance(text, str):
        return None
    try:
        lo, hi = int(min_rubrics), int(max_rubrics)
    except (TypeError, ValueError, OverflowError):
        return None
    visible = strip_think(text, starts_in_think=starts_in_think)
    blocks = _elements(visible, "rubrics", ignore_case=True)
    if not blocks:
        return None
    rubrics = []
    for attrs, content in _elements(blocks[-1][1], "rubric", ignore_case=True):
        body = " ".join(content.split())
        if not body:
            continue
        priority = _attributes(attrs).get("priority", "").strip().lower()
        rubrics.append(Rubric(body, priority if priority in PRIORITIES else DEFAULT_PRIORITY))
    if distinct:
        first = {}
        for rubric in rubrics:
            first.setdefault(rubric_identity(rubric.text), rubric)
        rubrics = list(first.values())
    return rubrics if lo <= len(rubrics) <= hi else None


def rubric_identity(text: str) -> str:
    """What two rubrics share when one repeats the other: the text in lower case, spacing collapsed, without
    closing punctuation."""
    return " ".join(text.casefold().split()).rstrip(" .;:!?")


def parse_score(text: Any, *, starts_in_think: bool = False) -> int | None:
    """A binary verdict from a grader or gate reply: the last complete ``<score>…</score>`` outside thinking.

    Its content must be 0 or 1 (whitespace allowed); anything else — or no score outside thinking — is None.
    The LAST score decides, so a reply that revises itself is read by its final word.
    """
    if not isinstance(text, str):
        return None
    scores = _elements(strip_think(text, starts_in_think=starts_in_think), "score", ignore_case=True)
    if not scores:
        return None
    match = _SCORE_BODY.fullmatch(scores[-1][1])
    return int(match.group(1)) if match else None


def parse_correct_wrong(text: Any, *, starts_in_think: bool = False) -> int | None:
    """An answer judge's verdict (Search Self-Play's LLM-as-a-judge, App. E: only "Correct" or "Wrong"): 1 for
    Correct, 0 for Wrong, in any letter case, the visible reply being that one word alone (spaces, quotes, backticks,
    asterisks and a full stop around it allowed); anything else, or nothing outside thinking, is None."""
    if not isinstance(text, str):
        return None
    word = strip_think(text, starts_in_think=starts_in_think).strip().strip("\"'`*.").strip().lower()
    return {"correct": 1, "wrong": 0}.get(word)


def last_json_object(text: str) -> dict | None:
    """The last top-level JSON object in `text` that decodes (SPICE's task, SCORE's harness). Each decoded object is
    skipped whole; the scan restarts at every "{" that does not decode (quadratic only on adversarial text; replies
    are token-capped)."""
    decoder = json.JSONDecoder()
    found: dict | None = None
    pos = text.find("{")
    while pos >= 0:
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            pos = text.find("{", pos + 1)
            continue
        if isinstance(value, dict):
            found = value
        pos = text.find("{", end)
    return found
