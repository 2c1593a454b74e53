"""The learning check pooled over seeds, and held-out answers shown verbatim: read from the checks `compare` wrote.

    pooled = pool_checks(["runs/smollm-learn-42", "runs/smollm-learn-43", "runs/smollm-learn-44"])
    pooled.verdict.outcome, pooled.measures["score"].pooled["over_control"].ci95   # or: scope learning-check pool
    examples_markdown(held_out_examples(["runs/smollm-learn-42", ...]))           # or: scope learning-check examples

Not in the paper (issue 47, item 6; docs/training.md, "Pooled over seeds"). One seed's check (`learning_check`)
says whether that run learned; runs of the same recipe on other seeds (`grpo.seed`) move as much as the gains do,
so the claim rests on several seeds, each with its own shuffled-reward control. Everything here reads what
`scope learning-check compare` wrote per seed (`runs/<name>/learning_check/<after>-vs-<before>.json`: each
comparison's per-task values) and the evaluations stored beside the held-out set; no model loads.

1. **Per seed**: each measure (the check's rubric metric and every judge-free measure, `judge_free.MEASURES`): the
   gain over M0, the control's gain and trained − control, with the 95% intervals that seed's check computed.
2. **Pooled** (`seeds_then_tasks`): the mean over every (seed, task) pair, its 95% percentile interval from a
   two-level bootstrap: the seeds resampled with replacement, then the tasks with replacement, one draw of tasks
   shared by the resampled seeds, because the seeds share one held-out set (a task easy to gain on is easy for every
   seed; drawing tasks apart per seed would average that away and give too narrow an interval: measured in
   docs/training.md). A comparison is pooled only where every seed has it.
3. **The pooled verdict**: one seed's rule (`learning_check.learning_verdict`) on the pooled comparisons, and the
   grader gate on every seed's probe (the first failed or missing one decides).
4. **Examples** (`held_out_examples`): the first `n` held-out tasks by task id (numbers read as numbers), each with its rubrics, M0's answer
   and each trained Solver's, the first rollout (k0) of each evaluation, verbatim, as markdown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scope_lib.evaluation.judge_free import LABELS as JUDGE_FREE_LABELS
from scope_lib.evaluation.judge_free import MEASURES, fact_recall
from scope_lib.evaluation.learning_check import (
    Comparison,
    JudgeFree,
    Verdict,
    evaluation_file,
    learning_verdict,
    read_check,
)
from scope_lib.runs import RunError, read_jsonl
from scope_lib.selfplay.grader_probe import Calibration

#: A check's three comparisons: the trained checkpoint and the control's over M0, and trained − control.
COMPARISONS = ("trained", "control", "over_control")
#: What each measure is called in tables: the rubric metrics, then the judge-free measures.
LABELS = {"score": "rubric score", "success": "success rate", **JUDGE_FREE_LABELS}
#: How the pooled interval resamples, in the written JSON's words.
RESAMPLING = "seeds with replacement, then tasks with replacement, one draw of tasks shared by the resampled seeds"


# -- one seed's written check ---------------------------------------------------------------------------------------


@dataclass
class SeedCheck:
    """One seed's Solver check as `compare` wrote it: its file, the run it checks (the run folder's name) and its
    record (`LearningCheck.to_record`)."""

    path: Path
    run: str
    record: dict[str, Any]

    @property
    def metric(self) -> str:
        return self.record["trained"]["metric"]

    def comparison(self, name: str, measure: str) -> Comparison | None:
        """The stored comparison `name` (one of COMPARISONS) of a measure (the check's metric or a judge-free one),
        None where the check has none (no control, or a measure not measurable on 2 tasks)."""
        if measure == self.metric:
            record = self.record.get(name)
        else:
            record = ((self.record.get("judge_free") or {}).get("comparisons", {}).get(name) or {}).get(measure)
        return Comparison.from_record(record) if record else None


def is_solver_check(record: Any) -> bool:
    return isinstance(record, dict) and "verdict" in record and "per_task" in (record.get("trained") or {})


def read_seed_check(source: str | Path) -> SeedCheck:
    """A written Solver check: its JSON file, or a run folder whose learning_check/ holds exactly one."""
    path = Path(source)
    if path.is_dir():
        folder = path / "learning_check" if (path / "learning_check").is_dir() else path
        found = [f for f in sorted(folder.glob("*.json")) if is_solver_check(read_check(f))]
        if len(found) != 1:
            raise RunError(f"{folder} holds {len(found)} Solver check(s) ({', '.join(f.name for f in found) or 'none'})"
                           ": give the check's JSON file, or run `scope learning-check compare` for that run first")
        path = found[0]
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: no such check or run folder (give runs/<name> or its "
                                "learning_check/<after>-vs-<before>.json)")
    record = read_check(path)
    if not is_solver_check(record):
        raise RunError(f"{path} is not a Solver check written by `scope learning-check compare`")
    run = path.parent.parent.name if path.parent.name == "learning_check" else path.stem
    return SeedCheck(path, run, record)


def read_seed_checks(sources: list[str | Path]) -> list[SeedCheck]:
    """Every seed's check, refusing the same check twice, checks on different held-out sets or of different
    metrics (the pooled pairs are (seed, task) pairs of one set)."""
    checks = [read_seed_check(s) for s in sources]
    paths = [c.path.resolve() for c in checks]
    if len(set(paths)) < len(paths):
        raise ValueError(f"the same check was given twice ({', '.join(map(str, paths))}): give one check per seed")
    keys = {c.record["held_out"].get("key") for c in checks}
    if len(keys) > 1:
        raise ValueError(f"the checks were made on different held-out sets ({', '.join(map(str, sorted(keys)))}): "
                         "pool seeds of one recipe (their held-out set is shared; `compare` with the same params)")
    metrics = {c.metric for c in checks}
    if len(metrics) > 1:
        raise ValueError(f"the checks compare different metrics ({', '.join(sorted(metrics))}): `compare` every seed "
                         "with the same --metric")
    return checks


# -- pooled over seeds ----------------------------------------------------------------------------------------------


def seeds_then_tasks(differences: Any, n_samples: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of the mean over (seed, task) pairs of a seeds × tasks array of paired differences
    (NaN where a pair has no value): each resample draws the seeds with replacement, then the tasks with
    replacement once for all the drawn seeds (they share one held-out set), and averages the pairs drawn that have
    a value. Seeded: all the seed draws come first, then all the task draws."""
    import numpy as np

    d = np.asarray(differences, dtype=float)
    if d.ndim != 2 or np.count_nonzero(~np.isnan(d)) < 2:
        raise ValueError(f"a pooled interval needs a seeds × tasks array with at least 2 values, got shape {d.shape}")
    n_seeds, n_tasks = d.shape
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, n_seeds, size=(n_samples, n_seeds))
    tasks = rng.integers(0, n_tasks, size=(n_samples, n_tasks))
    drawn = d[seeds[:, :, None], tasks[:, None, :]].reshape(n_samples, -1)
    counts = (~np.isnan(drawn)).sum(axis=1)
    sums = np.nansum(drawn, axis=1)
    means = sums[counts > 0] / counts[counts > 0]   # a resample that drew no value at all has no mean
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def pool_comparisons(by_seed: dict[str, Comparison | None], *, n_samples: int = 2000, seed: int = 0
                     ) -> Comparison | None:
    """One comparison over every seed's (seed, task) pairs (task ids "<run>/<task>"), its interval from
    `seeds_then_tasks`; None unless every seed has the comparison."""
    import numpy as np

    if not by_seed or any(c is None for c in by_seed.values()):
        return None
    present: dict[str, Comparison] = by_seed  # type: ignore[assignment]
    tasks = list(dict.fromkeys(t for c in present.values() for t in c.task_ids))
    column = {t: j for j, t in enumerate(tasks)}
    differences = np.full((len(present), len(tasks)), np.nan)
    ids, before, after = [], [], []
    for i, (run, c) in enumerate(present.items()):
        for t, b, a in zip(c.task_ids, c.values_before, c.values_after, strict=True):
            differences[i, column[t]] = a - b
            ids.append(f"{run}/{t}")
            before.append(b)
            after.append(a)
    if len(ids) < 2:
        return None
    first = next(iter(present.values()))
    return Comparison(first.before, first.after, first.metric, ids, before, after,
                      seeds_then_tasks(differences, n_samples, seed),
                      f"{len(present)} seed{'s' if len(present) > 1 else ''} × {len(tasks)} tasks")


