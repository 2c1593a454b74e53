"""SPICE, Self-Play In Corpus Environments (Meta FAIR, arXiv 2510.24684), on the shared harness. One policy plays
both roles (use `model.shared_policy: true`): the Challenger reads a corpus document, no search, and writes a task
with a gold answer as JSON; the Reasoner answers it closed-book (no document, no search) and boxes its answer; a
rule verifies it (`protocol.spice`, `protocol.verification`). No Judge.

    SPICE.stages             # `challenger` (GRPO on r_C over fresh documents), `solver` (GRPO on r_R, the Reasoner)

runs/<name>/iter_NN/challenger/  rollouts (every attempt: its task or why it is invalid, the Reasoner's verified
                                 answers, r_C), solver_rollouts (those answers), metrics, adapter, DONE
runs/<name>/iter_NN/solver/      rollouts (the Reasoner's answers to Stage 1's valid tasks, verified, r_R), metrics,
                                 adapter, DONE

Stage 1: each document is a prompt of one answer type (the seven apportioned); TRL's G copies of it are the
document's attempts. Each valid attempt gets K = `selfplay.solver_rollouts_train` Reasoner answers at the current
policy; r_C (eq. 1) is the Gaussian on their pass rate's variance, −0.1 for an invalid task. Stage 2 trains the
Reasoner on Stage 1's valid tasks, r_R = 1[verified], G answers per task. The paper's DrGRPO (no std division, no
KL) is the params' `grpo.loss_type: dr_grpo`, `grpo.scale_rewards: none`, `grpo.beta: 0` (params/spice-smoke.yaml).
Where we differ from the paper (docs/methods.md): the Reasoner's reward comes from its own G answers in Stage 2,
not from the K answers that scored the Challenger, and a document's attempts are the group (N = G, so
`spice.subsample_attempts` keeps them all).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from scope_lib.config import Params
from scope_lib.protocol import spice
from scope_lib.retrieval.corpus import document_range
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
)
from scope_lib.selfplay.rollout import (
    ChallengerPrompt,
    RolloutLimits,
    Trajectory,
    make_challenger_prompts,
    new_trajectory,
    run_rollouts,
)
from scope_lib.selfplay.tasks import challenger_limits, solver_limits
from scope_lib.selfplay.training import (
    RoleSession,
    StageContext,
    mean_of,
    never_ran,
    reward_stats,
    train_role,
)


def task_record(task: spice.SpiceTask) -> dict[str, Any]:
    """A SPICE task as a JSON record (its list gold as a list)."""
    record = dataclasses.asdict(task)
    record["options"] = list(task.options)
    if isinstance(task.answer, tuple):
        record["answer"] = list(task.answer)
    return record


def task_from_record(record: dict[str, Any]) -> spice.SpiceTask:
    answer = record["answer"]
    return spice.SpiceTask(question=record["question"], answer_type=record["answer_type"],
                           answer=tuple(answer) if isinstance(answer, list) else answer,
                           options=tuple(record.get("options") or ()), decimals=record.get("decimals", 0))


def _reply(traj: Trajectory) -> str:
    return traj.turns[-1] if traj.turns else ""


def _one_turn(limits: RolloutLimits) -> RolloutLimits:
    """No search: every rollout is one turn (closed-book Reasoner, a Challenger that only reads)."""
    return dataclasses.replace(limits, max_turns=1)


def reasoner_trajectory(ctx: StageContext, traj_id: str, task: spice.SpiceTask, meta: dict[str, Any]) -> Trajectory:
    """The Reasoner's rollout: the question alone (with its options), no document, no search (§2.3)."""
    return new_trajectory(traj_id, "solver", [{"role": "user", "content": spice.reasoner_prompt(task)}],
                          ctx.policy.tokenizer, max_searches=0, meta=meta)


