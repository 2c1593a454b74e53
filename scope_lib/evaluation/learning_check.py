"""The learning check: is a trained Solver better than M0 on tasks training never saw, by more than a control?

    check = run_check(params, after="iter_03/solver", control="runs/ctl/iter_03/solver")   # or: scope learning-check
    check.verdict.outcome, check.trained.gain, check.trained.ci95, check.verdict.ratio

Not in the paper (issue 32; docs/training.md, "The learning check"). A rising training curve proves nothing on its
own: rewards that carry no information move metrics too ("Spurious Rewards", arXiv 2506.10947). So:

1. **The held-out task set** (`evaluation.held_out`): M0's tasks on the last `learning_check.held_out_documents`
   documents of the run's permutation, which training never samples, screened by M0's Solver and the frozen Judge,
   with the frozen Judge's grader probe beside it.
2. **Evaluating a checkpoint** (`evaluate_checkpoint`): K Solver rollouts per held-out task at the training sampling
   (one engine call per turn for every rollout of a batch), graded by the frozen Judge at the training grading
   temperature. Per task: the mean rubric score (the task success ḡ, eq. 1 averaged over the K rollouts) and the
   success rate (the share of rollouts with g >= `success_threshold`). Every checkpoint uses the same seeds (paired
   samples), never the pre-screen's; results are stored per (checkpoint weights, seed) beside the set.
3. **Comparing** (`compare_evaluations`, `learning_verdict`): per-task differences after − before, their mean (the
   gain) and a 95% percentile interval from resampling the tasks with replacement (seeded). The same paired
   comparison is made of the trained checkpoint against the shuffled-reward control's (`grpo.reward_control`;
   `LearningCheck.over_control`), and of every judge-free measure (`evaluation.judge_free`: answered rate, answer
   length, names per answer, rubric-fact recall, name precision, the rubric score at M0's lengths; `JudgeFree`),
   read from the stored answers without the grader the Solver trained against.
4. **The verdict** (`learning_verdict`, one of VERDICTS, the words docs/training.md uses): *learned* only when the
   gain's interval lies above 0, the trained − control interval lies above 0, rubric-fact recall's gain interval
   lies above 0 and name precision's does not lie below 0, and the grader passed its probe. A check is only as good
   as its grader: one that failed the held-out set's probe (separation, name-list separation or invalid rate past
   `judge.calibration`'s thresholds) or was never probed makes the verdict "not shown" unless
   `learning_check.accept_untrusted_judge` accepts a failed probe; the verdict names the probe's numbers either way.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from scope_lib.config import Params, ParamsError, load_params
from scope_lib.evaluation.evaluate import Checkpoint, Policy, base_engine, open_policies, resolve_checkpoint
from scope_lib.evaluation.held_out import (
    CheckComponents,
    HeldOutSet,
    check_reserved,
    held_out_set,
    open_components,
    seed_of,
    success_rate,
)
from scope_lib.evaluation.judge_free import LABELS, MEASURES, length_range, task_measures
from scope_lib.models.engine import Engine
from scope_lib.models.loading import make_engine
from scope_lib.runs import RecordLog, RunError, Stage, atomic_write_json, read_json
from scope_lib.selfplay.grader_probe import Calibration
from scope_lib.selfplay.rollout import new_trajectory, run_rollouts, solver_messages
from scope_lib.selfplay.tasks import GradedSolverRollout, grade_rollouts, solver_limits
from scope_lib.selfplay.training import shuffles_rewards

log = logging.getLogger(__name__)

#: The issue's bar for a trained run's gain over the shuffled-reward control's.
TARGET_RATIO = 2.0
METRICS = ("score", "success")
#: The check's three verdicts (docs/training.md): every reason starts with one, and reports show it as it is.
VERDICTS = ("learned", "not learned", "not shown")


# -- evaluating a checkpoint -------------------------------------------------------------------------------------


@dataclass
class TaskResult:
    """One held-out task's K rollouts of one checkpoint: their rubric scores g (eq. 1)."""

    task_id: str
    document_id: str
    scores: list[float]
    answered: int = 0   # rollouts that ended with an answer (the rest score 0, F.2)
    answers: list[str | None] = field(default_factory=list)  # each rollout's answer text (None: no answer)

    @property
    def mean_score(self) -> float:
        """The task success ḡ: the mean rubric score over the K rollouts (eq. 1)."""
        return sum(self.scores) / len(self.scores) if self.scores else 0.0

    def value(self, metric: str, threshold: float) -> float:
        return self.mean_score if metric == "score" else success_rate(self.scores, threshold)


@dataclass
class CheckpointEvaluation:
    """A checkpoint's K rollouts on every held-out task, in the set's order."""

    checkpoint: str       # the checkpoint's name
    spec: str
    fingerprint: str      # of its weights: a retrained checkpoint is evaluated again
    seed: int
    held_out_key: str
    success_threshold: float
    results: list[TaskResult] = field(default_factory=list)
    engine_calls: int = 0  # made by this process (0 when read back from the store)

    def values(self, metric: str = "score") -> dict[str, float]:
        if metric not in METRICS:
            raise ValueError(f"metric {metric!r}: choose {' or '.join(METRICS)}")
        return {r.task_id: r.value(metric, self.success_threshold) for r in self.results}

    @property
    def mean_score(self) -> float:
        return sum(r.mean_score for r in self.results) / len(self.results) if self.results else 0.0

    @property
    def success_rate(self) -> float:
        values = self.values("success")
        return sum(values.values()) / len(values) if values else 0.0


