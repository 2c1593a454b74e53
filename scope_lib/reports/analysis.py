"""Pure measures for the analysis notebooks: rubric specificity (the paper's Table 10 finding, counted)
and agreement between two rubric writers or two graders."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scope_lib.protocol.parsing import Rubric
from scope_lib.runs import Stage, read_jsonl

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


# -- tables for notebook 04: a training run read back from its folder --------------------------------------


def _jsonl(path) -> list[dict]:
    return read_jsonl(path) if path.is_file() else []


def _iterations(run_dir) -> list[tuple[int, Any]]:
    from pathlib import Path

    folders = sorted(p for p in Path(run_dir).glob("iter_*") if p.is_dir() and p.name[5:].isdigit())
    return [(int(p.name[5:]), p) for p in folders]


def training_metrics(run_dir) -> Any:
    """Every training step of a run (iter_NN/<role>/metrics.jsonl), one row per step, with `global_step`
    counting a role's steps across iterations (the x axis of Figures 6 and 7)."""
    import pandas as pd

    rows = [r for _, folder in _iterations(run_dir) for role in ("challenger", "solver")
            for r in _jsonl(folder / role / "metrics.jsonl")]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame = frame.sort_values(["role", "iteration", "step"]).reset_index(drop=True)
    frame["global_step"] = frame.groupby("role").cumcount() + 1
    return frame


def pool_candidates(run_dir) -> Any:
    """Every candidate task of every task pool (Stage 2): its iteration, type, outcome, g-bar, and whether it
    was kept."""
    import pandas as pd

    rows = []
    for t, folder in _iterations(run_dir):
        for c in _jsonl(folder / "pool" / "candidates.jsonl"):
            e = c["evaluation"]
            rows.append({"iteration": t, "id": c["id"], "task type": e["task_type"], "outcome": e["outcome"],
                         "gates passed": e["gates_passed"], "g-bar": e["mean_score"], "kept": c["kept"],
                         "task": e["task"]})
    return pd.DataFrame(rows)


def gate_pass_by_task_type(candidates) -> Any:
    """Share of written tasks that passed the gates, per iteration and task type."""
    written = candidates[candidates["outcome"] != "no task"] if len(candidates) else candidates
    if written.empty:
        return written
    return (written.groupby(["iteration", "task type"])["gates passed"].mean().rename("gate pass rate")
            .reset_index())


def iteration_summary(run_dir) -> Any:
    """One row per iteration: Stage 1 reward, the pool's size and yield, Stage 3's rubric score, searches and
    answer length (Figure 3b, 6, 7 by iteration)."""
    import pandas as pd

    metrics = training_metrics(run_dir)
    rows = []
    for t, folder in _iterations(run_dir):
        pool = Stage(folder / "pool").summary
        row: dict[str, Any] = {"iteration": t, "pool tasks": pool.get("tasks"), "pool yield": pool.get("yield"),
                               "challenger frozen": "frozen_at" in Stage(folder / "challenger").summary}
        for role, columns in (("challenger", ["reward", "gate_pass_rate", "mean_rubric_score"]),
                              ("solver", ["reward", "rubric_score", "searches_per_rollout", "answer_tokens"])):
            steps = metrics[(metrics["role"] == role) & (metrics["iteration"] == t)] if len(metrics) else metrics
            for column in columns:
                values = steps[column].dropna() if column in steps else []
                row[f"{role} {column.replace('_', ' ')}"] = float(values.mean()) if len(values) else None
        rows.append(row)
    return pd.DataFrame(rows)


def time_split(metrics) -> Any:
    """Seconds per role and iteration in generation, retrieval, Judge, the Stage-1 Solver rollouts, the update
    and our own overhead."""
    columns = ["time_generation_s", "time_retrieval_s", "time_judge_s", "time_solver_rollouts_s", "time_update_s",
               "time_overhead_s"]
    if metrics.empty:
        return metrics
    present = [c for c in columns if c in metrics]
    table = metrics.groupby(["role", "iteration"])[present].sum()
    return table.rename(columns=lambda c: c.removeprefix("time_").removesuffix("_s")).round(2)


