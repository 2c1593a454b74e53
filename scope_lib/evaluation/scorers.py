"""Benchmark scorers: for each benchmark the paper's protocol (`scope_paper`, to compare with Tables 2-3) and the
benchmark's own metric (`official`), plus the standard short-form QA metrics.

A judge-based scorer turns one (item, answer) into judge *units* (one judge prompt each: a rubric criterion, a
pairwise game, a batch of rubric items, ...) and, once every unit has a parsed verdict, combines them into an
`ItemScore`. Units of every item of a benchmark are sent to the judge together (see `evaluation.score_items`).
A reply that does not parse is INVALID (None): it is re-sampled, and what is still invalid after the retries
is handled by the declared policy (`evaluation.judge_invalid`): "drop" leaves the unit out of the score (an item
with nothing left is dropped from the mean), "worst" gives it the outcome worst for the answer. Nothing here
turns a failed parse into a silent 0, 0.5 or mid-scale value; every invalid unit is counted.

Scores are in [0, 1] (WB-Score and ResearchRubrics compliance can go below 0, as officially); tables show x100.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from string import Template
from typing import Any

from scope_lib.protocol import parsing, prompts
from scope_lib.protocol.verification import normalize_answer

# -- judge templates ------------------------------------------------------------------------------------


@functools.cache
def _template_text(name: str) -> str:
    path = resources.files("scope_lib.evaluation").joinpath("prompts", f"{name}.txt")
    if not path.is_file():
        raise ValueError(f"unknown evaluation prompt template {name!r} (scope_lib/evaluation/prompts/{name}.txt)")
    return path.read_text(encoding="utf-8").rstrip("\n")


def render(name: str, **values: Any) -> str:
    """Fill an evaluation template (`$name` placeholders); a missing value is an error naming it."""
    try:
        return Template(_template_text(name)).substitute({k: str(v) for k, v in values.items()})
    except KeyError as exc:
        raise ValueError(f"evaluation template {name!r} needs a value for {exc.args[0]}") from None


def template_version(name: str) -> str:
    """`name@<hash of the template text>`: part of every judge cache key, so editing a prompt re-asks the judge."""
    return f"{name}@{hashlib.sha256(_template_text(name).encode()).hexdigest()[:10]}"


GRADER_VERSION = f"grader@{hashlib.sha256(prompts.load_template('grader').template.encode()).hexdigest()[:10]}"


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


# -- records --------------------------------------------------------------------------------------------


@dataclass
class Unit:
    """One judge prompt for one item. `parse(reply)` gives a verdict or None (invalid); `worst` is the verdict
    least favourable to the answer (used when `judge_invalid` is "worst")."""

    key: str
    messages: list[dict[str, str]]
    parse: Callable[[str], Any]
    prompt_version: str
    worst: Any


@dataclass
class ItemScore:
    """One item's score. `value` None = dropped (no valid judge verdict left, or not scorable: `reason`)."""

    value: float | None
    parts: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    n_units: int = 0
    n_invalid: int = 0
    reason: str | None = None


class Scorer:
    """Base: a scorer without judge units (override `units` and `combine`)."""

    name = "scorer"
    judged = True           # needs the LLM judge
    description = ""
    calibration_role: str | None = None   # which calibration probe checks its judge (evaluation.calibration)

    def units(self, item, answer: str) -> list[Unit]:
        return []

    def combine(self, item, answer: str, verdicts: dict[str, Any]) -> ItemScore:
        raise NotImplementedError

    def aggregate(self, scores: list[ItemScore]) -> float | None:
        """The benchmark's number from its item scores (default: mean over scored items)."""
        values = [s.value for s in scores if s.value is not None]
        return sum(values) / len(values) if values else None

    def summary_metrics(self, scores: list[ItemScore]) -> dict[str, float]:
        """Extra benchmark-level numbers (e.g. WildBench's task-macro WB-Score)."""
        return {}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# -- parsers of judge replies (total: never raise) ------------------------------------------------------

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def parse_json_object(text: Any) -> dict[str, Any] | None:
    """The last JSON object in a reply (outside <think>), fenced or bare; None when there is none."""
    if not isinstance(text, str):
        return None
    visible = parsing.strip_think(text)
    candidates = [m.group(1) for m in _FENCE.finditer(visible)] + [visible]
    for candidate in reversed(candidates):
        found = _last_object(candidate)
        if found is not None:
            return found
    return None


