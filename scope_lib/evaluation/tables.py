"""What notebook 05 shows of an evaluation: the paper's tables (2-3) from the stored summaries, gains over the
base, invalid judge replies, each judge's calibration beside the scores it produced (greyed out when untrusted),
the short-form judge's agreement with exact match, the leave-one-out table, and the co-evolution matrix with the
self-judge gap.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from scope_lib.config import Params
from scope_lib.evaluation import paper_tables
from scope_lib.evaluation import scorers as S
from scope_lib.evaluation.benchmarks import (
    BENCHMARKS,
    iter_records,
    select_items,
)
from scope_lib.evaluation.evaluate import Policy, eval_dir, load_trajectory, store_record
from scope_lib.protocol import parsing
from scope_lib.protocol.dialects import Dialect
from scope_lib.runs import RecordLog, read_jsonl
from scope_lib.selfplay.rollout import new_trajectory, run_rollouts, solver_messages
from scope_lib.selfplay.tasks import grade_rollouts, solver_limits

log = logging.getLogger(__name__)


def _kind_benchmarks(kind: str) -> list[str]:
    return [n for n, s in BENCHMARKS.items() if s.kind == kind]


def results_table(params: Params, checkpoints: list[str], kind: Literal["open_ended", "short_form"],
                  scorer: str = "scope_paper", *, run_dir: Path | None = None):
    """Table 2 (open_ended) or Table 3 (short_form) layout: one row per checkpoint name, one column per benchmark
    (the paper's labels), x100, then Avg over the benchmarks evaluated and how many there were. Missing = NaN."""
    import pandas as pd

    names = _kind_benchmarks(kind)
    base = run_dir or params.run_dir
    rows = {}
    for ck in checkpoints:
        row = {}
        for n in names:
            path = base / "eval" / ck / n / "summary.json"
            value = None
            if path.is_file():
                value = json.loads(path.read_text())["scorers"].get(scorer, {}).get("value")
            row[BENCHMARKS[n].column] = math.nan if value is None else 100 * value
        present = [v for v in row.values() if not math.isnan(v)]
        row["Avg"] = sum(present) / len(present) if present else math.nan
        row["benchmarks"] = len(present)
        rows[ck] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def results_trust(params: Params, checkpoints: list[str], kind: Literal["open_ended", "short_form"],
                  scorer: str = "scope_paper", *, run_dir: Path | None = None):
    """The `results_table` layout holding, per cell, whether the judge behind the score passed its calibration
    probe (True / False; None: no probe for that judge, or no score)."""
    import pandas as pd

    base = run_dir or params.run_dir
    rows = {}
    for ck in checkpoints:
        row = {}
        for n in _kind_benchmarks(kind):
            path = base / "eval" / ck / n / "summary.json"
            found = json.loads(path.read_text())["scorers"].get(scorer, {}) if path.is_file() else {}
            row[BENCHMARKS[n].column] = found.get("trusted")
        rows[ck] = row
    return pd.DataFrame.from_dict(rows, orient="index", dtype=object)


def grey_untrusted_cells(table, trust):
    """A Styler of a `results_table` whose cells scored by an untrusted judge are greyed out (`results_trust`)."""
    def style(column):
        flags = trust[column.name] if column.name in trust else [None] * len(column)
        return ["color: #9e9e9e; font-style: italic" if flag is False else "" for flag in flags]

    return table.style.apply(style, axis=0).format(precision=1, na_rep="-")


def summaries_frame(summaries: list[dict[str, Any]]):
    """One row per (checkpoint, benchmark, scorer): score x100 with its 95% CI, how many items were scored, how many
    judge units stayed invalid (and the policy applied), the share of rollouts that produced an answer, and the
    judge's calibration row: which judge, its probe's separation and invalid rate, and whether it is trusted
    (None: no probe for this judge prompt, or no judge)."""
    import pandas as pd

    rows = []
    for s in summaries:
        answered = sum(v for k, v in s["answer_status"].items() if k != "missing")
        n = sum(s["answer_status"].values()) or 1
        for scorer, v in s["scorers"].items():
            probe = v.get("calibration") or {}
            rows.append({"checkpoint": s["checkpoint"], "benchmark": s["benchmark"], "scorer": scorer,
                         "score": None if v["value"] is None else round(100 * v["value"], 1),
                         "95% CI": "-" if not v["ci95"] else f"{100 * v['ci95'][0]:.1f}-{100 * v['ci95'][1]:.1f}",
                         "scored": f"{v['n_scored']}/{v['n']}",
                         "invalid units": f"{v['n_invalid_units']}/{v['n_units']}",
                         "policy": v["invalid_policy"] if v["n_invalid_units"] else "",
                         "answered": round(answered / n, 2),
                         "judge": v.get("judge_id") or ("none (no judge)" if v.get("judge") is None else "no probe"),
                         "separation": _round(probe.get("separation")),
                         "probe invalid": _round(probe.get("invalid_rate")),
                         "trusted": v.get("trusted")})
    return pd.DataFrame(rows)


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def calibration_frame(calibrations: dict[str, dict[str, Any]]):
    """One row per judge (`evaluate.load_calibration`, or the records of `scope_lib.evaluation.judge_probes`): its
    probe's size, sensitivity, specificity, separation, invalid rate, position bias (pairwise), whether it is
    trusted and why not."""
    import pandas as pd

    rows = []
    for jid, c in calibrations.items():
        rows.append({"judge": jid, "role": c["role"], "model": c["model"],
                     "benchmarks": ", ".join(c.get("benchmarks", [])), "probes": c["n_items"],
                     "sensitivity": _round(c["sensitivity"]), "specificity": _round(c["specificity"]),
                     "separation": _round(c["separation"]), "invalid": _round(c["invalid_rate"]),
                     "position bias": _round(c.get("position_bias")),
                     "trusted": c["trusted"], "why not": "; ".join(c["reasons"])})
    columns = ["judge", "role", "model", "benchmarks", "probes", "sensitivity", "specificity", "separation",
               "invalid", "position bias", "trusted", "why not"]
    return pd.DataFrame(rows, columns=columns).set_index("judge")


def grey_untrusted(frame, column: str = "trusted"):
    """A Styler of `frame` whose rows with `column` False are greyed out (a judge that failed its probe)."""
    def style(row):
        untrusted = row[column] is False or row[column] == False  # noqa: E712 - numpy bools too
        return ["color: #9e9e9e; font-style: italic" if untrusted else "" for _ in row]

    return frame.style.apply(style, axis=1).format(precision=2, na_rep="-")


def agreement_frame(summaries: list[dict[str, Any]]):
    """The short-form judge against exact match on the run's own answers (`calibration.em_agreement`), one row
    per (checkpoint, benchmark): how often they agree, judge-yes with EM 0 and judge-no with EM 1, and the same
    with F1."""
    import pandas as pd

    rows = [{"checkpoint": s["checkpoint"], "benchmark": s["benchmark"], **s["judge_agreement"]}
            for s in summaries if s.get("judge_agreement")]
    return pd.DataFrame(rows).set_index(["checkpoint", "benchmark"]) if rows else pd.DataFrame()


def invalid_replies(params: Params, checkpoint: str, benchmark: str, limit: int = 3) -> list[dict[str, str]]:
    """A few judge replies that never parsed (after the retries), with the item and unit they belong to."""
    path = eval_dir(params, checkpoint, benchmark) / "items.jsonl"
    found: list[dict[str, str]] = []
    for record in read_jsonl(path) if path.is_file() else []:
        for scorer, score in record["scores"].items():
            for unit in score["units"]:
                if unit["invalid"] and len(found) < limit:
                    found.append({"item": record["item_id"], "scorer": scorer, "unit": unit["key"],
                                  "last reply": (unit["replies"] or [""])[-1][:200]})
    return found


def gains_frame(params: Params, checkpoints: list[str], scorer: str = "scope_paper"):
    """Long table for a Figure 5-style plot: per benchmark and checkpoint the score x100 and its gain over the first
    checkpoint (normally base)."""
    frames = []
    for kind in ("open_ended", "short_form"):
        table = results_table(params, checkpoints, kind, scorer).drop(columns=["benchmarks"])  # type: ignore[arg-type]
        long = table.reset_index(names="checkpoint").melt(id_vars="checkpoint", var_name="benchmark",
                                                          value_name="score").dropna()
        if long.empty:
            continue
        first = long[long["checkpoint"] == checkpoints[0]].set_index("benchmark")["score"]
        long["gain"] = long["score"] - long["benchmark"].map(first)
        long["table"] = "Table 2 (open-ended)" if kind == "open_ended" else "Table 3 (short-form QA)"
        frames.append(long)
    import pandas as pd

    columns = ["checkpoint", "benchmark", "score", "gain", "table"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def paper_table(params: Params, kind: Literal["open_ended", "short_form"]):
    """The paper's Table 2 or 3 rows for this run's base model (None when the paper has no such model)."""
    import pandas as pd

    model = paper_tables.paper_model(params.model.base)
    if model is None:
        return None
    table = (paper_tables.TABLE2 if kind == "open_ended" else paper_tables.TABLE3)[model]
    return pd.DataFrame.from_dict(table, orient="index")


def leave_one_out_table(params: Params, runs: dict[str, str], checkpoint: str = "iter_03-solver",
                        scorer: str = "scope_paper"):
    """Table 6 layout: one row per labelled run (e.g. {"w/o Planning": "qwen3-8b-no-planning"}) read from
    <runs_dir>/<run>/eval/<checkpoint>/; rows whose run has no results are left out."""
    import pandas as pd

    frames = []
    for label, run in runs.items():
        run_dir = Path(params.run.runs_dir) / run
        table = results_table(params, [checkpoint], "open_ended", scorer, run_dir=run_dir)
        if table["benchmarks"].iloc[0]:
            frames.append(table.rename(index={checkpoint: label}))
    return pd.concat(frames) if frames else None


@dataclass
class PoolTask:
    """A task of a Challenger's task pool (runs/<name>/iter_NN/pool/tasks.jsonl)."""

    id: str
    iteration: int
    task: str
    task_type: str
    document_id: str
    rubrics: list[parsing.Rubric]


def pool_iterations(params: Params) -> list[int]:
    return sorted(int(p.parent.parent.name.split("_")[1]) for p in params.run_dir.glob("iter_[0-9]*/pool/tasks.jsonl"))


def load_task_pool(params: Params, iteration: int) -> list[PoolTask]:
    """The filtered tasks of iteration `iteration` (Challenger_i's pool); malformed lines are logged with file
    and line and skipped."""
    path = params.run_dir / f"iter_{iteration:02d}" / "pool" / "tasks.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no task pool at {path}")
    tasks, problems = [], []
    for lineno, record in iter_records(path):
        if not isinstance(record, dict):
            problems.append(str(record))
            continue
        rubrics = record.get("rubrics")
        if not (isinstance(record.get("task"), str) and record["task"].strip() and isinstance(rubrics, list)
                and rubrics and all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in rubrics)
                and record.get("id") is not None):
            problems.append(f"{path}:{lineno}: needs id, task and rubrics [{{text, priority}}]")
            continue
        tasks.append(PoolTask(str(record["id"]), int(record.get("iteration", iteration)), record["task"],
                              str(record.get("task_type", "")), str(record.get("document_id", "")),
                              [parsing.Rubric(r["text"], r.get("priority") or parsing.DEFAULT_PRIORITY)
                               for r in rubrics]))
    if problems:
        log.warning("%s: %d malformed task record(s) skipped, e.g. %s", path, len(problems), problems[0])
    return tasks


