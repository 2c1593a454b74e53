"""Judge calibration: before a judge's verdicts count, it answers controlled pairs whose right verdict is known
(not in the paper, whose judges are trusted as they are; HealthBench measured its grader against physicians
before using it). Every probe is built from data the run already has, never labelled by hand:

- a rubric's fact stated in a response vs the same response with that fact removed or swapped for another
  document's (`fact_pairs`, from the corpus): the self-Judge's per-rubric grader (`probe_grader`, Figure 11's
  prompt) and the benchmark criterion graders (`scope_lib.evaluation.calibration`);
- a gold answer vs another question's gold, a paraphrase from the benchmark's aliases, an answer against itself
  and against its own truncation: the benchmark judges (`scope_lib.evaluation.calibration`).

Per judge (`calibrate`): sensitivity P(yes | should), specificity P(no | should not), separation P(yes | should)
- P(yes | should not) over the replies that parsed, the invalid-reply rate (no parse after the retries), and for
pairwise judges the position bias. A judge below `min_separation` or above `max_invalid_rate`
(`CalibrationConfig`) is untrusted: its verdicts are still used and written, marked untrusted, and the run says
so loudly (the `untrusted_judge` health alarm; `scope eval` exits non-zero unless told to accept).
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from scope_lib.config import CalibrationConfig, Params
from scope_lib.protocol import prompts
from scope_lib.retrieval.corpus import Passage, read_corpus, teacher_documents
from scope_lib.selfplay.judge import Judge, JudgeStats

log = logging.getLogger(__name__)

#: The rubric (criterion) every fact probe checks: one fact, named or not, nothing else to weigh.
FACT_RUBRIC = "Identifies {fact} by name."


@dataclass
class ProbeItem:
    """One probe: what it tests (`kind`), the right verdict (`should`: yes / no; None = no right yes/no, e.g. a
    pairwise game of an answer against itself), and the judge's (`yes`; None when the reply never parsed, or a
    tie). `a_score`: a pairwise judge's score for Assistant A (1 win, 0.5 tie, 0 loss)."""

    key: str
    kind: str
    should: bool | None
    yes: bool | None = None
    invalid: bool = False
    a_score: float | None = None
    reply: str = ""