def checkpoint_fingerprint(ck: Checkpoint, m0: str = "") -> str:
    """A digest of a checkpoint's weights: the checksums its stage's DONE recorded when there are any, else the
    files themselves; for M0 (no folder of its own) the digest of its name and `m0`, M0's identity
    (`held_out.model_identity`: its weight files' sha256), so an M0 rebuilt with other weights is evaluated again."""
    digest = hashlib.sha256()
    if ck.path is None:
        digest.update(f"{ck.name}\0{m0}".encode())
        return digest.hexdigest()
    recorded = Stage(ck.path.parent).summary.get("checksums") if (ck.path.parent / "DONE").is_file() else None
    if recorded:
        for name, value in sorted(recorded.items()):
            digest.update(f"{name}:{value}\n".encode())
        return digest.hexdigest()
    for file in sorted(f for f in ck.path.rglob("*") if f.is_file()):
        digest.update(str(file.relative_to(ck.path)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def evaluation_path(held_out: HeldOutSet, ck: Checkpoint, seed: int) -> Path:
    return evaluation_file(held_out.path, ck.name, checkpoint_fingerprint(ck, held_out.model), seed)


def evaluation_file(folder: str | Path, checkpoint: str, fingerprint: str, seed: int) -> Path:
    """Where a checkpoint's evaluation (by its name, weights' fingerprint and seed) lies in a held-out set's folder:
    what a written check records (`LearningCheck.to_record`) finds it again by."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", checkpoint).strip("-.") or "checkpoint"
    return Path(folder) / "evaluations" / f"{slug}-{fingerprint[:12]}-seed{seed}.jsonl"


def _result(rec: dict[str, Any]) -> TaskResult:
    return TaskResult(rec["id"], rec["document_id"], [float(g) for g in rec["scores"]], rec.get("answered", 0),
                      [r.get("answer") for r in rec.get("rollouts", [])])


def stored_evaluation(params: Params, held_out: HeldOutSet, ck: Checkpoint, seed: int | None = None
                      ) -> CheckpointEvaluation | None:
    """The checkpoint's evaluation read back from the store when every held-out task has one, else None."""
    seed = params.learning_check.seed if seed is None else seed
    path = evaluation_path(held_out, ck, seed)
    if not path.is_file():
        return None
    by_id = {rec["id"]: rec for rec in RecordLog(path)}
    if any(t.challenger_id not in by_id for t in held_out.tasks):
        return None
    return CheckpointEvaluation(ck.name, ck.spec, checkpoint_fingerprint(ck, held_out.model), seed, held_out.key,
                                params.learning_check.success_threshold,
                                [_result(by_id[t.challenger_id]) for t in held_out.tasks])


def evaluate_checkpoint(params: Params, held_out: HeldOutSet, policy: Policy, components: CheckComponents, *,
                        seed: int | None = None, progress: bool = True,
                        grade: Callable[[list, dict[str, Any], CheckComponents], list[GradedSolverRollout]]
                        | None = None) -> CheckpointEvaluation:
    """K Solver rollouts of `policy` per held-out task at the training sampling, graded by the frozen Judge at the
    training grading temperature (module docstring, 2). Batches of `eval_batch_tasks` tasks (one engine call per
    turn for all their rollouts, one Judge call per batch) are stored as they finish; a killed evaluation resumes,
    a finished one is read back without any model call. `grade(trajectories, tasks by id, components)` scores a
    batch instead of the Judge's rubrics (the gold-answer slice's rule, `gold_slice.grade_gold`)."""
    from tqdm.auto import tqdm

    lc, s = params.learning_check, params.solver
    seed = lc.seed if seed is None else seed
    ck = policy.checkpoint
    if len(held_out.tasks) == 0:
        raise RunError(f"the held-out set {held_out.path} has no task: raise learning_check.held_out_documents or "
                       "window_margin (a new set is built for the new values)")
    store = RecordLog(evaluation_path(held_out, ck, seed))
    batches = [held_out.tasks[i:i + lc.eval_batch_tasks] for i in range(0, len(held_out.tasks), lc.eval_batch_tasks)]
    have = store.ids
    partial = {b for b, batch in enumerate(batches) if 0 < sum(t.challenger_id in have for t in batch) < len(batch)}
    if partial:  # a batch is one unit: one seed, one engine call per turn; half of one is redone whole
        store.retain(lambda rec: rec["chunk"] not in partial)
    tokenizer = policy.engine.tokenizer
    engine_calls = 0
    todo = [(b, batch) for b, batch in enumerate(batches) if any(t.challenger_id not in store for t in batch)]
    for b, batch in tqdm(todo, desc=f"{ck.name} on the held-out set", disable=not (progress and todo), leave=False):
        trajectories = [new_trajectory(f"{ck.name}/{t.challenger_id}/k{j}", "solver",
                                       solver_messages(t.task, components.dialect, s.max_searches, s.prompt),
                                       tokenizer, max_searches=s.max_searches, meta={"challenger_id": t.challenger_id})
                        for t in batch for j in range(lc.samples)]
        limits = replace(solver_limits(params), seed=seed_of("evaluate", seed, b))  # the same for every checkpoint
        stats = run_rollouts(trajectories, policy.engine, components.retriever, components.dialect, limits,
                             adapter=policy.adapter)
        engine_calls += stats.engine_calls
        by_id = {t.challenger_id: t for t in batch}
        graded = grade(trajectories, by_id, components) if grade else grade_rollouts(trajectories, by_id,
                                                                                     components.judge)
        by_task: dict[str, list] = {}
        for g in graded:
            by_task.setdefault(g.trajectory.meta["challenger_id"], []).append(g)
        store.append({"id": t.challenger_id, "chunk": b, "document_id": t.document_id,
                      "scores": [g.rubric_score for g in by_task[t.challenger_id]],
                      "answered": sum(g.trajectory.answer is not None for g in by_task[t.challenger_id]),
                      "rollouts": [{"id": g.trajectory.id, "answer": g.trajectory.answer, "verdicts": g.verdicts,
                                    "rubric_score": g.rubric_score, "finish": g.trajectory.finish,
                                    "searches": [q.query for q in g.trajectory.searches if q.valid]}
                                   for g in by_task[t.challenger_id]]} for t in batch)
    evaluation = stored_evaluation(params, held_out, ck, seed)
    assert evaluation is not None, "every held-out task was just evaluated"
    evaluation.engine_calls = engine_calls
    log.info("%s on %d task(s) of %s: mean score %.3f, success rate %.3f (K = %d, seed %d)", ck.name,
             len(evaluation.results), held_out.path.name, evaluation.mean_score, evaluation.success_rate, lc.samples,
             seed)
    return evaluation


# -- comparing two checkpoints and the verdict -------------------------------------------------------------------


def paired_bootstrap(differences: list[float], n_samples: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of the mean of per-task differences, resampling tasks with replacement (seeded)."""
    import numpy as np

    d = np.asarray(differences, dtype=float)
    if len(d) < 2:
        raise ValueError(f"a paired interval needs at least 2 tasks, got {len(d)}: enlarge the held-out set "
                         "(learning_check.held_out_documents, window_margin)")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n_samples, len(d)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


@dataclass
class Comparison:
    """Two checkpoints on the same held-out tasks: per-task values, the mean paired difference (the gain) and
    its bootstrap 95% interval."""

    before: str
    after: str
    metric: str
    task_ids: list[str]
    values_before: list[float]
    values_after: list[float]
    ci95: tuple[float, float]
    pooled_over: str | None = None  # pooled over seeds (`evaluation.pooled_check`): "3 seeds × 48 tasks"
    unit: str = "tasks"  # what the values are over, in words: held-out tasks, or the gold slice's "questions"

    @property
    def n_tasks(self) -> int:
        return len(self.task_ids)

    @property
    def extent(self) -> str:
        """What the comparison pairs, in words: "48 tasks" ("12 questions"), or the seeds and tasks it pools."""
        return self.pooled_over or f"{self.n_tasks} {self.unit}"

    @property
    def differences(self) -> list[float]:
        return [a - b for a, b in zip(self.values_after, self.values_before, strict=True)]

    @property
    def gain(self) -> float:
        return sum(self.differences) / len(self.task_ids)

    @property
    def mean_before(self) -> float:
        return sum(self.values_before) / len(self.task_ids)

    @property
    def mean_after(self) -> float:
        return sum(self.values_after) / len(self.task_ids)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Comparison:
        """A comparison read back from a written check (`to_record`)."""
        rows = record["per_task"]
        return cls(record["before"], record["after"], record["metric"], [r["task_id"] for r in rows],
                   [float(r["before"]) for r in rows], [float(r["after"]) for r in rows],
                   (float(record["ci95"][0]), float(record["ci95"][1])), record.get("pooled_over"))

    def to_record(self) -> dict[str, Any]:
        return {"before": self.before, "after": self.after, "metric": self.metric, "tasks": self.n_tasks,
                "mean_before": self.mean_before, "mean_after": self.mean_after, "gain": self.gain,
                "ci95": list(self.ci95), **({"pooled_over": self.pooled_over} if self.pooled_over else {}),
                "per_task": [{"task_id": t, "before": b, "after": a}
                             for t, b, a in zip(self.task_ids, self.values_before, self.values_after, strict=True)]}


def compare_values(before: str, after: str, metric: str, values_before: dict[str, float | None],
                   values_after: dict[str, float | None], *, n_samples: int = 2000, seed: int = 0,
                   unit: str = "tasks") -> Comparison | None:
    """The paired comparison of two checkpoints' per-task values (in `values_before`'s order) over the tasks where
    both have one (a judge-free measure can be undefined on a task); None when fewer than 2 tasks have. `unit`
    names what the values are over in the verdict's words (the gold slice's "questions")."""
    ids = [t for t, v in values_before.items() if v is not None and values_after.get(t) is not None]
    if len(ids) < 2:
        return None
    vb, va = [float(values_before[t]) for t in ids], [float(values_after[t]) for t in ids]  # type: ignore[arg-type]
    differences = [a - b for a, b in zip(va, vb, strict=True)]
    return Comparison(before, after, metric, ids, vb, va, paired_bootstrap(differences, n_samples, seed), unit=unit)


def compare_evaluations(before: CheckpointEvaluation, after: CheckpointEvaluation, *, metric: str = "score",
                        n_samples: int = 2000, seed: int = 0) -> Comparison:
    """The paired comparison of two evaluations of the same held-out set (module docstring, 3)."""
    if before.held_out_key != after.held_out_key:
        raise ValueError(f"{before.checkpoint} and {after.checkpoint} were evaluated on different held-out sets "
                         f"({before.held_out_key} vs {after.held_out_key}): evaluate both with the same params")
    a, b = after.values(metric), before.values(metric)
    if set(a) != set(b):
        raise ValueError(f"{before.checkpoint} and {after.checkpoint} cover different tasks ({len(b)} vs {len(a)})")
    compared = compare_values(before.checkpoint, after.checkpoint, metric, {r.task_id: b[r.task_id]
                              for r in before.results}, a, n_samples=n_samples, seed=seed)
    if compared is None:
        raise ValueError(f"a paired interval needs at least 2 tasks, got {len(b)}: enlarge the held-out set "
                         "(learning_check.held_out_documents, window_margin)")
    return compared


def over_control_of(trained: Comparison, control: Comparison, *, n_samples: int = 2000, seed: int = 0
                    ) -> Comparison | None:
    """The trained checkpoint against the control's, paired over the tasks both comparisons share with `before`
    (None when fewer than 2 do)."""
    values_control = dict(zip(control.task_ids, control.values_after, strict=True))
    values_trained = dict(zip(trained.task_ids, trained.values_after, strict=True))
    return compare_values(control.after, trained.after, trained.metric, values_control, values_trained,
                          n_samples=n_samples, seed=seed, unit=trained.unit)


# -- the judge-free measures of a check ---------------------------------------------------------------------------


@dataclass
class JudgeFree:
    """The judge-free measures (`evaluation.judge_free`) of one check, read from the stored answers: per role
    ('before', 'after', 'control') each measure's per-task values, and per comparison ('trained': after vs before,
    'control': control vs before, 'over_control': after vs control) each measure's paired Comparison, None where
    fewer than 2 tasks have a value on both sides."""

    length_range: tuple[float, float] | None  # M0's (`before`'s) answer lengths, 5th to 95th percentile
    values: dict[str, dict[str, dict[str, float | None]]]
    comparisons: dict[str, dict[str, Comparison | None]]

    def mean(self, role: str, measure: str) -> float | None:
        """The measure's mean over the tasks where `role`'s checkpoint has a value."""
        kept = [v for v in self.values[role][measure].values() if v is not None]
        return sum(kept) / len(kept) if kept else None

    def to_record(self) -> dict[str, Any]:
        return {"length_range": list(self.length_range) if self.length_range else None,
                "means": {role: {m: self.mean(role, m) for m in MEASURES} for role in self.values},
                "comparisons": {name: {m: c.to_record() if c else None for m, c in by.items()}
                                for name, by in self.comparisons.items()}}


def evaluation_measures(ev: CheckpointEvaluation, held_out: HeldOutSet, lengths: tuple[float, float] | None
                        ) -> dict[str, dict[str, float | None]]:
    """Every judge-free measure of one checkpoint's evaluation: measure -> task id -> the task's value."""
    tasks = {t.challenger_id: t for t in held_out.tasks}
    out: dict[str, dict[str, float | None]] = {m: {} for m in MEASURES}
    for r in ev.results:
        task = tasks[r.task_id]
        answers = r.answers if len(r.answers) == len(r.scores) else []
        values = task_measures(answers, r.scores[:len(answers)], [x.text for x in task.rubrics or []],
                               held_out.documents.get(r.document_id), lengths)
        for m in MEASURES:
            out[m][r.task_id] = values[m]
    return out


def judge_free_measures(held_out: HeldOutSet, evaluations: dict[str, CheckpointEvaluation], *,
                        n_samples: int = 2000, seed: int = 0) -> JudgeFree:
    """The judge-free measures of a check's evaluations, each compared as the rubric score is (same bootstrap)."""
    lengths = length_range([a for r in evaluations["before"].results for a in r.answers])
    values = {role: evaluation_measures(ev, held_out, lengths) for role, ev in evaluations.items()}
    pairs = {"trained": ("before", "after"), "control": ("before", "control"), "over_control": ("control", "after")}
    comparisons = {name: {m: compare_values(evaluations[b].checkpoint, evaluations[a].checkpoint, m, values[b][m],
                                            values[a][m], n_samples=n_samples, seed=seed) for m in MEASURES}
                   for name, (b, a) in pairs.items() if a in values and b in values}
    return JudgeFree(lengths, values, comparisons)


