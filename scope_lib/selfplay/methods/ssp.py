"""Search Self-Play (SSP; Lu et al., Alibaba Qwen, github Qwen-Applications/SSP) on the shared harness. One policy
plays both roles (use `model.shared_policy: true`): the Proposer is given a ground-truth answer a*, searches over
several turns and writes a question between <question> tags; the Solver, a Search-R1-style agent, searches and
answers between <answer> tags. A question counts only if it passes the rule filters and RAG verification: the Solver
without search, given the Proposer's retrieved results plus noise results of other trajectories of the batch, must
answer it correctly (§3.2 eq. 3, §3.3, Algorithm 1 line 4; `protocol.ssp`). Answers are checked as
`ssp.answer_check` says (`check_answers`): by the paper's LLM judge (App. E, Correct or Wrong; the Judge's grader
model, one call per batch), or by rule (`protocol.ssp.answer_correct`). The Judge's other stages are not used.

    SSP.stages             # `challenger` (the Proposer: REINFORCE on r_propose), `solver` (the Solver: GRPO on r_solve)

runs/<name>/iter_NN/challenger/  rollouts (every proposal: its answer, question, filter reason, RAG outcome, the
                                 Solver's outcomes, r_propose, baseline, advantage), rag_rollouts (the RAG Solver's answers),
                                 solver_rollouts (the n Solver answers that scored it), metrics, adapter, DONE
runs/<name>/iter_NN/solver/      replay_buffer (the valid questions kept for the next iteration), rollouts (the
                                 Solver's answers, correct, r_solve), metrics, adapter, DONE
Every checked answer's record names the check that decided it (`answer_check`: one of ANSWER_CHECKS), and each
step's metrics count the judge's unparseable verdicts (`answers_unparseable`).

Stage 1 (Algorithm 1 lines 2-9): `selfplay.challenger_prompts` answers from the iteration's documents
(`answer_set.corpus_answers`) or from `ssp.answer_file` (`answer_set.read_answer_file`, never an evaluation set), each
with a search-chain length drawn from `selfplay.search_turn_strata`; one
proposal per answer (REINFORCE, eq. 5: `SspProposer.group_size` 1, the step's mean reward as the baseline). Each
proposal is filtered by rule (`ssp.filter_question`, with its valid
searches counted in the model's dialect), then RAG-verified (one answer per question, `ssp.rag_passages`: own
results plus `ssp.noise_passages` of the others); each valid question gets n = `selfplay.solver_rollouts_train` Solver rollouts
with search; r_propose = 1 - their success rate (eq. 7), 0 for an invalid question. Stage 2 (line 10) trains the
Solver on Stage 1's valid questions, slots they leave empty filled from the replay buffer (App. B.1, "Periodic
Reset": the buffer holds the valid questions of the Proposer's steps since the last reset, every
`ssp.replay_reset_steps` steps), r_solve = 1[correct] (eq. 6); a new question's group is the n rollouts that scored
its Proposer (`ssp.solver_samples: shared`), a buffer question's G new ones.

Where we differ from the paper (docs/methods.md, "SSP's loop"): the Proposer's REINFORCE subtracts the step's mean
reward (eq. 5 has none); the roles' updates are two stages, not one joint step (the shared core trains one role per
stage), so the buffer refreshes once per iteration.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scope_lib.config import Params, ParamsError
from scope_lib.protocol import ssp
from scope_lib.protocol.answer_set import (
    Answer,
    corpus_answers,
    evaluation_folders,
    read_answer_file,
    sample_answers,
)
from scope_lib.protocol.verification import normalize_answer
from scope_lib.retrieval.corpus import document_range
from scope_lib.runs import read_jsonl, write_jsonl
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
from scope_lib.selfplay.judge import ANSWER_MATCH
from scope_lib.selfplay.rollout import (
    RolloutLimits,
    RolloutStats,
    Trajectory,
    apportion,
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

#: The replay buffer is cleared every this many Proposer steps (App. B.1, "Replay Buffer (Periodic Reset)": 10), the
#: default of `ssp.replay_reset_steps`.
REPLAY_RESET_STEPS = 10
#: Why a proposal that passed the rule filters is invalid: the RAG Solver did not answer it correctly (eq. 3).
RAG_REJECTED = "rag_rejected"
#: What decided an answer (`Verdict.check`): the rule, the judge, the judge's unparseable reply (wrong), or no answer
#: to judge (wrong, no judge call).
ANSWER_CHECKS: tuple[str, ...] = ("rule", "judge", "judge_unparseable", "no_answer")


@dataclass(frozen=True)
class Verdict:
    """r(a, a*) for one answer and the check that decided it (one of ANSWER_CHECKS)."""

    correct: bool
    check: str


def check_answers(ctx: StageContext, questions: list[str], predictions: list[str | None], answers: list[str]
                  ) -> list[Verdict]:
    """r(a, a*) for a batch of Solver answers as `ssp.answer_check` says (eq. 6's 1[a = a*], eq. 3's check): the
    paper's LLM judge (§3.2, App. E) in one call for every answer of the batch (an empty or missing answer is wrong
    without asking; an unparseable verdict is wrong), or the rule (`protocol.ssp.answer_correct`)."""
    if ctx.params.ssp.answer_check == "rule":
        return [Verdict(ssp.answer_correct(p, a), "rule") for p, a in zip(predictions, answers, strict=True)]
    asked = [i for i, p in enumerate(predictions) if isinstance(p, str) and p.strip()]
    judged = dict(zip(asked, ctx.judge.answers_match([questions[i] for i in asked], [predictions[i] for i in asked],
                                                     [answers[i] for i in asked]), strict=True))
    return [Verdict(False, "no_answer") if i not in judged else
            Verdict(False, "judge_unparseable") if judged[i] is None else Verdict(judged[i] == 1, "judge")
            for i in range(len(predictions))]


def unparseable(checks) -> int:
    """How many answers of these `Verdict.check`s the judge's unparseable reply decided."""
    return sum(check == "judge_unparseable" for check in checks)