class SpiceChallenger:
    """Stage 1's rules: the Challenger sees a document and the answer type to write (App. E); r_C (eq. 1)."""

    extra_records = ("solver_rollouts",)
    searches = False

    def limits(self, params: Params) -> RolloutLimits:
        return _one_turn(challenger_limits(params))

    def new_trajectory(self, ctx: StageContext, item_id: str, item: ChallengerPrompt, traj_id: str) -> Trajectory:
        # ChallengerPrompt.task_type holds the SPICE answer type; its expected_searches is unused (no search)
        content = spice.challenger_prompt(item.document, item.task_type)
        return new_trajectory(traj_id, "challenger", [{"role": "user", "content": content}], ctx.policy.tokenizer,
                              max_searches=0, meta={"prompt_id": item.id, "document_id": item.document_id,
                                                    "answer_type": item.task_type})

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        k = ctx.params.selfplay.solver_rollouts_train
        parsed = {t.id: spice.parse_task(_reply(t), starts_in_think=t.opens_think)
                  for t in trajectories if not never_ran(t)}
        answers = [reasoner_trajectory(ctx, f"{t.id}/r{j}", parsed[t.id].task, {"task_id": t.id})
                   for t in trajectories if t.id in parsed and parsed[t.id].valid for j in range(k)]
        limits = _one_turn(solver_limits(ctx.params))
        limits.seed = ctx.seed * 1000 + 500 + step + 100_000 * ranks.rank()
        stats = run_rollouts(answers, ctx.rollout_engine, ctx.retriever, ctx.dialect, limits,
                             adapter=ctx.solver_adapter) if answers else None
        verified: dict[str, list[bool]] = {}
        for a in answers:
            task = parsed[a.meta["task_id"]].task
            a.meta["verified"] = spice.verify_reply(task, _reply(a), starts_in_think=a.opens_think)
            verified.setdefault(a.meta["task_id"], []).append(a.meta["verified"])
        values = [spice.challenger_reward(verified.get(t.id, []), parsed[t.id].valid) if t.id in parsed else None
                  for t in trajectories]
        session.unwritten["rollouts"] = [
            {"id": t.id, "iteration": ctx.iteration, "step": step + 1, "reward": value,
             "document_id": t.meta["document_id"], "answer_type": t.meta["answer_type"],
             "valid": parsed[t.id].valid if t.id in parsed else None,
             "invalid_reason": parsed[t.id].reason if t.id in parsed else "never_ran",
             "invalid_detail": parsed[t.id].detail if t.id in parsed else "",
             "task": task_record(parsed[t.id].task) if t.id in parsed and parsed[t.id].valid else None,
             "verified": verified.get(t.id), "pass_rate": mean_of(verified[t.id]) if t.id in verified else None,
             "trajectory": t.to_record()} for t, value in zip(trajectories, values, strict=True)]
        session.unwritten["solver_rollouts"] = [
            {"id": a.id, "iteration": ctx.iteration, "step": step + 1, "task_id": a.meta["task_id"],
             "verified": a.meta["verified"], "answer": spice.reasoner_answer(_reply(a), starts_in_think=a.opens_think),
             "trajectory": a.to_record()} for a in answers]
        rates = [mean_of(v) for v in verified.values()]
        return values, {
            **reward_stats(values),
            "task_rate": mean_of([p.valid for p in parsed.values()]) if parsed else None,
            "pass_rate": mean_of(rates) if rates else None,
            "zero_spread_tasks": mean_of([r in (0.0, 1.0) for r in rates]) if rates else None,
            "solver_rollouts": len(answers), "solver_rollout_s": stats.total_s if stats else 0.0,
            "solver_stops_in_thinking": stats.stops_in_thinking if stats else 0}


class SpiceReasoner:
    """Stage 2's rules: the Reasoner sees the question alone; r_R = 1[verified] (§2.3)."""

    extra_records: tuple[str, ...] = ()
    searches = False

    def limits(self, params: Params) -> RolloutLimits:
        return _one_turn(solver_limits(params))

    def new_trajectory(self, ctx: StageContext, item_id: str, item: spice.SpiceTask, traj_id: str) -> Trajectory:
        return reasoner_trajectory(ctx, traj_id, item, {"task_id": item_id})

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        verified = {t.id: spice.verify_reply(session.items[t.meta["task_id"]], _reply(t), starts_in_think=t.opens_think)
                    for t in trajectories if not never_ran(t)}
        values = [spice.reasoner_reward(verified[t.id]) if t.id in verified else None for t in trajectories]
        answers = {t.id: spice.reasoner_answer(_reply(t), starts_in_think=t.opens_think) for t in trajectories}
        session.unwritten["rollouts"] = [
            {"id": t.id, "iteration": ctx.iteration, "step": step + 1, "task_id": t.meta["task_id"], "reward": value,
             "verified": verified.get(t.id), "answer": answers[t.id], "trajectory": t.to_record()}
            for t, value in zip(trajectories, values, strict=True)]
        return values, {**reward_stats(values), "pass_rate": mean_of(verified.values()) if verified else None,
                        "boxed_rate": mean_of([a is not None for a in answers.values()])}


