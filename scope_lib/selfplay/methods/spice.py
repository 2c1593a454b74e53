"""SPICE, Self-Play In Corpus Environments (Meta FAIR, arXiv 2510.24684), on the shared harness. One policy plays
both roles (use `model.shared_policy: true`): the Challenger reads a corpus document, no search, and writes a task
with a gold answer as JSON; the Reasoner answers it closed-book (no document, no search) and boxes its answer; a
rule verifies it (`protocol.spice`, `protocol.verification`). No Judge.

    SPICE.stages             # `challenger` (GRPO on r_C over fresh documents), `solver` (GRPO on r_R, the Reasoner)

runs/<name>/iter_NN/challenger/  formats (each document's answer type and who chose it), attempts (every attempt:
                                 its reply, task or why it is invalid, whether the group kept it), rollouts (the
                                 kept attempts: the Reasoner's verified answers, r_C), solver_rollouts (those
                                 answers), metrics, adapter, DONE
runs/<name>/iter_NN/solver/      rollouts (the Reasoner's answers, verified, r_R), metrics, adapter, DONE

Stage 1 (Algorithm 1, lines 3-13): each document gets its answer type, chosen by the Challenger (App. E, Figure 9;
`spice.format_choice: challenger`) or apportioned; its attempts are drawn G at a time until one is a valid task or
N = `spice.attempts` are drawn, and G of them, with their valid:invalid ratio (`spice.subsample_attempts`), are the
document's GRPO group. Each kept valid task gets K = `selfplay.solver_rollouts_train` Reasoner answers at the
current policy; r_C (eq. 1) is the Gaussian on their pass rate's variance, -0.1 for an invalid task. Stage 2
(lines 14-19) trains the Reasoner, r_R = 1[verified]: on one valid task per document with the same K answers as its
group (`spice.reasoner_samples: shared`, §2.5; K = G), or on every valid task with G fresh answers (`fresh`). The
paper's DrGRPO (no std division, no KL) is the params' `grpo.loss_type: dr_grpo`, `grpo.scale_rewards: none`,
`grpo.beta: 0` (params/spice-smoke.yaml). Where we differ from the paper: docs/methods.md, "SPICE's loop".
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from scope_lib.config import Params, ParamsError
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
    trained_summary,
)
from scope_lib.selfplay.rollout import (
    ChallengerPrompt,
    RolloutLimits,
    RolloutStats,
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


#: Seed offset of each further round of a document's attempts (round r samples at the step's seed + r x this).
ROUND_SEED = 7919


def check_params(params: Params) -> None:
    """SPICE's settings that must agree, checked before a stage runs."""
    k, g = params.selfplay.solver_rollouts_train, params.grpo.group_size
    if params.spice.reasoner_samples == "shared" and k != g:
        raise ParamsError(f"spice.reasoner_samples: shared trains the Reasoner on the K answers that scored the "
                          f"Challenger as its group of G (§2.5), but selfplay.solver_rollouts_train (K) is {k} and "
                          f"grpo.group_size (G) is {g}: make them equal, or set spice.reasoner_samples: fresh")


def combined(a: RolloutStats, b: RolloutStats) -> RolloutStats:
    """The cost of two batches of rollouts drawn one after the other."""
    return RolloutStats(turns=max(a.turns, b.turns), engine_calls=a.engine_calls + b.engine_calls,
                        stops_in_thinking=a.stops_in_thinking + b.stops_in_thinking,
                        retrieval_calls=a.retrieval_calls + b.retrieval_calls,
                        generated_tokens=a.generated_tokens + b.generated_tokens,
                        generation_s=a.generation_s + b.generation_s, retrieval_s=a.retrieval_s + b.retrieval_s,
                        total_s=a.total_s + b.total_s,
                        finishes=dict(Counter(a.finishes) + Counter(b.finishes)))


def reasoner_trajectory(ctx: StageContext, traj_id: str, task: spice.SpiceTask, meta: dict[str, Any]) -> Trajectory:
    """The Reasoner's rollout: the question alone (with its options), no document, no search (§2.3)."""
    return new_trajectory(traj_id, "solver", [{"role": "user", "content": spice.reasoner_prompt(task)}],
                          ctx.policy.tokenizer, max_searches=0, meta=meta)