@dataclass(frozen=True)
class ProposerPrompt:
    """One ground truth a* for the Proposer: its text, its kind and where it came from (`answer_set.Answer`: a
    document id, or file:line), and the search chain's length the prompt asks for (the paper's n of its prompt)."""

    id: str
    answer: str
    kind: str
    document_id: str
    num_searches: int


@dataclass(frozen=True)
class SspQuestion:
    """A valid question: the proposal that wrote it (`id`), its gold answer, and the Proposer's global step that
    wrote it, (iteration - 1) x Proposer steps + step, which decides when the replay buffer drops it."""

    id: str
    question: str
    answer: str
    iteration: int
    global_step: int


@dataclass(frozen=True)
class SolverTask:
    """A question of the Solver's stage and, with `ssp.solver_samples: shared` for a question new this iteration, the
    n Solver rollouts that scored its Proposer (Stage 1's `solver_rollouts` records: the trajectory and its verdict):
    its GRPO group (Algorithm 1 line 10)."""

    question: SspQuestion
    rollouts: tuple[dict[str, Any], ...] = ()


def check_params(params: Params) -> None:
    """SSP's settings that must agree, checked before a stage runs."""
    n, g = params.selfplay.solver_rollouts_train, params.grpo.group_size
    if params.ssp.solver_samples == "shared" and n != g:
        raise ParamsError(f"ssp.solver_samples: shared trains the Solver on the n rollouts that scored the Proposer as "
                          f"its group of G (Algorithm 1 line 10), but selfplay.solver_rollouts_train (n) is {n} and "
                          f"grpo.group_size (G) is {g}: make them equal, or set ssp.solver_samples: fresh")


def proposer_prompts(answers: list[Answer], strata: list[int], seed: int, id_prefix: str) -> list[ProposerPrompt]:
    """One Proposer prompt per answer, each with a search-chain length of 1, 2, 3, ... apportioned by `strata` and
    shuffled."""
    searches = apportion(len(answers), strata, seed + 1)
    return [ProposerPrompt(f"{id_prefix}{i}", a.text, a.kind, a.source, s + 1)
            for i, (a, s) in enumerate(zip(answers, searches, strict=True))]