@dataclass
class _PoolEntry:  # what selfplay.grade_rollouts reads of a task
    task: str
    rubrics: list[parsing.Rubric]


def coevolution_matrix(params: Params, policies: dict[str, Policy], judge, *, retriever, dialect: Dialect,
                       iterations: list[int] | None = None, max_tasks: int | None = None):
    """SPICE's cross-checkpoint diagnostic: Solver_j answers the pooled tasks of Challenger_i, and the frozen
    Judge grades each answer against the task's rubrics (eq. 1). Returns (matrix of mean rubric scores,
    rows = Challenger iteration, columns = Solver checkpoint; per-task records). Solver rollouts use the training
    Solver settings (`selfplay.solver_limits`), so a cell is the g-bar a training run would see; they are stored
    under eval/<solver>/pool_iter_NN/ and reused."""
    import random

    import pandas as pd

    iterations = iterations if iterations is not None else pool_iterations(params)
    matrix: dict[str, dict[str, float]] = {}
    rows = []
    for it in iterations:
        tasks = load_task_pool(params, it)
        if max_tasks is not None and len(tasks) > max_tasks:
            tasks = random.Random(params.selfplay.seed + it).sample(tasks, max_tasks)
        entries = {t.id: _PoolEntry(t.task, t.rubrics) for t in tasks}
        label = f"Challenger iter {it}"
        matrix[label] = {}
        for name, policy in policies.items():
            store = RecordLog(eval_dir(params, name, f"pool_iter_{it:02d}") / "trajectories.jsonl")
            stored = {r["meta"]["challenger_id"]: load_trajectory(r) for r in store}
            fresh = [new_trajectory(f"{name}/pool_iter_{it:02d}/{t.id}", "solver",
                                    solver_messages(t.task, dialect, params.solver.max_searches, params.solver.prompt),
                                    policy.engine.tokenizer, max_searches=params.solver.max_searches,
                                    meta={"challenger_id": t.id}) for t in tasks if t.id not in stored]
            if fresh:
                run_rollouts(fresh, policy.engine, retriever, dialect, solver_limits(params), adapter=policy.adapter)
                store.append(store_record(t) for t in fresh)
                stored.update({t.meta["challenger_id"]: t for t in fresh})
            solvers = [stored[t.id] for t in tasks]
            graded = grade_rollouts(solvers, entries, judge) if solvers else []
            for g in graded:
                rows.append({"challenger_iteration": it, "solver": name, "task_id": g.trajectory.meta["challenger_id"],
                             "answered": g.trajectory.answer is not None, "verdicts": g.verdicts,
                             "rubric_score": g.rubric_score})
            matrix[label][name] = (sum(g.rubric_score for g in graded) / len(graded)) if graded else math.nan
    return pd.DataFrame.from_dict(matrix, orient="index"), pd.DataFrame(rows)


