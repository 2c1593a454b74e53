"""SCORE, Evaluator-Solver self-play with consistency-driven dimension learning (Zhu et al., arXiv 2606.04507), on
the shared harness. One policy plays both roles (use `model.shared_policy: true`): the Evaluator chooses a weighted
rubric from the dimension pool under the meta-harness's constraints, the Solver researches a query with search and
writes a report under that rubric, the Evaluator searches to verify the K reports of the query and scores them all
in one call (`protocol.score`). A frozen meta-harness model (the Judge's engine: M0 by default) rewrites the
Evaluator's constraints every 5 steps. One iteration is one SCORE training step (Algorithm 1, lines 6-40):

    SCORE.stages   # rubric (the Evaluator's rubrics, lines 11-13), solver (GRPO on R_s, lines 15-30),
                   # evaluator (REINFORCE on the consistency, line 32 and Algorithm 2), harness (lines 35-39)

runs/<name>/iter_NN/rubric/     rollouts (per query: the harness in force, the Evaluator's rubric or why it is invalid)
runs/<name>/iter_NN/solver/     rollouts (the K reports of each query, a(r), scores, R_s), evaluations (per query: the
                                rubric, scores, problem counts, searches, the verifier's zeroing, the consistency C_q),
                                metrics, adapter, DONE
runs/<name>/iter_NN/evaluator/  rollouts (each rubric: R_e, the EMA baseline before and after, the advantage),
                                metrics, adapter, DONE (the baseline b_t a resume reads back)
runs/<name>/iter_NN/harness/    DONE (the harness in force from the next step on; on refresh steps the statistics,
                                the meta-harness's reply and whether it was accepted)

The queries are written from training documents (`QUERY_TEMPLATE` on the document's title: data-free; the paper's
are Reddit user questions). The rubric comes first (Algorithm 1's order, `protocol.score` "When the rubric is
chosen"): one rubric per query, so R_e(Γ_q) = C(Γ_q) (§3.5) and its REINFORCE advantage is R_e(Γ_q) − b_{t−1}; the
baseline moves by the batch mean (Algorithm 2, lines 8-11). An invalid rubric earns R_e = 0 and zeroes its query's
R_s (the verifier). The Evaluator's update is REINFORCE with a rollout of 1 (`ScoreEvaluator.group_size`): its
rubric rows, sampled before the Solver's step, are replayed to the trainer, whose advantages are then the given
ones (`training.ScopeGRPOTrainer.reinforce`). docs/methods.md, "SCORE's loop", says where this differs from the
paper.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from typing import Any

from scope_lib.config import Params, ParamsError
from scope_lib.models.engine import Sampling
from scope_lib.protocol import score
from scope_lib.protocol.parsing import extract_answer
from scope_lib.retrieval.corpus import Passage, document_range
from scope_lib.runs import Stage, iteration_dir
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
from scope_lib.selfplay.rollout import RolloutLimits, Trajectory, new_trajectory, run_rollouts
from scope_lib.selfplay.tasks import challenger_limits, solver_limits
from scope_lib.selfplay.training import (
    RoleSession,
    StageContext,
    mean_of,
    never_ran,
    reward_stats,
    train_role,
)

log = logging.getLogger(__name__)

#: A query written from a training document (the paper's are user questions; ours need no data beyond the corpus).
QUERY_TEMPLATE = "Write a research report on {title}: what it is, the key facts about it, and why they matter."
#: The Evaluator trains as the shared core's `challenger` role (its budgets: `challenger.*`), the Solver as `solver`.
EVALUATOR = "challenger"


def query_from_document(passage: Passage) -> str:
    return QUERY_TEMPLATE.format(title=passage.title.strip() or passage.text.split(".")[0][:80])


def harness_record(harness: score.Harness) -> dict[str, Any]:
    """The harness as its JSON record (lists for its tuples)."""
    return json.loads(json.dumps(dataclasses.asdict(harness)))


def harness_in_brief(harness: score.Harness) -> dict[str, Any]:
    """The harness as the per-query records keep it: Listing 3's fields and the pool's names (`score.harness_json`;
    the pool's descriptions are in the harness stage's DONE)."""
    return json.loads(score.harness_json(harness))


def harness_from_record(record: dict[str, Any]) -> score.Harness:
    return score.Harness(**{**record, "must_include": tuple(record["must_include"]),
                            "pool": tuple(tuple(p) for p in record["pool"])})


def rubric_record(rubric: score.Rubric | None) -> dict[str, Any] | None:
    return None if rubric is None else {"dimensions": list(rubric.dimensions), "weights": list(rubric.weights)}


def rubric_from_record(record: dict[str, Any] | None) -> score.Rubric | None:
    return None if record is None else score.Rubric(tuple(record["dimensions"]), tuple(record["weights"]))


def _reply(traj: Trajectory) -> str:
    return traj.turns[-1] if traj.turns else ""


def _one_turn(limits: RolloutLimits) -> RolloutLimits:
    return dataclasses.replace(limits, max_turns=1)


def harness_in_force(r: SelfPlayRun, t: int) -> score.Harness:
    """ℳ_{t−1}: the harness the previous step's harness stage left (ℳ_default before the first step)."""
    if t == 1:
        return score.DEFAULT_HARNESS
    previous = r.stage(t - 1, "harness")
    if not previous.done:
        raise RuntimeError(f"iteration {t - 1}'s harness stage is not finished; run the iterations in order")
    return harness_from_record(previous.summary["harness"])