def evaluation_data(params: Params) -> tuple[list[Path], list[str], list[str]]:
    """What the answer file must stay clear of: the evaluation folders and `evaluation.data_files`, and the questions
    and gold answers of those files' JSONL records ("question"; "golden_answers", "answers" or "answer")."""
    files = [params.data_dir / f for value in params.evaluation.data_files.values()
             for f in ([value] if isinstance(value, str) else value)]
    questions: list[str] = []
    answers: list[str] = []
    for path in files:
        if path.suffix != ".jsonl" or not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # not a JSONL record: its folder is guarded all the same
                continue
            if not isinstance(record, dict):
                continue
            if isinstance(record.get("question"), str):
                questions.append(record["question"])
            golds = record.get("golden_answers") or record.get("answers") or record.get("answer")
            answers += [str(g) for g in ([golds] if isinstance(golds, str | int | float) else golds or [])]
    return evaluation_folders(params.data_dir, files), questions, answers


def file_answers(params: Params) -> list[Answer]:
    """`ssp.answer_file`'s answers in the run's seeded order, after the evaluation guard (`read_answer_file`)."""
    path = Path(params.ssp.answer_file)
    paths, questions, golds = evaluation_data(params)
    answers = read_answer_file(path if path.is_absolute() else params.data_dir / path, evaluation_paths=paths,
                               evaluation_questions=questions, evaluation_answers=golds)
    return sample_answers(answers, len(answers), params.selfplay.seed)


def iteration_answers(r: SelfPlayRun, t: int) -> tuple[list[Answer], dict[str, list[int]]]:
    """Iteration t's `selfplay.challenger_prompts` answers and where they came from, for the stage's summary: the
    corpus rule over the next fresh documents (`documents`: their range in the run's permutation), or the next
    positions of the answer file's seeded order (`answer_positions`, wrapping round)."""
    n = r.params.selfplay.challenger_prompts
    previous = r.stage(t - 1, "challenger").summary if t > 1 else {}
    if r.params.ssp.answer_file:
        answers = file_answers(r.params)
        start = previous.get("answer_positions", [0, 0])[1]
        return [answers[(start + j) % len(answers)] for j in range(min(n, len(answers)))], {
            "answer_positions": [start, start + min(n, len(answers))]}
    start = documents_start(r, t, "challenger")
    documents = document_range(r.passages, start, n, r.params.selfplay.seed, limit=r.training_documents)
    return corpus_answers(documents, n, stage_seed(r.params, t, "challenger")), {
        "documents": [start, start + len(documents)]}


# -- the replay buffer (App. B.1) -------------------------------------------------------------------------------


def replay_period(global_step: int, reset_steps: int = REPLAY_RESET_STEPS) -> int:
    """Which buffer a Proposer step (1, 2, ...) fills: steps 1-10 the first, 11-20 the second (cleared in between)."""
    if global_step < 1:
        raise ValueError(f"global steps count from 1, got {global_step}")
    return (global_step - 1) // reset_steps


def refill_buffer(kept: list[SspQuestion], new: list[SspQuestion], now: int,
                  reset_steps: int = REPLAY_RESET_STEPS) -> list[SspQuestion]:
    """The replay buffer after Proposer step `now`: the questions of `kept` and `new` written in `now`'s period
    (the rest were cleared by a reset), each question text once (the first kept)."""
    period = replay_period(now, reset_steps)
    buffer: dict[str, SspQuestion] = {}
    for q in [*kept, *new]:
        if replay_period(q.global_step, reset_steps) == period:
            buffer.setdefault(normalize_answer(q.question), q)
    return list(buffer.values())


def training_questions(new: list[SspQuestion], buffer: list[SspQuestion], slots: int, seed: int
                       ) -> list[SspQuestion]:
    """The Solver stage's questions: every new valid question (each text once), then, for the slots they leave
    empty, questions drawn from the buffer without replacement (seeded; App. B.1: "invalid slots are filled by
    sampling from the buffer"). Never a question twice."""
    chosen: dict[str, SspQuestion] = {}
    for q in new:
        chosen.setdefault(normalize_answer(q.question), q)
    older = [q for q in buffer if normalize_answer(q.question) not in chosen]
    for q in random.Random(f"{seed}/ssp/replay").sample(older, min(len(older), max(0, slots - len(chosen)))):
        chosen[normalize_answer(q.question)] = q
    return list(chosen.values())


def question_record(q: SspQuestion) -> dict[str, Any]:
    return dataclasses.asdict(q)


def question_from_record(record: dict[str, Any]) -> SspQuestion:
    return SspQuestion(**{f.name: record[f.name] for f in dataclasses.fields(SspQuestion)})


# -- the roles' rollouts ---------------------------------------------------------------------------------------