@dataclass(frozen=True)
class ReasonerTask:
    """A task of the Reasoner's stage and, with `spice.reasoner_samples: shared`, the K answers (trajectory
    records) that Stage 1 sampled for it: its GRPO group."""

    task: spice.SpiceTask
    answers: tuple[dict[str, Any], ...] = ()


class SpiceChallenger:
    """Stage 1's rules: the Challenger sees a document and the answer type to write (App. E); its attempts are drawn
    until one is valid and subsampled to the group (Algorithm 1, lines 5-6); r_C (eq. 1)."""

    extra_records = ("solver_rollouts", "attempts")
    searches = False

    def limits(self, params: Params) -> RolloutLimits:
        return _one_turn(challenger_limits(params))

    def new_trajectory(self, ctx: StageContext, item_id: str, item: ChallengerPrompt, traj_id: str) -> Trajectory:
        # ChallengerPrompt.task_type holds the SPICE answer type; its expected_searches is unused (no search)
        content = spice.challenger_prompt(item.document, item.task_type)
        return new_trajectory(traj_id, "challenger", [{"role": "user", "content": content}], ctx.policy.tokenizer,
                              max_searches=0, meta={"prompt_id": item.id, "document_id": item.document_id,
                                                    "answer_type": item.task_type})

    def draw_rollouts(self, session: RoleSession, trajectories: list[Trajectory], limits: RolloutLimits, step: int
                      ) -> tuple[list[Trajectory], RolloutStats]:
        """Algorithm 1, lines 5-6: a document's rows are its first attempts; while none of its attempts is a valid
        task and fewer than N = `spice.attempts` are drawn, as many again are drawn (`draw_more`). Then
        `spice.subsample_attempts` keeps as many as the document has rows, with their valid:invalid ratio (seeded by
        stage, step and document), in their rows' places. Every attempt is recorded (`attempts`)."""
        ctx = session.ctx
        rows: dict[str, list[int]] = {}
        for i, t in enumerate(trajectories):
            rows.setdefault(t.meta["prompt_id"], []).append(i)
        drawn = {item_id: [trajectories[i] for i in places] for item_id, places in rows.items()}
        stats = run_rollouts(trajectories, ctx.rollout_engine, ctx.retriever, ctx.dialect, limits, adapter=ctx.role)
        parsed = {t.id: spice.parse_task(_reply(t), starts_in_think=t.opens_think) for t in trajectories}
        stats = self.draw_more(session, drawn, parsed, limits, step, stats)
        out: list[Trajectory] = list(trajectories)
        records = []
        for item_id, attempts in drawn.items():
            keep = spice.subsample_attempts([parsed[a.id].valid for a in attempts], len(rows[item_id]),
                                            seed=f"{ctx.seed}/{step}/{item_id}/{ranks.rank()}")
            for place, index in zip(rows[item_id], keep, strict=True):
                out[place] = attempts[index]
                attempts[index].meta["attempts"] = len(attempts)
            records += [{"id": a.id, "iteration": ctx.iteration, "step": step + 1, "prompt_id": item_id,
                         "document_id": a.meta["document_id"], "answer_type": a.meta["answer_type"],
                         "kept": j in keep, **_parse_fields(parsed[a.id], a), "reply": _reply(a)}
                        for j, a in enumerate(attempts)]
        session.unwritten["attempts"] = records
        return out, stats

    def draw_more(self, session: RoleSession, drawn: dict[str, list[Trajectory]], parsed: dict[str, spice.TaskParse],
                  limits: RolloutLimits, step: int, stats: RolloutStats) -> RolloutStats:
        """Further rounds (each at its own seed): every document without a valid attempt, whose attempts ran and are
        still at most N less its first round's count, draws that many more. Extends `drawn` and `parsed`."""
        ctx = session.ctx
        tag = f"r{ranks.rank()}." if ranks.distributed() else ""
        first = {item_id: len(attempts) for item_id, attempts in drawn.items()}
        for round_ in range(1, ctx.params.spice.attempts + 1):
            more = []
            for item_id, attempts in drawn.items():
                if (len(attempts) + first[item_id] > ctx.params.spice.attempts
                        or any(parsed[a.id].valid or never_ran(a) for a in attempts)):
                    continue
                fresh = [self.new_trajectory(ctx, item_id, session.items[item_id],
                                             f"{item_id}/t{step:03d}/a{tag}{len(attempts) + j}")
                         for j in range(first[item_id])]
                attempts.extend(fresh)
                more.extend(fresh)
            if not more:
                return stats
            again = dataclasses.replace(limits, seed=None if limits.seed is None else limits.seed + ROUND_SEED * round_)
            stats = combined(stats, run_rollouts(more, ctx.rollout_engine, ctx.retriever, ctx.dialect, again,
                                                 adapter=ctx.role))
            parsed.update({t.id: spice.parse_task(_reply(t), starts_in_think=t.opens_think) for t in more})
        return stats

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
             "attempts": t.meta.get("attempts"), **_parse_fields(parsed.get(t.id), t),
             "verified": verified.get(t.id), "pass_rate": mean_of(verified[t.id]) if t.id in verified else None,
             "trajectory": t.to_record()} for t, value in zip(trajectories, values, strict=True)]
        session.unwritten["solver_rollouts"] = [
            {"id": a.id, "iteration": ctx.iteration, "step": step + 1, "task_id": a.meta["task_id"],
             "verified": a.meta["verified"], "answer": spice.reasoner_answer(_reply(a), starts_in_think=a.opens_think),
             "trajectory": a.to_record()} for a in answers]
        rates = [mean_of(v) for v in verified.values()]
        drawn = session.unwritten.get("attempts", [])
        return values, {
            **reward_stats(values),
            "task_rate": mean_of([p.valid for p in parsed.values()]) if parsed else None,
            "attempts_per_document": len(drawn) / len({a["prompt_id"] for a in drawn}) if drawn else None,
            "attempt_valid_rate": mean_of([a["valid"] is True for a in drawn]) if drawn else None,
            "pass_rate": mean_of(rates) if rates else None,
            "zero_spread_tasks": mean_of([r in (0.0, 1.0) for r in rates]) if rates else None,
            "solver_rollouts": len(answers), "solver_rollout_s": stats.total_s if stats else 0.0,
            "solver_stops_in_thinking": stats.stops_in_thinking if stats else 0}


