"""The Challenger's learning check: does a trained Challenger write held-out tasks nearer the difficulty window than
M0's, by more than a control? And cross-checkpoint play on held-out tasks (the paper's Figure 3b for any run).

    check = run_challenger_check(params, "iter_03/challenger", control="runs/ctl/iter_03/challenger")
    check.verdict.outcome, check.comparisons["trained"]["in_window"].ci95      # or: scope learning-check compare
    play = cross_play(params, ["base", "iter_01/challenger"], ["base", "iter_01/solver"])   # scope learning-check play
    play.matrix()                                           # Challenger_i's held-out tasks x Solver_j's mean score

Not in the paper (issue 50; docs/training.md, "The Challenger's learning check"). The Solver's check
(`evaluation.learning_check`) scores Solvers on M0's held-out tasks; this one scores Challengers on the same held-out
documents (`held_out.held_out_candidates`: the reserved tail of the permutation less the teacher's documents; the
first `learning_check.tasks` of them, every one counted, whatever its task became):

1. **The Challenger's held-out tasks** (`challenger_tasks`): the checkpoint (M0's, `iter_NN/challenger` or a folder,
   as `evaluation.evaluate.resolve_checkpoint` names them) writes one task per document through the task pool's batch
   step (`selfplay.tasks.candidate_batch`, batches of `learning_check.batch_size`, the Challenger's training
   sampling, the same seeds for every checkpoint); the frozen Judge gates each task and writes its rubrics. Stored
   batch by batch under the held-out set's folder (`challengers/<checkpoint>-<weights>-seed<seed>/`), resumed like
   the held-out set (`runs.finished_chunks`: a batch counts once its marker is written; a half-written one is
   redone).
2. **A fixed Solver answers** (`learning_check.evaluate_checkpoint` on the gated tasks): M0's by default, or a named
   checkpoint; K = `learning_check.samples` rollouts per task at the Solver's training sampling, graded by the frozen
   Judge; stored beside the Challenger's tasks, so a second compare loads no model.
3. **Per document** (`DocumentResult`, MEASURES): the gate passed; ḡ in the difficulty window
   (`selfplay.difficulty_window`; a document whose task failed the gates or never came is outside it); |ḡ − τ|
   (τ = `challenger.difficulty_target`, eq. 5; only where ḡ exists); R_C (eq. 4 with `challenger.reward_shape`, as
   training gives it: a failed gate keeps the format term, no format no reward); and, read without the Judge, the
   task's length in whitespace tokens and whether it names its source (`protocol.gate_rules.source_relevance`: a
   name of the task, `protocol.names.names_in`, in the source document).
4. **Comparing** (`compare_measure`): every measure paired over the documents against M0's Challenger (or
   `before`) with the Solver's check's paired bootstrap (`learning_check.compare_values`), and against the controls:
   the shuffled-reward control (a run with `grpo.reward_control: shuffled_challenger`, the Challenger's rewards
   alone permuted; `shuffled_both` is accepted too) and the frozen-Challenger ablation (`selfplay.co_evolution: false`,
   params/ablations/no-co-evolution.yaml).
5. **The verdict** (`challenger_verdict`, learning_check.VERDICTS): *learned* only when the window share rises over
   M0's Challenger with its 95% interval above 0 (or |ḡ − τ| falls, interval below 0, with `metric="distance"`), the
   trained Challenger beats the shuffled-reward control's paired over the documents (interval clear of 0) and the
   frozen Challenger's when one is given, its tasks do not name their source less (interval not below 0), and the
   Judge's gates, rubric writer and grader passed their probes (stored beside the held-out set).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scope_lib.config import Params, ParamsError
from scope_lib.evaluation.evaluate import Checkpoint, Policy, resolve_checkpoint
from scope_lib.evaluation.held_out import (
    CheckComponents,
    HeldOutSet,
    check_reserved,
    corpus_passages,
    held_out_candidates,
    held_out_location,
    held_out_probes,
    model_identity,
    probe_beside,
    seed_of,
)
from scope_lib.evaluation.judge_free import answer_tokens
from scope_lib.evaluation.learning_check import (
    CheckpointEvaluation,
    Comparison,
    Verdict,
    check_file,
    check_training,
    checkpoint_fingerprint,
    checkpoint_training,
    compare_values,
    evaluate_checkpoint,
    grader_gate,
    interval_text,
    opener,
    stored_evaluation,
    unique_names,
)
from scope_lib.models.engine import Engine
from scope_lib.protocol import rewards
from scope_lib.protocol.gate_rules import source_relevance
from scope_lib.runs import RunError, Stage, atomic_write_json, finished_chunks, read_json
from scope_lib.selfplay.grader_probe import Calibration
from scope_lib.selfplay.stage_probes import StageProbes
from scope_lib.selfplay.tasks import TaskEvaluation, candidate_batch

log = logging.getLogger(__name__)

#: Per-document measures of a Challenger checkpoint, in the order reports show them.
MEASURES = ("gate_pass", "in_window", "distance", "reward", "mean_score", "task_tokens", "names_source")
LABELS = {"gate_pass": "gate pass rate", "in_window": "window share", "distance": "mean |ḡ − τ|",
          "reward": "mean R_C", "mean_score": "mean ḡ", "task_tokens": "task length (tokens)",
          "names_source": "names its source"}
#: The verdict's metrics and their better direction: the window share rises, |ḡ − τ| falls.
BETTER = {"in_window": 1, "distance": -1}
#: `grpo.reward_control` values whose run trained its Challenger on permuted rewards (`selfplay.training`'s
#: `shuffles_rewards(value, "challenger")`; tests/test_challenger_check.py keeps the two in step).
CHALLENGER_SHUFFLED = ("shuffled_challenger", "shuffled_both")
#: The comparisons a check makes: name -> (baseline role, compared role).
PAIRS = {"trained": ("before", "after"), "control": ("before", "control"), "over_control": ("control", "after"),
         "frozen": ("before", "frozen"), "over_frozen": ("frozen", "after")}


# -- the Challenger's held-out tasks ------------------------------------------------------------------------------


@dataclass
class ChallengerTasks:
    """One Challenger checkpoint's task on each held-out document (in the documents' order; `task` None where it
    wrote none), gated and given rubrics by the frozen Judge, and the folder they live in."""

    checkpoint: str
    path: Path
    evaluations: list[TaskEvaluation]
    documents: dict[str, str]   # document id -> its text (title and passage)
    summary: dict[str, Any]

    def solvable(self, m0: str) -> HeldOutSet:
        """The tasks a Solver answers (gates passed, rubrics written) as a held-out set rooted in this folder, so
        `learning_check.evaluate_checkpoint` stores each Solver's answers beside them."""
        tasks = [e for e in self.evaluations if e.gates_passed and e.rubrics]
        key = hashlib.sha256(str(self.path).encode()).hexdigest()[:16]
        return HeldOutSet(self.path, key, tasks, self.summary, None, self.documents, m0)