def _one_turn(limits: RolloutLimits) -> RolloutLimits:
    """No search: the RAG Solver answers in one turn."""
    return dataclasses.replace(limits, max_turns=1)


def proposer_steps(params: Params) -> int:
    """The Proposer's training steps per iteration (`selfplay.challenger_steps`, else `steps_per_role`)."""
    return params.selfplay.challenger_steps or params.selfplay.steps_per_role


def solver_trajectory(ctx: StageContext, traj_id: str, question: str, meta: dict[str, Any]) -> Trajectory:
    """The Solver's rollout: the question, search allowed up to `solver.max_searches` (Search-R1's prompt, App. E)."""
    searches = ctx.params.solver.max_searches
    content = ssp.solver_prompt(question, searches, ctx.dialect.search_example, ctx.dialect.results_description)
    return new_trajectory(traj_id, "solver", [{"role": "user", "content": content}], ctx.policy.tokenizer,
                          max_searches=searches, meta=meta)


def rag_trajectory(ctx: StageContext, traj_id: str, question: str, passages: list[str],
                   meta: dict[str, Any]) -> Trajectory:
    """RAG verification's rollout: the Solver without search, the passages before the question (eq. 2-3)."""
    return new_trajectory(traj_id, "solver", [{"role": "user", "content": ssp.rag_solver_prompt(question, passages)}],
                          ctx.policy.tokenizer, max_searches=0, meta=meta)


def _solver_seed(ctx: StageContext, step: int, offset: int) -> int:
    return ctx.seed * 1000 + offset + step + 100_000 * ranks.rank()


def batch_baseline(rewards: list[float | None]) -> float:
    """REINFORCE's baseline for one Proposer step: the mean reward of the step's proposals that ran (on this rank),
    0 when none did. Subtracting it leaves eq. 5's gradient unbiased and centres it: with one proposal per answer
    there is no group to centre by."""
    scored = [r for r in rewards if r is not None]
    return sum(scored) / len(scored) if scored else 0.0


@dataclass
class Proposal:
    """What became of one Proposer rollout in its step (Algorithm 1 lines 3-8): its question, the first rule filter
    it broke, its RAG verification and the Solver's n outcomes. A rollout that never ran has no question to judge."""

    trajectory: Trajectory
    ran: bool
    question: str | None = None
    filter_reason: str | None = None
    rag: Trajectory | None = None            # the RAG Solver's answer, for a question that passed the filters
    rag_verified: bool | None = None
    solvers: list[Trajectory] = dataclasses.field(default_factory=list)

    @property
    def answer(self) -> str:
        return self.trajectory.meta["answer"]

    @property
    def solved(self) -> list[bool] | None:
        """The Solver's n outcomes, for a valid question (None otherwise)."""
        return [s.meta["correct"] for s in self.solvers] if self.rag_verified else None

    @property
    def invalid_reason(self) -> str | None:
        if not self.ran:
            return "never_ran"
        return self.filter_reason or (None if self.rag_verified else RAG_REJECTED)

    @property
    def reward(self) -> float | None:
        """r_propose (eq. 7): 1 - the Solver's success rate; 0 for an invalid question; None when it never ran."""
        return ssp.proposer_reward(self.solved or [], self.solved is not None) if self.ran else None

    def record(self, iteration: int, step: int) -> dict[str, Any]:
        t = self.trajectory
        return {"id": t.id, "iteration": iteration, "step": step, "reward": self.reward, "answer": self.answer,
                "answer_kind": t.meta["answer_kind"], "document_id": t.meta["document_id"],
                "num_searches": t.meta["num_searches"], "n_valid_searches": t.n_valid_searches,
                "question": self.question, "valid": self.solved is not None if self.ran else None,
                "invalid_reason": self.invalid_reason, "filter_reason": self.filter_reason,
                "rag_verified": self.rag_verified, "rag_answer": self.rag.answer if self.rag else None,
                "solved": self.solved, "success_rate": mean_of(self.solved) if self.solved else None,
                "trajectory": t.to_record()}


