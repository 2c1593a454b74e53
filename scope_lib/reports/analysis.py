"""Pure measures for the analysis notebooks: rubric specificity (the paper's Table 10 finding, counted)
and agreement between two rubric writers or two graders."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scope_lib.protocol.parsing import Rubric, rubric_identity
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
    """One row per rubric: task, type, priority, text, words, command-verb compliance, specificity against the
    task's source document plus its retrieved evidence, and whether it repeats an earlier rubric of its set
    (`parsing.rubric_identity`; `judge.distinct_rubrics` drops such repeats)."""
    import pandas as pd

    traj_by_id = {t.id: t for t in trajectories}
    prompt_by_id = {p.id: p for p in prompts}
    rows = []
    for e in evals:
        t = traj_by_id[e.challenger_id]
        context = prompt_by_id[t.meta["prompt_id"]].document + "\n" + "\n".join(t.evidence)
        seen: set[str] = set()
        for k, r in enumerate(e.rubrics or []):
            s = rubric_specificity(r.text, context)
            identity = rubric_identity(r.text)
            rows.append({"task": e.challenger_id, "task type": e.task_type, "k": k, "priority": r.priority,
                         "rubric": r.text, "words": len(r.text.split()),
                         "command verb": starts_with_command_verb(r.text), "entity": s.entity,
                         "number": s.number, "date": s.date, "specific": s.specific, "repeat": identity in seen})
            seen.add(identity)
    columns = ["task", "task type", "k", "priority", "rubric", "words", "command verb", "entity", "number",
               "date", "specific", "repeat"]
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


#: SCOPE's training stages: (the stage's folder, the role it trains).
SCOPE_TRAINING_STAGES: tuple[tuple[str, str], ...] = (("challenger", "challenger"), ("solver", "solver"))


def training_metrics(run_dir, stages: tuple[tuple[str, str], ...] = SCOPE_TRAINING_STAGES) -> Any:
    """Every training step of a run (iter_NN/<stage>/metrics.jsonl for each (stage, role) of `stages`: SCOPE's by
    default, another method's from `harness.Method.stages`, e.g. SCORE's evaluator/ training `challenger`), one row
    per step with its `role`, and `global_step` counting a role's steps across iterations (the x axis of Figures 6
    and 7)."""
    import pandas as pd

    rows = [{**r, "role": role} for _, folder in _iterations(run_dir) for stage, role in stages
            for r in _jsonl(folder / stage / "metrics.jsonl")]
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


# -- figures: notebook 04's reward components, and plotly's static export ------------------------------------

#: Tick spacings an axis of whole numbers may use (times a power of ten).
_NICE_STEPS = (1, 2, 5)


def whole_number_step(span: float, max_ticks: int = 10) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, … that puts at most `max_ticks` ticks over `span`."""
    scale = 1
    while True:
        for step in _NICE_STEPS:
            if span / (step * scale) <= max_ticks:
                return step * scale
        scale *= 10


def integer_axis(fig, values, axis: str = "x", **where) -> Any:
    """Draw an axis that counts steps, iterations or items at whole numbers only (plotly's automatic ticks put
    1.2, 1.4, … between two steps): ticks from the first value, `whole_number_step` apart, without decimals.
    `where` selects the subplot axes as plotly's `update_xaxes` does (row=, col=); all of them by default."""
    present = [float(v) for v in values if v is not None and v == v]
    low, high = (min(present), max(present)) if present else (0.0, 1.0)
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(tickmode="linear", tick0=low, dtick=whole_number_step(high - low), tickformat="d", **where)
    return fig

#: The reward components notebook 04 plots per role, one line each (those with values).
REWARD_COMPONENTS = {"challenger": ["reward", "format", "gate_pass_rate", "mean_rubric_score", "difficulty"],
                     "solver": ["reward", "rubric_score", "format", "search_reward", "length_multiplier"]}