@dataclass
class PooledMeasure:
    """One measure's comparisons (COMPARISONS), per seed as each seed's check computed them and pooled."""

    measure: str
    per_seed: dict[str, dict[str, Comparison | None]]   # run -> comparison name -> its comparison
    pooled: dict[str, Comparison | None]


def seeds_grader(checks: list[SeedCheck]) -> Calibration | None:
    """The grader gate's input for pooled seeds: None when a seed's grader was never probed, else the first failed
    probe, else the first seed's (every seed passed)."""
    records = [c.record.get("grader_calibration") for c in checks]
    if any(r is None for r in records):
        return None
    probes = [Calibration.from_record(r) for r in records]
    return next((p for p in probes if not p.trusted), probes[0])


@dataclass
class PooledCheck:
    """The seeds' checks, each measure per seed and pooled, and the pooled verdict."""

    checks: list[SeedCheck]
    metric: str
    measures: dict[str, PooledMeasure]   # the metric first, then the judge-free measures
    verdict: Verdict
    n_samples: int
    seed: int

    def table(self) -> list[dict[str, Any]]:
        """One row per measure and seed, then the pooled row: the gain over M0 and trained − control, each with its
        95% interval, and the (seed, task) pairs it averages."""
        rows = []
        pooled = f"pooled ({len(self.checks)} seed{'s' if len(self.checks) > 1 else ''})"
        for m, pm in self.measures.items():
            for who, by in [*pm.per_seed.items(), (pooled, pm.pooled)]:
                rows.append({"measure": LABELS.get(m, m), "seed": who,
                             **{name: by.get(name) for name in ("trained", "over_control")}})
        return rows

    def to_record(self) -> dict[str, Any]:
        def summary(c: Comparison | None) -> dict[str, Any] | None:
            return None if c is None else {"before": c.before, "after": c.after, "pairs": c.n_tasks,
                                           "over": c.extent, "mean_before": c.mean_before,
                                           "mean_after": c.mean_after, "gain": c.gain, "ci95": list(c.ci95)}

        first = self.checks[0].record["held_out"]
        return {"checks": [{"run": c.run, "path": str(c.path), "outcome": c.record["verdict"].get("outcome")}
                           for c in self.checks],
                "held_out": {"path": first.get("path"), "key": first.get("key"), "tasks": first.get("tasks")},
                "metric": self.metric,
                "bootstrap": {"samples": self.n_samples, "seed": self.seed, "resampling": RESAMPLING},
                "measures": {m: {"label": LABELS.get(m, m),
                                 "per_seed": {run: {n: summary(c) for n, c in by.items()}
                                              for run, by in pm.per_seed.items()},
                                 "pooled": {n: summary(c) for n, c in pm.pooled.items()}}
                             for m, pm in self.measures.items()},
                "verdict": self.verdict.to_record()}


