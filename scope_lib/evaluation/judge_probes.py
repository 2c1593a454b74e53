"""Calibration of the benchmark judges: before `scope eval` counts a judge's verdicts, the judge answers controlled
pairs whose right verdict is known, built from data the run already has (not in the paper, which trusts its §4.1
judges as they are; `scope_lib.selfplay.grader_probe` has the records, the numbers and the self-Judge's probe,
`probe_self_judge`, which notebook 05 takes from here beside the benchmark judges').

One probe per judge *role* (the judge prompt a scorer uses, `Scorer.calibration_role`), made with that scorer's own
prompt builder, so the probe asks exactly what scoring asks:

| role            | prompt                          | should be yes                     | should be no                       |
|-----------------|---------------------------------|-----------------------------------|------------------------------------|
| short_form      | SCOPE grader + equivalence rubric | the gold answer; an alias from the benchmark's gold list (else the gold in a sentence) | another question's gold; the same in a sentence |
| criterion       | criterion_grader (HealthBench, ResearchPlanGen, ResearchRubrics scope_paper) | a response stating a corpus fact the criterion asks for, in two orders | the same response with the fact's sentence removed, or the fact swapped |
| researchrubrics | researchrubrics_grader (ResearchRubrics official) | as criterion              | as criterion                       |
| pairwise        | arena_pairwise (Arena-Hard)     | A is a baseline answer (`clip`), B its first third | A is the first third, B the answer |

The pairwise probe also plays each answer against itself in both orders (a tie, or one win each, is right) and
measures position bias: Assistant A's mean score over every game minus 0.5. Judges of rating prompts (DRB, WildBench,
SQA, ResearchQA) have no probe yet: their scores carry `trusted: null`.

Probe requests go through the judge's cache and are accounted under the tag `calibration/<judge id>`. For short-form
QA, `em_agreement` sets the judge's verdicts on the run's own answers against exact match and F1, both ways.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scope_lib.config import CalibrationConfig, Params
from scope_lib.evaluation import scorers as S
from scope_lib.evaluation.benchmarks import BENCHMARKS, Item
from scope_lib.evaluation.judge import BenchmarkJudge, JudgeSettings, Usage, ask_with_retries
from scope_lib.protocol.facts import fact_pairs, fact_responses
from scope_lib.retrieval.corpus import Passage
from scope_lib.selfplay.grader_probe import (
    FACT_RUBRIC,
    Calibration,
    ProbeItem,
    calibrate,
    pairs_needed,
    unseen_by_teacher,
)
from scope_lib.selfplay.grader_probe import (  # the self-Judge grader's probe, beside the judges' (notebook 05)
    probe_self_judge as probe_self_judge,
)

log = logging.getLogger(__name__)

#: What each probe role is called in tables and messages.
ROLE_TITLES = {"short_form": "short-form judge", "criterion": "criterion grader",
               "researchrubrics": "ResearchRubrics grader", "pairwise": "pairwise judge"}


@dataclass
class Case:
    """One probe request: what it tests and the judge unit (prompt and parser) that asks it."""

    item: ProbeItem
    unit: S.Unit


@dataclass
class JudgeUse:
    """One judge as the evaluation uses it: a probe role with one model's settings, and the (benchmark, scorer)
    pairs whose verdicts it gives."""

    id: str
    role: str
    settings: JudgeSettings
    scorers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def benchmarks(self) -> list[str]:
        return list(dict.fromkeys(b for b, _ in self.scorers))


def judge_uses(params: Params, judges: dict[str, JudgeSettings]) -> dict[str, JudgeUse]:
    """The judges the benchmarks need (`judges`: each benchmark's judge settings, `evaluate.judge_settings`), by
    id ('<role>@<model>', with '#2' after it for a second set of settings of the same role and model), each with
    the scorers it serves."""
    uses: dict[tuple[str, JudgeSettings], JudgeUse] = {}
    for name, settings in judges.items():
        for scorer_name in params.evaluation.scorers:
            scorer = BENCHMARKS[name].scorers.get(scorer_name)
            role = getattr(scorer, "calibration_role", None) if scorer is not None and scorer.judged else None
            if role is None:
                continue
            key = (role, settings)
            if key not in uses:
                base = f"{role}@{settings.model}"
                taken = sum(u.id.split("#")[0] == base for u in uses.values())
                uses[key] = JudgeUse(base if not taken else f"{base}#{taken + 1}", role, settings)
            uses[key].scorers.append((name, scorer_name))
    return {u.id: u for u in uses.values()}


# -- the probes ---------------------------------------------------------------------------------------------


def _other_gold(item: Item, others: Sequence[Item]) -> str | None:
    """A gold answer of another question that shares no token with any of this item's gold answers."""
    golds = item.reference["golden_answers"]
    for other in others:
        for gold in other.reference["golden_answers"]:
            if S.normalize_answer(gold) and S.f1_score(gold, golds) == 0.0 and not S.substring_match(gold, golds) \
                    and not S.substring_match(golds[0], [gold]):
                return gold
    return None


def _probe_order(items: Sequence[Item], seed: str, evaluated: set[str]) -> list[Item]:
    """Items in a seeded order, those the evaluation does not score first (held-out questions)."""
    order = list(items)
    random.Random(seed).shuffle(order)
    return sorted(order, key=lambda i: i.id in evaluated)


def short_form_probe(items: Sequence[Item], n: int, seed: int = 0, evaluated: set[str] = frozenset()
                     ) -> list[Case]:
    """Four probes per question (seeded order, questions outside `evaluated` first) until `n`: its gold answer
    (yes), an alias from its gold list or the gold in a sentence (yes), another question's gold answer bare and
    in the same sentence (no)."""
    order = _probe_order([i for i in items if i.reference.get("golden_answers")], f"{seed}/calibration/short_form",
                         evaluated)
    qa = S.QAJudge()
    cases: list[Case] = []
    for k, item in enumerate(order):
        if len(cases) >= n:
            break
        other = _other_gold(item, order[k + 1:] + order[:k])
        if other is None:
            continue
        golds = item.reference["golden_answers"]
        alias = next((g for g in golds[1:] if S.normalize_answer(g) != S.normalize_answer(golds[0])), None)
        probes = [("gold", golds[0], True),
                  ("alias", alias, True) if alias else ("gold_sentence", f"The answer is {golds[0]}.", True),
                  ("other_gold", other, False), ("fluent_wrong", f"The answer is {other}.", False)]
        for kind, answer, should in probes:
            cases.append(Case(ProbeItem(f"{item.id}/{kind}", kind, should), qa.units(item, answer)[0]))
    return cases[:n]


def criterion_probe(passages: Sequence[Passage], n: int, seed: int = 0, role: str = "criterion") -> list[Case]:
    """Fact pairs from the corpus (`protocol.facts.fact_pairs`): the criterion asks for one fact; the reply
    states it (yes, in two orders), drops its sentence or swaps the fact for another passage's (no)."""
    cases: list[Case] = []
    for pair in fact_pairs(passages, pairs_needed(n), seed):
        messages = [{"role": "user", "content": f"Write a short note on {pair.subject}."}]
        criterion = FACT_RUBRIC.format(fact=pair.fact)
        for kind, response, should in fact_responses(pair):
            if role == "researchrubrics":
                item = Item(f"probe-{pair.passage_id}", "probe", messages,
                            {"rubrics": [{"criterion": criterion, "weight": 1.0, "axis": "criterion"}]})
                unit = S.ResearchRubricsScorer("official").units(item, response)[0]
            else:
                unit = S.criterion_unit("c0", S.render_conversation(messages), response, criterion, 1.0)
            cases.append(Case(ProbeItem(f"{pair.passage_id}/{kind}", kind, should), unit))
    return cases[:n]


#: Longest answer (in characters, about 300 English words) a pairwise probe plays: longer baseline answers are cut
#: at a sentence end, so a probe game costs about what a scored one does and the judge's context holds both seats.
PAIRWISE_MAX_CHARS = 1800
_SENTENCE_END = re.compile(r"[.!?][\"'”’)]*(?=\s)|[。！？]")


def clip(text: str, max_chars: int = PAIRWISE_MAX_CHARS) -> str:
    """An answer of at most `max_chars` characters: whole when it is short enough, else cut at the last sentence
    end in its first `max_chars` (at a space, or the limit, when no sentence ends in their second half)."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    ends = [m.end() for m in _SENTENCE_END.finditer(cut + " ") if m.end() >= max_chars // 2]
    if ends:
        return cut[:ends[-1]]
    space = cut.rfind(" ")
    return cut[:space] if space >= max_chars // 2 else cut


def truncate(text: str, share: float = 1 / 3) -> str:
    """The first `share` of an answer (at least 40 characters), cut at a space when there is one near, its line
    breaks kept: an answer that stops mid-way."""
    n = max(40, int(len(text) * share))
    space = text.rfind(" ", 0, n)
    return text[:space] if space >= n // 2 else text[:n]


def pairwise_probe(items: Sequence[Item], n: int, seed: int = 0, evaluated: set[str] = frozenset()) -> list[Case]:
    """Four games per question with a baseline answer of 30 words or more (seeded order: questions outside
    `evaluated` first, whole answers of at most PAIRWISE_MAX_CHARS characters before clipped ones) until `n`: the answer
    against itself in both orders (no right winner: a tie or a split; the two orders are one prompt, asked once),
    and the answer against its first third in both orders (the whole one should win)."""
    order = _probe_order([i for i in items if len(str(i.reference.get("baseline_answer") or "").split()) >= 30],
                         f"{seed}/calibration/pairwise", evaluated)
    order.sort(key=lambda i: (i.id in evaluated, len(i.reference["baseline_answer"]) > PAIRWISE_MAX_CHARS))
    arena = S.ArenaHardScorer("official")
    cases: list[Case] = []
    for item in order:
        if len(cases) >= n:
            break
        full = clip(item.reference["baseline_answer"])
        same = Item(item.id, item.benchmark, item.messages, {**item.reference, "baseline_answer": full})
        game1, game2 = arena.units(same, full)          # identical answers in both seats
        cases += [Case(ProbeItem(f"{item.id}/identity/game1", "identity", None), game1),
                  Case(ProbeItem(f"{item.id}/identity/game2", "identity", None), game2)]
        game1, game2 = arena.units(same, truncate(full))  # game 1: A = full; game 2: A = truncated
        cases += [Case(ProbeItem(f"{item.id}/truncated/game1", "full_first", True), game1),
                  Case(ProbeItem(f"{item.id}/truncated/game2", "full_second", False), game2)]
    return cases[:n]


def interpret(role: str, verdict: Any) -> tuple[bool | None, float | None]:
    """(yes, Assistant A's score) of a parsed verdict: a binary judge's yes; a pairwise judge's "A is better"
    (a tie is not) and A's score (strong verdicts count as a plain win)."""
    if verdict is None:
        return None, None
    if role == "pairwise":
        scores = S.ARENA_LABELS[verdict]
        a_score = sum(scores) / len(scores)
        return a_score > 0.5, a_score
    return bool(verdict), None


# -- running them -------------------------------------------------------------------------------------------


def probe_judge(judge: BenchmarkJudge, use: JudgeUse, cases: list[Case], cfg: CalibrationConfig, retries: int,
                note: str = "") -> Calibration:
    """Ask every probe (one batch, unparseable replies re-sampled `retries` times as in scoring) and compute the
    judge's numbers. `note`: why no probe could be built, when `cases` is empty."""
    tag = f"calibration/{use.id}"
    asked = ask_with_retries(judge, use.settings, [(k, c.unit, tag) for k, c in enumerate(cases)], retries) \
        if cases else {}
    items = []
    for k, case in enumerate(cases):
        verdict = asked[k].verdict
        case.item.invalid = verdict is None
        case.item.yes, case.item.a_score = interpret(use.role, verdict)
        case.item.reply = (asked[k].replies or [""])[-1][:300]
        items.append(case.item)
    title = f"{ROLE_TITLES.get(use.role, use.role)} ({use.settings.model})"
    prompt = cases[0].unit.prompt_version if cases else ""
    result = calibrate(title, use.role, use.settings.model, prompt, items, cfg, vars(judge.usage.get(tag, Usage())))
    if not cases:
        result.reasons.insert(0, f"no probe could be built: {note}")
    log.info("judge calibration %s: %s -> %s", use.id, result.numbers(),
             "trusted" if result.trusted else "UNTRUSTED: " + "; ".join(result.reasons))
    return result


def calibrate_judges(params: Params, judge: BenchmarkJudge, uses: dict[str, JudgeUse],
                     items: dict[str, list[Item]], passages: Sequence[Passage] | None,
                     corpus_note: str = "", evaluated: set[str] = frozenset()) -> dict[str, Calibration]:
    """Probe every judge in `uses` (`judge_uses`): short-form judges on the items of the benchmarks they serve,
    criterion graders on fact pairs from `passages` (the run's corpus), pairwise judges on the baseline answers of
    theirs; items whose id is in `evaluated` (the scored sample) are used last. Returns each judge's calibration
    by id."""
    e = params.evaluation
    cfg, seed = e.calibration, e.sample_seed
    results = {}
    for jid, use in uses.items():
        served = [i for b in use.benchmarks for i in items.get(b, [])]
        note = ""
        if use.role == "short_form":
            cases = short_form_probe(served, cfg.items, seed, evaluated)
            note = "fewer than two questions with gold answers"
        elif use.role == "pairwise":
            cases = pairwise_probe(served, cfg.items, seed, evaluated)
            note = "no question with a baseline answer of 30 words or more"
        else:
            cases = criterion_probe(unseen_by_teacher(params, passages or []), cfg.items, seed, use.role)
            note = corpus_note or "no fact pair in the corpus"
        results[jid] = probe_judge(judge, use, cases, cfg, e.judge_parse_retries, note)
    return results


def scorer_trust(calibration: Calibration | None, judge_id: str | None) -> dict[str, Any]:
    """What a scorer's summary says about its judge: the judge's id, `trusted` (None: no probe for this judge
    prompt, or calibration off) and the calibration's numbers."""
    return {"judge_id": judge_id, "trusted": None if calibration is None else calibration.trusted,
            "calibration": None if calibration is None else calibration.summary()}


def untrusted_line(judge_id: str, calibration: Calibration, benchmarks: Sequence[str]) -> str:
    """One line for a judge that failed its probe: which judge, for which benchmarks, its numbers, and how to
    go on."""
    return (f"untrusted judge {judge_id} ({', '.join(benchmarks)}): {'; '.join(calibration.reasons)} "
            f"[{calibration.numbers()}]. Its scores are written marked untrusted; fix the judge (model, prompt, "
            "budget: docs/evaluation.md, Judge calibration) or accept them with --accept-untrusted-judge "
            "(params: evaluation.accept_untrusted_judge: true)")


# -- agreement with the official scorer ------------------------------------------------------------------


def em_agreement(records: Sequence[dict[str, Any]], f1_threshold: float = 0.5) -> dict[str, Any] | None:
    """The short-form judge (scope_paper) against exact match and token F1 (official) on the same answers, both
    ways: how often they agree, how many answers the judge accepts with EM 0 (or F1 0) and how many it rejects
    with EM 1 (or F1 1). F1 labels an answer correct at `f1_threshold`. Units the judge left invalid are not
    counted. None when the records lack either scorer."""
    rows = []
    for r in records:
        judged, official = r["scores"].get("scope_paper"), r["scores"].get("official")
        if not judged or not official or not judged["units"] or judged["units"][0]["invalid"]:
            continue
        verdict = judged["parts"].get("verdict")
        if verdict is None or "em" not in official["metrics"]:
            continue
        rows.append((verdict == 1, official["metrics"]["em"] == 1.0, official["metrics"]["f1"]))
    if not rows:
        return None
    n = len(rows)
    return {"n": n, "judge_yes_rate": sum(y for y, _, _ in rows) / n, "em_rate": sum(e for _, e, _ in rows) / n,
            "agreement_em": sum(y == e for y, e, _ in rows) / n,
            "judge_yes_em_0": sum(y and not e for y, e, _ in rows), "judge_no_em_1": sum(e and not y for y, e, _ in rows),
            "agreement_f1": sum(y == (f >= f1_threshold) for y, _, f in rows) / n, "f1_threshold": f1_threshold,
            "judge_yes_f1_0": sum(y and f == 0.0 for y, _, f in rows),
            "judge_no_f1_1": sum(f == 1.0 and not y for y, _, f in rows)}
