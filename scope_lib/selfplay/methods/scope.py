"""SCOPE (the paper): a Challenger that reads a document and searches to write an open-ended task, a Solver that
answers it by searching, a frozen Judge that gates tasks, writes rubrics from the source and grades answers.

    SCOPE.stages             # Stage 1 (train the Challenger), Stage 2 (the task pool), Stage 3 (train the Solver)
    SCOPE.role_rules(role)   # what each role sees and how it is rewarded (eq. 4-7)

runs/<name>/iter_NN/challenger/  rollouts, solver_rollouts, metrics, adapter (or model), DONE   Stage 1
runs/<name>/iter_NN/pool/        candidates, chunks, tasks, DONE                                 Stage 2
runs/<name>/iter_NN/solver/      rollouts, metrics, adapter (or model), DONE                     Stage 3

A finished stage (DONE) is skipped. The task pool resumes batch by batch: a candidate batch counts once its marker is
in chunks.jsonl; records of an unfinished batch are dropped and the batch is redone, so nothing is lost or
duplicated. Every stage has its own seed (`harness.stage_seed`), so a resumed run writes the same records as an
uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from scope_lib.config import Params
from scope_lib.protocol import rewards
from scope_lib.retrieval.corpus import document_range
from scope_lib.runs import finished_chunks
from scope_lib.selfplay import health, ranks
from scope_lib.selfplay.harness import (
    Method,
    SelfPlayRun,
    StageSpec,
    documents_start,
    mark_done,
    publish_roles,
    reset_stage,
    stage_context,
    stage_seed,
    trained_summary,
)
from scope_lib.selfplay.judge import STAGES as JUDGE_STAGES
from scope_lib.selfplay.rollout import (
    ChallengerPrompt,
    RolloutLimits,
    Trajectory,
    challenger_messages,
    make_challenger_prompts,
    new_trajectory,
    solver_messages,
)
from scope_lib.selfplay.tasks import (
    TaskEvaluation,
    candidate_batch,
    challenger_limits,
    evaluate_tasks,
    filter_tasks,
    grade_rollouts,
    solver_limits,
    solver_rewards,
)
from scope_lib.selfplay.training import (
    RoleSession,
    StageContext,
    mean_of,
    never_ran,
    reward_stats,
    train_role,
)

log = logging.getLogger(__name__)


def train_challenger(r: SelfPlayRun, t: int) -> dict:
    """Stage 1 (Algorithm 1 lines 4-17): GRPO on R_C against S_{t-1}, over fresh documents."""
    stage = r.stage(t, "challenger")
    if stage.done:
        return stage.summary
    start = documents_start(r, t, "pool")
    sp = r.params.selfplay
    if not sp.co_evolution and t > 1:
        summary = {"frozen_at": 1, "documents": [start, start],
                   "note": "selfplay.co_evolution is false: the Challenger stays at its iteration-1 checkpoint"}
        mark_done(stage, summary)
        return summary
    reset_stage(r, t, stage)
    publish_roles(r, t, "challenger", ("solver",))  # S_{t-1} estimates the difficulty (the Challenger syncs itself)
    seed = stage_seed(r.params, t, "challenger")
    documents = document_range(r.passages, start, sp.challenger_prompts, sp.seed, limit=r.training_documents)
    prompts = make_challenger_prompts(documents, sp.task_types, sp.search_turn_strata, seed,
                                      tokenizer=r.policy.tokenizer, document_max_tokens=sp.document_max_tokens,
                                      id_prefix=f"i{t:02d}-c")
    result = train_role(stage_context(r, t, "challenger", stage), {p.id: p for p in prompts})
    summary = trained_summary(result, documents=[start, start + len(documents)])
    mark_done(stage, summary, result.saved)
    return summary


def build_pool(r: SelfPlayRun, t: int) -> dict:
    """Stage 2 (Algorithm 1 lines 19-27, App. G): C_t writes candidate tasks over fresh documents, batch by
    batch; gates, rubrics, N_filter rollouts of S_{t-1} at the filter sampling; tasks with l <= g-bar <= u are
    kept, one per document, until `target_tasks` (or the documents, or `max_candidate_batches`, run out)."""
    from tqdm.auto import tqdm

    stage = r.stage(t, "pool")
    if stage.done:
        return stage.summary
    p, sp = r.params, r.params.selfplay
    main = ranks.is_main()
    if main:  # a kill (or a damaged line) may have left half a batch: the main rank repairs before anyone reads
        candidates, chunks, tasks = stage.records("candidates"), stage.records("chunks"), stage.records("tasks")
        finished = finished_chunks(candidates, chunks, tasks)
        candidates.retain(lambda rec: rec["chunk"] in finished)  # drop a batch a kill (or damage) left incomplete
        tasks.retain(lambda rec: rec["chunk"] in finished)
    ranks.barrier()
    if not main:
        candidates, chunks, tasks = stage.records("candidates"), stage.records("chunks"), stage.records("tasks")
        finished = {c["chunk"] for c in chunks}
    kept_per_batch = Counter(rec["chunk"] for rec in tasks)  # counted by every rank: only the main rank appends
    n_candidates = len(candidates)
    first = r.stage(t, "challenger").summary["documents"][1]  # right after Stage 1's documents
    publish_roles(r, t, "pool", ("challenger", "solver"))    # C_t writes, S_{t-1} estimates the difficulty
    seed, size = stage_seed(p, t, "pool"), sp.candidate_batch_size
    available = max(0, (r.training_documents - first) // size)  # whole batches of unused, not held-out documents
    limit = min(available, sp.max_candidate_batches) if sp.max_candidate_batches else available
    holes = sorted(set(range(max(finished, default=-1))) - finished)  # batches a damaged record took back
    k = max(finished, default=-1) + 1
    bar = tqdm(total=sp.target_tasks, initial=min(sum(kept_per_batch.values()), sp.target_tasks),
               desc=f"iteration {t} task pool", unit="task", leave=False, disable=not main)
    while holes or (sum(kept_per_batch.values()) < sp.target_tasks and k < limit):
        hole = holes.pop(0) if holes else None
        k, resume_k = (hole, k) if hole is not None else (k, None)
        started, judge_before = time.perf_counter(), r.judge.stats.totals()
        documents = document_range(r.passages, first + k * size, size, sp.seed, limit=r.training_documents)
        offset = 100_000 * ranks.rank()  # each rank samples its own share; rank 0 keeps the 1-process seeds
        batch = candidate_batch(
            documents, params=p, engine=r.engine, retriever=r.retriever, dialect=r.dialect, judge=r.judge,
            tokenizer=r.policy.tokenizer, prompt_seed=seed * 1000 + k, id_prefix=f"i{t:02d}-p{k:04d}-",
            challenger_seed=seed * 1000 + k + offset, screen_seed=seed * 1000 + 500 + k + offset,
            n_solver=sp.solver_rollouts_filter, challenger_adapter="challenger", solver_adapter="solver",
            grading_temperature=p.judge.difficulty_grading_temperature, filtering=True,
            share=ranks.share)  # this rank's share of the batch (all of it with one process)
        trajectories, evals, written, solved = batch.trajectories, batch.evaluations, batch.written, batch.screened
        judge_after = r.judge.stats.totals()
        costs = {"engine_calls": written.engine_calls + solved.engine_calls,
                 "judge_calls": judge_after["calls"] - judge_before["calls"],
                 "time_generation_s": written.generation_s + solved.generation_s,
                 "time_retrieval_s": written.retrieval_s + solved.retrieval_s,
                 "time_judge_s": judge_after["seconds"] - judge_before["seconds"],
                 "stops_in_thinking": written.stops_in_thinking + solved.stops_in_thinking}
        traj_records = {q.id: q.to_record() for q in trajectories}
        gathered = ranks.gather([(evals, traj_records, costs)])  # every rank's share, in prompt order
        evals = [e for share, _, _ in gathered for e in share]
        traj_by_id = {i: rec for _, records, _ in gathered for i, rec in records.items()}
        costs = {key: sum(c[key] for _, _, c in gathered) for key in costs}  # calls and rank-seconds, summed
        kept = filter_tasks(evals, sp.difficulty_window, sp.tasks_per_document)
        room = sp.target_tasks - sum(n for b, n in kept_per_batch.items() if b < k)  # as when batch k first ran
        kept_ids = {e.challenger_id for e in kept[:room]}
        if main:
            candidates.append({"id": e.challenger_id, "chunk": k, "iteration": t,
                               "kept": e.challenger_id in kept_ids, "evaluation": e.to_record(),
                               "trajectory": traj_by_id[e.challenger_id]} for e in evals)
            tasks.append({**e.to_record(), "id": e.challenger_id, "iteration": t, "chunk": k}
                         for e in kept[:room])
            chunks.append([{"id": f"chunk-{k:04d}", "chunk": k, "candidates": len(evals),
                            "with_task": sum(e.task is not None for e in evals),
                            "passed_gates": sum(e.gates_passed for e in evals),
                            "in_window": len(kept), "kept": len(kept_ids),
                            "yield": len(kept) / len(evals) if evals else 0.0,
                            "engine_calls": costs["engine_calls"], "judge_calls": costs["judge_calls"],
                            "stops_in_thinking": costs["stops_in_thinking"],
                            "time_total_s": time.perf_counter() - started,
                            **{key: costs[key] for key in ("time_generation_s", "time_retrieval_s", "time_judge_s")}}])
        kept_per_batch[k], n_candidates = len(kept_ids), n_candidates + len(evals)
        bar.update(len(kept_ids))
        k = resume_k if resume_k is not None else k + 1
    bar.close()
    n_tasks = sum(kept_per_batch.values())
    summary = {"tasks": n_tasks, "candidates": n_candidates, "chunks": k,
               "documents": [first, first + k * size],
               "yield": n_tasks / n_candidates if n_candidates else 0.0,
               "stopped": "target" if n_tasks >= sp.target_tasks else
               ("max_candidate_batches" if sp.max_candidate_batches and k >= sp.max_candidate_batches
                else "documents ran out")}
    for alarm in health.check_pool({**summary, "iteration": t}):
        r.alarms.append(alarm)
        if main:
            health.report(alarm, r.run_dir)
    mark_done(stage, summary)
    return summary


def train_solver(r: SelfPlayRun, t: int) -> dict:
    """Stage 3 (Algorithm 1 lines 28-33): GRPO on R_S over iteration t's task pool."""
    stage = r.stage(t, "solver")
    if stage.done:
        return stage.summary
    reset_stage(r, t, stage)
    pool = {rec["id"]: TaskEvaluation.from_record(rec) for rec in r.stage(t, "pool").records("tasks")}
    if not pool:
        summary = {"skipped": "empty task pool", "steps": 0,
                   "note": "no task survived the filter; the Solver keeps S_{t-1} (see the health alarms)"}
        log.warning("iteration %d: the task pool is empty; Stage 3 trains nothing", t)
        mark_done(stage, summary)
        return summary
    result = train_role(stage_context(r, t, "solver", stage), pool)
    summary = trained_summary(result, "rubric_score", tasks=len(pool))
    mark_done(stage, summary, result.saved)
    return summary


