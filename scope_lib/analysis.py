"""Pure measures for the analysis notebooks: rubric specificity (the paper's Table 10 finding, counted)
and agreement between two rubric writers or two graders."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scope_lib.parsing import Rubric

#: The command verbs the rubric writer is told to start with (App. H, Figure 12).
COMMAND_VERBS = ("Addresses", "Demonstrates", "Provides", "Incorporates", "Synthesises", "Synthesizes",
                 "Identifies", "Explains", "Compares", "Evaluates", "Integrates", "Supports", "Applies")

_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December|"
           "Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
_DATE = re.compile(rf"\b(?:(?:\d{{1,2}} )?(?:{_MONTHS})\.?(?: \d{{1,2}},?)? \d{{4}}|1[0-9]{{3}}|20[0-9]{{2}})\b")
_NUMBER = re.compile(r"(?<![\w.])[$£€]?\d[\d,]*(?:\.\d+)?%?(?![\w])")
# A proper name: capitalised words (with connectors like "of", "de"), at least one not sentence-initial.
_NAME = re.compile(r"\b[A-Z][\w'’.-]*(?:\s+(?:of|de|da|the|von|van|and|la|le|du|del|al|bin)?\s*[A-Z][\w'’.-]*)*")
_STOP = {"The", "A", "An", "This", "That", "These", "Those", "It", "Its", "Each", "Every", "Any", "All", "Both",
         "Response", "Task", "Answer", "In", "On", "For", "With", "Of", "And", "Or", "To", "How", "What", "Why"}


@dataclass(frozen=True)
class Specificity:
    """Which source-grounded details a rubric names: a proper name, a number, a date (each found in the
    source document or the retrieved evidence)."""

    entity: bool
    number: bool
    date: bool

    @property
    def specific(self) -> bool:
        return self.entity or self.number or self.date


def _names(text: str) -> list[str]:
    words = text.split()
    first = words[0] if words else ""
    names = []
    for match in _NAME.finditer(text):
        parts = re.sub(r"['’]s$", "", match.group(0).strip(" .,'’")).split()
        while parts and (parts[0] in _STOP or parts[0] in COMMAND_VERBS):
            parts.pop(0)
        name = " ".join(parts)
        if not name or (match.start() == 0 and name == first):
            continue
        names.append(name)
    return names


def rubric_specificity(rubric: str, context: str) -> Specificity:
    """Does the rubric name an entity, a number or a date that appears in the context documents?

    A generic restatement ("Identifies key events and motivations") names none; a source-grounded rubric
    ("Correctly attributes the $125,000 franchise purchase to Tuckman in 2003") names all three.
    """
    haystack = context.lower()
    dates = [d for d in _DATE.findall(rubric)]
    date_digits = {re.sub(r"\D", "", d) for d in dates}
    numbers = [n for n in _NUMBER.findall(rubric) if re.sub(r"\D", "", n) not in date_digits]

    def present(token: str) -> bool:
        return token.lower() in haystack or token.replace(",", "").lower() in haystack

    return Specificity(entity=any(present(n) for n in _names(rubric)),
                       number=any(present(n.strip("$£€%")) for n in numbers),
                       date=any(present(d) or present(d[-4:]) for d in dates))


def starts_with_command_verb(rubric: str) -> bool:
    first = rubric.strip().split(" ", 1)[0].strip(".,:;")
    return first in COMMAND_VERBS


def grader_agreement(a: Sequence[int | None], b: Sequence[int | None]) -> dict[str, float]:
    """Agreement of two graders on the same (answer, rubric) pairs: share of equal verdicts and Cohen's
    kappa (None verdicts count as 0, as in the reward)."""
    if len(a) != len(b):
        raise ValueError(f"graders judged different numbers of pairs: {len(a)} vs {len(b)}")
    if not a:
        return {"pairs": 0, "agreement": float("nan"), "kappa": float("nan")}
    x = [int(v or 0) for v in a]
    y = [int(v or 0) for v in b]
    n = len(x)
    observed = sum(i == j for i, j in zip(x, y, strict=True)) / n
    p_x, p_y = sum(x) / n, sum(y) / n
    expected = p_x * p_y + (1 - p_x) * (1 - p_y)
    kappa = 1.0 if expected == 1.0 else (observed - expected) / (1 - expected)
    return {"pairs": n, "agreement": observed, "kappa": kappa}


def rubric_overlap(a: Sequence[Rubric], b: Sequence[Rubric]) -> float:
    """Content-word Jaccard overlap of two rubric sets for the same task (0 = disjoint, 1 = same words)."""
    def words(rubrics: Sequence[Rubric]) -> set[str]:
        return {w.lower() for r in rubrics for w in re.findall(r"[A-Za-z0-9$]{4,}", r.text)} - \
               {v.lower() for v in COMMAND_VERBS}

    wa, wb = words(a), words(b)
    return len(wa & wb) / len(wa | wb) if wa | wb else float("nan")


# -- tables for notebook 03 (pandas imported lazily: the library core does not need it) ------------


def rubric_table(evals, trajectories, prompts) -> Any:
    """One row per rubric: task, type, priority, text, words, command-verb compliance and specificity
    against the task's source document plus its retrieved evidence."""
    import pandas as pd

    traj_by_id = {t.id: t for t in trajectories}
    prompt_by_id = {p.id: p for p in prompts}
    rows = []
    for e in evals:
        t = traj_by_id[e.challenger_id]
        context = prompt_by_id[t.meta["prompt_id"]].document + "\n" + "\n".join(t.evidence)
        for k, r in enumerate(e.rubrics or []):
            s = rubric_specificity(r.text, context)
            rows.append({"task": e.challenger_id, "task type": e.task_type, "k": k, "priority": r.priority,
                         "rubric": r.text, "words": len(r.text.split()),
                         "command verb": starts_with_command_verb(r.text), "entity": s.entity,
                         "number": s.number, "date": s.date, "specific": s.specific})
    columns = ["task", "task type", "k", "priority", "rubric", "words", "command verb", "entity", "number",
               "date", "specific"]
    return pd.DataFrame(rows, columns=columns)