class SspProposer:
    """Stage 1's rules: the Proposer sees a ground-truth answer and searches (App. E); its proposals are filtered,
    RAG-verified and tried n times by the Solver; r_propose (eq. 7). The Proposer's rollouts follow the rollout
    machinery's answer protocol (search until a turn makes no search); its question is read from its last turn."""

    extra_records = ("rag_rollouts", "solver_rollouts")
    searches = True
    group_size = 1  # REINFORCE with one proposal per answer (eq. 5, Table 4): the rewards below are the advantages

    def limits(self, params: Params) -> RolloutLimits:
        return challenger_limits(params)  # the Proposer's budgets are the task writer's (challenger.*)

    def new_trajectory(self, ctx: StageContext, item_id: str, item: ProposerPrompt, traj_id: str) -> Trajectory:
        content = ssp.proposer_prompt(item.answer, item.num_searches, ctx.dialect.search_example,
                                      ctx.dialect.results_description)
        return new_trajectory(traj_id, "solver", [{"role": "user", "content": content}], ctx.policy.tokenizer,
                              max_searches=item.num_searches,
                              meta={"prompt_id": item.id, "answer": item.answer, "answer_kind": item.kind,
                                    "document_id": item.document_id, "num_searches": item.num_searches})

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        proposals = [Proposal(t, ran=not never_ran(t)) for t in trajectories]
        for p in proposals:
            if p.ran:  # the rule filters (§3.3), valid searches counted in the dialect
                p.question = ssp.extract_question(p.trajectory.turns[-1] if p.trajectory.turns else "",
                                                  starts_in_think=p.trajectory.opens_think)
                p.filter_reason = ssp.filter_question(p.question, p.answer, p.trajectory.n_valid_searches)
        rag_s = self._verify(ctx, proposals, step)
        solvers = [s for p in proposals if p.rag_verified for s in self._solvers(ctx, p)]
        stats = None
        if solvers:  # Algorithm 1 lines 5-7: n Solver rollouts with search per valid question
            limits = solver_limits(ctx.params)
            limits.seed = _solver_seed(ctx, step, 500)
            stats = run_rollouts(solvers, ctx.rollout_engine, ctx.retriever, ctx.dialect, limits,
                                 adapter=ctx.solver_adapter)
        pairs = [(p, s) for p in proposals for s in p.solvers]
        verdicts = check_answers(ctx, [p.question for p, _ in pairs], [s.answer for _, s in pairs],
                                 [p.answer for p, _ in pairs])
        for (_, s), v in zip(pairs, verdicts, strict=True):
            s.meta["correct"], s.meta["answer_check"] = v.correct, v.check
        rewards = [p.reward for p in proposals]
        baseline = batch_baseline(rewards)
        advantages = [None if r is None else r - baseline for r in rewards]
        self._write(session, step, proposals, baseline)
        ran = [p for p in proposals if p.ran]
        checked = [p.rag_verified for p in ran if p.rag_verified is not None]
        rates = [mean_of(p.solved) for p in ran if p.solved is not None]
        return advantages, {
            **reward_stats(rewards), "baseline": baseline,
            "valid_rate": mean_of([p.solved is not None for p in ran]) if ran else None,
            "filter_pass_rate": mean_of([p.filter_reason is None for p in ran]) if ran else None,
            "rag_pass_rate": mean_of(checked) if checked else None,
            "solver_success": mean_of(rates) if rates else None,
            "zero_spread_tasks": mean_of([r in (0.0, 1.0) for r in rates]) if rates else None,
            "rag_rollouts": len(checked), "solver_rollouts": len(solvers),
            "answers_unparseable": unparseable(t.meta["answer_check"] for p in proposals
                                               for t in [p.rag, *p.solvers] if t is not None),
            "solver_rollout_s": (stats.total_s if stats else 0.0) + rag_s,
            "solver_stops_in_thinking": stats.stops_in_thinking if stats else 0}

    @staticmethod
    def _verify(ctx: StageContext, proposals: list[Proposal], step: int) -> float:
        """RAG verification (eq. 3) of every proposal that passed the rule filters, in place: one no-search Solver
        answer from its own retrieved results plus noise results of the batch's other rollouts (`ssp.rag_passages`),
        checked against its answer (`check_answers`, one call for the step). Returns the seconds it took."""
        batch_passages = [p.trajectory.evidence for p in proposals]
        for i, p in enumerate(proposals):
            if p.ran and p.filter_reason is None:
                passages = ssp.rag_passages(batch_passages, i, n_noise=ctx.params.ssp.noise_passages,
                                            seed=f"{ctx.seed}/{step}")
                own = sum(passage in p.trajectory.evidence for passage in passages)
                p.rag = rag_trajectory(ctx, f"{p.trajectory.id}/rag", p.question, passages,
                                       {"question_id": p.trajectory.id, "own_passages": own,
                                        "noise_passages": len(passages) - own})
        checked = [p for p in proposals if p.rag is not None]
        if not checked:
            return 0.0
        limits = _one_turn(solver_limits(ctx.params))
        limits.seed = _solver_seed(ctx, step, 700)
        stats = run_rollouts([p.rag for p in checked], ctx.rollout_engine, ctx.retriever, ctx.dialect, limits,
                             adapter=ctx.solver_adapter)
        verdicts = check_answers(ctx, [p.question for p in checked], [p.rag.answer for p in checked],
                                 [p.answer for p in checked])
        for p, v in zip(checked, verdicts, strict=True):
            p.rag_verified, p.rag.meta["answer_check"] = v.correct, v.check
        return stats.total_s

    @staticmethod
    def _solvers(ctx: StageContext, p: Proposal) -> list[Trajectory]:
        p.solvers = [solver_trajectory(ctx, f"{p.trajectory.id}/s{j}", p.question, {"question_id": p.trajectory.id})
                     for j in range(ctx.params.selfplay.solver_rollouts_train)]
        return p.solvers

    @staticmethod
    def _write(session: RoleSession, step: int, proposals: list[Proposal], baseline: float) -> None:
        """The step's records: every proposal (its reward, the step's baseline and its advantage), the RAG Solver's
        answers, the n Solver rollouts (1-based step)."""
        iteration = session.ctx.iteration
        session.unwritten["rollouts"] = [
            {**p.record(iteration, step + 1), "baseline": baseline,
             "advantage": None if p.reward is None else p.reward - baseline} for p in proposals]
        session.unwritten["rag_rollouts"] = [
            {"id": p.rag.id, "iteration": iteration, "step": step + 1, "question_id": p.trajectory.id,
             "answer": p.rag.answer, "correct": p.rag_verified, "answer_check": p.rag.meta["answer_check"],
             "finish": p.rag.finish,
             "own_passages": p.rag.meta["own_passages"], "noise_passages": p.rag.meta["noise_passages"],
             "trajectory": p.rag.to_record()} for p in proposals if p.rag is not None]
        session.unwritten["solver_rollouts"] = [
            {"id": s.id, "iteration": iteration, "step": step + 1, "question_id": p.trajectory.id,
             "answer": s.answer, "correct": s.meta["correct"], "answer_check": s.meta["answer_check"],
             "trajectory": s.to_record()}
            for p in proposals for s in p.solvers]