# -- the verdict ---------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """Whether a run learned (`learning_verdict`): the gain, trained − control, the judge-free guards, the grader."""

    outcome: str  # one of VERDICTS: learned, not learned, or not shown
    reason: str  # the outcome, then why, in one sentence
    gain: float
    ci95: tuple[float, float]
    control_gain: float | None = None
    control_ci95: tuple[float, float] | None = None
    ratio: float | None = None  # gain / control gain (inf when the control did not gain; None without a control)
    judge_trusted: bool | None = None  # the grader probe's verdict (None: not probed)
    judge: str | None = None  # the probe's numbers in one phrase
    over_control: float | None = None  # trained − control, paired over the tasks
    over_control_ci95: tuple[float, float] | None = None
    judge_free: list[str] = field(default_factory=list)  # each judge-free measure's gain, one phrase each

    def __post_init__(self) -> None:
        if self.outcome not in VERDICTS:
            raise ValueError(f"a verdict is one of {VERDICTS}, not {self.outcome!r}")

    @property
    def learned(self) -> bool:
        return self.outcome == "learned"

    @property
    def meets_target(self) -> bool:
        """Learned, with a gain at least TARGET_RATIO times the control's (the issue's bar)."""
        return self.learned and self.ratio is not None and self.ratio >= TARGET_RATIO

    def restate(self, outcome: str, addition: str) -> None:
        """Change the outcome to `outcome` and add why to the reason (which keeps what it said)."""
        if ", but " in self.reason and addition.startswith("but "):
            addition = "and " + addition.removeprefix("but ")
        self.outcome = outcome
        self.reason = f"{outcome}: {self.reason.split(': ', 1)[1]}, {addition}"

    def to_record(self) -> dict[str, Any]:
        ratio = self.ratio if self.ratio is None or math.isfinite(self.ratio) else "inf"
        return {"learned": self.learned, "outcome": self.outcome, "meets_target": self.meets_target,
                "target_ratio": TARGET_RATIO, "reason": self.reason, "gain": self.gain, "ci95": list(self.ci95),
                "control_gain": self.control_gain,
                "control_ci95": list(self.control_ci95) if self.control_ci95 else None, "ratio": ratio,
                "over_control": self.over_control,
                "over_control_ci95": list(self.over_control_ci95) if self.over_control_ci95 else None,
                "judge_trusted": self.judge_trusted, "judge": self.judge, "judge_free": self.judge_free}