def challenger_documents(params: Params, passages: list) -> list:
    """The held-out documents the Challenger writes on: the first `learning_check.tasks` of the held-out set's
    candidates (the reserved tail less the teacher's documents)."""
    return held_out_candidates(params, passages)[:params.learning_check.tasks]


def challenger_folder(held_out_folder: Path, ck: Checkpoint, m0: str, seed: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", ck.name).strip("-.") or "checkpoint"
    return held_out_folder / "challengers" / f"{slug}-{checkpoint_fingerprint(ck, m0)[:12]}-seed{seed}"


def challenger_tasks(params: Params, folder: Path, checkpoint: str, policy, components, *, seed: int,
                     progress: bool = True) -> ChallengerTasks:
    """The Challenger's task on each held-out document, written on first use (module docstring, 1) and read back
    after. `policy` and `components` are functions returning the Challenger's Policy and the check's components,
    called only when something must be written. A write killed mid-way resumes batch by batch; a set asked for more
    documents later grows by whole batches."""
    from filelock import FileLock

    n_documents = params.learning_check.tasks
    stage = Stage(folder)
    def short() -> bool:  # written for fewer documents than asked now
        return stage.summary.get("asked", 0) < n_documents

    if not stage.done or short():
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".lock")):
            if stage.done and short():
                (folder / "DONE").unlink()
            if not stage.done:
                stage.mark_done(_write_tasks(params, stage, checkpoint, policy(), components(), seed, progress))
    return load_challenger_tasks(folder, params)