def _parse_fields(parse: spice.TaskParse | None, traj: Trajectory) -> dict[str, Any]:
    """What an attempt's record says of its parse: valid (None: the attempt never ran), why not, the task."""
    if parse is None or never_ran(traj):
        return {"valid": None, "invalid_reason": "never_ran", "invalid_detail": "", "task": None}
    return {"valid": parse.valid, "invalid_reason": parse.reason, "invalid_detail": parse.detail,
            "task": task_record(parse.task) if parse.valid else None}


class SpiceReasoner:
    """Stage 2's rules: the Reasoner sees the question alone; r_R = 1[verified] (§2.3). With
    `spice.reasoner_samples: shared` its rows are the answers Stage 1 sampled (§2.5), not new ones."""

    extra_records: tuple[str, ...] = ()
    searches = False

    def limits(self, params: Params) -> RolloutLimits:
        return _one_turn(solver_limits(params))

    def new_trajectory(self, ctx: StageContext, item_id: str, item: ReasonerTask, traj_id: str) -> Trajectory:
        return reasoner_trajectory(ctx, traj_id, item.task, {"task_id": item_id})

    def draw_rollouts(self, session: RoleSession, trajectories: list[Trajectory], limits: RolloutLimits, step: int
                      ) -> tuple[list[Trajectory], RolloutStats]:
        """`fresh`: the rows rolled out now. `shared`: row j of a task's group (its id ends in /g<j>) is the j-th of
        the K answers Stage 1 sampled for it, under the row's id (`sampled_as` names the answer)."""
        ctx = session.ctx
        if ctx.params.spice.reasoner_samples == "fresh":
            return trajectories, run_rollouts(trajectories, ctx.rollout_engine, ctx.retriever, ctx.dialect, limits,
                                              adapter=ctx.role)
        out = []
        for t in trajectories:
            answers = session.items[t.meta["task_id"]].answers
            stored = Trajectory.from_record(answers[int(t.id.rsplit("/g", 1)[1]) % len(answers)])
            out.append(dataclasses.replace(stored, id=t.id, meta={**t.meta, "sampled_as": stored.id}))
        return out, RolloutStats()

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        verified = {t.id: spice.verify_reply(session.items[t.meta["task_id"]].task, _reply(t),
                                             starts_in_think=t.opens_think)
                    for t in trajectories if not never_ran(t)}
        values = [spice.reasoner_reward(verified[t.id]) if t.id in verified else None for t in trajectories]
        answers = {t.id: spice.reasoner_answer(_reply(t), starts_in_think=t.opens_think) for t in trajectories}
        session.unwritten["rollouts"] = [
            {"id": t.id, "iteration": ctx.iteration, "step": step + 1, "task_id": t.meta["task_id"], "reward": value,
             "verified": verified.get(t.id), "answer": answers[t.id], "sampled_as": t.meta.get("sampled_as"),
             "trajectory": t.to_record()}
            for t, value in zip(trajectories, values, strict=True)]
        return values, {**reward_stats(values), "pass_rate": mean_of(verified.values()) if verified else None,
                        "boxed_rate": mean_of([a is not None for a in answers.values()])}