def interval_text(c: Comparison) -> str:
    """A comparison's gain and 95% interval in one phrase: "+0.123 [+0.045, +0.201]"."""
    return f"{c.gain:+.3f} [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}]"


def learning_verdict(trained: Comparison, control: Comparison | None = None, grader: Calibration | None = None,
                     accept_untrusted_judge: bool = False, *, over_control: Comparison | None = None,
                     judge_free: JudgeFree | None = None, judged: bool = True) -> Verdict:
    """The verdict rule (docs/training.md, "The learning check"): learned only when the trained comparison's 95%
    interval lies above 0, AND the trained checkpoint's interval against the shuffled-reward control's, paired
    over the tasks (`over_control`; derived from the two comparisons when not given), lies above 0, AND, read
    without the grader (`judge_free`), rubric-fact recall's gain interval lies above 0 and name precision's does not
    lie below 0, AND the grader that scored it passed its calibration probe (`grader`). No control, no judge-free
    measures, or no probe: "not shown". A failed probe: "not shown" whatever the interval, unless
    `accept_untrusted_judge` (the reason says so). `judged=False` is the rule for a measure no judge scored (the
    gold-answer slice's rule-verified pass rate, `method_comparison.home_verdict`): the two interval tests alone,
    neither the judge-free guards nor the grader's probe, which guard against a judge."""
    if control is not None and over_control is None:
        over_control = over_control_of(trained, control)
    verdict = _gain_verdict(trained, control, over_control)
    if judged:
        _judge_free_gate(verdict, judge_free)
        grader_gate(verdict, grader, accept_untrusted_judge)
    return verdict