def reward_components_figure(metrics, role: str, components: list[str] | None = None,
                             role_name: str | None = None) -> Any:
    """Notebook 04's "<Role>: reward components per GRPO step" figure (one point per step, one line per
    component: REWARD_COMPONENTS[role], or a method's own `components`, titled with its `role_name`), or None when
    the role has no step with a component."""
    import plotly.express as px

    steps = metrics[metrics["role"] == role] if len(metrics) else metrics
    present = [c for c in components or REWARD_COMPONENTS[role] if c in steps and steps[c].notna().any()]
    if steps.empty or not present:
        return None
    long = steps.melt(id_vars=["global_step", "iteration"], value_vars=present, var_name="component")
    fig = px.line(long, x="global_step", y="value", color="component", markers=True,
                  title=f"{role_name or role.capitalize()}: reward components per GRPO step",
                  labels={"global_step": "step (all iterations)", "value": "mean over the batch"})
    return integer_axis(fig, steps["global_step"])


def step_figure(metrics, role: str, column: str, title: str, label: str) -> Any:
    """One measure of a role's training steps (a column of metrics.jsonl) per step, a line per iteration: notebook
    04's searches and answer length per Solver step (Figures 6 and 7); None without such steps."""
    import plotly.express as px

    steps = metrics[metrics["role"] == role] if len(metrics) and "role" in metrics else metrics.iloc[0:0]
    if steps.empty or column not in steps or steps[column].isna().all():
        return None
    fig = px.line(steps, x="global_step", y=column, color="iteration", markers=True, title=title,
                  labels={"global_step": f"{role.capitalize()} step", column: label})
    return integer_axis(fig, steps["global_step"])


def iteration_figure(summary, column: str, title: str, label: str, range_y=None) -> Any:
    """One column of `iteration_summary` per iteration (Figure 3b: the Solver's mean rubric score); None when the
    column has no value yet."""
    import plotly.express as px

    if summary.empty or column not in summary or summary[column].isna().all():
        return None
    fig = px.line(summary, x="iteration", y=column, markers=True, range_y=range_y, title=title,
                  labels={column: label})
    return integer_axis(fig, summary["iteration"])