def refresh_due(params: Params, t: int) -> bool:
    """Whether the meta-harness runs after iteration t: one of its steps ((t−1)·s + 1 … t·s, s =
    `selfplay.steps_per_role`) is a multiple of 5 (Algorithm 1 line 35; with s = 1, t mod 5 = 0)."""
    s = params.selfplay.steps_per_role
    return any(score.harness_refresh_due(step) for step in range((t - 1) * s + 1, t * s + 1))


@dataclasses.dataclass(frozen=True)
class ScoreQuery:
    """A query of one step and what its Solver rollouts are conditioned on (Algorithm 1 line 16)."""

    id: str
    query: str
    harness: score.Harness
    rubric: score.Rubric | None


# -- the rules of the two roles ------------------------------------------------------------------------------------


class ScoreSolver:
    """The Solver's stage: K reports per query with search, under the query's rubric (Listing 5); the Evaluator
    scores them in one call with search (Listing 4); R_s = a(r)·(1 + Σ w_j s_j), zeroed by the verifier (§3.5,
    Algorithm 1 lines 21-23); the query's consistency C_q from the K conclusions (Algorithm 2 lines 4-6)."""

    extra_records = ("evaluations",)
    searches = True

    def limits(self, params: Params) -> RolloutLimits:
        return solver_limits(params)

    def new_trajectory(self, ctx: StageContext, item_id: str, item: ScoreQuery, traj_id: str) -> Trajectory:
        d, searches = ctx.dialect, ctx.params.solver.max_searches
        content = score.solver_prompt(item.query, searches, d.search_example, d.results_description,
                                      rubric=item.rubric)
        return new_trajectory(traj_id, "solver", [{"role": "user", "content": content}], ctx.policy.tokenizer,
                              max_searches=searches, meta={"query_id": item_id})

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        groups: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            groups.setdefault(t.meta["query_id"], []).append(t)
        valid = {t.id: not never_ran(t) and score.report_valid(_reply(t), starts_in_think=t.opens_think)
                 for t in trajectories}
        scored = {q: session.items[q] for q in groups if session.items[q].rubric is not None}
        evaluations = [self._evaluation(ctx, f"{q}/t{step:03d}/e", session.items[q], groups[q]) for q in scored]
        stats = None
        if evaluations:
            limits = challenger_limits(ctx.params)  # the Evaluator's budgets
            limits.seed = ctx.seed * 1000 + 500 + step + 100_000 * ranks.rank()
            # the shared weights under the trained role's name: a serving engine has this step's copy under it
            stats = run_rollouts(evaluations, ctx.rollout_engine, ctx.retriever, ctx.dialect, limits,
                                 adapter=ctx.role)
        by_query = {e.meta["query_id"]: e for e in evaluations}
        records = [{"id": f"{q}/t{step:03d}", "iteration": ctx.iteration, "step": step + 1, "query_id": q,
                    **query_outcome(session.items[q], reports, by_query.get(q), [valid[t.id] for t in reports])}
                   for q, reports in groups.items()]
        reward = {rid: value for rec in records for rid, value in zip(rec["report_ids"], rec["rewards"], strict=True)}
        values = [None if never_ran(t) else reward[t.id] for t in trajectories]
        scores_of = {rid: s for rec in records for rid, s in zip(rec["report_ids"], rec["scores"] or [], strict=False)}
        session.unwritten["rollouts"] = [
            {"id": t.id, "iteration": ctx.iteration, "step": step + 1, "query_id": t.meta["query_id"],
             "reward": value, "report_valid": valid[t.id], "scores": scores_of.get(t.id),
             "trajectory": t.to_record()} for t, value in zip(trajectories, values, strict=True)]
        session.unwritten["evaluations"] = records
        consistencies = [rec["consistency"] for rec in records if rec["consistency"] is not None]
        return values, {
            **reward_stats(values), "report_valid_rate": mean_of(valid.values()),
            "evaluation_valid_rate": mean_of([evaluation_valid(rec) for rec in records]),
            "evaluator_searches": mean_of([rec["searches"] for rec in records if rec["evaluated"]]) if evaluations
            else None,
            "zeroed_queries": mean_of([rec["zeroed"] for rec in records]),
            "consistency": mean_of(consistencies) if consistencies else None,
            # the core's names for rollouts made inside the reward (its time breakdown): the Evaluator's calls
            "solver_rollouts": len(evaluations), "solver_rollout_s": stats.total_s if stats else 0.0,
            "solver_stops_in_thinking": stats.stops_in_thinking if stats else 0}

    @staticmethod
    def _evaluation(ctx: StageContext, traj_id: str, item: ScoreQuery, reports: list[Trajectory]) -> Trajectory:
        """The Evaluator's one call for the query's K reports (Listing 4), searching under the harness; a rollout
        with the Solver's protocol shape (search, results) whose final turn is the XML `parse_evaluation` reads."""
        d, searches = ctx.dialect, ctx.params.solver.max_searches
        texts = [extract_answer(_reply(t), starts_in_think=t.opens_think) or "" for t in reports]
        content = score.evaluator_prompt(item.query, texts, item.harness, d.search_example, d.results_description,
                                         searches, rubric=item.rubric)
        return new_trajectory(traj_id, "solver", [{"role": "user", "content": content}], ctx.policy.tokenizer,
                              max_searches=searches, meta={"query_id": item.id, "role": "evaluator"})


