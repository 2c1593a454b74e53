"""The self-Judge grader's calibration probe, and the records and numbers every judge probe shares. Before a judge's
verdicts count, it answers controlled pairs whose right verdict is known (not in the paper, whose judges are trusted
as they are; HealthBench measured its grader against physicians before using it). Every probe is built from data
the run already has, never labelled by hand:

- a rubric's fact stated in a response vs the same response with that fact removed or swapped for another
  document's (`protocol.facts.fact_pairs`, from the corpus): the self-Judge's per-rubric grader (`probe_self_judge`,
  `probe_grader`, Figure 11's prompt) and the benchmark criterion graders (`scope_lib.evaluation.judge_probes`);
  the self-Judge's grader also gets a list of the document's other names without the fact (`name_list`: what a
  Solver that dumps the names it read would write; it must score 0);
- a gold answer vs another question's gold, a paraphrase from the benchmark's aliases, an answer against itself
  and against its own truncation: the benchmark judges (`scope_lib.evaluation.judge_probes`).

Per judge (`calibrate`): sensitivity P(yes | should), specificity P(no | should not), separation P(yes | should)
- P(yes | should not) over the replies that parsed, the invalid-reply rate (no parse after the retries), and for
pairwise judges the position bias; for the self-Judge's grader also the name-list separation, P(yes | should)
- P(yes | a name list). A judge below `min_separation` (either separation) or above `max_invalid_rate`
(`CalibrationConfig`) is untrusted: its verdicts are still used and written, marked untrusted, and the run says
so loudly (the `untrusted_judge` health alarm; `scope eval` exits non-zero unless told to accept).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from scope_lib.config import CalibrationConfig, Params
from scope_lib.protocol import prompts
from scope_lib.protocol.facts import (
    FactPair,
    fact_pairs,
    fact_responses,
    facts_of,
    is_year,
    mentions,
    sentences,
)
from scope_lib.retrieval.corpus import Passage, read_corpus, teacher_documents
from scope_lib.selfplay.judge import Judge, JudgeStats, judge_models

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
    name_list_separation: float | None = None  # the self-Judge's grader: P(yes | should) - P(yes | a name list)
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
        if self.name_list_separation is not None:
            text += f", name-list separation {self.name_list_separation:.2f}"
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


# -- fact pairs from the corpus (`protocol.facts`) --------------------------------------------------------


def pairs_needed(items: int, per_pair: int = 4) -> int:
    return max(1, math.ceil(items / per_pair))


# -- the self-Judge's per-rubric grader --------------------------------------------------------------------

#: Items per fact pair of the self-Judge's grader probe: stated, reordered (yes), removed, swapped, name list (no).
GRADER_KINDS = 5
#: The most names a name-list response lists; it needs at least NAME_LIST_MIN.
NAME_LIST_MAX, NAME_LIST_MIN = 5, 3


def name_list(pair: FactPair, passage: Passage) -> str | None:
    """A response that lists several of the document's other facts (names; years too when the fact is a year)
    without the rubric's fact, in the warm-started Solver's words ("X is linked to A, B and C."): what an answer
    that dumps the names it read looks like. None when the document has fewer than NAME_LIST_MIN of them."""
    others: list[str] = []
    for sentence in sentences(passage.text):
        for kind, fact in facts_of(sentence, passage.title):
            if kind == "year" and not is_year(pair.fact):
                continue
            if fact not in others and not mentions(fact, pair.fact) and not mentions(pair.fact, fact):
                others.append(fact)
    if len(others) < NAME_LIST_MIN:
        return None
    listed = others[:NAME_LIST_MAX]
    return f"{pair.subject} is linked to {', '.join(listed[:-1])} and {listed[-1]}."


def grader_items(passages: Sequence[Passage], n: int, seed: int) -> list[tuple[ProbeItem, FactPair, str]]:
    """The first `n` probe items (item, its fact pair, the response): GRADER_KINDS per pair, from fact pairs whose
    document lists enough other names (`name_list`), in the pairs' seeded order."""
    by_id = {p.id: p for p in passages}
    out: list[tuple[ProbeItem, FactPair, str]] = []
    for pair in fact_pairs(passages, 2 * pairs_needed(n, GRADER_KINDS), seed):
        listed = name_list(pair, by_id[pair.passage_id])
        if listed is None:
            continue
        for kind, response, should in [*fact_responses(pair), ("name_list", listed, False)]:
            out.append((ProbeItem(f"{pair.passage_id}/{kind}", kind, should), pair, response))
    return out[:n]


def name_list_separation(items: Sequence[ProbeItem]) -> float | None:
    """P(yes | should) - P(yes | a name list) over the replies that parsed (None without both)."""
    valid = [i for i in items if not i.invalid]
    should = _share([bool(i.yes) for i in valid if i.should is True])
    listed = _share([bool(i.yes) for i in valid if i.kind == "name_list"])
    return None if should is None or listed is None else should - listed


def unseen_by_teacher(params: Params, passages: Sequence[Passage]) -> list[Passage]:
    """`passages` less the documents the warm start's teacher wrote traces from, when M0 is warm-started
    (`model.warm_start`): its grading traces quote those documents' sentences (`sentence_grades`), so a probe on
    them would measure recall, not grading. The split is recomputed from the run's whole corpus file."""
    ws = params.model.warm_start
    if not ws.enabled or not passages:
        return list(passages)
    corpus = read_corpus(params.corpus_path, on_error="skip").passages
    seen = {p.id for p in teacher_documents(corpus, ws)}
    return [p for p in passages if p.id not in seen]


def probe_self_judge(params: Params, judge: Judge, passages: Sequence[Passage]) -> Calibration:
    """The run's probe of its Judge's per-rubric grader (`judge.calibration`): on the corpus less the teacher's
    documents (`unseen_by_teacher`), seeded by the document permutation's seed. A run takes it when it opens
    (`selfplay.loop.open_run`), the learning check once per held-out set, notebook 05 beside the benchmark judges."""
    return probe_grader(judge, unseen_by_teacher(params, passages), params.judge.calibration,
                        model=judge_models(params)["grading"], seed=params.selfplay.seed)


def probe_grader(judge: Judge, passages: Sequence[Passage], cfg: CalibrationConfig, *, model: str, seed: int = 0
                 ) -> Calibration:
    """Calibrate the Judge's per-rubric grader (Figure 11) on fact pairs from the corpus (`grader_items`: a fact
    stated, reordered, removed, swapped, and a list of the document's other names): ONE batched `grade` call at the
    grading temperature, as in training (with its corrective retry). The Judge's running statistics are left as
    they were; the probe's own are in `usage`. Besides the separation, the name-list separation must reach
    `cfg.min_separation`: a grader that a list of names satisfies would reward a Solver for dumping them."""
    built = grader_items(passages, cfg.items, seed)
    items = [item for item, _, _ in built]
    tasks = [f"Write a short note on {pair.subject}." for _, pair, _ in built]
    answers = [response for _, _, response in built]
    rubrics = [FACT_RUBRIC.format(fact=pair.fact) for _, pair, _ in built]
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
    result.name_list_separation = name_list_separation(items)
    if result.name_list_separation is not None and result.name_list_separation < cfg.min_separation:
        result.reasons.append(f"name-list separation {result.name_list_separation:.2f} < {cfg.min_separation:.2f}")
    if not built:
        result.reasons.insert(0, "no fact pair could be built from the corpus")
    result.trusted = not result.reasons
    log.info("self-Judge grader calibration: %s -> %s", result.numbers(),
             "trusted" if result.trusted else "UNTRUSTED: " + "; ".join(result.reasons))
    return result