def load_challenger_tasks(folder: Path, params: Params) -> ChallengerTasks:
    """A finished Challenger's tasks read back: the first `learning_check.tasks` documents'."""
    stage = Stage(folder)
    if not stage.done:
        raise RunError(f"{folder} holds no finished Challenger tasks (no DONE): run `scope learning-check compare "
                       "PARAMS --role challenger` again to finish them")
    records = list(stage.records("tasks"))[:params.learning_check.tasks]
    return ChallengerTasks(stage.summary["checkpoint"], Path(folder), [TaskEvaluation.from_record(r) for r in records],
                           {r["document_id"]: r["document"] for r in records}, stage.summary)


def _write_tasks(params: Params, stage: Stage, checkpoint: str, policy: Policy, c: CheckComponents, seed: int,
                 progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    lc, sp = params.learning_check, params.selfplay
    documents = challenger_documents(params, corpus_passages(params, c))
    contents = {p.id: p.contents for p in documents}
    candidates, chunks, tasks = stage.records("candidates"), stage.records("chunks"), stage.records("tasks")
    batches = [documents[i:i + lc.batch_size] for i in range(0, len(documents), lc.batch_size)]
    finished = finished_chunks(candidates, chunks, tasks)
    sizes = {m["chunk"]: m["candidates"] for m in chunks}
    finished = {k for k in finished if k < len(batches) and sizes[k] == len(batches[k])}  # a last batch now longer
    chunks.retain(lambda m: m["chunk"] in finished)
    candidates.retain(lambda rec: rec["chunk"] in finished)  # a batch a kill left half-written is redone
    tasks.retain(lambda rec: rec["chunk"] in finished)
    todo = [k for k in range(len(batches)) if k not in finished]
    for k in tqdm(todo, desc=f"{checkpoint}'s held-out tasks", unit="batch", leave=False,
                  disable=not (progress and todo)):
        batch = candidate_batch(  # the same prompts and seeds for every checkpoint: paired over the documents
            batches[k], params=params, engine=policy.engine, retriever=c.retriever, dialect=c.dialect, judge=c.judge,
            tokenizer=policy.engine.tokenizer, prompt_seed=seed_of("challenger-check/prompts", sp.seed, k),
            id_prefix=f"c{k:04d}-", challenger_seed=seed_of("challenger-check/challenger", seed, k),
            screen_seed=seed_of("challenger-check/screen", seed, k), n_solver=0, challenger_adapter=policy.adapter,
            solver_adapter=None, grading_temperature=params.judge.grading_temperature)
        by_id = {t.id: t for t in batch.trajectories}
        candidates.append({"id": e.challenger_id, "chunk": k, "trajectory": by_id[e.challenger_id].to_record()}
                          for e in batch.evaluations)
        tasks.append({**e.to_record(), "id": e.challenger_id, "chunk": k, "document": contents[e.document_id]}
                     for e in batch.evaluations)
        chunks.append([{"id": f"chunk-{k:04d}", "chunk": k, "candidates": len(batch.evaluations),
                        "kept": len(batch.evaluations)}])
    written = [TaskEvaluation.from_record(r) for r in tasks]
    summary = {"checkpoint": checkpoint, "documents": len(written), "with_task": sum(e.task is not None for e in written),
               "passed_gates": sum(e.gates_passed for e in written),
               "with_rubrics": sum(bool(e.gates_passed and e.rubrics) for e in written), "seed": seed,
               "asked": lc.tasks}
    log.info("%s wrote %d task(s) on %d held-out document(s), %d passed the gates -> %s", checkpoint,
             summary["with_task"], summary["documents"], summary["passed_gates"], stage.path)
    return summary


# -- one Challenger with one Solver --------------------------------------------------------------------------------


@dataclass
class DocumentResult:
    """One held-out document under one Challenger and one Solver: the task, the gates, the Solver's rubric scores."""

    document_id: str
    task_id: str
    task: str | None
    gates_passed: bool
    format_score: float          # r_fmt of the Challenger's rollout (F.1)
    rubrics: bool                # the Judge wrote rubrics (so a Solver answered)
    scores: list[float] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)

    @property
    def mean_score(self) -> float | None:
        """ḡ: the Solver's mean rubric score over its K rollouts (eq. 1); None without a task to answer."""
        return sum(self.scores) / len(self.scores) if self.scores else None