def query_outcome(item: ScoreQuery, reports: list[Trajectory], evaluation: Trajectory | None,
                  valid: list[bool]) -> dict[str, Any]:
    """One query's record: the Evaluator's scores of its K reports (`parse_evaluation`), their rewards R_s with the
    verifier's zeroing (`solver_rewards`), and the consistency C_q of their conclusions (`pairwise_consistency`).
    Without a rubric there is no evaluation and every R_s is 0."""
    required = score.required_searches(item.harness)
    if evaluation is None:
        parsed, searches, values = None, 0, [0.0] * len(reports)
    else:
        parsed = score.parse_evaluation(_reply(evaluation), item.harness, len(reports), rubric=item.rubric,
                                        starts_in_think=evaluation.opens_think)
        searches = evaluation.n_valid_searches
        values = score.solver_rewards(parsed, valid, searches, required)
    conclusions = [score.extract_conclusion(_reply(t), starts_in_think=t.opens_think) for t in reports]
    zeroed = parsed is None or not parsed.valid or not score.search_verified(searches, required)
    return {"query": item.query, "harness": harness_in_brief(item.harness), "rubric": rubric_record(item.rubric),
            "evaluated": parsed is not None,
            "problems": parsed.problem_counts() if parsed is not None else {"rubric_invalid": len(reports)},
            "scores": [dict(zip(item.rubric.dimensions, r.scores, strict=True)) for r in parsed.reports]
            if parsed is not None else None,
            "searches": searches, "required_searches": required, "zeroed": zeroed,
            "zero_reason": zero_reason(parsed, evaluation) if zeroed else None,
            "report_ids": [t.id for t in reports], "rewards": values, "conclusions": conclusions,
            "consistency": score.pairwise_consistency(conclusions) if len(reports) > 1 else None,
            "trajectory": evaluation.to_record() if evaluation is not None else None}


