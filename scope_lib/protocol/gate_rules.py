"""Rule-based quality gates (not in the paper): the two gates of §3.1 decided by reading the task's words, with no
model. Search Self-Play filters its proposer's tasks with rules before its judge sees them; SCOPE's small Judges can
say yes to everything (issue 51), and a rule cannot. `judge.gates_by` chooses: the Judge's prompts (the paper), these
rules, or the rules first and the Judge only for tasks the rules pass (`selfplay.judge.Judge.gates`).

    entity_identifiability(task, title)           # names a capitalised name (`protocol.names.names_in`), or a word of the title
    source_relevance(task, source_document)       # a name of the task occurs in the source
    rule_verdicts(task, source_document, gates)   # {gate: 0 or 1}

- **entity identifiability** passes when the task names something: a capitalised name that does not merely start a
  sentence (every imperative task starts with a capital: "Plan", "Write"), in any case ("ARSENAL STADIUM" counts), or
  a word of the source's title in any case. A bare ambiguous name ("Kennedy") passes too: the rule cannot tell.
- **source relevance** passes when a name of the task, or one of its words, occurs in the source document (its
  title included) as a whole word, ignoring case and accents, or the task holds a word of the source's title.

Words of `protocol.facts.NOT_NAMES` (function words, months, the protocol's labels) are never names.
"""

from __future__ import annotations

import re
import unicodedata

from scope_lib.protocol.names import bare, is_name_word, names_in

#: The quality gates a rule can decide (`config.Gate` less the answerability check, which needs rubrics).
RULE_GATES: tuple[str, ...] = ("entity_identifiability", "source_relevance")

_WORD = re.compile(r"[^\W\d_][\w'’-]*")
_TITLE = re.compile(r"^\(Title: (.*?)\)\n")


def fold(text: str) -> str:
    """`text` without accents, case-folded: what the rules compare ("Zürich" and "ZURICH" are one name)."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()


def title_of(source_document: str) -> str:
    """The title of a source document as the Challenger and the gates see it ("(Title: X)\\n..."), else ""."""
    m = _TITLE.match(source_document)
    return m.group(1) if m else ""


def title_words(title: str) -> list[str]:
    """The words of a title that can name its subject: capitalised, not in NOT_NAMES, at least 3 letters."""
    return [w for w in (bare(m.group(0)) for m in _WORD.finditer(title)) if is_name_word(w)]


def mentions_folded(text: str, phrase: str) -> bool:
    """Whether `phrase` occurs in `text` as a whole word or phrase, ignoring case and accents."""
    return re.search(rf"(?<!\w){re.escape(fold(phrase))}(?!\w)", fold(text)) is not None


def entity_identifiability(task: str, title: str = "") -> bool:
    """The rule for entity identifiability: the task names a capitalised name, or a word of the source's title."""
    return bool(names_in(task)) or any(mentions_folded(task, w) for w in title_words(title))


def source_relevance(task: str, source_document: str) -> bool:
    """The rule for source relevance: a name of the task (the whole name or one of its name words) occurs in the
    source document, or the task holds a word of the source's title; whole words, any case, any accents."""
    for name in names_in(task):
        words = [name, *(w for w in name.split() if is_name_word(w))]
        if any(mentions_folded(source_document, w) for w in words):
            return True
    return any(mentions_folded(task, w) for w in title_words(title_of(source_document)))


def rule_verdicts(task: str, source_document: str, gates: list[str] | tuple[str, ...]) -> dict[str, int]:
    """The rules' verdict (1 pass, 0 fail) on every gate of `gates` that a rule decides."""
    checks = {"entity_identifiability": lambda: entity_identifiability(task, title_of(source_document)),
              "source_relevance": lambda: source_relevance(task, source_document)}
    return {g: int(checks[g]()) for g in gates if g in checks}