class SspSolver:
    """Stage 2's rules: the Solver sees a valid question and searches; r_solve = 1[correct] (eq. 6). With
    `ssp.solver_samples: shared` a new question's rows are the n rollouts that scored its Proposer."""

    extra_records: tuple[str, ...] = ()
    searches = True

    def limits(self, params: Params) -> RolloutLimits:
        return solver_limits(params)

    def new_trajectory(self, ctx: StageContext, item_id: str, item: SolverTask, traj_id: str) -> Trajectory:
        return solver_trajectory(ctx, traj_id, item.question.question, {"task_id": item_id})

    def draw_rollouts(self, session: RoleSession, trajectories: list[Trajectory], limits: RolloutLimits, step: int
                      ) -> tuple[list[Trajectory], RolloutStats]:
        """Row j of a question with stored rollouts (its id ends in /g<j>) is the j-th of them, under the row's id
        (`sampled_as` names it), with the verdict that scored the Proposer (`correct`, `answer_check`: Algorithm 1
        line 10 reuses the rollouts and their rewards; a record written before `answer_check` existed was checked by
        rule); the other rows (replay buffer questions, `fresh`) are rolled out now."""
        ctx = session.ctx
        fresh = [t for t in trajectories if not session.items[t.meta["task_id"]].rollouts]
        stats = run_rollouts(fresh, ctx.rollout_engine, ctx.retriever, ctx.dialect, limits,
                             adapter=ctx.role) if fresh else RolloutStats()
        out = []
        for t in trajectories:
            stored = session.items[t.meta["task_id"]].rollouts
            if not stored:
                out.append(t)
                continue
            rec = stored[int(t.id.rsplit("/g", 1)[1]) % len(stored)]
            sampled = Trajectory.from_record(rec["trajectory"])
            out.append(dataclasses.replace(sampled, id=t.id, meta={
                **t.meta, "sampled_as": sampled.id, "correct": rec["correct"],
                "answer_check": rec.get("answer_check", "rule")}))
        return out, stats

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        ctx = session.ctx
        ran = [t for t in trajectories if not never_ran(t)]
        verdicts = {t.id: Verdict(t.meta["correct"], t.meta["answer_check"]) for t in ran if "sampled_as" in t.meta}
        new = [t for t in ran if t.id not in verdicts]   # rows rolled out now: checked now, in one call
        asked = [session.items[t.meta["task_id"]].question for t in new]
        verdicts |= dict(zip([t.id for t in new], check_answers(ctx, [q.question for q in asked],
                                                                [t.answer for t in new], [q.answer for q in asked]),
                             strict=True))
        correct = {i: v.correct for i, v in verdicts.items()}
        values = [ssp.solver_reward(correct[t.id]) if t.id in correct else None for t in trajectories]
        session.unwritten["rollouts"] = [
            {"id": t.id, "iteration": ctx.iteration, "step": step + 1, "task_id": t.meta["task_id"], "reward": value,
             "from_buffer": session.items[t.meta["task_id"]].question.iteration < ctx.iteration,
             "sampled_as": t.meta.get("sampled_as"), "answer": t.answer, "correct": correct.get(t.id),
             "answer_check": verdicts[t.id].check if t.id in verdicts else None, "trajectory": t.to_record()}
            for t, value in zip(trajectories, values, strict=True)]
        return values, {**reward_stats(values), "pass_rate": mean_of(correct.values()) if correct else None,
                        "answer_rate": mean_of([t.answer is not None for t in trajectories]),
                        "answers_unparseable": unparseable(v.check for v in verdicts.values())}