def zero_reason(parsed: score.EvaluationParse | None, evaluation: Trajectory | None) -> str:
    """Why the verifier zeroed a query's rewards: no valid rubric, an evaluation that never ran (its prompt, the
    query and the K reports, did not fit `challenger.max_prompt_tokens`), or too few searches."""
    if parsed is None or not parsed.valid:
        return "no_rubric"
    return "evaluation_not_run" if evaluation is not None and never_ran(evaluation) else "too_few_searches"


def evaluation_valid(record: dict[str, Any]) -> bool:
    """An Evaluator reply that scored something: a valid rubric and at least one report's scores found."""
    return record["evaluated"] and "rubric_invalid" not in record["problems"] and (
        record["problems"].get("report_missing", 0) < len(record["report_ids"]))


class ScoreEvaluator:
    """The Evaluator's stage: REINFORCE with a rollout of 1 on its rubrics (Algorithm 2 line 14), advantage
    A_q = R_e(Γ_q) − b_{t−1}, R_e(Γ_q) = C_q (0 for an invalid rubric); b_t = β b_{t−1} + (1 − β)·mean R_e."""

    extra_records: tuple[str, ...] = ()
    searches = False
    group_size = 1  # the paper's evaluator rollout number (Table 2): REINFORCE, no group

    def limits(self, params: Params) -> RolloutLimits:
        return _one_turn(challenger_limits(params))

    def new_trajectory(self, ctx: StageContext, item_id: str, item: dict[str, Any], traj_id: str) -> Trajectory:
        """The rubric the Evaluator sampled before the Solver's step (the rubric stage), replayed: it is finished,
        so the rollout adds nothing and the trainer takes its tokens as they were sampled."""
        traj = Trajectory.from_record(item["trajectory"])
        traj.id = traj_id
        return traj

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        before = baseline_before(session, step)
        rewards_e = [session.items[t.meta["query_id"]]["reward_e"] for t in trajectories]
        shared = [v for share in ranks.gather([rewards_e]) for v in share]  # the batch over every rank
        r_eval = score.evaluator_reward(shared)  # Algorithm 2 line 8
        _, after = score.ema_step(r_eval, before)  # line 11
        values = [None if never_ran(t) else reward_e - before  # line 10, per query (§3.5)
                  for t, reward_e in zip(trajectories, rewards_e, strict=True)]
        session.score_baseline = after
        session.unwritten["rollouts"] = [
            {"id": t.id, "iteration": ctx.iteration, "step": step + 1, "query_id": t.meta["query_id"],
             "reward": value, "reward_e": reward_e, "rubric_valid": session.items[t.meta["query_id"]]["valid"],
             "consistency": session.items[t.meta["query_id"]]["consistency"], "baseline_before": before,
             "advantage": value, "baseline": after, "trajectory": t.to_record()}
            for t, value, reward_e in zip(trajectories, values, rewards_e, strict=True)]
        return values, {**reward_stats(values), "reward_eval": r_eval, "baseline_before": before, "baseline": after,
                        "rubric_valid_rate": mean_of([session.items[t.meta["query_id"]]["valid"]
                                                      for t in trajectories])}