class ScopeChallenger:
    """The Challenger's rules (Stage 1): it sees a document and its task type and searches (App. H); R_C (eq. 4-5)
    from the gates, the rubrics and N_train rollouts of S_{t-1} graded by the Judge."""

    extra_records = ("solver_rollouts",)
    searches = True

    def limits(self, params: Params) -> RolloutLimits:
        return challenger_limits(params)

    def new_trajectory(self, ctx: StageContext, item_id: str, item: ChallengerPrompt, traj_id: str) -> Trajectory:
        return new_trajectory(traj_id, "challenger", challenger_messages(item, ctx.dialect), ctx.policy.tokenizer,
                              expected_searches=item.expected_searches,
                              meta={"prompt_id": item.id, "document_id": item.document_id,
                                    "task_type": item.task_type})

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        ran = [t for t in trajectories if not never_ran(t)]
        evals, graded, solver_stats = evaluate_tasks(
            ran, session.items, params=ctx.params, judge=ctx.judge, solver_engine=ctx.rollout_engine,
            retriever=ctx.retriever, dialect=ctx.dialect, n_solver=ctx.params.selfplay.solver_rollouts_train,
            solver_adapter=ctx.solver_adapter, seed=ctx.seed * 1000 + 500 + step)
        by_id = {e.challenger_id: e for e in evals}
        values = [by_id[t.id].reward if t.id in by_id else None for t in trajectories]
        session.unwritten["rollouts"] = [{"id": t.id, "iteration": ctx.iteration, "step": step + 1, "reward": value,
                                          "evaluation": by_id[t.id].to_record() if t.id in by_id else None,
                                          "trajectory": t.to_record()}
                                         for t, value in zip(trajectories, values, strict=True)]
        session.unwritten["solver_rollouts"] = [{"id": g.trajectory.id, "iteration": ctx.iteration, "step": step + 1,
                                                 "task_id": g.trajectory.meta["challenger_id"], "verdicts": g.verdicts,
                                                 "rubric_score": g.rubric_score,
                                                 "trajectory": g.trajectory.to_record()} for g in graded]
        gated = [e for e in evals if e.gates]
        scored = [e.mean_score for e in evals if e.mean_score is not None]
        c = ctx.params.challenger
        return values, {
            **reward_stats(values),
            "format": mean_of([e.format.total for e in evals]),
            "format_think": mean_of([e.format.think for e in evals]),
            "format_tool": mean_of([e.format.tool for e in evals]),
            "format_structure": mean_of([e.format.structure for e in evals]),
            "task_rate": mean_of([e.task is not None for e in evals]),
            "gate_pass_rate": mean_of([e.gates_passed for e in gated]) if gated else None,
            "mean_rubric_score": mean_of(scored) if scored else None,
            "difficulty": mean_of([rewards.difficulty_reward(g, c.difficulty_target, c.reward_shape)
                                   for g in scored]) if scored else None,
            "solver_rollouts": len(graded), "solver_rollout_s": solver_stats.total_s,
            "solver_stops_in_thinking": solver_stats.stops_in_thinking}


