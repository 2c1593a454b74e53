"""Facts of a text: the names and years a rubric can ask for, and probes built from them (not in the paper).

One home for what every piece that reads facts out of corpus text uses: the warm start's teacher (the rubrics it
writes name a document's facts, its grades check them: `scope_lib.smoke.teacher`), the judges' calibration probes
(a rubric's fact stated, removed or swapped: `scope_lib.selfplay.grader_probe`, `scope_lib.evaluation.judge_probes`)
and the learning check's grader probe.

    mentions(text, "Paris")                        # the fact as a whole word or phrase, any case
    facts_of(sentence, exclude=title)              # [("year", "1990"), ("name", "Marie Curie")]
    fact_pairs(passages, n, seed)                  # a fact stated / removed / swapped, from the corpus
    Names(tokenizer, max_tokens).facts(text)       # the short facts a model can copy (the teacher's)

Passages are anything with `id`, `title`, `text` and `contents` (`retrieval.corpus.Passage`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: Capitalised words that are never a name by themselves: function words, pronouns, months, weekdays, and the
#: protocol's own labels (`Title`, `Doc`, `Task`). One list for the teacher and the probes: the union of the two
#: lists they kept before. On the 1000-passage sample the smoke teacher writes the same examples with it as with
#: its old list (sha256 of every example's tokens unchanged); the probes' fact pairs change in 17 of the 1000
#: passages ("In September" is no fact, "Yes Minister" is "Minister"), and so do the grades that
#: `model.warm_start.sentence_grades` writes from them (params/smollm.yaml: its warm start is rebuilt).
NOT_NAMES = frozenset({
    "A", "An", "The", "In", "On", "At", "He", "She", "It", "His", "Her", "Its", "They", "Their", "This", "That",
    "These", "Those", "There", "Here", "After", "Before", "During", "From", "With", "For", "By", "As", "When",
    "While", "Although", "However", "But", "And", "Or", "If", "Since", "Then", "Also", "Some", "Many", "Most",
    "One", "Two", "Both", "Each", "All", "Other", "Following", "According", "Despite", "Under", "Over", "Between",
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December", "Monday", "Friday", "Saturday", "Sunday", "I", "We", "You", "Our", "To", "Of", "Not",
    "No", "Yes", "Later", "Today", "Title", "Doc", "Document", "Question", "Task",
})
#: A year from 1500 to 2049, standing alone (not part of a longer number).
YEAR = re.compile(r"(?<![\w.,])(1[5-9]\d\d|20[0-4]\d)(?![\w])")

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(])")
_NAME = re.compile(r"(?<![\w'’-])([A-Z][a-z]+(?:\s+[A-Z][a-z]+){0,2})(?![\w'’-])")
_WORD = re.compile(r"(?<![\w'’-])[A-Z][\w'’-]*|(?<![\w.,])\d{2,4}(?![\w])")
_SENTENCE_START = re.compile(r"(?:^|[.!?:;]\s+|[\n(\"“]\s*)$")


class Document(Protocol):
    """What fact extraction reads of a passage (`retrieval.corpus.Passage` is one)."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str: ...


def mentions(text: str, fact: str) -> bool:
    """Whether `fact` occurs in `text` as a whole word or phrase, ignoring case."""
    return re.search(rf"(?<![\w]){re.escape(fact)}(?![\w])", text, re.IGNORECASE) is not None


def is_year(word: str) -> bool:
    return YEAR.fullmatch(word) is not None


def sentences(text: str) -> list[str]:
    """Complete sentences of a passage (a 100-word passage starts and ends mid-sentence: those pieces go)."""
    parts = [s.strip() for s in _SENTENCE.split(text.strip())]
    return [s for s in parts[1:] if s.endswith((".", "!", "?")) and 6 <= len(s.split()) <= 60]


def facts_of(sentence: str, exclude: str = "") -> list[tuple[str, str]]:
    """(kind, fact) pairs of a sentence: years, and capitalised names (up to three words, without a leading word
    of NOT_NAMES) that do not start it and are not in `exclude` (the passage's title)."""
    found: list[tuple[str, str]] = [("year", m.group(1)) for m in YEAR.finditer(sentence)]
    for m in _NAME.finditer(sentence):
        words = m.group(1).split()
        while words and words[0] in NOT_NAMES:
            words.pop(0)
        name = " ".join(words)
        if not name or m.start() == 0 or len(name) < 4 or mentions(exclude, name):
            continue
        found.append(("name", name))
    return found