def _gain_verdict(trained: Comparison, control: Comparison | None, over: Comparison | None) -> Verdict:
    lo, hi = trained.ci95
    gain = trained.gain
    ratio = None
    if control is not None and gain > 0:
        # a control "gain" within float rounding of 0 (identical scores summed in another order) did not gain
        ratio = gain / control.gain if control.gain > 1e-9 else math.inf
    common = {"gain": gain, "ci95": (lo, hi), "ratio": ratio,
              "control_gain": control.gain if control else None, "control_ci95": control.ci95 if control else None,
              "over_control": over.gain if over else None, "over_control_ci95": over.ci95 if over else None}
    if lo <= 0:
        return Verdict("not learned", f"not learned: the gain {interval_text(trained)} over {trained.extent} "
                       "does not lie above 0 (no gain that can be told from noise)", **common)
    if control is None:
        return Verdict("not shown", f"not shown: the gain {interval_text(trained)} is above 0, but without a "
                       "shuffled-reward control it may be drift, not learning: train the same params with "
                       "-o grpo.reward_control=shuffled and give its checkpoint as the control", **common)
    if over is None or over.ci95[0] <= 0:
        return Verdict("not learned", f"not learned: the gain {interval_text(trained)} is above 0, but trained − "
                       f"control {interval_text(over) if over else f'(not 2 {trained.unit} in common)'} (the control gained "
                       f"{interval_text(control)}) does not lie above 0: the trained run cannot be told from its "
                       "shuffled-reward control", **common)
    times = "the control did not gain" if ratio == math.inf else f"{ratio:.1f}x the control's {control.gain:+.3f}"
    target = "meets" if ratio is not None and ratio >= TARGET_RATIO else "below"
    return Verdict("learned", f"learned: the gain {interval_text(trained)} and trained − control {interval_text(over)} lie "
                   f"above 0 ({times}; {target} the {TARGET_RATIO:g}x target)", **common)


