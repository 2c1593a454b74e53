"""The names a text names, read without a tokenizer (`names_in`): the rule gates read a task's names with it
(`protocol.gate_rules`), the learning check an answer's and a rubric's (`evaluation.judge_free`). It shares
`protocol.facts`' word list (NOT_NAMES); `facts.facts_of` (the teacher's facts: a whole run that starts a sentence
is dropped) and `facts.Names` (names as the model's tokenizer cuts them) are its neighbours for the warm start,
kept apart because the warm start's cache key hashes facts.py (`smoke.teacher.protocol_fingerprint`).

    names_in("It was built by Gustave Eiffel for the Exposition.")   # ['Gustave Eiffel', 'Exposition']
    names_in("Arsenal Stadium opened when?")                          # ['Stadium']: "Arsenal" starts the sentence
    names_in("Write about ARSENAL STADIUM in The Times.")             # ['ARSENAL STADIUM', 'Times']
"""

from __future__ import annotations

import re

from scope_lib.protocol.facts import NOT_NAMES

#: The shortest word that makes a run a name ("St" or "Al" alone say too little).
MIN_NAME_LETTERS = 3

_SENTENCE_BREAK = re.compile(r"(?<=[.!?:;])\s+|\n+")
_CAPITALISED_RUN = re.compile(r"(?<![\w'’-])[A-ZÀ-ÖØ-Þ][\w'’-]*(?:[ \t]+[A-ZÀ-ÖØ-Þ][\w'’-]*)*")
_POSSESSIVE = re.compile(r"['’]s$")


def is_name_word(word: str) -> bool:
    """A word that can name something: capitalised, not in NOT_NAMES, at least MIN_NAME_LETTERS long."""
    return word[:1].isupper() and word not in NOT_NAMES and len(word) >= MIN_NAME_LETTERS


def bare(word: str) -> str:
    """A word without a possessive ending or trailing hyphens and apostrophes ("Kennedy's" -> "Kennedy")."""
    return _POSSESSIVE.sub("", word).rstrip("'’-")


def names_in(text: str) -> list[str]:
    """The names of `text`, in order and without repeats (ignoring case): runs of capitalised words one space or
    tab apart, less a run's first word where the run starts a sentence or a line (capitalised by grammar: "Plan",
    "Write"), less leading words of NOT_NAMES; a run is a name when one of its words `is_name_word`."""
    found: list[str] = []
    for sentence in _SENTENCE_BREAK.split(text):
        sentence = sentence.lstrip(" \t\"'“‘([")
        for m in _CAPITALISED_RUN.finditer(sentence):
            words = [bare(w) for w in m.group(0).split()]
            if m.start() == 0:
                words = words[1:]
            while words and words[0] in NOT_NAMES:
                words.pop(0)
            name = " ".join(words)
            if any(is_name_word(w) for w in words) and name.casefold() not in {f.casefold() for f in found}:
                found.append(name)
    return found