@dataclass
class Calibration:
    """One judge's probe result. `trusted` is False when separation < min_separation (or cannot be measured) or
    invalid_rate > max_invalid_rate; `reasons` says which."""

    judge: str
    role: str
    model: str
    prompt: str
    n_items: int
    n_invalid: int
    invalid_rate: float
    sensitivity: float | None
    specificity: float | None
    separation: float | None
    trusted: bool
    reasons: list[str]
    min_separation: float
    max_invalid_rate: float
    position_bias: float | None = None
    identity_consistency: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    items: list[ProbeItem] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Everything but the items (what summaries and manifests carry)."""
        record = asdict(self)
        record.pop("items")
        return record

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Calibration:
        items = [ProbeItem(**i) for i in record.get("items", [])]
        return cls(**{**{k: v for k, v in record.items() if k != "items"}, "items": items})

    def numbers(self) -> str:
        """The probe's numbers in one phrase."""
        text = (f"separation {_fmt(self.separation)} (sensitivity {_fmt(self.sensitivity)}, specificity "
                f"{_fmt(self.specificity)}), invalid {self.invalid_rate:.2f} over {self.n_items} probes")
        if self.position_bias is not None:
            text += f", position bias {self.position_bias:+.2f}"
        return text


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _share(values: list[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def calibrate(judge: str, role: str, model: str, prompt: str, items: list[ProbeItem], cfg: CalibrationConfig,
              usage: dict[str, Any] | None = None) -> Calibration:
    """The probe's numbers and the verdict on the judge. Rates are over the replies that parsed; a judge with no
    parsed reply on one side has no separation and is untrusted."""
    valid = [i for i in items if not i.invalid]
    should = [bool(i.yes) for i in valid if i.should is True]
    should_not = [bool(i.yes) for i in valid if i.should is False]
    sensitivity = _share(should)
    yes_when_not = _share(should_not)
    specificity = None if yes_when_not is None else 1.0 - yes_when_not
    separation = None if sensitivity is None or yes_when_not is None else sensitivity - yes_when_not
    n_invalid = sum(i.invalid for i in items)
    invalid_rate = n_invalid / len(items) if items else 1.0
    games = [i.a_score for i in valid if i.a_score is not None]
    position_bias = sum(games) / len(games) - 0.5 if games else None
    identity = [i for i in valid if i.kind == "identity" and i.a_score is not None]
    consistency = _identity_consistency(identity)
    reasons = []
    if separation is None:
        reasons.append("separation cannot be measured (no parsed reply on one side)")
    elif separation < cfg.min_separation:
        reasons.append(f"separation {separation:.2f} < {cfg.min_separation:.2f}")
    if invalid_rate > cfg.max_invalid_rate:
        reasons.append(f"invalid {invalid_rate:.2f} > {cfg.max_invalid_rate:.2f}")
    return Calibration(judge=judge, role=role, model=model, prompt=prompt, n_items=len(items), n_invalid=n_invalid,
                       invalid_rate=invalid_rate, sensitivity=sensitivity, specificity=specificity,
                       separation=separation, trusted=not reasons, reasons=reasons,
                       min_separation=cfg.min_separation, max_invalid_rate=cfg.max_invalid_rate,
                       position_bias=position_bias, identity_consistency=consistency, usage=dict(usage or {}),
                       items=list(items))


def _identity_consistency(games: list[ProbeItem]) -> float | None:
    """Share of an answer-against-itself pair of games (both orders) that tie or split evenly: the two games'
    A-scores sum to 1 (A=B twice, or A wins one and B the other)."""
    by_pair: dict[str, list[float]] = {}
    for g in games:
        by_pair.setdefault(g.key.rsplit("/", 1)[0], []).append(float(g.a_score))  # type: ignore[arg-type]
    pairs = [v for v in by_pair.values() if len(v) == 2]
    return sum(abs(v[0] + v[1] - 1.0) < 1e-9 for v in pairs) / len(pairs) if pairs else None


# -- fact pairs from the corpus ----------------------------------------------------------------------------

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(])")
_YEAR = re.compile(r"(?<![\w.,])(1[5-9]\d\d|20[0-4]\d)(?![\w])")
_NAME = re.compile(r"(?<![\w'’-])([A-Z][a-z]+(?:\s+[A-Z][a-z]+){0,2})(?![\w'’-])")
_NOT_NAMES = {
    "The", "This", "That", "These", "Those", "There", "Their", "They", "His", "Her", "Its", "She", "After", "Before",
    "During", "From", "With", "For", "When", "While", "Although", "However", "But", "And", "Also", "Some", "Many",
    "Most", "One", "Two", "Both", "Each", "All", "Other", "Following", "According", "Despite", "Under", "Over",
    "Between", "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December", "Monday", "Sunday", "Saturday", "Friday", "Later", "Today", "Since", "Then", "Here",
}


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


def mentions(text: str, fact: str) -> bool:
    """Whether `fact` occurs in `text` as a whole word or phrase, ignoring case."""
    return re.search(rf"(?<![\w]){re.escape(fact)}(?![\w])", text, re.IGNORECASE) is not None


def sentences(text: str) -> list[str]:
    """Complete sentences of a passage (a 100-word passage starts and ends mid-sentence: those pieces go)."""
    parts = [s.strip() for s in _SENTENCE.split(text.strip())]
    return [s for s in parts[1:] if s.endswith((".", "!", "?")) and 6 <= len(s.split()) <= 60]


def facts_of(sentence: str, exclude: str = "") -> list[tuple[str, str]]:
    """(kind, fact) pairs of a sentence: years, and capitalised names that do not start it and are not in
    `exclude` (the passage's title)."""
    found: list[tuple[str, str]] = [("year", m.group(1)) for m in _YEAR.finditer(sentence)]
    for m in _NAME.finditer(sentence):
        name = m.group(1)
        words = name.split()
        while words and words[0] in _NOT_NAMES:
            words.pop(0)
        name = " ".join(words)
        if not name or m.start() == 0 or len(name) < 4 or mentions(exclude, name):
            continue
        found.append(("name", name))
    return found


def fact_pairs(passages: Sequence[Passage], n: int, seed: int = 0) -> list[FactPair]:
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


def _pair(p: Passage, pool: dict[str, list[tuple[str, str]]], rng: random.Random) -> FactPair | None:
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


def pairs_needed(items: int, per_pair: int = 4) -> int:
    return max(1, math.ceil(items / per_pair))


# -- the self-Judge's per-rubric grader --------------------------------------------------------------------


def unseen_by_teacher(params: Params, passages: Sequence[Passage]) -> list[Passage]:
    """`passages` less the documents the warm start's teacher wrote traces from, when M0 is warm-started
    (`model.warm_start`): its grading traces quote those documents' sentences (`sentence_grades`), so a probe on
    them would measure recall, not grading. The split is recomputed from the run's whole corpus file."""
    ws = params.model.warm_start
    if not ws.enabled or not passages:
        return list(passages)
    corpus = read_corpus(params.corpus_path, on_error="skip").passages
    seen = {p.id for p in teacher_documents(corpus, ws.documents, ws.held_out_share, ws.seed)}
    return [p for p in passages if p.id not in seen]


def probe_grader(judge: Judge, passages: Sequence[Passage], cfg: CalibrationConfig, *, model: str, seed: int = 0
                 ) -> Calibration:
    """Calibrate the Judge's per-rubric grader (Figure 11) on fact pairs from the corpus: ONE batched `grade`
    call at the grading temperature, as in training (with its corrective retry). The Judge's running statistics
    are left as they were; the probe's own are in `usage`."""
    pairs = fact_pairs(passages, pairs_needed(cfg.items), seed)
    items, tasks, answers, rubrics = [], [], [], []
    for pair in pairs:
        for kind, response, should in fact_responses(pair):
            items.append(ProbeItem(f"{pair.passage_id}/{kind}", kind, should))
            tasks.append(f"Write a short note on {pair.subject}.")
            answers.append(response)
            rubrics.append(FACT_RUBRIC.format(fact=pair.fact))
    items, tasks, answers, rubrics = items[:cfg.items], tasks[:cfg.items], answers[:cfg.items], rubrics[:cfg.items]
    saved, judge.stats = judge.stats, JudgeStats()
    try:
        verdicts = judge.grade(tasks, answers, rubrics)
        stage = judge.stats.stage("grading")
        usage = {"prompts": stage.prompts, "engine_calls": stage.calls, "retried": stage.retried,
                 "seconds": round(stage.seconds, 3)}
    finally:
        judge.stats = saved
    for item, verdict in zip(items, verdicts, strict=True):
        item.invalid = verdict is None
        item.yes = None if verdict is None else verdict == 1
    template = "grader_native_thinking" if judge.thinking["grading"] else "grader"
    result = calibrate("self-Judge grader", "grader", model, prompts.template_version(template), items, cfg, usage)
    if not pairs:
        result.reasons.insert(0, "no fact pair could be built from the corpus")
    log.info("self-Judge grader calibration: %s -> %s", result.numbers(),
             "trusted" if result.trusted else "UNTRUSTED: " + "; ".join(result.reasons))
    return result