@dataclass
class ChallengerEvaluation:
    """A Challenger checkpoint's held-out tasks answered by one Solver: per document, what each measure reads."""

    challenger: str
    solver: str
    documents: list[DocumentResult]
    window: tuple[float, float]
    tau: float
    reward: dict[str, Any]          # challenger.*: how R_C is computed (eq. 4, as training)
    sources: dict[str, str] = field(default_factory=dict)

    def measure(self, d: DocumentResult, name: str) -> float | None:
        g = d.mean_score
        if name == "gate_pass":
            return float(d.gates_passed)
        if name == "in_window":
            return float(g is not None and self.window[0] <= g <= self.window[1])
        if name == "distance":
            return None if g is None else abs(g - self.tau)
        if name == "reward":  # eq. 4, what Stage 1 gives the rollout
            return rewards.challenger_reward(d.format_score, d.gates_passed, g, rubrics_parsed=d.rubrics,
                                             target=self.tau, **self.reward)
        if name == "mean_score":
            return g
        if name == "task_tokens":
            return None if d.task is None else float(answer_tokens(d.task))
        if name == "names_source":
            source = self.sources.get(d.document_id)
            return None if d.task is None or source is None else float(source_relevance(d.task, source))
        raise ValueError(f"measure {name!r}: choose one of {', '.join(MEASURES)}")

    def values(self, name: str) -> dict[str, float | None]:
        """document id -> the measure's value (None where it is undefined)."""
        return {d.document_id: self.measure(d, name) for d in self.documents}

    def mean(self, name: str) -> float | None:
        kept = [v for v in self.values(name).values() if v is not None]
        return sum(kept) / len(kept) if kept else None


def challenger_evaluation(params: Params, tasks: ChallengerTasks, solver: str,
                          answered: CheckpointEvaluation | None) -> ChallengerEvaluation:
    """Join a Challenger's tasks with a Solver's answers to them (None: no task passed the gates)."""
    by_task = {r.task_id: r for r in answered.results} if answered else {}
    docs = []
    for e in tasks.evaluations:
        r = by_task.get(e.challenger_id)
        docs.append(DocumentResult(e.document_id, e.challenger_id, e.task, e.gates_passed, e.format.total,
                                   e.rubrics is not None, r.scores if r else [], r.answers if r else []))
    c = params.challenger
    return ChallengerEvaluation(tasks.checkpoint, solver, docs, params.selfplay.difficulty_window,
                                c.difficulty_target, {"format_weight": c.format_weight,
                                                      "difficulty_weight": c.difficulty_weight,
                                                      "shape": c.reward_shape,
                                                      "no_rubrics_reward": c.no_rubrics_reward}, tasks.documents)


def compare_measure(before: ChallengerEvaluation, after: ChallengerEvaluation, measure: str, *,
                    n_samples: int = 2000, seed: int = 0) -> Comparison | None:
    """`after` − `before` on one measure, paired over the documents where both have a value, with the paired
    bootstrap's 95% interval (None below 2 such documents)."""
    if before.solver != after.solver:
        raise ValueError(f"{before.challenger} was answered by {before.solver} and {after.challenger} by "
                         f"{after.solver}: compare Challengers with the same Solver")
    if [d.document_id for d in before.documents] != [d.document_id for d in after.documents]:
        raise ValueError(f"{before.challenger} and {after.challenger} wrote on different held-out documents: "
                         "evaluate both with the same params")
    return compare_values(before.challenger, after.challenger, measure, before.values(measure), after.values(measure),
                          n_samples=n_samples, seed=seed)


# -- opening checkpoints and evaluating them --------------------------------------------------------------------