def example_tasks(run_dir, per_iteration: int = 1) -> list[dict[str, Any]]:
    """Appendix I style examples: for each iteration, pooled tasks with their rubrics, source document and
    the Solver answer of Stage 3 that scored best, with its per-rubric verdicts."""
    examples = []
    for t, folder in _iterations(run_dir):
        tasks = _jsonl(folder / "pool" / "tasks.jsonl")
        answers: dict[str, list[dict]] = {}
        for r in _jsonl(folder / "solver" / "rollouts.jsonl"):
            answers.setdefault(r["task_id"], []).append(r)
        for task in sorted(tasks, key=lambda k: -len(answers.get(k["id"], [])))[:per_iteration]:
            graded = [a for a in answers.get(task["id"], []) if a.get("rubric_score") is not None]
            best = max(graded, key=lambda a: a["rubric_score"], default=None)
            examples.append({
                "iteration": t, "task type": task["task_type"], "task": task["task"], "g-bar": task["mean_score"],
                "rubrics": [(r["priority"], r["text"]) for r in task.get("rubrics") or []],
                "answer": best["trajectory"]["answer"] if best else None,
                "searches": [s["query"] for s in best["trajectory"]["searches"] if s["valid"]] if best else [],
                "verdicts": best["verdicts"] if best else None,
                "rubric score": best["rubric_score"] if best else None})
    return examples


# -- a static figure for the README ---------------------------------------------------------------------------

#: Line colours of `svg_line_chart` (plotly's default sequence, so the README matches the notebooks).
_COLOURS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3")


def svg_line_chart(frame, x: str, columns: Sequence[str], *, title: str, x_label: str, y_label: str,
                   width: int = 720, height: int = 360) -> str:
    """`columns` of `frame` against `x` as a self-contained SVG line chart with markers and a legend: the
    README's copy of a notebook figure (plotly's static export needs Chrome, which a CPU box may lack)."""
    from xml.sax.saxutils import escape

    columns = [c for c in columns if c in frame and frame[c].notna().any()]
    if frame.empty or not columns:
        raise ValueError(f"nothing to plot: no values in {list(columns)}")
    left, right, top, bottom = 60, 170, 40, 50
    xs = [float(v) for v in frame[x]]
    values = [float(v) for c in columns for v in frame[c].dropna()]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(0.0, min(values)), max(values) * 1.05 or 1.0
    px = lambda v: left + (v - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    py = lambda v: height - bottom - (v - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2:.0f}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for k in range(5):   # horizontal grid with y ticks
        v = y0 + (y1 - y0) * k / 4
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for v in sorted(set(xs)):
        out.append(f'<text x="{px(v):.1f}" y="{height - bottom + 16}" text-anchor="middle">{v:g}</text>')
    out.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 12}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text transform="translate(16 {(top + height - bottom) / 2:.0f}) rotate(-90)" '
               f'text-anchor="middle">{escape(y_label)}</text>')
    for i, column in enumerate(columns):
        colour = _COLOURS[i % len(_COLOURS)]
        points = [(px(float(a)), py(float(b))) for a, b in zip(frame[x], frame[column], strict=True) if b == b]
        out.append(f'<polyline class="series" fill="none" stroke="{colour}" stroke-width="2" points="'
                   + " ".join(f"{a:.1f},{b:.1f}" for a, b in points) + '"/>')
        out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3.5" fill="{colour}"/>' for a, b in points]
        ly = top + 10 + 20 * i
        out.append(f'<line x1="{width - right + 14}" x2="{width - right + 34}" y1="{ly}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="2"/><text x="{width - right + 40}" y="{ly + 4}">'
                   f'{escape(column)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_solver_reward_figure(run_dir, path) -> str:
    """Notebook 04's "Solver: reward components per GRPO step" figure for `run_dir`, written to `path` as SVG
    (`make readme-figure` draws the README's from the smoke run)."""
    from pathlib import Path

    metrics = training_metrics(run_dir)
    steps = metrics[metrics["role"] == "solver"] if len(metrics) else metrics
    svg = svg_line_chart(steps, "global_step", ["reward", "rubric_score", "format", "search_reward"],
                         title="Solver: reward components per GRPO step", x_label="step (all iterations)",
                         y_label="mean over the batch")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(svg)
    return svg