def _judge_free_gate(verdict: Verdict, judge_free: JudgeFree | None) -> None:
    """Record the judge-free gains on the verdict; a gain the grader alone shows is not learned: rubric-fact recall
    must rise (interval above 0) and name precision must not fall (interval not below 0)."""
    if judge_free is None:
        if verdict.learned:
            verdict.restate("not shown", "but no judge-free measure was given (`judge_free_measures`): nothing "
                            "shows the gain without the grader the Solver trained against")
        return
    gains = judge_free.comparisons.get("trained", {})
    verdict.judge_free = [f"{LABELS[m]} {interval_text(c)}" if c else f"{LABELS[m]} not measurable"
                          for m, c in gains.items()]
    if not verdict.learned:
        return
    recall, precision = gains.get("fact_recall"), gains.get("name_precision")
    missing = [LABELS[m] for m, c in (("fact_recall", recall), ("name_precision", precision)) if c is None]
    if missing:
        verdict.restate("not shown", f"but {' and '.join(missing)} cannot be measured on 2 tasks or more (no rubric "
                        "with a name or number, no answer that names something, or no stored answers: evaluate "
                        "again): nothing shows the gain without the grader")
        return
    failed = []
    if recall.ci95[0] <= 0:  # type: ignore[union-attr]
        failed.append(f"rubric-fact recall did not rise ({interval_text(recall)})")  # type: ignore[arg-type]
    if precision.ci95[1] < 0:  # type: ignore[union-attr]
        names = gains.get("names")
        more = f", names per answer {interval_text(names)}" if names else ""
        failed.append(f"name precision against the source document fell ({interval_text(precision)}{more})")  # type: ignore[arg-type]
    if failed:
        verdict.restate("not learned", f"but read without the grader {' and '.join(failed)}: the grader's gain is "
                        "not the rubrics' facts stated from the source")


def grader_gate(verdict: Verdict, grader: Calibration | None, accept_untrusted_judge: bool) -> None:
    """Scores of an unprobed or untrusted grader show nothing either way: "not shown", whatever the interval."""
    if grader is None:
        verdict.restate("not shown", "but the grader that scored it was never probed (no calibration probe beside "
                        "the held-out set): its scores may not follow the rubrics; probe it (`held_out_set` does)")
        return
    verdict.judge_trusted, verdict.judge = grader.trusted, grader.numbers()
    if grader.trusted:
        return
    why = f"the frozen Judge's grader failed its calibration probe ({'; '.join(grader.reasons)}: {grader.numbers()})"
    if not accept_untrusted_judge:
        verdict.restate("not shown", f"but {why}, so its scores may not follow the rubrics; fix the Judge "
                        "(docs/evaluation.md, Judge calibration) or accept it with "
                        "learning_check.accept_untrusted_judge (--accept-untrusted-judge)")
    else:
        verdict.reason += f" [{why}{', accepted' if verdict.learned else ''}]"


# -- one check, end to end ---------------------------------------------------------------------------------------