def check_challenger_role(params: Params, ck: Checkpoint, role: str) -> None:
    """Refuse a checkpoint that could have trained on the held-out documents (`learning_check.check_training`), and
    one whose run plays another role: the trained Challenger's run trained it on its rewards with co-evolution, the
    control's permuted the Challenger's rewards, the frozen one's is the no-co-evolution ablation."""
    check_training(params, ck, "checkpoint")
    trained = checkpoint_training(params, ck)
    if trained is None:
        return
    shuffled = trained.grpo.reward_control in CHALLENGER_SHUFFLED
    frozen = not trained.selfplay.co_evolution
    if role == "after" and (shuffled or frozen):
        what = f"its Challenger's rewards were permuted (grpo.reward_control: {trained.grpo.reward_control})" if shuffled else \
            "its Challenger was frozen (selfplay.co_evolution: false)"
        raise ParamsError(f"{ck.spec}: {what}: it is a control; give it as --{'control' if shuffled else 'frozen'} "
                          "and a run trained on its rewards as the checkpoint to check")
    if role == "control" and not shuffled:
        raise ParamsError(f"{ck.spec} was trained with grpo.reward_control: {trained.grpo.reward_control}: its "
                          "Challenger trained on its rewards; the Challenger's control is a run of the same params "
                          "trained with -o grpo.reward_control=shuffled_challenger")
    if role == "frozen" and not frozen:
        raise ParamsError(f"{ck.spec}: its run co-evolved the Challenger; the frozen-Challenger ablation is a run of "
                          "the same params with -o selfplay.co_evolution=false (params/ablations/no-co-evolution.yaml)")


def evaluate_play(params: Params, challengers: dict[str, str | Checkpoint], solvers: dict[str, str | Checkpoint], *,
                  seed: int | None = None, engine: Engine | None = None, components: CheckComponents | None = None,
                  policies: dict[str, Policy] | None = None, model_id: str | None = None,
                  root: str | Path | None = None, progress: bool = True
                  ) -> tuple[Path, dict[tuple[str, str], ChallengerEvaluation]]:
    """Every Challenger's held-out tasks answered by every Solver: (the held-out folder, {(challenger key, solver
    key): evaluation}). Stored tasks and answers are read back: no model loads when all are stored. A challenger key
    that is a role ('after', 'control', 'frozen') is checked for it (`check_challenger_role`). `engine` /
    `components` / `policies` (keyed by checkpoint name) let a caller that holds models lend them."""
    check_reserved(params)
    seed = params.learning_check.seed if seed is None else seed
    if set(challengers) & set(solvers):
        raise ValueError(f"the keys of challengers and solvers must differ: {set(challengers) & set(solvers)}")
    named = unique_names({k: v if isinstance(v, Checkpoint) else resolve_checkpoint(params, v)
                          for k, v in {**challengers, **solvers}.items()})
    for key, ck in named.items():
        if key in challengers:
            check_challenger_role(params, ck, key)
        else:
            check_training(params, ck, "checkpoint")
    open_all = opener(params, list(named.values()), engine=engine, components=components, policies=policies)
    m0 = model_id or model_identity(params)
    folder = held_out_location(params, m0, root)[0]
    probe_beside(folder, params, lambda: open_all()["components"])
    out = {}
    for ckey in challengers:
        ck = named[ckey]
        tasks = challenger_tasks(params, challenger_folder(folder, ck, m0, seed), ck.name,
                                 lambda ck=ck: open_all()["policies"][ck.name], lambda: open_all()["components"],
                                 seed=seed, progress=progress)
        solvable = tasks.solvable(m0)
        for skey in solvers:
            sck = named[skey]
            answered = None
            if solvable.tasks:
                answered = stored_evaluation(params, solvable, sck, seed) or evaluate_checkpoint(
                    params, solvable, open_all()["policies"][sck.name], open_all()["components"], seed=seed,
                    progress=progress)
            out[(ckey, skey)] = challenger_evaluation(params, tasks, sck.name, answered)
    return folder, out


# -- the verdict ---------------------------------------------------------------------------------------------------


def improved(c: Comparison | None, metric: str) -> bool:
    """The comparison's interval lies on the better side of 0 (above for the window share, below for |ḡ − τ|)."""
    if c is None:
        return False
    return c.ci95[0] > 0 if BETTER[metric] > 0 else c.ci95[1] < 0