def _last_object(text: str) -> dict[str, Any] | None:
    """The last top-level JSON object in the text (objects nested in it are part of it)."""
    decoder = json.JSONDecoder()
    found, pos = None, 0
    while True:
        start = text.find("{", pos)
        if start < 0:
            return found
        try:
            obj, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            pos = start + 1
            continue
        if isinstance(obj, dict):
            found = obj
        pos = end


def parse_criteria_met(text: Any) -> bool | None:
    """{"criteria_met": true|false} -> bool; anything else is None (invalid)."""
    obj = parse_json_object(text)
    value = obj.get("criteria_met") if obj else None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def _number(value: Any, lo: float, hi: float, integer: bool = False) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        value = value.strip()
        if not re.fullmatch(r"-?\d+(\.\d+)?", value):
            return None
        value = float(value)
    if not isinstance(value, (int, float)) or value != value:
        return None
    if integer and float(value) != int(value):
        return None
    return float(value) if lo <= value <= hi else None


def parse_wildbench_score(text: Any) -> float | None:
    """WildBench's {"score": "1~10"} -> 1..10 (an integer), else None."""
    obj = parse_json_object(text)
    return _number(obj.get("score"), 1, 10, integer=True) if obj else None


ARENA_LABELS: dict[str, list[float]] = {  # score of Assistant A per label; strong verdicts count three times
    "A>>B": [1.0, 1.0, 1.0], "A>B": [1.0], "A=B": [0.5], "B=A": [0.5], "A<B": [0.0], "B>A": [0.0],
    "A<<B": [0.0, 0.0, 0.0], "B>>A": [0.0, 0.0, 0.0], "B<A": [1.0], "B<<A": [1.0, 1.0, 1.0],
}
_ARENA_DOUBLE = re.compile(r"\[\[([AB<>=]+)\]\]")
_ARENA_SINGLE = re.compile(r"\[([AB<>=]+)\]")


def parse_arena_verdict(text: Any) -> str | None:
    """The LAST [[label]] (else [label]) in the upper-cased reply outside thinking, if it is a known label."""
    if not isinstance(text, str):
        return None
    visible = parsing.strip_think(text).upper()
    for pattern in (_ARENA_DOUBLE, _ARENA_SINGLE):
        found = pattern.findall(visible)
        if found:
            label = found[-1]
            return label if label in ARENA_LABELS else None
    return None


RESEARCHQA_LEVELS = {"not at all": 1, "barely": 2, "moderately": 3, "mostly": 4, "completely": 5}
_NUMBERED = re.compile(r"^\s*(?:item\s*|ingredient\s*)?\(?(\d+)\)?\s*[:.)\-]\s*(.+?)\s*$", re.IGNORECASE)


def parse_numbered(text: Any, count: int, value: Callable[[str], Any]) -> dict[int, Any] | None:
    """Lines "<n>: <label>" for n = 1..count, each exactly once, every label known; else None (count-checked:
    a missing, repeated or extra number, or an unknown label, makes the whole reply invalid)."""
    if not isinstance(text, str) or count < 1:
        return None
    found: dict[int, Any] = {}
    for line in parsing.strip_think(text).splitlines():
        match = _NUMBERED.match(line.strip().strip("*").strip())
        if not match:
            continue
        n, parsed = int(match.group(1)), value(match.group(2).strip().strip("*`\"'").strip().rstrip("."))
        if parsed is None or n in found or not 1 <= n <= count:
            return None
        found[n] = parsed
    return found if len(found) == count else None


def coverage_level(label: str) -> int | None:
    return RESEARCHQA_LEVELS.get(label.strip().lower())