def pool_checks(sources: list[str | Path], *, n_samples: int = 2000, seed: int = 0,
                accept_untrusted_judge: bool = False) -> PooledCheck:
    """`scope learning-check pool`: every seed's written check (a JSON file or a run folder each; module docstring),
    each measure pooled over the seeds, and the verdict under one seed's rule on the pooled comparisons."""
    checks = read_seed_checks(sources)
    metric = checks[0].metric
    measures = {}
    for m in (metric, *MEASURES):
        per_seed = {c.run: {name: c.comparison(name, m) for name in COMPARISONS} for c in checks}
        pooled = {name: pool_comparisons({run: by[name] for run, by in per_seed.items()}, n_samples=n_samples,
                                         seed=seed) for name in COMPARISONS}
        measures[m] = PooledMeasure(m, per_seed, pooled)
    score = measures[metric].pooled
    has_judge_free = any(c.record.get("judge_free") for c in checks)
    judge_free = JudgeFree(None, {}, {name: {m: measures[m].pooled[name] for m in MEASURES} for name in COMPARISONS}
                           ) if has_judge_free else None
    if score["trained"] is None:
        raise ValueError("the checks' gains over M0 cannot be pooled (fewer than 2 task values in all)")
    verdict = learning_verdict(score["trained"], score["control"], seeds_grader(checks), accept_untrusted_judge,
                               over_control=score["over_control"], judge_free=judge_free)
    return PooledCheck(checks, metric, measures, verdict, n_samples, seed)


def pooled_path(checks: list[SeedCheck]) -> Path:
    """Where `pool` writes by default: <runs>/learning_check_pooled/<run>+<run>+....json, <runs> the folder of the
    first check's run (the check's own folder for a check outside a run)."""
    first = checks[0].path
    runs = first.parent.parent.parent if first.parent.name == "learning_check" else first.parent
    return runs / "learning_check_pooled" / f"{'+'.join(c.run for c in checks)}.json"


# -- held-out answers, verbatim --------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One rollout's answer as stored (None: the rollout ended without one), its rubric score g and its
    rubric-fact recall (`judge_free.fact_recall`)."""

    who: str
    text: str | None
    score: float | None
    recall: float | None


@dataclass
class HeldOutExample:
    """A held-out task, its rubrics, and M0's and each trained Solver's first rollout's answer."""

    task_id: str
    document_id: str
    task: str
    rubrics: list[dict[str, Any]]   # each with its text and priority
    answers: list[Answer]