def baseline_before(session: RoleSession, step: int) -> float:
    """b_{t−1} for the stage's step `step` (0-based): the baseline the previous step left, in memory, or read back
    from the stage's records (a resumed stage keeps those of its finished steps) or, at the stage's first step, from
    the previous iteration's Evaluator summary (b_0 = 0, Algorithm 1 line 5)."""
    if hasattr(session, "score_baseline"):
        return session.score_baseline
    earlier = [rec for rec in session.records if rec["step"] <= step]
    if earlier:
        return max(earlier, key=lambda rec: rec["step"])["baseline"]
    ctx = session.ctx
    if ctx.iteration == 1:
        return 0.0
    return Stage(iteration_dir(ctx.params.run_dir, ctx.iteration - 1) / "evaluator").summary["baseline"]


# -- the stages ---------------------------------------------------------------------------------------------------


def sample_rubrics(r: SelfPlayRun, t: int) -> dict:
    """The step's queries (solver.batch_size × selfplay.steps_per_role fresh documents) and the Evaluator's rubric
    for each, sampled once under ℳ_{t−1} before any report (Algorithm 1 lines 9-13; `score.rubric_prompt`)."""
    stage = r.stage(t, "rubric")
    if stage.done:
        return stage.summary
    sp, harness = r.params.selfplay, harness_in_force(r, t)
    start = documents_start(r, t, "rubric")
    n = r.params.solver.batch_size * sp.steps_per_role
    if ranks.is_main():
        stage.reset()
    ranks.barrier()
    publish_roles(r, t, "rubric", (EVALUATOR,))
    documents = document_range(r.passages, start, n, sp.seed, limit=r.training_documents)
    trajectories = [new_trajectory(f"i{t:02d}-q{j:03d}", "challenger",
                                   [{"role": "user", "content": score.rubric_prompt(query_from_document(doc),
                                                                                    harness)}],
                                   r.policy.tokenizer, expected_searches=0,
                                   meta={"query_id": f"i{t:02d}-q{j:03d}", "document_id": doc.id,
                                         "query": query_from_document(doc)})
                    for j, doc in enumerate(documents)]
    limits = _one_turn(challenger_limits(r.params))
    limits.seed = stage_seed(r.params, t, "pool") * 1000
    run_rollouts(trajectories, r.engine, r.retriever, r.dialect, limits, adapter=EVALUATOR)
    parsed = [score.parse_rubric(_reply(traj), harness, starts_in_think=traj.opens_think) for traj in trajectories]
    records = [{"id": traj.meta["query_id"], "iteration": t, "query": traj.meta["query"],
                "document_id": traj.meta["document_id"], "harness": harness_in_brief(harness), "valid": p.valid,
                "invalid_reason": p.reason, "invalid_detail": p.detail, "rubric": rubric_record(p.rubric),
                "trajectory": traj.to_record()} for traj, p in zip(trajectories, parsed, strict=True)]
    if ranks.is_main():
        stage.records("rollouts").append(records)
    summary = {"documents": [start, start + n], "queries": n, "valid_rubrics": sum(p.valid for p in parsed),
               "invalid_reasons": dict(Counter(p.reason for p in parsed if not p.valid)),
               "harness": harness_in_brief(harness)}
    mark_done(stage, summary)
    return summary


def _rubrics(r: SelfPlayRun, t: int) -> list[dict[str, Any]]:
    return list(r.stage(t, "rubric").records("rollouts"))