# -- the stages -------------------------------------------------------------------------------------------------


def train_proposer(r: SelfPlayRun, t: int) -> dict:
    """Stage 1: REINFORCE on r_propose over `selfplay.challenger_prompts` answers (fresh documents, or the file)."""
    stage = r.stage(t, "challenger")
    if stage.done:
        return stage.summary
    check_params(r.params)
    answers, source = iteration_answers(r, t)
    if not answers:
        raise RuntimeError(f"iteration {t}: no answer for the Proposer ({source}): the corpus rule found none in these "
                           "documents (raise selfplay.challenger_prompts), or ssp.answer_file kept none")
    reset_stage(r, t, stage)
    publish_roles(r, t, "challenger", ("solver",))  # the Solver verifies and answers the Proposer's questions
    prompts = proposer_prompts(answers, r.params.selfplay.search_turn_strata, stage_seed(r.params, t, "challenger"),
                               id_prefix=f"i{t:02d}-a")
    result = train_role(stage_context(r, t, "challenger", stage), {p.id: p for p in prompts})
    attempts = [rec for rec in stage.records("rollouts") if rec["valid"] is not None]
    valid = sum(rec["valid"] for rec in attempts)
    checked = [rec["rag_verified"] for rec in attempts if rec["rag_verified"] is not None]
    rates = [rec["success_rate"] for rec in attempts if rec["success_rate"] is not None]
    answer_checks = Counter(rec.get("answer_check", "rule")   # records written before the option: by rule
                            for name in ("rag_rollouts", "solver_rollouts") for rec in stage.records(name))
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2),
               **source, "answers": len(prompts), "saved": result.saved.name,
               "reward": [m.get("reward") for m in result.metrics], "attempts": len(attempts), "valid": valid,
               "valid_rate": valid / len(attempts) if attempts else 0.0,
               "invalid_reasons": dict(Counter(rec["invalid_reason"] for rec in attempts if not rec["valid"])),
               "rag_checked": len(checked), "rag_passed": sum(checked),
               "rag_pass_rate": sum(checked) / len(checked) if checked else None,
               "solver_success": mean_of(rates) if rates else None,
               "zero_spread_tasks": mean_of([x in (0.0, 1.0) for x in rates]) if rates else None,
               "answer_checks": dict(answer_checks)}
    consequence = "the Solver trains only on the replay buffer's questions this iteration, if it holds any"
    for alarm in health.check_valid_tasks({**summary, "iteration": t}, writer="Proposer", consequence=consequence):
        r.alarms.append(alarm)
        if ranks.is_main():
            health.report(alarm, r.run_dir)
    mark_done(stage, summary, result.saved)
    return summary