@dataclass
class LearningCheck:
    """The held-out set, each checkpoint's evaluation ('before', 'after', 'control'), the trained and control
    comparisons with `before`, and the verdict."""

    held_out: HeldOutSet
    evaluations: dict[str, CheckpointEvaluation]
    trained: Comparison
    control: Comparison | None
    verdict: Verdict
    over_control: Comparison | None = None  # the trained checkpoint against the control's, paired over the tasks
    judge_free: JudgeFree | None = None  # the judge-free measures, per checkpoint and compared

    def table(self) -> list[dict[str, Any]]:
        """One row per checkpoint: its role, tasks, mean rubric score, success rate, its gain over `before` with
        the 95% interval, and each judge-free measure's mean (LABELS)."""
        rows = []
        for role, ev in self.evaluations.items():
            comparison = {"after": self.trained, "control": self.control}.get(role)
            means = {LABELS[m]: self.judge_free.mean(role, m) for m in MEASURES} if self.judge_free else {}
            rows.append({"role": role, "checkpoint": ev.checkpoint, "tasks": len(ev.results),
                         "mean rubric score": ev.mean_score, "success rate": ev.success_rate,
                         f"gain ({self.trained.metric})": comparison.gain if comparison else None,
                         "95% interval": list(comparison.ci95) if comparison else None, **means})
        return rows

    def to_record(self) -> dict[str, Any]:
        grader = self.held_out.grader
        return {"held_out": {"path": str(self.held_out.path), **self.held_out.summary},
                "grader_calibration": grader.summary() if grader is not None else None,
                "evaluations": {role: {"checkpoint": ev.checkpoint, "spec": ev.spec, "fingerprint": ev.fingerprint,
                                       "seed": ev.seed, "mean_score": ev.mean_score, "success_rate": ev.success_rate,
                                       "success_threshold": ev.success_threshold}
                                for role, ev in self.evaluations.items()},
                "trained": self.trained.to_record(), "control": self.control.to_record() if self.control else None,
                "over_control": self.over_control.to_record() if self.over_control else None,
                "judge_free": self.judge_free.to_record() if self.judge_free else None,
                "verdict": self.verdict.to_record()}


def checkpoint_training(params: Params, ck: Checkpoint) -> Params | None:
    """The parameters the checkpoint's run trained with (its params.yaml), or None for M0 or a folder outside a
    run (or a params.yaml this version cannot read)."""
    if ck.kind == "base" or ck.path is None:
        return None
    run = params.run_dir if ck.iteration is not None else next(
        (p for p in list(ck.path.parents)[:4] if (p / "params.yaml").is_file() and (p / "manifest.json").is_file()),
        None)
    if run is None or not (Path(run) / "params.yaml").is_file():
        return None
    try:
        return load_params(Path(run) / "params.yaml")
    except ParamsError as exc:
        log.warning("cannot read how %s was trained: %s", ck.spec, exc)
        return None


def check_training(params: Params, ck: Checkpoint, role: str) -> None:
    """Refuse a checkpoint whose run could have trained on the held-out documents, a control run given as the
    trained one, or a trained run given as the control (each run records `grpo.reward_control`)."""
    check_reserved(params)
    trained = checkpoint_training(params, ck)
    if trained is None:
        if ck.kind != "base":
            log.warning("%s: no run folder (params.yaml, manifest.json) above it: the check cannot confirm that it "
                        "never trained on the held-out documents, nor whether it is a control", ck.spec)
        return
    need, have = params.learning_check.held_out_documents, trained.learning_check.held_out_documents
    same_order = (trained.selfplay.seed, trained.retrieval.corpus, trained.retrieval.max_passages) == \
        (params.selfplay.seed, params.retrieval.corpus, params.retrieval.max_passages)
    if have < need or not same_order:
        raise ParamsError(f"{ck.spec} was trained with learning_check.held_out_documents {have} (selfplay.seed "
                          f"{trained.selfplay.seed}, corpus {trained.retrieval.corpus}); the held-out set needs "
                          f"{need} documents reserved from the same permutation (seed {params.selfplay.seed}, corpus "
                          f"{params.retrieval.corpus}), else its tasks may come from training documents: check with "
                          "that run's values, or retrain with these")
    control = trained.grpo.reward_control
    if role == "control" and not shuffles_rewards(control, "solver"):
        raise ParamsError(f"{ck.spec} was trained with grpo.reward_control: {control}: its Solver trained on its "
                          "rewards, so it is no control; give a checkpoint of the same params trained with "
                          "-o grpo.reward_control=shuffled")
    if role == "after" and control != "none":
        raise ParamsError(f"{ck.spec} was trained with grpo.reward_control: {control}: it is the control; give it as "
                          "the control and a run trained on its rewards as the checkpoint to check")


def unique_names(checkpoints: dict[str, Checkpoint]) -> dict[str, Checkpoint]:
    """Distinct checkpoints get distinct names (adapters are served under their names: two runs'
    'iter_01-solver' must not be taken for each other)."""
    seen: dict[str, tuple] = {}
    out = {}
    for role, ck in checkpoints.items():
        identity = (ck.kind, str(ck.path))
        if ck.name in seen and seen[ck.name] != identity:
            ck = replace(ck, name=f"{role}-{ck.name}")
        seen[ck.name] = identity
        out[role] = ck
    return out


def opener(params: Params, checkpoints: list[Checkpoint], *, engine: Engine | None = None,
           components: CheckComponents | None = None, policies: dict[str, Policy] | None = None
           ) -> Callable[[], dict[str, Any]]:
    """A function that opens, on its first call only, the checkpoints' policies (beside those lent in `policies`,
    keyed by name) and the check's components (the lent ones, or M0's over the lent engine, a lent policy's base
    engine or a new one), and returns {"policies": ..., "components": ...}: nothing loads while every result is
    stored."""
    opened: dict[str, Any] = {}

    def open_all() -> dict[str, Any]:
        if not opened:
            lent = components.engine if components is not None else engine
            wanted = [ck for ck in dict.fromkeys(checkpoints) if ck.name not in (policies or {})]
            opened["policies"] = {**(policies or {}), **(open_policies(params, wanted, engine=lent) if wanted else {})}
            m0 = lent or base_engine(opened["policies"]) or make_engine(params, "policy")
            opened["components"] = components or open_components(params, engine=m0)
        return opened

    return open_all