def verdict_table(evals) -> Any:
    """One row per (Solver rollout, rubric) verdict with the rubric's priority."""
    import pandas as pd

    rows = [{"task": e.challenger_id, "rollout": sid, "priority": r.priority, "verdict": v}
            for e in evals if e.rubrics
            for sid, row in zip(e.solver_ids, e.verdicts, strict=True)
            for r, v in zip(e.rubrics, row, strict=True)]
    return pd.DataFrame(rows, columns=["task", "rollout", "priority", "verdict"])


def compare_rubric_writers(evals, other: list, label_a: str, label_b: str) -> Any:
    """Side by side per task: rubric counts, specific-rubric counts are left to rubric_table; word overlap."""
    import pandas as pd

    ready = [e for e in evals if e.rubrics]
    if len(other) != len(ready):
        raise ValueError(f"expected rubrics for {len(ready)} tasks, got {len(other)}")
    return pd.DataFrame([{"task": e.challenger_id, label_a: len(e.rubrics), label_b: len(b or []),
                          "word overlap": rubric_overlap(e.rubrics, b or [])}
                         for e, b in zip(ready, other, strict=True)])


def grading_pairs(evals, graded) -> list[tuple[str, str, str, int | None]]:
    """(task, answer, rubric, verdict) for every graded answer: the inputs a second grader re-grades."""
    by_task = {e.challenger_id: e for e in evals if e.rubrics}
    pairs = []
    for g in graded:
        e = by_task.get(g.trajectory.meta["challenger_id"])
        if e is None or not g.trajectory.answer:
            continue
        pairs.extend((e.task, g.trajectory.answer, r.text, v) for r, v in zip(e.rubrics, g.verdicts, strict=True))
    return pairs