def challenger_verdict(trained: Comparison | None, *, metric: str = "in_window", over_control: Comparison | None = None,
                       control: Comparison | None = None, over_frozen: Comparison | None = None,
                       names_source: Comparison | None = None, grader: Calibration | None = None,
                       stages: StageProbes | None = None, accept_untrusted_judge: bool = False) -> Verdict:
    """The Challenger's verdict (docs/training.md, "The Challenger's learning check"): learned only when `trained`
    (after − M0's Challenger on `metric`) has its interval on the better side of 0, AND trained − the shuffled-reward
    control's (`over_control`) does too, AND trained − the frozen Challenger's (`over_frozen`) does when given, AND
    the share of tasks that name their source (`names_source`, after − before) does not have its interval below 0,
    AND the Judge's gates and rubric writer (`stages`) and grader (`grader`) passed their probes. No control, no
    measurable source naming or a missing probe: "not shown"; an untrusted stage or grader: "not shown" unless
    `accept_untrusted_judge`."""
    if metric not in BETTER:
        raise ValueError(f"metric {metric!r}: choose {' or '.join(BETTER)}")
    label, way = LABELS[metric], "rise above" if BETTER[metric] > 0 else "fall below"
    if trained is None:
        return Verdict("not shown", f"not shown: fewer than 2 held-out documents have a {label} under both "
                       "Challengers (no task passed the gates): nothing to compare", 0.0, (0.0, 0.0))
    common = {"gain": trained.gain, "ci95": trained.ci95,
              "control_gain": control.gain if control else None, "control_ci95": control.ci95 if control else None,
              "over_control": over_control.gain if over_control else None,
              "over_control_ci95": over_control.ci95 if over_control else None}
    said = f"{label} {interval_text(trained)} over {trained.n_tasks} documents"
    if not improved(trained, metric):
        verdict = Verdict("not learned", f"not learned: the {said} does not {way} 0 (no change from M0's "
                          "Challenger that can be told from noise)", **common)
    elif over_control is None:
        verdict = Verdict("not shown", f"not shown: the {said} improves on M0's Challenger, but without a "
                          "shuffled-reward control it may be drift: train the same params with "
                          "-o grpo.reward_control=shuffled_challenger and give its Challenger as the control", **common)
    elif not improved(over_control, metric):
        verdict = Verdict("not learned", f"not learned: the {said} improves on M0's Challenger, but trained − "
                          f"control {interval_text(over_control)} does not {way} 0: the Challenger cannot be told from "
                          "its shuffled-reward control", **common)
    elif over_frozen is not None and not improved(over_frozen, metric):
        verdict = Verdict("not learned", f"not learned: the {said} and trained − control "
                          f"{interval_text(over_control)} improve, but trained − frozen {interval_text(over_frozen)} "
                          f"does not {way} 0: no better than the frozen Challenger", **common)
    else:
        frozen = f" and trained − frozen {interval_text(over_frozen)}" if over_frozen is not None else ""
        verdict = Verdict("learned", f"learned: the {said} and trained − control {interval_text(over_control)}"
                          f"{frozen} improve", **common)
    verdict.judge_free = [f"{LABELS['names_source']} {interval_text(names_source)}" if names_source
                          else f"{LABELS['names_source']} not measurable"]
    if verdict.learned:
        if names_source is None:
            verdict.restate("not shown", "but whether its tasks name their source cannot be compared on 2 documents "
                            "or more")
        elif names_source.ci95[1] < 0:
            verdict.restate("not learned", f"but its tasks name their source document less "
                            f"({interval_text(names_source)}): nearer the window by leaving the document")
    _stages_gate(verdict, stages, accept_untrusted_judge)
    grader_gate(verdict, grader, accept_untrusted_judge)
    return verdict


def _stages_gate(verdict: Verdict, stages: StageProbes | None, accept_untrusted_judge: bool) -> None:
    """The gates chose which tasks count and the rubric writer wrote what ḡ measures: unprobed or untrusted, they
    show nothing either way."""
    if stages is None:
        verdict.restate("not shown", "but the Judge's gates and rubric writer were never probed (no "
                        "judge_stage_calibration.json beside the held-out set)")
        return
    untrusted = stages.untrusted()
    if not untrusted:
        return
    why = "; ".join(f"{c.judge}: {c.numbers()}" for c in untrusted)
    if not accept_untrusted_judge:
        verdict.restate("not shown", f"but the Judge's stages failed their calibration probes ({why}), so the gates "
                        "and rubrics the measures rest on may not follow the tasks; fix the Judge or accept it with "
                        "learning_check.accept_untrusted_judge (--accept-untrusted-judge)")
    else:
        verdict.reason += f" [untrusted stages: {why}{', accepted' if verdict.learned else ''}]"


# -- one check, end to end ---------------------------------------------------------------------------------------