def evaluate_checkpoints(params: Params, checkpoints: dict[str, str | Checkpoint], *, seed: int | None = None,
                         engine: Engine | None = None, components: CheckComponents | None = None,
                         policies: dict[str, Policy] | None = None, model_id: str | None = None,
                         root: str | Path | None = None, progress: bool = True,
                         opened: Callable[[], dict[str, Any]] | None = None
                         ) -> tuple[HeldOutSet, dict[str, CheckpointEvaluation]]:
    """`scope learning-check evaluate`: the held-out set (built or reused) and each checkpoint's evaluation, keyed
    like `checkpoints` (stored evaluations are read back; no model loads when every one is stored). A key that is a
    role ('after', 'control') is checked for it too (`check_training`). `engine` / `components` / `policies`
    (keyed by checkpoint name) let a caller that holds models (notebook 04) lend them; `opened`, an `opener` the
    caller shares with other measures (`method_comparison`), opens them instead."""
    resolved = unique_names({key: spec if isinstance(spec, Checkpoint) else resolve_checkpoint(params, spec)
                        for key, spec in checkpoints.items()})
    for key, ck in resolved.items():
        check_training(params, ck, key)
    open_all = opened or opener(params, list(resolved.values()), engine=engine, components=components,
                                policies=policies)
    held_out = held_out_set(params, lambda: open_all()["components"], model_id=model_id, root=root, progress=progress)
    evaluations = {}
    for key, ck in resolved.items():
        evaluations[key] = stored_evaluation(params, held_out, ck, seed) or evaluate_checkpoint(
            params, held_out, open_all()["policies"][ck.name], open_all()["components"], seed=seed,
            progress=progress)
    return held_out, evaluations


def check_of(params: Params, held_out: HeldOutSet, evaluations: dict[str, CheckpointEvaluation],
             metric: str = "score") -> LearningCheck:
    """The check of evaluations already made ('before', 'after', and optionally 'control'): the paired comparisons
    with `before`, trained − control, the judge-free measures and the verdict (`run_check` without evaluating;
    `method_comparison` makes one per method from one round of evaluations)."""
    lc = params.learning_check

    def comparison(role: str, base: str = "before") -> Comparison:
        return compare_evaluations(evaluations[base], evaluations[role], metric=metric,
                                   n_samples=lc.bootstrap_samples, seed=lc.seed)

    trained = comparison("after")
    controlled = comparison("control") if "control" in evaluations else None
    over_control = comparison("after", base="control") if controlled else None
    judge_free = judge_free_measures(held_out, evaluations, n_samples=lc.bootstrap_samples, seed=lc.seed)
    verdict = learning_verdict(trained, controlled, held_out.grader, lc.accept_untrusted_judge,
                               over_control=over_control, judge_free=judge_free)
    check = LearningCheck(held_out, evaluations, trained, controlled, verdict, over_control, judge_free)
    log.info("learning check of %s against %s: %s", trained.after, trained.before, check.verdict.reason)
    return check


def check_file(params: Params, stem: str, metric: str, default: str) -> Path:
    """<run>/learning_check/<stem>.json for the role's default metric, <stem>-<metric>.json for another, so that
    verdicts on two metrics sit side by side (the Solver's and the Challenger's checks alike)."""
    return params.run_dir / "learning_check" / f"{stem}{'' if metric == default else f'-{metric}'}.json"


def check_path(params: Params, after: str, before: str, metric: str = "score") -> Path:
    """Where a Solver check is written; a verdict on `success` gets its own file beside the rubric score's."""
    return check_file(params, f"{after}-vs-{before}", metric, "score")


def run_check(params: Params, after: str | Checkpoint, *, before: str | Checkpoint = "base",
              control: str | Checkpoint | None = None, metric: str = "score", write: bool = True,
              **lent: Any) -> LearningCheck:
    """`scope learning-check compare`: `before`, `after` and the optional shuffled-reward `control` evaluated on the
    held-out set (`evaluate_checkpoints`, which takes `lent` models), the paired comparisons with `before`, and
    the verdict, written to <run>/learning_check/<after>-vs-<before>.json (`-success` before .json when the verdict
    reads the success rate). Refuses a checkpoint whose run could have trained on the held-out documents, or whose
    run's `grpo.reward_control` says it plays the other role."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: choose {' or '.join(METRICS)}")
    specs = {"before": before, "after": after, **({"control": control} if control is not None else {})}
    held_out, evaluations = evaluate_checkpoints(params, specs, **lent)
    check = check_of(params, held_out, evaluations, metric)
    if write:
        atomic_write_json(check_path(params, check.trained.after, check.trained.before, metric), check.to_record())
    return check


def read_check(path: str | Path) -> dict[str, Any]:
    """A written check (`run_check(write=True)`) read back."""
    return read_json(path, "delete it; `scope learning-check compare` writes it again from the stored evaluations")