def train_solver(r: SelfPlayRun, t: int) -> dict:
    """GRPO on R_s over the step's queries, K = grpo.group_size reports each (Algorithm 1 lines 15-30)."""
    stage = r.stage(t, "solver")
    if stage.done:
        return stage.summary
    reset_stage(r, t, stage)
    harness = harness_in_force(r, t)  # the one the rubric stage chose its rubrics under
    items = {rec["id"]: ScoreQuery(rec["id"], rec["query"], harness,
                                   rubric_from_record(rec["rubric"])) for rec in _rubrics(r, t)}
    result = train_role(stage_context(r, t, "solver", stage), items)
    evaluations = list(stage.records("evaluations"))
    problems: Counter = Counter()
    for rec in evaluations:
        problems.update(rec["problems"])
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2), "saved": result.saved.name,
               "queries": len(evaluations), "reward": [m.get("reward") for m in result.metrics],
               "valid_evaluations": sum(evaluation_valid(rec) for rec in evaluations),
               "zeroed_queries": sum(rec["zeroed"] for rec in evaluations),
               "evaluator_searches": mean_of([rec["searches"] for rec in evaluations]) if evaluations else None,
               "consistency": mean_of([rec["consistency"] for rec in evaluations if rec["consistency"] is not None])
               if evaluations else None,
               "problems": dict(problems), "dimension_scores": dimension_means(evaluations)}
    for alarm in check_evaluations({**summary, "iteration": t}):
        r.alarms.append(alarm)
        if ranks.is_main():
            health.report(alarm, r.run_dir)
    mark_done(stage, summary, result.saved)
    return summary


def dimension_means(evaluations: list[dict[str, Any]]) -> dict[str, float]:
    """The mean score (0-10) of every dimension the valid evaluations scored, for the meta-harness's statistics."""
    values: dict[str, list[float]] = {}
    for rec in evaluations:
        for scores in rec["scores"] or []:
            for dim, value in scores.items():
                values.setdefault(dim, []).append(value)
    return {dim: mean_of(v) for dim, v in sorted(values.items())}


def check_evaluations(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The `no_valid_evaluation` alarm: no Evaluator reply of the step gave a rubric and scores (the Solver got no
    signal: every R_s was 0). The run goes on."""
    if summary.get("queries") and not summary.get("valid_evaluations"):
        reasons = ", ".join(f"{k} {n}" for k, n in sorted((summary.get("problems") or {}).items()))
        return [{"alarm": "no_valid_evaluation", "role": "evaluator", "iteration": summary.get("iteration"),
                 "step": None, "value": 0, "threshold": 1,
                 "message": f"none of the Evaluator's {summary['queries']} replies gave a rubric and scores "
                            f"({reasons}): every Solver reward of the step is 0"}]
    return []


def train_evaluator(r: SelfPlayRun, t: int) -> dict:
    """REINFORCE on the step's rubrics (Algorithm 2): R_e(Γ_q) = C_q from the Solver's stage (0 for an invalid
    rubric), centred by the EMA baseline kept across steps and resumes (the summary's `baseline`)."""
    stage = r.stage(t, "evaluator")
    if stage.done:
        return stage.summary
    if r.params.challenger.batch_size != r.params.solver.batch_size:
        raise ParamsError(f"method: score trains the Evaluator on the rubrics of the Solver's queries, one per row: "
                          f"challenger.batch_size ({r.params.challenger.batch_size}) must equal solver.batch_size "
                          f"({r.params.solver.batch_size})")
    reset_stage(r, t, stage)
    consistency: dict[str, float | None] = {}
    for rec in r.stage(t, "solver").records("evaluations"):  # the latest step's C_q for each query
        consistency[rec["query_id"]] = rec["consistency"]
    items = {}
    for rec in _rubrics(r, t):
        c = consistency.get(rec["id"])
        items[rec["id"]] = {**rec, "consistency": c, "reward_e": (c or 0.0) if rec["valid"] else 0.0}
    result = train_role(stage_context(r, t, EVALUATOR, stage), items)
    baseline = result.metrics[-1]["baseline"] if result.metrics else baseline_from_records(stage)
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2), "saved": result.saved.name,
               "rubrics": len(items), "valid_rubrics": sum(rec["valid"] for rec in items.values()),
               "reward_eval": [m.get("reward_eval") for m in result.metrics],
               "baselines": [m.get("baseline") for m in result.metrics], "baseline": baseline}
    mark_done(stage, summary, result.saved)
    return summary