def save_figure(fig, path, *, width: int | None = None, height: int | None = None):
    """A plotly figure as a static image, in the format of the path's suffix (.svg, .png, .pdf, .jpg), by
    plotly's own export: kaleido driving an installed Chrome or Chromium (`make chromium` installs Debian's;
    BROWSER_PATH points kaleido at another)."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.write_image(str(path), width=width, height=height)
    except RuntimeError as exc:
        if "Chrome" not in str(exc):
            raise
        raise RuntimeError(f"cannot write {path}: plotly's static export needs Chrome or Chromium. "
                           "`make chromium` installs Debian's package (or set BROWSER_PATH to a Chrome "
                           f"binary). kaleido said: {exc}") from exc
    return path


def write_solver_reward_figure(run_dir, path):
    """Notebook 04's Solver reward figure for `run_dir`, written to `path` by plotly's export
    (`make readme-figure` draws the README's from the smoke run)."""
    figure = reward_components_figure(training_metrics(run_dir), "solver")
    if figure is None:
        raise ValueError(f"{run_dir} has no Solver training step with rewards: train it first "
                         "(`make demo` runs notebook 04)")
    return save_figure(figure, path, width=760, height=400)


# -- notebook 04: learning signals per step and the learning check --------------------------------------------

#: The learning signals notebook 04's health panel draws per step (metrics.jsonl columns), with their axis titles.
LEARNING_SIGNALS = {"zero_spread_share": "share of zero-spread groups", "entropy": "sampling entropy (nats/token)",
                    "reward": "mean reward"}


def learning_signals_figure(metrics) -> Any:
    """Notebook 04's "Learning signals per GRPO step": per role, the share of groups whose rollouts all scored
    alike (`training.zero_spread_share`: their advantages are 0), the policy's sampling entropy (TRL's entropy) and
    the mean reward, one panel each, with the `mostly_zero_spread` alarm's share drawn; None without steps."""
    from plotly.subplots import make_subplots

    from scope_lib.selfplay.health import ZERO_SPREAD_MOST, ZERO_SPREAD_STEPS

    present = [c for c in LEARNING_SIGNALS if len(metrics) and c in metrics and metrics[c].notna().any()]
    if not present:
        return None
    fig = make_subplots(rows=len(present), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[LEARNING_SIGNALS[c] for c in present])
    colours = {"challenger": "#d62728", "solver": "#1f77b4"}
    for row, column in enumerate(present, 1):
        for role, steps in metrics.groupby("role"):
            fig.add_scatter(x=steps["global_step"], y=steps[column], mode="lines+markers", name=role,
                            legendgroup=role, showlegend=row == 1, line={"color": colours.get(role)}, row=row, col=1)
        fig.update_yaxes(title_text=column, row=row, col=1)
        if column == "zero_spread_share":
            fig.update_yaxes(range=[-0.05, 1.05], row=row, col=1)
            fig.add_hline(y=ZERO_SPREAD_MOST, line_dash="dot", row=row, col=1,
                          annotation_text=f"alarm: at or above for {ZERO_SPREAD_STEPS} steps running")
    integer_axis(fig, metrics["global_step"])
    fig.update_xaxes(title_text="step (all iterations)", row=len(present), col=1)
    fig.update_layout(title="Learning signals per GRPO step", height=240 * len(present) + 80)
    return fig


#: Per-step counts of stops that fell inside thinking (metrics.jsonl columns; the turn went on instead of ending,
#: `selfplay.rollout.stopped_in_thinking`), with the panel's column titles.
THINKING_STOPS = {"stops_in_thinking": "stops inside thinking (the role's rollouts)",
                  "solver_stops_in_thinking": "stops inside thinking (Stage 1's Solver rollouts)"}


def thinking_stops_per_step(metrics) -> Any:
    """Notebook 04's health panel: per role, iteration and step, how many stop strings fell inside an open
    <think> block (a plan naming `</answer>`, `</task>` or the search closer) and so continued the turn instead of
    ending it. None when the metrics hold no such count (a run written before it was recorded)."""
    present = [c for c in THINKING_STOPS if len(metrics) and c in metrics and metrics[c].notna().any()]
    if not present:
        return None
    table = metrics.set_index(["role", "iteration", "step"])[present]
    return table.fillna(0).astype(int).rename(columns=THINKING_STOPS)


def learning_check_table(check) -> Any:
    """One row per checkpoint of a learning check (`evaluation.learning_check.LearningCheck.table`)."""
    import pandas as pd

    return pd.DataFrame(check.table())


def learning_check_figure(check) -> Any:
    """Notebook 04's learning check: left, each held-out task's value before and after (sorted by before, joined
    by a line); right, the mean paired gain with its bootstrap 95% interval, beside the shuffled-reward
    control's when there is one, and the trained checkpoint against the control's, paired over the tasks."""
    from plotly.subplots import make_subplots

    trained, control = check.trained, check.control
    label = "mean rubric score ḡ" if trained.metric == "score" else "success rate"
    order = sorted(range(trained.n_tasks), key=lambda i: (trained.values_before[i], trained.values_after[i]))
    fig = make_subplots(rows=1, cols=2, column_widths=[0.75, 0.25], horizontal_spacing=0.1,
                        subplot_titles=[f"per held-out task ({trained.n_tasks})", "gain with its 95% interval"])
    xs = list(range(1, trained.n_tasks + 1))
    for x, i in zip(xs, order, strict=True):
        fig.add_scatter(x=[x, x], y=[trained.values_before[i], trained.values_after[i]], mode="lines",
                        line={"color": "lightgray"}, showlegend=False, hoverinfo="skip", row=1, col=1)
    for name, values, colour in ((f"before: {trained.before}", trained.values_before, "gray"),
                                 (f"after: {trained.after}", trained.values_after, "#1f77b4")):
        fig.add_scatter(x=xs, y=[values[i] for i in order], mode="markers", name=name, marker={"color": colour},
                        text=[trained.task_ids[i] for i in order], row=1, col=1)
    bars = [("trained", trained, "#1f77b4")] + ([("control", control, "#ff7f0e")] if control is not None else [])
    if check.over_control is not None:
        bars.append(("trained − control", check.over_control, "#2ca02c"))
    for name, comparison, colour in bars:
        lo, hi = comparison.ci95
        fig.add_bar(x=[name], y=[comparison.gain], marker_color=colour, showlegend=False,
                    error_y={"type": "data", "symmetric": False, "array": [hi - comparison.gain],
                             "arrayminus": [comparison.gain - lo]}, row=1, col=2)
    fig.add_hline(y=0, line_color="black", line_width=1, row=1, col=2)
    fig.update_xaxes(title_text="held-out task (sorted by its value before)", row=1, col=1)
    integer_axis(fig, xs, row=1, col=1)
    fig.update_yaxes(title_text=label, range=[-0.05, 1.05], row=1, col=1)
    fig.update_yaxes(title_text=f"gain in {label} (paired difference)", row=1, col=2)
    verdict = check.verdict.outcome
    fig.update_layout(title=f"Learning check: {trained.after} vs {trained.before} on held-out tasks "
                            f"(gain {trained.gain:+.3f}, 95% CI [{trained.ci95[0]:+.3f}, {trained.ci95[1]:+.3f}]; "
                            f"{verdict})", height=420)
    return fig


# -- one-line results (`reports.notebook.summary`): what the index page states per notebook ------------------


def training_result(metrics, candidates, n_alarms: int, check=None) -> str:
    """Notebook 04's result: the task pool (kept of candidates, all iterations), the Solver's mean reward R_S at
    its first and last step, the health alarms, and the learning check's verdict when it ran."""
    parts = [f"pool {int(candidates['kept'].sum())} of {len(candidates)} candidates" if len(candidates)
             else "no candidate tasks"]
    solver = metrics[metrics["role"] == "solver"] if len(metrics) and "role" in metrics else metrics.iloc[0:0]
    rewards = solver["reward"].dropna() if "reward" in solver else solver.iloc[0:0]
    parts.append(f"R_S {rewards.iloc[0]:.2f} → {rewards.iloc[-1]:.2f} over {len(rewards)} Solver steps"
                 if len(rewards) else "no Solver step")
    parts.append(f"{n_alarms} alarm{'s' if n_alarms != 1 else ''}")
    if check is not None:
        grader = check.held_out.grader
        trusted = "" if grader is None or grader.trusted else ", grader untrusted"
        parts.append(f"learning check {check.verdict.outcome} (gain {check.trained.gain:+.3f}{trusted})")
    return ", ".join(parts)


def evaluation_result(summaries: list[dict[str, Any]], checkpoint: str | None = None) -> str:
    """Notebook 05's result: per benchmark, the last checkpoint's (or `checkpoint`'s) scores on a 0–1 scale:
    exact match where the benchmark has it, and the judged score (scope_paper protocol), marked when its judge
    failed its calibration probe: "iter_01: NQ EM 0.00, judged 1.00 (judge untrusted); …"."""
    from scope_lib.evaluation.benchmarks import BENCHMARKS

    if not summaries:
        return "nothing evaluated"
    name = checkpoint or summaries[-1]["checkpoint"]
    parts = []
    for s in (s for s in summaries if s["checkpoint"] == name):
        judged = s["scorers"].get("scope_paper", {})
        official = s["scorers"].get("official", {}).get("metrics") or {}
        scores = [f"EM {official['em']:.2f}"] if official.get("em") is not None else []
        if judged.get("value") is not None:
            scores.append(f"{'judged ' if scores else ''}{judged['value']:.2f}")
        elif not scores:
            scores.append("not scored")
        untrusted = " (judge untrusted)" if judged.get("trusted") is False else ""
        column = BENCHMARKS[s["benchmark"]].column if s["benchmark"] in BENCHMARKS else s["benchmark"]
        parts.append(f"{column} {', '.join(scores)}{untrusted}")
    return f"{name}: " + "; ".join(parts)


def replay_result(scores) -> str:
    """Notebook 06's result: the replay pair and benchmark whose score moved most against the first row (a
    checkpoint's own evaluation), in points: "largest change +3.0 points: search base → answer iter_01 on NQ"."""
    if scores.empty:
        return "no replay scored"
    first = scores.index[0]
    swapped = [pair for pair in scores.index if pair[0] != pair[1]]
    if not swapped:
        return f"only {first[0]}'s own evaluation: no second checkpoint to swap in"
    changes = (scores.loc[swapped] - scores.iloc[0]).stack().dropna()
    if changes.empty:
        return f"{len(swapped)} replay pair(s), none scored on both sides"
    (search, answer, benchmark) = changes.abs().idxmax()
    change = changes[(search, answer, benchmark)]
    return (f"{len(swapped)} replay pair(s) on {scores.shape[1]} benchmark(s); largest change {change:+.1f} points "
            f"against {first[0]} → {first[1]}: search {search} → answer {answer} on {benchmark}")