def first_rollouts(folder: Path, evaluation: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    """task id -> the first rollout (k0) of a checkpoint's stored evaluation, found by what a written check records
    of it (checkpoint name, weights' fingerprint, seed)."""
    path = evaluation_file(folder, evaluation["checkpoint"], evaluation["fingerprint"], evaluation["seed"])
    if not path.is_file():
        raise RunError(f"{path}: the evaluation of {evaluation['checkpoint']} is not stored here (the held-out set "
                       "lives in the cache of the machine that ran the check): run `scope learning-check compare` "
                       "here, which evaluates it again")
    out: dict[str, dict[str, Any] | None] = {}
    for rec in read_jsonl(path):
        rollouts = rec.get("rollouts") or []
        out[rec["id"]] = next((r for r in rollouts if str(r.get("id", "")).endswith("/k0")),
                              rollouts[0] if rollouts else None)
    return out


def task_order(task_id: str) -> list[Any]:
    """A task id's sort key with its numbers read as numbers: "h0001-0" (batch 1, position 0) after "h0000-15"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", task_id)]


def held_out_examples(sources: list[str | Path], n: int = 3) -> list[HeldOutExample]:
    """The first `n` tasks of the checks' held-out set by task id (`task_order`: "h0000-2" before "h0000-10", the
    set's build order), each with its rubrics, M0's answer (the first check's `before`) and each check's trained
    Solver's (`after`): the first rollout (k0) of each evaluation, all sampled with the check's evaluation seed
    (`learning_check.seed`, the same for every checkpoint). Read from the stored evaluations; no model loads."""
    checks = read_seed_checks(sources)
    folder = Path(checks[0].record["held_out"]["path"])
    tasks_file = folder / "tasks.jsonl"
    if not tasks_file.is_file():
        raise RunError(f"{tasks_file}: the held-out set is not on this machine: run `scope learning-check build` "
                       "with the checks' params")
    tasks = {rec["id"]: rec for rec in read_jsonl(tasks_file)}
    ids = sorted((r["task_id"] for r in checks[0].record["trained"]["per_task"]), key=task_order)[:n]
    answered = [("M0", first_rollouts(folder, checks[0].record["evaluations"]["before"]))]
    answered += [(f"trained Solver ({c.run})", first_rollouts(folder, c.record["evaluations"]["after"]))
                 for c in checks]
    examples = []
    for task_id in ids:
        rec = tasks[task_id]
        rubrics = rec.get("rubrics") or []
        texts = [r["text"] for r in rubrics]
        answers = []
        for who, rollouts in answered:
            rollout = rollouts.get(task_id) or {}
            text = rollout.get("answer")
            answers.append(Answer(who, text, rollout.get("rubric_score"), fact_recall(text, texts)))
        examples.append(HeldOutExample(task_id, rec["document_id"], rec["task"], rubrics, answers))
    return examples


def examples_markdown(examples: list[HeldOutExample]) -> str:
    """The examples as markdown: per task its id, source document, text and rubrics, then each answer quoted as
    stored, with its rubric score g (the frozen grader's) and rubric-fact recall (lexical)."""
    lines = [f"The first {len(examples)} held-out tasks by task id; for each, the first rollout (k0) of M0's "
             "evaluation and of each trained Solver's, all sampled with the check's evaluation seed, verbatim.", ""]
    for ex in examples:
        lines += [f"### {ex.task_id} (document {ex.document_id})", "", "**Task.**", "", *quoted(ex.task), "",
                  "**Rubrics.**", ""]
        lines += [f"{k}. ({r.get('priority', '-')}) {r['text']}" for k, r in enumerate(ex.rubrics, 1)] or ["(none)"]
        for a in ex.answers:
            score = "-" if a.score is None else f"{a.score:.2f}"
            recall = "-" if a.recall is None else f"{a.recall:.2f}"
            lines += ["", f"**{a.who}** (g = {score}, rubric-fact recall {recall}):", "",
                      *(quoted(a.text) if a.text is not None else ["*(no answer)*"])]
        lines.append("")
    return "\n".join(lines)


def quoted(text: str) -> list[str]:
    """Markdown block-quote lines of a text, kept as it is (blank lines stay inside the quote)."""
    return [f"> {line}".rstrip() for line in text.splitlines()] or [">"]