def baseline_from_records(stage) -> float:
    records = list(stage.records("rollouts"))
    return max(records, key=lambda rec: rec["step"])["baseline"] if records else 0.0


def harness_statistics(r: SelfPlayRun, t: int) -> dict[str, Any]:
    """𝒯_t (Algorithm 1 line 36): the steps since the last refresh, from their Solver and Evaluator summaries."""
    first = max(1, t - score.HARNESS_PERIOD + 1)
    solver = [r.stage(i, "solver").summary for i in range(first, t + 1) if r.stage(i, "solver").done]
    evaluator = [r.stage(i, "evaluator").summary for i in range(first, t + 1) if r.stage(i, "evaluator").done]
    rewards = [v for s in solver for v in s.get("reward", []) if v is not None]
    queries = sum(s.get("queries", 0) for s in solver)
    dimensions: dict[str, list[float]] = {}
    for s in solver:
        for dim, value in (s.get("dimension_scores") or {}).items():
            dimensions.setdefault(dim, []).append(value)
    return {"steps": [first, t], "solver_mean_reward": mean_of(rewards) if rewards else None,
            "dimension_mean_scores": {d: mean_of(v) for d, v in dimensions.items()},
            "evaluator_consistency": mean_of([v for s in evaluator for v in s.get("reward_eval", [])
                                              if v is not None]) if evaluator else None,
            "evaluator_searches_per_query": mean_of([s["evaluator_searches"] for s in solver
                                                     if s.get("evaluator_searches") is not None]) if solver else None,
            "zeroed_reward_share": sum(s.get("zeroed_queries", 0) for s in solver) / queries if queries else None,
            "valid_evaluation_share": sum(s.get("valid_evaluations", 0) for s in solver) / queries if queries
            else None}


def refresh_harness(r: SelfPlayRun, t: int) -> dict:
    """After step t: when due (`refresh_due`), the frozen meta-harness model (the Judge's rubric engine: M0 unless
    `judge.rubric_model` names another, served as the Judge's models are) rewrites the harness from the statistics
    (Listing 3); a rejected reply keeps the previous harness (`score.parse_harness`). Otherwise ℳ_t = ℳ_{t−1}."""
    stage = r.stage(t, "harness")
    if stage.done:
        return stage.summary
    previous = harness_in_force(r, t)
    summary: dict[str, Any] = {"refreshed": False, "harness": harness_record(previous)}
    if refresh_due(r.params, t):
        statistics = harness_statistics(r, t)
        engine, j = r.judge.rubric_engine, r.params.judge
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": score.meta_harness_prompt(statistics, previous)}], tokenize=False,
            add_generation_prompt=True)
        sampling = Sampling(max_new_tokens=j.rubric_max_tokens, temperature=j.rubric_temperature,
                            seed=stage_seed(r.params, t, "pool") * 1000 + 1, logprobs=False)
        reply = engine.generate([engine.tokenizer.encode(text, add_special_tokens=False)], sampling,
                                adapter=None)[0].text
        parsed = score.parse_harness(reply, previous)
        summary = {"refreshed": True, "accepted": parsed.valid, "reason": parsed.reason, "detail": parsed.detail,
                   "statistics": statistics, "reply": reply, "previous": harness_record(previous),
                   "harness": harness_record(parsed.harness)}
        log.info("iteration %d: the meta-harness's reply was %s", t,
                 "accepted" if parsed.valid else f"rejected ({parsed.reason}); the previous harness stays")
    mark_done(stage, summary)
    return summary


class Score(Method):
    """SCORE's four stages per step and its two trained roles' rules (the Evaluator trains as `challenger`)."""

    name = "score"
    roles = {EVALUATOR: ScoreEvaluator(), "solver": ScoreSolver()}

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return (StageSpec("rubric", sample_rubrics), StageSpec("solver", train_solver, trains="solver"),
                StageSpec("evaluator", train_evaluator, trains=EVALUATOR), StageSpec("harness", refresh_harness))


SCORE = Score()