def new_questions(records, t: int, steps: int) -> list[SspQuestion]:
    """Stage 1's valid questions of iteration t, in record order, each question text once (the first)."""
    found: dict[str, SspQuestion] = {}
    for rec in records:
        if rec.get("valid"):
            found.setdefault(normalize_answer(rec["question"]),
                             SspQuestion(rec["id"], rec["question"], rec["answer"], t, (t - 1) * steps + rec["step"]))
    return list(found.values())


def solver_tasks(r: SelfPlayRun, t: int, questions: list[SspQuestion]) -> dict[str, SolverTask]:
    """The Solver stage's rows by id; with `ssp.solver_samples: shared`, each question new this iteration carries
    the n Solver rollouts that scored its Proposer (Stage 1's `solver_rollouts`, in their order)."""
    stored: dict[str, list[dict[str, Any]]] = {}
    if r.params.ssp.solver_samples == "shared":
        for rec in r.stage(t, "challenger").records("solver_rollouts"):
            stored.setdefault(rec["question_id"], []).append(rec)
    return {q.id: SolverTask(q, tuple(stored.get(q.id, ())) if q.iteration == t else ()) for q in questions}


def replay_buffer(r: SelfPlayRun, t: int) -> list[SspQuestion]:
    """The replay buffer iteration t left (its Solver stage's `replay_buffer.jsonl`); empty before iteration 1."""
    if t < 1:
        return []
    path = r.stage(t, "solver").path / "replay_buffer.jsonl"
    if not r.stage(t, "solver").done:
        raise RuntimeError(f"iteration {t}'s Solver stage is not finished; run the iterations in order")
    return [question_from_record(rec) for rec in read_jsonl(path)] if path.is_file() else []


def train_solver(r: SelfPlayRun, t: int) -> dict:
    """Stage 2: GRPO on r_solve over Stage 1's valid questions and the replay buffer's, G rollouts with search each."""
    stage = r.stage(t, "solver")
    if stage.done:
        return stage.summary
    check_params(r.params)
    reset_stage(r, t, stage)
    steps = proposer_steps(r.params)
    now = t * steps  # the Proposer's last global step so far
    new = new_questions(r.stage(t, "challenger").records("rollouts"), t, steps)
    reset = r.params.ssp.replay_reset_steps
    before = refill_buffer(replay_buffer(r, t - 1), [], now, reset)  # what a reset since then has not cleared
    slots = r.params.selfplay.steps_per_role * r.params.solver.batch_size
    questions = training_questions(new, before, slots, stage_seed(r.params, t, "solver"))
    buffer = refill_buffer(before, new, now, reset)
    if ranks.is_main():  # stored, so that the next iteration (or a resumed run) starts from it
        write_jsonl(stage.path / "replay_buffer.jsonl", [question_record(q) for q in buffer])
    ranks.barrier()
    replay = {"period": replay_period(now, reset), "new": len(new), "from_buffer": sum(q.iteration < t for q in questions),
              "buffer": len(buffer)}
    if not questions:
        summary = {"skipped": "no valid question", "steps": 0, "questions": 0, "replay": replay,
                   "note": "no valid question this iteration and none in the replay buffer; the Solver keeps its "
                           "weights (see the alarms)"}
        mark_done(stage, summary)
        return summary
    result = train_role(stage_context(r, t, "solver", stage), solver_tasks(r, t, questions))
    summary = trained_summary(result, "pass_rate", "answers_unparseable", questions=len(questions), replay=replay,
                              samples=r.params.ssp.solver_samples)
    mark_done(stage, summary, result.saved)
    return summary


class Ssp(Method):
    """SSP's two stages per iteration and its two roles' rules (the Proposer trains as the `challenger` role)."""

    name = "ssp"
    roles = {"challenger": SspProposer(), "solver": SspSolver()}

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return (StageSpec("challenger", train_proposer, trains="challenger"),
                StageSpec("solver", train_solver, trains="solver"))

    def judge_stages(self, params: Params) -> frozenset[str]:
        """The LLM judge's Correct/Wrong (`Judge.answers_match`) when `ssp.answer_check` is judge; by rule, none."""
        return frozenset({ANSWER_MATCH}) if params.ssp.answer_check == "judge" else frozenset()


SSP = Ssp()