@dataclass
class ChallengerCheck:
    """The Challenger checkpoints ('before', 'after', 'control', 'frozen') on the held-out documents, answered by
    one Solver; every measure compared (PAIRS) and the verdict."""

    folder: Path
    solver: str
    metric: str
    evaluations: dict[str, ChallengerEvaluation]
    comparisons: dict[str, dict[str, Comparison | None]]
    verdict: Verdict
    grader: Calibration | None = None
    stages: StageProbes | None = None

    def table(self) -> list[dict[str, Any]]:
        """One row per Challenger: its role, documents, each measure's mean, the metric's change over `before`."""
        rows = []
        for role, ev in self.evaluations.items():
            name = {"after": "trained", "control": "control", "frozen": "frozen"}.get(role)
            c = self.comparisons.get(name, {}).get(self.metric) if name else None
            rows.append({"role": role, "challenger": ev.challenger, "documents": len(ev.documents),
                         **{LABELS[m]: ev.mean(m) for m in MEASURES},
                         f"change ({LABELS[self.metric]})": c.gain if c else None,
                         "95% interval": list(c.ci95) if c else None})
        return rows

    def to_record(self) -> dict[str, Any]:
        return {"held_out": str(self.folder), "solver": self.solver, "metric": self.metric,
                "grader_calibration": self.grader.summary() if self.grader else None,
                "stages_trusted": None if self.stages is None else not self.stages.untrusted(),
                "evaluations": {role: {"challenger": ev.challenger, "solver": ev.solver, "window": list(ev.window),
                                       "tau": ev.tau, "means": {m: ev.mean(m) for m in MEASURES},
                                       "documents": [{"document_id": d.document_id, "task": d.task,
                                                      **{m: ev.measure(d, m) for m in MEASURES}}
                                                     for d in ev.documents]}
                                for role, ev in self.evaluations.items()},
                "comparisons": {name: {m: c.to_record() if c else None for m, c in by.items()}
                                for name, by in self.comparisons.items()},
                "verdict": self.verdict.to_record()}


def check_path(params: Params, after: str, before: str, solver: str, metric: str = "in_window") -> Path:
    """Where a Challenger check is written; a verdict on `distance` gets its own file beside the window share's."""
    return check_file(params, f"challenger-{after}-vs-{before}-solver-{solver}", metric, "in_window")


def run_challenger_check(params: Params, after: str | Checkpoint, *, before: str | Checkpoint = "base",
                         control: str | Checkpoint | None = None, frozen: str | Checkpoint | None = None,
                         solver: str | Checkpoint = "base", metric: str = "in_window", write: bool = True,
                         **lent: Any) -> ChallengerCheck:
    """`scope learning-check compare --role challenger`: the Challengers `before` (M0's), `after`, and the optional
    shuffled-reward `control` and `frozen` Challenger, each writing on the held-out documents, answered by `solver`
    (`evaluate_play`, which takes `lent` models); every measure paired over the documents; the verdict; written to
    <run>/learning_check/challenger-<after>-vs-<before>-solver-<solver>.json (`-distance` before .json when the
    verdict reads |ḡ − τ|)."""
    if metric not in BETTER:
        raise ValueError(f"metric {metric!r}: choose {' or '.join(BETTER)}")
    specs = {"before": before, "after": after, **({"control": control} if control is not None else {}),
             **({"frozen": frozen} if frozen is not None else {})}
    folder, played = evaluate_play(params, specs, {"solver": solver}, **lent)
    evaluations = {role: played[(role, "solver")] for role in specs}
    lc = params.learning_check
    comparisons = {name: {m: compare_measure(evaluations[b], evaluations[a], m, n_samples=lc.bootstrap_samples,
                                             seed=lc.seed) for m in MEASURES}
                   for name, (b, a) in PAIRS.items() if a in evaluations and b in evaluations}
    grader, stages = held_out_probes(folder)
    verdict = challenger_verdict(comparisons["trained"][metric], metric=metric,
                                 over_control=comparisons.get("over_control", {}).get(metric),
                                 control=comparisons.get("control", {}).get(metric),
                                 over_frozen=comparisons.get("over_frozen", {}).get(metric) if frozen is not None
                                 else None,
                                 names_source=comparisons["trained"]["names_source"], grader=grader, stages=stages,
                                 accept_untrusted_judge=lc.accept_untrusted_judge)
    if frozen is not None and comparisons["over_frozen"][metric] is None and verdict.learned:
        verdict.restate("not shown", "but trained − frozen cannot be compared on 2 documents or more")
    check = ChallengerCheck(folder, evaluations["after"].solver, metric, evaluations, comparisons, verdict, grader,
                            stages)
    log.info("Challenger check of %s against %s (Solver %s): %s", evaluations["after"].challenger,
             evaluations["before"].challenger, check.solver, verdict.reason)
    if write:
        atomic_write_json(check_path(params, evaluations["after"].challenger, evaluations["before"].challenger,
                                     check.solver, metric), check.to_record())
    return check