def self_judge_gap(params: Params, checkpoint: str, benchmarks: list[str], judge):
    """Does the training reward track the benchmark judge? On the same stored answers, the frozen self-Judge
    (SCOPE's binary grader, Figure 11) grades each item's binary rubrics (`scorers.self_judge_rubrics`) and its
    rubric score (eq. 1) is set against the external judge's scope_paper score. An answer-less rollout gets 0
    from the self-Judge without a call, as in training. One row per benchmark."""
    import pandas as pd

    rows = []
    for name in benchmarks:
        path = eval_dir(params, checkpoint, name) / "items.jsonl"
        if not path.is_file():
            continue
        items = {i.id: i for i in select_items(params, name)[0]}
        records = [r for r in read_jsonl(path) if r["item_id"] in items
                   and r["scores"].get("scope_paper", {}).get("value") is not None]
        triples, owners = [], []
        for k, r in enumerate(records):
            if r["answer_status"] == "missing":
                continue
            for rubric in S.self_judge_rubrics(name, items[r["item_id"]]):
                triples.append((r["question"], r["answer"], rubric))
                owners.append(k)
        if not records or not any(S.self_judge_rubrics(name, items[r["item_id"]]) for r in records):
            continue
        verdicts: dict[int, list[int]] = {k: [] for k in range(len(records))}
        if triples:
            got = judge.grade([t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples])
            for k, v in zip(owners, got, strict=True):
                verdicts[k].append(int(v or 0))
        self_scores = [sum(v) / len(v) if v else 0.0 for v in verdicts.values()]
        external = [r["scores"]["scope_paper"]["value"] for r in records]
        rows.append({"benchmark": BENCHMARKS[name].column, "items": len(records),
                     "self-judge": 100 * sum(self_scores) / len(records),
                     "external judge": 100 * sum(external) / len(records),
                     "gap (self - external)": 100 * (sum(self_scores) - sum(external)) / len(records),
                     "pearson r": _pearson(self_scores, external)})
    return pd.DataFrame(rows)


def _pearson(x: list[float], y: list[float]) -> float:
    n = len(x)
    if n < 2:
        return math.nan
    mx, my = sum(x) / n, sum(y) / n
    sx = math.sqrt(sum((a - mx) ** 2 for a in x))
    sy = math.sqrt(sum((b - my) ** 2 for b in y))
    if sx == 0 or sy == 0:
        return math.nan
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / (sx * sy)