class Names:
    """The names and facts a model can copy: capitalised words and numbers of at most `max_tokens` tokens of its
    tokenizer (written with a leading space, as they appear inside text; `model.warm_start.fact_max_tokens`).
    The tiny model gets 1: copying longer names needs induction heads, which it does not learn in a CPU budget;
    a pretrained model copies longer ones."""

    def __init__(self, tokenizer, max_tokens: int = 1):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self._short: dict[str, bool] = {}

    def single(self, word: str) -> bool:
        """Whether `word` is short enough to be a fact (at most `max_tokens` tokens)."""
        if word not in self._short:
            n = len(self.tokenizer.encode(" " + word, add_special_tokens=False))
            self._short[word] = n <= self.max_tokens
        return self._short[word]

    def names(self, text: str, exclude: Sequence[str] = ()) -> list[str]:
        """Short capitalised words (`single`) of `text` in order, without repeats; a word that starts a sentence
        (or a line) does not count, nor a word of NOT_NAMES."""
        skip = {e.lower() for e in exclude}
        found: list[str] = []
        for m in _WORD.finditer(text):
            word = re.sub(r"['’]s$", "", m.group(0)).rstrip("'’-")
            if word[0].isdigit() or word in NOT_NAMES or word.lower() in skip or word in found or len(word) < 3:
                continue
            if m.start() == 0 or _SENTENCE_START.search(text[max(0, m.start() - 3):m.start()]):
                continue
            if self.single(word):
                found.append(word)
        return found

    def facts(self, text: str, exclude: Sequence[str] = ()) -> list[str]:
        """Checkable short facts of `text` in order: names and years."""
        skip = {e.lower() for e in exclude}
        names = set(self.names(text, exclude))
        found: list[str] = []
        for m in _WORD.finditer(text):
            word = re.sub(r"['’]s$", "", m.group(0)).rstrip("'’-")
            keep = word in names or (is_year(word) and self.single(word))
            if keep and word not in found and word.lower() not in skip:
                found.append(word)
        return found


# -- fact pairs: one fact stated, removed, swapped -------------------------------------------------------------


@dataclass(frozen=True)
class FactPair:
    """A fact of one passage and the sentences a probe response is made of: `stated` holds the fact, `context` is
    another sentence of the passage that does not, `swapped` is `stated` with the fact replaced by `other`, a fact
    of the same kind (a year, a name) from another passage that this one never mentions."""

    passage_id: str
    subject: str
    fact: str
    other: str
    stated: str
    context: str
    swapped: str


def fact_pairs(passages: Sequence[Document], n: int, seed: int = 0) -> list[FactPair]:
    """Up to `n` fact pairs from distinct passages in a seeded order: each with a fact stated exactly once, in
    one sentence, a context sentence without it, and a same-kind fact of another passage to swap in."""
    order = list(range(len(passages)))
    random.Random(f"{seed}/calibration/facts").shuffle(order)
    pool: dict[str, list[tuple[str, str]]] = {"year": [], "name": []}
    for i in order[: 4 * n + 40]:  # facts to swap in, from the same seeded sample
        for sentence in sentences(passages[i].text):
            for kind, fact in facts_of(sentence, passages[i].title):
                pool[kind].append((passages[i].id, fact))
    pairs: list[FactPair] = []
    for i in order:
        if len(pairs) >= n:
            break
        p = passages[i]
        found = _pair(p, pool, random.Random(f"{seed}/calibration/{p.id}"))
        if found is not None:
            pairs.append(found)
    return pairs


def _pair(p: Document, pool: dict[str, list[tuple[str, str]]], rng: random.Random) -> FactPair | None:
    parts = sentences(p.text)
    for k, stated in enumerate(parts):
        for kind, fact in facts_of(stated, p.title):
            if len(re.findall(rf"(?<![\w]){re.escape(fact)}(?![\w])", stated, re.IGNORECASE)) != 1:
                continue
            context = next((s for j, s in enumerate(parts) if j != k and not mentions(s, fact)), None)
            others = [o for pid, o in pool[kind] if pid != p.id and not mentions(p.contents, o)
                      and not mentions(o, fact) and not mentions(fact, o)]
            if context is None or not others:
                continue
            other = rng.choice(sorted(set(others)))
            swapped = re.sub(rf"(?<![\w]){re.escape(fact)}(?![\w])", other, stated, flags=re.IGNORECASE)
            return FactPair(p.id, p.title, fact, other, stated, context, swapped)
    return None


def fact_responses(pair: FactPair) -> list[tuple[str, str, bool]]:
    """(kind, response, should the rubric be met) for one fact pair: the fact stated (in either order with the
    context sentence), the same response with the fact's sentence removed, and with the fact swapped."""
    return [("stated", f"{pair.stated} {pair.context}", True),
            ("reordered", f"{pair.context} {pair.stated}", True),
            ("removed", pair.context, False),
            ("swapped", f"{pair.swapped} {pair.context}", False)]