def ingredient_level(label: str) -> int | None:
    return int(label) if label in ("0", "1", "2") else None


# -- short-form QA: normalisation, EM, F1 (FlashRAG / SQuAD) ----------------------------------------------

# normalize_answer: lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace (the standard QA
# rule), one home with the self-play methods' rule verifier (`protocol.verification`)


def exact_match(prediction: Any, golds: list[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def substring_match(prediction: Any, golds: list[str]) -> float:
    """FlashRAG's "acc": some normalised gold answer occurs in the normalised prediction."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) and normalize_answer(g) in pred for g in golds))


def f1_score(prediction: Any, golds: list[str]) -> float:
    """Token F1, the max over gold answers. When either side normalises to yes / no / noanswer and the two
    differ, the pair scores 0 (FlashRAG)."""
    pred = normalize_answer(prediction)
    best = 0.0
    for gold in golds:
        ref = normalize_answer(gold)
        if (pred in ("yes", "no", "noanswer") or ref in ("yes", "no", "noanswer")) and pred != ref:
            continue
        p_tokens, r_tokens = pred.split(), ref.split()
        same = sum((Counter(p_tokens) & Counter(r_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(p_tokens), same / len(r_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


class QAMetrics(Scorer):
    """official: exact match after standard normalisation (the QA sets' own metric), F1 and FlashRAG's
    substring accuracy beside it. No judge."""

    name = "official"
    judged = False
    description = "EM (standard normalisation; max over gold answers), with F1 and substring accuracy"

    def combine(self, item, answer, verdicts) -> ItemScore:
        golds = item.reference["golden_answers"]
        metrics = {"em": exact_match(answer, golds), "f1": f1_score(answer, golds),
                   "acc": substring_match(answer, golds)}
        return ItemScore(metrics["em"], metrics=metrics)

    def summary_metrics(self, scores):
        return {k: _mean([s.metrics[k] for s in scores]) for k in ("em", "f1", "acc")}


def semantic_equivalence_rubric(golds: list[str]) -> str:
    return render("semantic_equivalence_rubric", answers="; ".join(f'"{g}"' for g in golds))


class QAJudge(Scorer):
    """scope_paper: the gold answers become one rubric ("semantically equivalent to any of ...") graded by the
    strict binary grader (App. H, Figure 11), one call per item (§4.1: LLM-as-judge instead of EM)."""

    name = "scope_paper"
    description = "LLM judge: semantic equivalence to any gold answer, strict binary grader"
    calibration_role = "short_form"

    def units(self, item, answer):
        text = prompts.grader_prompt(item.question, answer, semantic_equivalence_rubric(
            item.reference["golden_answers"]))
        return [Unit("equivalent", user(text), parsing.parse_score, GRADER_VERSION, 0)]

    def combine(self, item, answer, verdicts):
        v = verdicts.get("equivalent")
        return ItemScore(None if v is None else float(v), parts={"verdict": v})


# -- rubric criteria (HealthBench, ResearchRubrics, ResearchPlanGen) ------------------------------------


def render_conversation(messages: list[dict[str, str]]) -> str:
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _points_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def criterion_unit(key: str, conversation: str, answer: str, criterion: str, points: float) -> Unit:
    text = render("criterion_grader", conversation=conversation, response=answer, criterion=criterion,
                  points=_points_text(points))
    return Unit(key, user(text), parse_criteria_met, template_version("criterion_grader"), points < 0)


def weighted_met(criteria: list[tuple[float, bool | None]]) -> tuple[float | None, int]:
    """Sum of the weights of met criteria over the sum of positive weights, over criteria with a verdict.
    Negative weights subtract when met (HealthBench points, ResearchRubrics penalties). No clipping."""
    kept = [(w, v) for w, v in criteria if v is not None]
    positive = sum(w for w, _ in kept if w > 0)
    if not kept or positive <= 0:
        return None, len(criteria) - len(kept)
    return sum(w for w, v in kept if v) / positive, len(criteria) - len(kept)


class HealthBenchScorer(Scorer):
    """One grader call per rubric criterion (whole conversation + reply; negative-point criteria asked
    literally). Item = Σ points of met criteria / Σ positive points. official: no per-item clip, the final
    mean is clipped to [0, 1] (simple-evals); scope_paper: each item clipped to [0, 1] (the authors' code)."""

    calibration_role = "criterion"

    def __init__(self, name: str):
        self.name = name
        self.description = ("points met / positive points; mean clipped to [0, 1]" if name == "official"
                            else "points met / positive points, each item clipped to [0, 1]")

    def units(self, item, answer):
        conversation = render_conversation(item.messages)
        return [criterion_unit(f"c{k}", conversation, answer, r["criterion"], float(r["points"]))
                for k, r in enumerate(item.reference["rubrics"])]

    def combine(self, item, answer, verdicts):
        criteria = [(float(r["points"]), verdicts.get(f"c{k}")) for k, r in enumerate(item.reference["rubrics"])]
        value, invalid = weighted_met(criteria)
        if value is not None and self.name == "scope_paper":
            value = min(1.0, max(0.0, value))
        return ItemScore(value, parts={"met": [v for _, v in criteria]})

    def aggregate(self, scores):
        mean = super().aggregate(scores)
        return None if mean is None else (min(1.0, max(0.0, mean)) if self.name == "official" else mean)


class ResearchRubricsScorer(Scorer):
    """One call per criterion. official: the judge sees the report, criterion, axis and weight but not the task
    (Scale's setup); compliance = Σ weight x met / Σ positive weights, not clipped (penalties can push it below
    0). scope_paper: the criterion grader with the task, each item clipped to [0, 1] (the authors' code)."""

    def __init__(self, name: str):
        self.name = name
        self.calibration_role = "researchrubrics" if name == "official" else "criterion"
        self.description = ("weighted compliance over positive weights, unclipped; judge does not see the task"
                            if name == "official" else "criterion grader with the task; item clipped to [0, 1]")

    def units(self, item, answer):
        units = []
        for k, r in enumerate(item.reference["rubrics"]):
            weight = float(r["weight"])
            if self.name == "official":
                text = render("researchrubrics_grader", response=answer, criterion=r["criterion"],
                              axis=r.get("axis") or "criterion", weight=_points_text(weight))
                units.append(Unit(f"c{k}", user(text), parse_criteria_met,
                                  template_version("researchrubrics_grader"), weight < 0))
            else:
                units.append(criterion_unit(f"c{k}", render_conversation(item.messages), answer, r["criterion"],
                                            weight))
        return units

    def combine(self, item, answer, verdicts):
        criteria = [(float(r["weight"]), verdicts.get(f"c{k}")) for k, r in enumerate(item.reference["rubrics"])]
        value, _ = weighted_met(criteria)
        if value is not None and self.name == "scope_paper":
            value = min(1.0, max(0.0, value))
        return ItemScore(value, parts={"met": [v for _, v in criteria]})


class ResearchPlanGenScorer(Scorer):
    """One call per rubric item, weight 1; score = items met / items with a verdict. scope_paper: the grader sees
    the question as the Solver got it (the authors' wrapper around the goal); official (Goel et al.: share of
    rubric items satisfied): the grader sees the bare research goal."""

    calibration_role = "criterion"

    def __init__(self, name: str):
        self.name = name
        self.description = "share of rubric items satisfied" + (
            " (grader sees the goal)" if name == "official" else " (grader sees the Solver's question)")

    def units(self, item, answer):
        context = (f"user: {item.reference['goal']}" if self.name == "official"
                   else render_conversation(item.messages))
        return [criterion_unit(f"c{k}", context, answer, text, 1.0) for k, text in enumerate(item.reference["rubric"])]

    def combine(self, item, answer, verdicts):
        met = [verdicts.get(f"c{k}") for k in range(len(item.reference["rubric"]))]
        value, _ = weighted_met([(1.0, v) for v in met])
        return ItemScore(value, parts={"met": met})


# -- ResearchQA ------------------------------------------------------------------------------------------


class ResearchQAScorer(Scorer):
    """Coverage of each rubric item on 5 levels (Not at all .. Completely -> (x - 1) / 4), item = mean over rubric
    items. The judge numbers its lines and every number must be there exactly once (count-checked). official:
    rubric items in batches of 8 (ResearchQA's compute_coverage); scope_paper: all items in one call (the
    authors' code). A batch that stays invalid loses its rubric items (drop) or scores them "Not at all"."""

    def __init__(self, name: str, batch_size: int | None):
        self.name = name
        self.batch_size = batch_size
        self.description = (f"coverage levels in batches of {batch_size}, count-checked" if batch_size
                            else "coverage levels, all rubric items in one call, count-checked")

    def _batches(self, item) -> list[list[str]]:
        texts = [r["rubric_item"] for r in item.reference["rubric"]]
        size = self.batch_size or max(1, len(texts))
        return [texts[i:i + size] for i in range(0, len(texts), size)]

    def units(self, item, answer):
        units = []
        for b, batch in enumerate(self._batches(item)):
            listing = "\n".join(f"{i}. {t}" for i, t in enumerate(batch, 1))
            text = render("researchqa_coverage", query=item.question, response=answer, items=listing, count=len(batch))
            units.append(Unit(f"b{b}", user(text), functools.partial(parse_numbered, count=len(batch),
                                                                     value=coverage_level),
                              template_version("researchqa_coverage"), {i: 1 for i in range(1, len(batch) + 1)}))
        return units

    def combine(self, item, answer, verdicts):
        levels: list[int | None] = []
        for b, batch in enumerate(self._batches(item)):
            got = verdicts.get(f"b{b}")
            levels.extend([got[i] for i in range(1, len(batch) + 1)] if got else [None] * len(batch))
        kept = [(x - 1) / 4 for x in levels if x is not None]
        return ItemScore(_mean(kept), parts={"levels": levels})


# -- WildBench -------------------------------------------------------------------------------------------

WILDBENCH_TAG_GROUPS = {  # WildBench's task tags -> leaderboard categories
    "Information seeking": "Information/Advice seeking", "Advice seeking": "Information/Advice seeking",
    "Creative Writing": "Creative Tasks", "Editing": "Creative Tasks", "Brainstorming": "Creative Tasks",
    "Role playing": "Creative Tasks", "Others": "Creative Tasks", "Coding & Debugging": "Coding & Debugging",
    "Reasoning": "Planning & Reasoning", "Planning": "Planning & Reasoning", "Math": "Math & Data Analysis",
    "Data Analysis": "Math & Data Analysis",
}
WILDBENCH_CATEGORY_WEIGHTS = {"Creative Tasks": 0.5, "Planning & Reasoning": 1.25, "Math & Data Analysis": 1.0,
                              "Information/Advice seeking": 0.75, "Coding & Debugging": 1.25}


class WildBenchScorer(Scorer):
    """Checklist-guided 1-10 rating of the reply to the last user turn. official: WB-Score, (s - 5) / 5 per item
    (x100 = (mean - 5) x 2 x 10, range -80..100) plus the leaderboard's task-macro WB-Score; scope_paper:
    (s - 1) / 9 (the authors' code)."""

    def __init__(self, name: str):
        self.name = name
        self.description = "WB-Score (s - 5) / 5, task-macro beside it" if name == "official" else "(s - 1) / 9"

    def units(self, item, answer):
        history = render_conversation(item.messages[:-1]) or "(none)"
        checklist = "\n".join(f"- {c}" for c in item.reference["checklist"]) or "(none)"
        text = render("wildbench_checklist", history=history, query=item.messages[-1]["content"], response=answer,
                      checklist=checklist)
        return [Unit("score", user(text), parse_wildbench_score, template_version("wildbench_checklist"), 1.0)]

    def combine(self, item, answer, verdicts):
        s = verdicts.get("score")
        if s is None:
            return ItemScore(None, parts={"score": None})
        tags = [item.meta.get("primary_tag")] + list(item.meta.get("secondary_tags") or [])
        categories = sorted({WILDBENCH_TAG_GROUPS[t] for t in tags if t in WILDBENCH_TAG_GROUPS})
        value = (s - 5) / 5 if self.name == "official" else (s - 1) / 9
        return ItemScore(value, parts={"score": s, "categories": categories})

    def summary_metrics(self, scores):
        if self.name != "official":
            return {}
        by_category: dict[str, list[float]] = {}
        for s in scores:
            if s.value is not None:
                for c in s.parts.get("categories", []):
                    by_category.setdefault(c, []).append(s.parts["score"])
        if not by_category:
            return {}
        # per category (mean - 5) x 2, weighted, over the sum of ALL five weights (as WildBench computes it)
        macro = sum((sum(v) / len(v) - 5) * 2 * WILDBENCH_CATEGORY_WEIGHTS[c] for c, v in by_category.items())
        return {"task_macro": macro / sum(WILDBENCH_CATEGORY_WEIGHTS.values()) / 10}


# -- Arena-Hard v2 creative writing ---------------------------------------------------------------------


def arena_game_scores(game1: str | None, game2: str | None) -> list[float] | None:
    """The model's exploded scores from two position-swapped games: game 1 has the baseline as A, game 2 has the
    model as A. None when a game has no verdict."""
    if game1 is None or game2 is None:
        return None
    return list(ARENA_LABELS[game2]) + [1.0 - s for s in ARENA_LABELS[game1]]


class ArenaHardScorer(Scorer):
    """Two games against the baseline's answer, positions swapped; strong verdicts count x3. official: questions
    with an invalid game are dropped and every exploded score is pooled (arena-hard-auto); scope_paper: each
    question's exploded scores are averaged first, then questions (the authors' code)."""

    calibration_role = "pairwise"

    def __init__(self, name: str):
        self.name = name
        self.description = ("two swapped games, strong x3, pooled over questions" if name == "official"
                            else "two swapped games, strong x3, mean per question then over questions")

    def units(self, item, answer):
        baseline = item.reference["baseline_answer"]
        system = {"role": "system", "content": render("arena_pairwise_system")}
        version = template_version("arena_pairwise_system") + "+" + template_version("arena_pairwise")
        games = []
        for key, a, b, worst in (("game1", baseline, answer, "A>>B"), ("game2", answer, baseline, "B>>A")):
            text = render("arena_pairwise", prompt=item.question, answer_a=a, answer_b=b)
            games.append(Unit(key, [system, *user(text)], parse_arena_verdict, version, worst))
        return games

    def combine(self, item, answer, verdicts):
        g1, g2 = verdicts.get("game1"), verdicts.get("game2")
        scores = arena_game_scores(g1, g2)
        if scores is None and self.name == "scope_paper" and (g1 or g2):
            scores = list(ARENA_LABELS[g2]) if g2 else [1.0 - s for s in ARENA_LABELS[g1]]
        return ItemScore(_mean(scores) if scores else None, parts={"game1": g1, "game2": g2, "scores": scores})

    def aggregate(self, scores):
        if self.name != "official":
            return super().aggregate(scores)
        pooled = [x for s in scores if s.value is not None for x in s.parts["scores"]]
        return _mean(pooled)


# -- DeepResearch Bench ----------------------------------------------------------------------------------

DRB_DIMENSIONS = ("comprehensiveness", "insight", "instruction_following", "readability")
DRB_HOLISTIC = ("depth", "structure", "relevance", "accuracy", "completeness")


def parse_race(text: Any, counts: dict[str, int], with_reference: bool) -> dict[str, dict[int, tuple]] | None:
    """{dimension: [{"criterion": n, "report_1": x, "report_2": y}, ...]} with every criterion of every
    dimension exactly once and scores in [0, 10]; else None."""
    obj = parse_json_object(text)
    if obj is None:
        return None
    out: dict[str, dict[int, tuple]] = {}
    for dim, count in counts.items():
        entries = obj.get(dim)
        if not isinstance(entries, list):
            return None
        scores: dict[int, tuple] = {}
        for entry in entries:
            if not isinstance(entry, dict):
                return None
            n = _number(entry.get("criterion"), 1, count, integer=True)
            target = _number(entry.get("report_1"), 0, 10)
            reference = _number(entry.get("report_2"), 0, 10) if with_reference else 0.0
            if n is None or target is None or reference is None or int(n) in scores:
                return None
            scores[int(n)] = (target, reference)
        if len(scores) != count:
            return None
        out[dim] = scores
    return out


class DRBRaceScorer(Scorer):
    """official: RACE. One judge call scores the answer and the reference report side by side on every criterion
    of the task (0-10, numbered and count-checked); per dimension a criterion-weighted mean; a report's total is
    the dimension-weighted sum; score = answer / (answer + reference) (0.5 = parity). Without a reference report
    the answer's total / 10 (absolute RACE; reported as such). The LLM "cleaning" of articles is not done."""

    name = "official"
    description = "RACE vs the reference report (absolute total / 10 without one)"

    def units(self, item, answer):
        criteria = item.reference.get("criteria")
        if not criteria:
            return []
        reference = item.reference.get("reference_article")
        reports = f"<report_1>\n{answer}\n</report_1>"
        if reference:
            reports += f"\n\n<report_2>\n{reference}\n</report_2>"
        listing, counts = [], {}
        for dim in DRB_DIMENSIONS:
            entries = criteria["criterions"].get(dim) or []
            counts[dim] = len(entries)
            listing.append(f"{dim}:\n" + "\n".join(f"  {i}. {c['criterion']} ({c.get('explanation', '')})".rstrip(" ()")
                                                     for i, c in enumerate(entries, 1)))
        example = {"criterion": 1, "report_1": 7.5, **({"report_2": 8.0} if reference else {})}
        fmt = json.dumps({d: [example, "..."] for d in DRB_DIMENSIONS})
        text = render("drb_race", task=item.question, reports=reports, criteria="\n".join(listing),
                      which="each report" if reference else "report_1", format=fmt)
        worst = {d: {i: (0.0, 10.0) for i in range(1, n + 1)} for d, n in counts.items()}
        parse = functools.partial(parse_race, counts=counts, with_reference=bool(reference))
        return [Unit("race", user(text), parse, template_version("drb_race"), worst)]

    def combine(self, item, answer, verdicts):
        criteria = item.reference.get("criteria")
        if not criteria:
            return ItemScore(None, reason="no criteria for this task")
        got = verdicts.get("race")
        if got is None:
            return ItemScore(None)
        totals = [0.0, 0.0]
        dims = {}
        for dim in DRB_DIMENSIONS:
            entries = criteria["criterions"].get(dim) or []
            weight_sum = sum(float(c["weight"]) for c in entries) or 1.0
            avg = [sum(float(c["weight"]) * got[dim][i][side] for i, c in enumerate(entries, 1)) / weight_sum
                   for side in (0, 1)]
            dims[dim] = avg
            for side in (0, 1):
                totals[side] += float(criteria["dimension_weight"][dim]) * avg[side]
        relative = bool(item.reference.get("reference_article"))
        if relative:
            value = totals[0] / (totals[0] + totals[1]) if sum(totals) > 0 else 0.0
        else:
            value = totals[0] / 10
        return ItemScore(value, parts={"mode": "relative" if relative else "absolute", "totals": totals,
                                       "dimensions": dims})


def parse_holistic(text: Any, keys: tuple[str, ...]) -> dict[str, float] | None:
    obj = parse_json_object(text)
    if obj is None:
        return None
    values = {k: _number(obj.get(k), 1, 5, integer=True) for k in keys}
    return None if any(v is None for v in values.values()) else values


class DRBHolisticScorer(Scorer):
    """scope_paper: what the authors' code calls DRB "RACE": one absolute call rating depth, structure,
    relevance, accuracy and completeness 1-5, each (x - 1) / 4, plain mean. No criteria, no reference."""

    name = "scope_paper"
    description = "5 holistic dimensions 1-5, (x - 1) / 4, mean"

    def units(self, item, answer):
        text = render("drb_holistic", task=item.question, response=answer)
        return [Unit("rating", user(text), functools.partial(parse_holistic, keys=DRB_HOLISTIC),
                     template_version("drb_holistic"), dict.fromkeys(DRB_HOLISTIC, 1.0))]

    def combine(self, item, answer, verdicts):
        got = verdicts.get("rating")
        if got is None:
            return ItemScore(None)
        return ItemScore(_mean([(v - 1) / 4 for v in got.values()]), parts={"rating": got})


# -- SQA-CS-V2 -------------------------------------------------------------------------------------------


class SQAQualityScorer(Scorer):
    """scope_paper: one 1-5 content-quality rating, (x - 1) / 4 (the authors' code; ingredients unused)."""

    name = "scope_paper"
    description = "holistic content quality 1-5, (x - 1) / 4"

    def units(self, item, answer):
        text = render("sqa_quality", question=item.question, response=answer)
        return [Unit("rating", user(text), functools.partial(parse_holistic, keys=("score",)),
                     template_version("sqa_quality"), {"score": 1.0})]

    def combine(self, item, answer, verdicts):
        got = verdicts.get("rating")
        return ItemScore(None if got is None else (got["score"] - 1) / 4, parts={"rating": got})


class SQAIngredientScorer(Scorer):
    """official (partial): AstaBench's ingredient recall: each rubric ingredient 0 / 1 / 2, weighted, / 2; one
    count-checked call. The other three official metrics (answer precision, citation precision and recall) need
    the JSON sections-with-citations answer format, which a Solver answering in <answer> text does not produce;
    they are not computed, so this is NOT the full official SQA score. Items without ingredients are not scored."""

    name = "official"
    description = "ingredient recall only (1 of the 4 official metrics)"

    def units(self, item, answer):
        ingredients = item.reference.get("ingredients") or []
        if not ingredients:
            return []
        listing = "\n".join(f"{i}. {g['criterion']}" for i, g in enumerate(ingredients, 1))
        text = render("sqa_ingredients", question=item.question, response=answer, items=listing,
                      count=len(ingredients))
        return [Unit("ingredients", user(text), functools.partial(parse_numbered, count=len(ingredients),
                                                                  value=ingredient_level),
                     template_version("sqa_ingredients"), {i: 0 for i in range(1, len(ingredients) + 1)})]

    def combine(self, item, answer, verdicts):
        ingredients = item.reference.get("ingredients") or []
        if not ingredients:
            return ItemScore(None, reason="no ingredients (rubric) in the source")
        got = verdicts.get("ingredients")
        if got is None:
            return ItemScore(None)
        weights = [float(g.get("weight", 1.0)) for g in ingredients]
        value = sum(w * got[i] / 2 for i, w in enumerate(weights, 1)) / (sum(weights) or 1.0)
        return ItemScore(value, parts={"levels": [got[i] for i in range(1, len(weights) + 1)]})


# -- binary rubrics the frozen self-Judge can grade (the self-judge vs external-judge gap) --------------


def self_judge_rubrics(benchmark: str, item) -> list[str]:
    """Binary rubrics for an item that the SCOPE grader (Figure 11) can check: the semantic-equivalence rubric
    for short-form QA, rubric items for ResearchPlanGen, positive criteria for HealthBench and ResearchRubrics.
    Empty for benchmarks whose judge is not a set of binary rubric checks."""
    ref = item.reference
    if "golden_answers" in ref:
        return [semantic_equivalence_rubric(ref["golden_answers"])]
    if benchmark == "researchplangen":
        return list(ref["rubric"])
    if benchmark == "healthbench":
        return [r["criterion"] for r in ref["rubrics"] if float(r["points"]) > 0]
    if benchmark == "researchrubrics":
        return [r["criterion"] for r in ref["rubrics"] if float(r["weight"]) > 0]
    return []