# -- cross-checkpoint play on held-out tasks (Figure 3b) ----------------------------------------------------------


@dataclass
class CrossPlay:
    """Challenger_i's held-out tasks answered by Solver_j (the paper's Figure 3b on held-out documents)."""

    challengers: list[str]
    solvers: list[str]
    evaluations: dict[tuple[str, str], ChallengerEvaluation]

    def matrix(self, measure: str = "mean_score") -> list[list[float | None]]:
        """Rows Challengers, columns Solvers: the measure's mean over the documents (ḡ by default: over the tasks
        that passed the gates; None where none did)."""
        return [[self.evaluations[(c, s)].mean(measure) for s in self.solvers] for c in self.challengers]

    def table(self, measure: str = "mean_score"):
        """The matrix as a pandas DataFrame, with each Challenger's gate pass rate beside it."""
        import pandas as pd

        frame = pd.DataFrame(self.matrix(measure), index=self.challengers, columns=self.solvers, dtype=float)
        frame.index.name, frame.columns.name = "challenger", "solver"
        frame["gate pass rate"] = [self.evaluations[(c, self.solvers[0])].mean("gate_pass") for c in self.challengers]
        return frame

    def to_record(self) -> dict[str, Any]:
        return {"challengers": self.challengers, "solvers": self.solvers,
                "matrix": {m: self.matrix(m) for m in ("mean_score", "in_window", "gate_pass", "reward")}}


def cross_play(params: Params, challengers: list[str], solvers: list[str], *, write: bool = True,
               **lent: Any) -> CrossPlay:
    """`scope learning-check play`: every Challenger's held-out tasks answered by every Solver (`evaluate_play`;
    stored, so a second call loads no model), written to <run>/learning_check/cross_play.json."""
    keys_c, keys_s = [f"c{i}" for i in range(len(challengers))], [f"s{j}" for j in range(len(solvers))]
    _, played = evaluate_play(params, dict(zip(keys_c, challengers, strict=True)),
                              dict(zip(keys_s, solvers, strict=True)), **lent)
    names_c = [played[(c, keys_s[0])].challenger for c in keys_c]
    names_s = [played[(keys_c[0], s)].solver for s in keys_s]
    play = CrossPlay(names_c, names_s, {(played[(c, s)].challenger, played[(c, s)].solver): played[(c, s)]
                                        for c in keys_c for s in keys_s})
    if write:
        atomic_write_json(params.run_dir / "learning_check" / "cross_play.json", play.to_record())
    return play


def cross_play_figure(play: CrossPlay, measure: str = "mean_score"):
    """A heatmap of `play.matrix(measure)`: Challengers down, Solvers across, each cell's value written in it."""
    import plotly.graph_objects as go

    z = [[math.nan if v is None else v for v in row] for row in play.matrix(measure)]
    fig = go.Figure(go.Heatmap(z=z, x=play.solvers, y=play.challengers, zmin=0, zmax=1 if measure != "reward" else None,
                               colorscale="RdBu", text=[[f"{v:.2f}" if v == v else "-" for v in row] for row in z],
                               texttemplate="%{text}", colorbar={"title": LABELS[measure]}))
    fig.update_layout(title=f"Cross-checkpoint play on held-out documents: {LABELS[measure]}",
                      xaxis_title="Solver checkpoint", yaxis_title="Challenger checkpoint (its held-out tasks)")
    return fig


def read_challenger_check(path: str | Path) -> dict[str, Any]:
    """A written Challenger check read back."""
    return read_json(path, "delete it; `scope learning-check compare --role challenger` writes it again from the "
                     "stored tasks and answers")