def train_challenger(r: SelfPlayRun, t: int) -> dict:
    """Stage 1: GRPO on r_C over `selfplay.challenger_prompts` fresh documents, one answer type each."""
    stage = r.stage(t, "challenger")
    if stage.done:
        return stage.summary
    start = documents_start(r, t, "challenger")
    sp = r.params.selfplay
    reset_stage(r, t, stage)
    publish_roles(r, t, "challenger", ("solver",))  # the Reasoner answers the Challenger's tasks
    documents = document_range(r.passages, start, sp.challenger_prompts, sp.seed, limit=r.training_documents)
    prompts = make_challenger_prompts(documents, list(spice.ANSWER_TYPES), [1], stage_seed(r.params, t, "challenger"),
                                      tokenizer=r.policy.tokenizer, document_max_tokens=sp.document_max_tokens,
                                      id_prefix=f"i{t:02d}-c")
    result = train_role(stage_context(r, t, "challenger", stage), {p.id: p for p in prompts})
    attempts = [rec for rec in stage.records("rollouts") if rec["valid"] is not None]
    valid = sum(rec["valid"] for rec in attempts)
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2),
               "documents": [start, start + len(documents)], "saved": result.saved.name,
               "reward": [m.get("reward") for m in result.metrics], "attempts": len(attempts), "valid": valid,
               "valid_rate": valid / len(attempts) if attempts else 0.0,
               "invalid_reasons": dict(Counter(rec["invalid_reason"] for rec in attempts if not rec["valid"]))}
    for alarm in health.check_valid_tasks({**summary, "iteration": t}):
        r.alarms.append(alarm)
        if ranks.is_main():
            health.report(alarm, r.run_dir)
    mark_done(stage, summary, result.saved)
    return summary


def train_reasoner(r: SelfPlayRun, t: int) -> dict:
    """Stage 2: GRPO on r_R over Stage 1's valid tasks (each once), G closed-book answers per task."""
    stage = r.stage(t, "solver")
    if stage.done:
        return stage.summary
    reset_stage(r, t, stage)
    tasks: dict[str, spice.SpiceTask] = {}
    seen: set[str] = set()
    for rec in r.stage(t, "challenger").records("rollouts"):
        if rec.get("valid") and rec["task"]["question"] not in seen:
            seen.add(rec["task"]["question"])
            tasks[rec["id"]] = task_from_record(rec["task"])
    if not tasks:
        summary = {"skipped": "no valid task", "steps": 0, "tasks": 0,
                   "note": "no Challenger attempt was a valid task; the Reasoner keeps its weights (see the alarms)"}
        mark_done(stage, summary)
        return summary
    result = train_role(stage_context(r, t, "solver", stage), tasks)
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2), "tasks": len(tasks),
               "saved": result.saved.name, "reward": [m.get("reward") for m in result.metrics],
               "pass_rate": [m.get("pass_rate") for m in result.metrics]}
    mark_done(stage, summary, result.saved)
    return summary


class Spice(Method):
    """SPICE's two stages per iteration and its two roles' rules (the Reasoner trains as the `solver` role)."""

    name = "spice"
    _rules = {"challenger": SpiceChallenger(), "solver": SpiceReasoner()}

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return (StageSpec("challenger", train_challenger, trains="challenger"),
                StageSpec("solver", train_reasoner, trains="solver"))

    def role_rules(self, role: str):
        if role not in self._rules:
            raise ValueError(f"SPICE has no role {role!r}; it trains {', '.join(self._rules)}")
        return self._rules[role]


SPICE = Spice()