def choose_formats(r: SelfPlayRun, t: int, stage, prompts: list[ChallengerPrompt]) -> list[ChallengerPrompt]:
    """Each document's answer type. `spice.format_choice: challenger` (App. E, Figure 9): the Challenger (the
    current policy, one turn, `spice.format_max_tokens`) is asked which format suits the document; a reply that
    names none keeps the apportioned type. The choices are recorded (`formats`) and a resumed stage reads them back.
    The main rank asks; every rank uses its answers."""
    if r.params.spice.format_choice == "apportioned":
        return prompts
    log = stage.records("formats")
    chosen = {rec["id"]: rec for rec in log}
    missing = [p for p in prompts if p.id not in chosen]
    if missing:
        records = None
        if ranks.is_main():
            limits = _one_turn(challenger_limits(r.params))
            limits.max_new_tokens_per_turn = min(limits.max_new_tokens_per_turn, r.params.spice.format_max_tokens)
            limits.seed = stage_seed(r.params, t, "challenger") * 1000 + 999
            asks = [new_trajectory(f"{p.id}/format", "challenger",
                                   [{"role": "user", "content": spice.format_choice_prompt(p.document)}],
                                   r.policy.tokenizer, max_searches=0) for p in missing]
            run_rollouts(asks, r.engine, r.retriever, r.dialect, limits, adapter="challenger")
            choices = [spice.parse_format_choice(_reply(a), starts_in_think=a.opens_think) for a in asks]
            records = [{"id": p.id, "iteration": t, "document_id": p.document_id,
                        "answer_type": choice or p.task_type, "chosen_by": "challenger" if choice else "apportioned",
                        "apportioned": p.task_type, "reply": _reply(a)}
                       for p, a, choice in zip(missing, asks, choices, strict=True)]
            log.append(records)
        chosen.update({rec["id"]: rec for rec in ranks.broadcast(records)})
    return [dataclasses.replace(p, task_type=chosen[p.id]["answer_type"]) for p in prompts]