class ScopeSolver:
    """The Solver's rules (Stage 3): it sees a pooled task and searches; R_S (eq. 6-7) from the Judge's rubric
    grades, the format, the searches and the answer's length."""

    extra_records: tuple[str, ...] = ()
    searches = True

    def limits(self, params: Params) -> RolloutLimits:
        return solver_limits(params)

    def new_trajectory(self, ctx: StageContext, item_id: str, item: TaskEvaluation, traj_id: str) -> Trajectory:
        s = ctx.params.solver
        return new_trajectory(traj_id, "solver", solver_messages(item.task, ctx.dialect, s.max_searches, s.prompt),
                              ctx.policy.tokenizer, max_searches=s.max_searches,
                              meta={"task_id": item_id, "challenger_id": item.challenger_id})

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        ran = [t for t in trajectories if not never_ran(t)]
        graded = grade_rollouts(ran, {t.meta["challenger_id"]: session.items[t.meta["task_id"]] for t in ran},
                                ctx.judge)
        solver_rewards(graded, ctx.params, ctx.dialect, ctx.policy.tokenizer)
        by_id = {g.trajectory.id: g for g in graded}
        values = [by_id[t.id].reward if t.id in by_id else None for t in trajectories]
        s = ctx.params.solver
        length = rewards.LengthPenalty(s.length_soft, s.length_hard, s.length_floor)
        answer_tokens = [len(ctx.policy.tokenizer.encode(g.trajectory.answer, add_special_tokens=False))
                         if g.trajectory.answer else 0 for g in graded]
        session.unwritten["rollouts"] = [{"id": t.id, "iteration": ctx.iteration, "step": step + 1,
                                          "task_id": t.meta["task_id"], "reward": value,
                                          "rubric_score": by_id[t.id].rubric_score if t.id in by_id else None,
                                          "verdicts": by_id[t.id].verdicts if t.id in by_id else None,
                                          "format": by_id[t.id].format.total if t.id in by_id else None,
                                          "trajectory": t.to_record()}
                                         for t, value in zip(trajectories, values, strict=True)]
        return values, {
            **reward_stats(values),
            "rubric_score": mean_of([g.rubric_score for g in graded]),
            "format": mean_of([g.format.total for g in graded]),
            "format_think": mean_of([g.format.think for g in graded]),
            "format_tool": mean_of([g.format.tool for g in graded]),
            "format_answer": mean_of([g.format.answer for g in graded]),
            "length_multiplier": mean_of([length(n) if s.length_penalty else 1.0 for n in answer_tokens]),
            "search_reward": mean_of([rewards.search_reward(
                ctx.dialect.count_searches(g.trajectory.turns, starts_in_think=g.trajectory.opens_think)[0],
                s.search_saturation) for g in graded]),
            "answer_tokens": mean_of(answer_tokens)}


class Scope(Method):
    """SCOPE's three stages per iteration (Algorithm 1) and its two roles' rules."""

    name = "scope"
    roles = {"challenger": ScopeChallenger(), "solver": ScopeSolver()}

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return (StageSpec("challenger", train_challenger, trains="challenger"), StageSpec("pool", build_pool),
                StageSpec("solver", train_solver, trains="solver"))

    def judge_stages(self, params: Params) -> frozenset[str]:
        """Every stage of the frozen Judge: its configured gates, the rubric writer and the per-rubric grader."""
        return frozenset(JUDGE_STAGES)


SCOPE = Scope()
