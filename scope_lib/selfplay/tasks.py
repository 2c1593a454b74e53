"""Self-play pieces shared by Stage 1 (Challenger reward) and Stage 2 (task filter, Solver reward).

`evaluate_tasks` is Algorithm 1 lines 7-12 and 21-24 for a whole batch: Challenger format score, quality
gates, rubrics, N Solver rollouts, per-rubric grades, the mean rubric score g-bar and R_C (eq. 4, 5).
`solver_rewards` is R_S (eq. 6, 7) for graded Solver rollouts. Every model call is batched: one engine call
per rollout turn, one Judge call per stage. `answerability_check` is the optional answerability gate (Search
Self-Play's RAG check, `judge.gates: [..., answerability]`). `candidate_batch` is the task pool's batch step
(Stage 2 and the learning check's held-out set): prompts, the Challenger's rollouts, `evaluate_tasks`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from scope_lib.config import JudgeConfig, Params
from scope_lib.models.engine import Engine
from scope_lib.protocol import rewards
from scope_lib.protocol.dialects import Dialect
from scope_lib.protocol.parsing import Rubric
from scope_lib.retrieval.api import Retriever
from scope_lib.selfplay.judge import ANSWERABILITY, Judge
from scope_lib.selfplay.rollout import (
    ChallengerPrompt,
    RolloutLimits,
    RolloutStats,
    Trajectory,
    challenger_trajectories,
    make_challenger_prompts,
    new_trajectory,
    run_rollouts,
    solver_messages,
)

log = logging.getLogger(__name__)


def challenger_limits(params: Params) -> RolloutLimits:
    c = params.challenger
    return RolloutLimits(max_turns=c.max_turns, max_new_tokens_per_turn=c.max_new_tokens_per_turn,
                         max_response_tokens=c.max_response_tokens, max_model_len=params.model.max_model_len,
                         max_prompt_tokens=min(c.max_prompt_tokens, params.selfplay.rollout_prompt_tokens),
                         temperature=c.temperature, top_p=c.top_p,
                         top_k_docs=params.retrieval.top_k, max_result_tokens=params.retrieval.max_result_tokens,
                         seed=params.selfplay.seed)


def solver_limits(params: Params, *, filtering: bool = False) -> RolloutLimits:
    """Solver budgets; `filtering` uses the task-filter sampling (T = 0.7, top-p 0.9, App. G)."""
    s = params.solver
    return RolloutLimits(max_turns=s.turn_limit, max_new_tokens_per_turn=s.max_new_tokens_per_turn,
                         max_response_tokens=s.max_response_tokens, max_model_len=params.model.max_model_len,
                         max_prompt_tokens=min(s.max_prompt_tokens, params.selfplay.rollout_prompt_tokens),
                         temperature=s.filter_temperature if filtering else s.temperature,
                         top_p=s.filter_top_p if filtering else s.top_p,
                         top_k_docs=params.retrieval.top_k, max_result_tokens=params.retrieval.max_result_tokens,
                         seed=params.selfplay.seed)


@dataclass
class TaskEvaluation:
    """Everything the Judge and the Solver said about one Challenger rollout, linked by ids."""

    challenger_id: str
    document_id: str
    task_type: str
    expected_searches: int
    task: str | None
    format: rewards.FormatScore
    gates: dict[str, int | None] = field(default_factory=dict)
    gates_passed: bool = False
    rubrics: list[Rubric] | None = None
    solver_ids: list[str] = field(default_factory=list)
    solver_scores: list[float] = field(default_factory=list)
    verdicts: list[list[int | None]] = field(default_factory=list)
    mean_score: float | None = None
    reward: float = 0.0
    answerability: float | None = None  # the Judge's no-search answer's rubric score (answerability gate only)

    @property
    def outcome(self) -> str:
        """Where the task stopped in the pipeline (for tables of what failed and why)."""
        if self.task is None:
            return "no task"
        if self.format.total == 0:
            return "format 0"
        if not self.gates_passed:
            return "gate failed"
        if self.rubrics is None:
            return "no rubrics"
        return "graded"

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record["format_total"] = self.format.total
        record["outcome"] = self.outcome
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TaskEvaluation:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in record.items() if k in names}
        values["format"] = rewards.FormatScore(**record["format"])
        if record.get("rubrics") is not None:
            values["rubrics"] = [Rubric(**r) for r in record["rubrics"]]
        return cls(**values)


@dataclass
class GradedSolverRollout:
    """A Solver rollout with its per-rubric verdicts, rubric score g (eq. 1) and reward R_S (eq. 6)."""

    trajectory: Trajectory
    verdicts: list[int | None]
    rubric_score: float
    reward: float = 0.0
    format: rewards.FormatScore | None = None


def challenger_format(traj: Trajectory, dialect: Dialect) -> rewards.FormatScore:
    """F.1: think, tool and structure components from the decoded turns."""
    valid, malformed = dialect.count_searches(traj.turns, starts_in_think=traj.opens_think)
    return rewards.challenger_format(traj.turns, traj.expected_searches or 0, valid, malformed, traj.task,
                                     starts_in_think=traj.opens_think)


def solver_format(traj: Trajectory, dialect: Dialect) -> rewards.FormatScore:
    """F.2: think, tool (non-final turns) and answer components."""
    valid_nonfinal, _ = dialect.count_searches(traj.turns[:-1], starts_in_think=traj.opens_think)
    return rewards.solver_format(traj.turns, valid_nonfinal, traj.answer, starts_in_think=traj.opens_think)


def evaluate_tasks(challengers: list[Trajectory], prompts: dict[str, ChallengerPrompt], *, params: Params,
                   judge: Judge, solver_engine: Engine, retriever: Retriever, dialect: Dialect,
                   n_solver: int, solver_adapter: str | None = None, filtering: bool = False,
                   grading_temperature: float | None = None, seed: int | None = None
                   ) -> tuple[list[TaskEvaluation], list[GradedSolverRollout], RolloutStats]:
    """Gate, write rubrics for, and estimate the difficulty of every Challenger task in one batch.
    `seed` seeds the Solver rollouts (default: `selfplay.seed`); give each batch its own."""
    evals = []
    for traj in challengers:
        prompt = prompts[traj.meta["prompt_id"]]
        evals.append(TaskEvaluation(challenger_id=traj.id, document_id=prompt.document_id,
                                    task_type=prompt.task_type, expected_searches=prompt.expected_searches,
                                    task=traj.task, format=challenger_format(traj, dialect)))
    by_id = {t.id: t for t in challengers}

    # Quality gates QG(q, d): only tasks that exist and have a non-zero format score (F.1).
    gated = [e for e in evals if e.task is not None and e.format.total > 0]
    for e, outcome in zip(gated, judge.gates([e.task for e in gated],
                                             [prompts[by_id[e.challenger_id].meta["prompt_id"]].document
                                              for e in gated]), strict=True):
        e.gates, e.gates_passed = outcome.verdicts, outcome.passed

    # Rubrics G from the source document (paper) or the source plus the retrieved evidence (option).
    passed = [e for e in gated if e.gates_passed]
    contexts = []
    for e in passed:
        traj = by_id[e.challenger_id]
        source = prompts[traj.meta["prompt_id"]].document
        contexts.append([source] + (traj.evidence if params.judge.rubric_context == "source+evidence" else []))
    for e, rubric_list in zip(passed, judge.rubrics([e.task_type for e in passed], [e.task for e in passed],
                                                    contexts), strict=True):
        e.rubrics = rubric_list

    temperature = grading_temperature
    if temperature is None:
        temperature = params.judge.difficulty_grading_temperature
    if ANSWERABILITY in params.judge.gates:
        answerability_check([e for e in passed if e.rubrics], challengers, judge, params.judge,
                            seed=params.selfplay.seed if seed is None else seed, temperature=temperature)

    # N Solver rollouts per task with rubrics, all in one batched rollout.
    ready = [e for e in passed if e.rubrics and e.gates_passed]
    solvers = []
    for e in ready:
        for j in range(n_solver):
            solvers.append(new_trajectory(f"{e.challenger_id}/s{j}", "solver",
                                          solver_messages(e.task, dialect, params.solver.max_searches,
                                                          params.solver.prompt),
                                          solver_engine.tokenizer, max_searches=params.solver.max_searches,
                                          meta={"challenger_id": e.challenger_id}))
            e.solver_ids.append(solvers[-1].id)
    limits = solver_limits(params, filtering=filtering)
    if seed is not None:
        limits = replace(limits, seed=seed)
    stats = run_rollouts(solvers, solver_engine, retriever, dialect, limits, adapter=solver_adapter)

    graded = grade_rollouts(solvers, {e.challenger_id: e for e in ready}, judge, temperature=temperature)
    by_task: dict[str, list[GradedSolverRollout]] = {}
    for g in graded:
        by_task.setdefault(g.trajectory.meta["challenger_id"], []).append(g)
    c = params.challenger
    for e in evals:
        runs = by_task.get(e.challenger_id, [])
        e.verdicts = [g.verdicts for g in runs]
        e.solver_scores = [g.rubric_score for g in runs]
        e.mean_score = sum(e.solver_scores) / len(runs) if runs else None
        e.reward = rewards.challenger_reward(e.format.total, e.gates_passed, e.mean_score,
                                             format_weight=c.format_weight, difficulty_weight=c.difficulty_weight,
                                             target=c.difficulty_target, shape=c.reward_shape,
                                             rubrics_parsed=e.rubrics is not None,
                                             no_rubrics_reward=c.no_rubrics_reward)
    return evals, graded, stats


def answerability_contexts(tasks: list[Trajectory], batch: list[Trajectory], n_noise: int, seed: int
                           ) -> list[list[str]]:
    """Per Challenger rollout in `tasks`: its own retrieved blocks (evidence) and `n_noise` blocks that other
    rollouts of `batch` retrieved, in an order shuffled by (seed, rollout id)."""
    contexts = []
    for traj in tasks:
        own = traj.evidence
        pool = list(dict.fromkeys(b for other in batch if other.id != traj.id for b in other.evidence if b not in own))
        rng = random.Random(f"{seed}/answerability/{traj.id}")
        docs = own + rng.sample(pool, min(n_noise, len(pool)))
        rng.shuffle(docs)
        contexts.append(docs)
    return contexts


def answerability_check(evals: list[TaskEvaluation], batch: list[Trajectory], judge: Judge, cfg: JudgeConfig, *,
                        seed: int,
                        temperature: float | None = None) -> None:
    """The answerability gate, in place (Search Self-Play's RAG check, related-methods.md): for every task with
    rubrics, the Judge answers it without searching from the Challenger's own retrieved documents mixed with
    `cfg.answerability_noise_documents` noise documents (one Judge call), the answers are graded on the task's
    rubrics (one grading call), and the task passes only if that rubric score (eq. 1) reaches
    `cfg.answerability_threshold`. An answer that does not parse scores 0."""
    if not evals:
        return
    by_id = {t.id: t for t in batch}
    contexts = answerability_contexts([by_id[e.challenger_id] for e in evals], batch,
                                      cfg.answerability_noise_documents, seed)
    answers = judge.answer([e.task for e in evals], contexts)
    triples, owners = [], []
    for i, (e, answer) in enumerate(zip(evals, answers, strict=True)):
        if answer is not None:
            triples += [(e.task, answer, r.text) for r in e.rubrics]
            owners += [(i, k) for k in range(len(e.rubrics))]
    verdicts: list[list[int | None]] = [[0] * len(e.rubrics) for e in evals]
    if triples:
        results = judge.grade(*map(list, zip(*triples, strict=True)), temperature=temperature)
        for (i, k), verdict in zip(owners, results, strict=True):
            verdicts[i][k] = verdict
    for e, v in zip(evals, verdicts, strict=True):
        e.answerability = rewards.rubric_score(v, judge.rubric_weights(e.rubrics))
        e.gates[ANSWERABILITY] = int(e.answerability >= cfg.answerability_threshold)
        e.gates_passed = e.gates_passed and e.gates[ANSWERABILITY] == 1


def grade_rollouts(solvers: list[Trajectory], tasks: dict[str, TaskEvaluation], judge: Judge, *,
                   temperature: float | None = None) -> list[GradedSolverRollout]:
    """Grade every (answer, rubric) pair in one Judge call. A rollout without an answer is not graded:
    every verdict is 0 (F.2: the answer reward is 0 too)."""
    triples, owners = [], []
    for i, traj in enumerate(solvers):
        task = tasks[traj.meta["challenger_id"]]
        if traj.answer is None:
            continue
        for k, rubric in enumerate(task.rubrics or []):
            triples.append((task.task, traj.answer, rubric.text))
            owners.append((i, k))
    verdicts: list[list[int | None]] = [[0] * len(tasks[t.meta["challenger_id"]].rubrics or []) for t in solvers]
    if triples:
        results = judge.grade(*map(list, zip(*triples, strict=True)), temperature=temperature)
        for (i, k), verdict in zip(owners, results, strict=True):
            verdicts[i][k] = verdict
    graded = []
    for traj, v in zip(solvers, verdicts, strict=True):
        task = tasks[traj.meta["challenger_id"]]
        weights = judge.rubric_weights(task.rubrics or [])
        graded.append(GradedSolverRollout(traj, v, rewards.rubric_score(v, weights)))
    return graded


def solver_rewards(graded: list[GradedSolverRollout], params: Params, dialect: Dialect, tokenizer) -> None:
    """R_S (eq. 6) for each graded rollout, in place. |a| counts policy-tokenizer tokens of the extracted
    answer (eq. 7); `solver.length_penalty: false` is the No-LP ablation."""
    s = params.solver
    length = rewards.LengthPenalty(s.length_soft, s.length_hard, s.length_floor) if s.length_penalty else None
    for g in graded:
        traj = g.trajectory
        g.format = solver_format(traj, dialect)
        n_answer = len(tokenizer.encode(traj.answer, add_special_tokens=False)) if traj.answer else 0
        # F.2: well-formed searches in ALL turns
        n_searches, _ = dialect.count_searches(traj.turns, starts_in_think=traj.opens_think)
        g.reward = rewards.solver_reward(g.rubric_score, n_answer, g.format.total, n_searches,
                                         accuracy_weight=s.accuracy_weight, format_weight=s.format_weight,
                                         search_weight=s.search_weight, length=length,
                                         search_saturation=s.search_saturation)


def filter_tasks(evals: list[TaskEvaluation], window: tuple[float, float], per_document: int = 1
                 ) -> list[TaskEvaluation]:
    """Stage 2's task pool: gates passed, rubrics written, l <= g-bar <= u, at most `per_document` tasks
    per source document (Algorithm 1 line 24, App. G)."""
    lo, hi = window
    kept, per_doc = [], {}
    for e in evals:
        if e.gates_passed and e.rubrics and e.mean_score is not None and lo <= e.mean_score <= hi:
            if per_doc.get(e.document_id, 0) < per_document:
                per_doc[e.document_id] = per_doc.get(e.document_id, 0) + 1
                kept.append(e)
    return kept


@dataclass
class CandidateBatch:
    """One batch of candidate tasks (Stage 2, Algorithm 1 lines 19-24): the Challenger's trajectories and their
    evaluations (gates, rubrics, the Solver's mean rubric score g-bar), and what writing and screening them cost."""

    trajectories: list[Trajectory]
    evaluations: list[TaskEvaluation]
    written: RolloutStats
    screened: RolloutStats


def candidate_batch(documents: list, *, params: Params, engine: Engine, retriever: Retriever, dialect: Dialect,
                    judge: Judge, tokenizer, prompt_seed: int, id_prefix: str, challenger_seed: int, screen_seed: int,
                    n_solver: int, challenger_adapter: str | None, solver_adapter: str | None,
                    grading_temperature: float, filtering: bool = False,
                    share: Callable[[list[ChallengerPrompt]], list[ChallengerPrompt]] | None = None) -> CandidateBatch:
    """The task pool's batch step, for the pool (`selfplay.methods.scope.build_pool`) and the learning check's held-out set:
    one Challenger prompt per document, the Challenger's rollouts (`challenger_adapter`; None: M0), then
    `evaluate_tasks` with `n_solver` Solver rollouts each (`solver_adapter`) graded at `grading_temperature`.
    `share` picks this process's share of the prompts (`ranks.share`; default all of them)."""
    prompts = make_challenger_prompts(documents, params.selfplay.task_types, params.selfplay.search_turn_strata,
                                      prompt_seed, tokenizer=tokenizer,
                                      document_max_tokens=params.selfplay.document_max_tokens, id_prefix=id_prefix)
    mine = share(prompts) if share is not None else prompts
    trajectories = challenger_trajectories(mine, dialect, tokenizer)
    limits = replace(challenger_limits(params), seed=challenger_seed)
    written = run_rollouts(trajectories, engine, retriever, dialect, limits, adapter=challenger_adapter)
    evaluations, _graded, screened = evaluate_tasks(
        trajectories, {q.id: q for q in mine}, params=params, judge=judge, solver_engine=engine,
        retriever=retriever, dialect=dialect, n_solver=n_solver, solver_adapter=solver_adapter, filtering=filtering,
        grading_temperature=grading_temperature, seed=screen_seed)
    return CandidateBatch(trajectories, evaluations, written, screened)