def train_challenger(r: SelfPlayRun, t: int) -> dict:
    """Stage 1: GRPO on r_C over `selfplay.challenger_prompts` fresh documents, one answer type each."""
    check_params(r.params)
    stage = r.stage(t, "challenger")
    if stage.done:
        return stage.summary
    start = documents_start(r, t, "challenger")
    sp = r.params.selfplay
    reset_stage(r, t, stage)
    publish_roles(r, t, "challenger", ("challenger", "solver"))  # the format choice, the Reasoner's answers
    documents = document_range(r.passages, start, sp.challenger_prompts, sp.seed, limit=r.training_documents)
    prompts = make_challenger_prompts(documents, list(spice.ANSWER_TYPES), [1], stage_seed(r.params, t, "challenger"),
                                      tokenizer=r.policy.tokenizer, document_max_tokens=sp.document_max_tokens,
                                      id_prefix=f"i{t:02d}-c")
    prompts = choose_formats(r, t, stage, prompts)
    result = train_role(stage_context(r, t, "challenger", stage), {p.id: p for p in prompts})
    attempts = [rec for rec in stage.records("attempts") if rec["valid"] is not None]
    kept = [rec for rec in stage.records("rollouts") if rec["valid"] is not None]
    valid = sum(rec["valid"] for rec in attempts)
    formats = list(stage.records("formats")) if r.params.spice.format_choice == "challenger" else []
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2),
               "documents": [start, start + len(documents)], "saved": result.saved.name,
               "reward": [m.get("reward") for m in result.metrics], "attempts": len(attempts), "valid": valid,
               "valid_rate": valid / len(attempts) if attempts else 0.0,
               "invalid_reasons": dict(Counter(rec["invalid_reason"] for rec in attempts if not rec["valid"])),
               "kept": len(kept), "kept_valid": sum(rec["valid"] for rec in kept),
               "answer_types": dict(Counter(p.task_type for p in prompts)),
               "formats_chosen": sum(rec["chosen_by"] == "challenger" for rec in formats) if formats else None}
    for alarm in health.check_valid_tasks({**summary, "iteration": t}):
        r.alarms.append(alarm)
        if ranks.is_main():
            health.report(alarm, r.run_dir)
    mark_done(stage, summary, result.saved)
    return summary


def reasoner_tasks(r: SelfPlayRun, t: int) -> dict[str, ReasonerTask]:
    """Stage 2's tasks from Stage 1's kept valid ones. `shared` (Algorithm 1 line 15, §3.1: "we randomly select one
    per document"): one per document, seeded, with its K answers; `fresh`: every distinct question once."""
    challenger = r.stage(t, "challenger")
    valid = [rec for rec in challenger.records("rollouts") if rec.get("valid")]
    if r.params.spice.reasoner_samples == "fresh":
        seen: set[str] = set()
        tasks = {}
        for rec in valid:
            if rec["task"]["question"] not in seen:
                seen.add(rec["task"]["question"])
                tasks[rec["id"]] = ReasonerTask(task_from_record(rec["task"]))
        return tasks
    answers: dict[str, list[dict]] = {}
    for rec in challenger.records("solver_rollouts"):
        answers.setdefault(rec["task_id"], []).append(rec["trajectory"])
    by_document: dict[str, list[dict]] = {}
    for rec in valid:
        by_document.setdefault(rec["document_id"], []).append(rec)
    rng = random.Random(f"{stage_seed(r.params, t, 'solver')}/spice/one-per-document")
    picked = [rng.choice(recs) for recs in by_document.values()]
    return {rec["id"]: ReasonerTask(task_from_record(rec["task"]), tuple(answers[rec["id"]]))
            for rec in picked if answers.get(rec["id"])}


def train_reasoner(r: SelfPlayRun, t: int) -> dict:
    """Stage 2: GRPO on r_R over Stage 1's valid tasks, G closed-book answers per task (`reasoner_tasks`)."""
    check_params(r.params)
    stage = r.stage(t, "solver")
    if stage.done:
        return stage.summary
    reset_stage(r, t, stage)
    tasks = reasoner_tasks(r, t)
    if not tasks:
        summary = {"skipped": "no valid task", "steps": 0, "tasks": 0,
                   "note": "no Challenger attempt was a valid task; the Reasoner keeps its weights (see the alarms)"}
        mark_done(stage, summary)
        return summary
    result = train_role(stage_context(r, t, "solver", stage), tasks)
    summary = trained_summary(result, "pass_rate", tasks=len(tasks), samples=r.params.spice.reasoner_samples)
    mark_done(stage, summary, result.saved)
    return summary


class Spice(Method):
    """SPICE's two stages per iteration and its two roles' rules (the Reasoner trains as the `solver` role)."""

    name = "spice"
    roles = {"challenger": SpiceChallenger(), "solver": SpiceReasoner()}
    uses_index = False   # the Challenger reads its document, the Reasoner answers closed-book: nothing searches

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return (StageSpec("challenger", train_challenger, trains="challenger"),
                StageSpec("solver", train_reasoner, trains="solver"))


SPICE = Spice()
