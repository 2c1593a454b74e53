"""Self-play pieces shared by Stage 1 (Challenger reward) and Stage 2 (task filter, Solver reward).

`evaluate_tasks` is Algorithm 1 lines 7-12 and 21-24 for a whole batch: Challenger format score, quality
gates, rubrics, N Solver rollouts, per-rubric grades, the mean rubric score g-bar and R_C (eq. 4, 5).
`solver_rewards` is R_S (eq. 6, 7) for graded Solver rollouts. Every model call is batched: one engine call
per rollout turn, one Judge call per stage.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from scope_lib import rewards
from scope_lib.config import Params, ParamsError
from scope_lib.dialects import Dialect
from scope_lib.engines import Engine
from scope_lib.judge import Judge
from scope_lib.parsing import Rubric
from scope_lib.retrieval import Retriever
from scope_lib.rollout import (
    ChallengerPrompt,
    RolloutLimits,
    RolloutStats,
    Trajectory,
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
    valid, malformed = dialect.count_searches(traj.turns)
    return rewards.challenger_format(traj.turns, traj.expected_searches or 0, valid, malformed, traj.task,
                                     starts_in_think=traj.opens_think)


def solver_format(traj: Trajectory, dialect: Dialect) -> rewards.FormatScore:
    """F.2: think, tool (non-final turns) and answer components."""
    valid_nonfinal, _ = dialect.count_searches(traj.turns[:-1])
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

    # N Solver rollouts per task with rubrics, all in one batched rollout.
    ready = [e for e in passed if e.rubrics]
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

    temperature = grading_temperature
    if temperature is None:
        temperature = params.judge.difficulty_grading_temperature
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
                                             target=c.difficulty_target, shape=c.reward_shape)
    return evals, graded, stats


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
        n_searches, _ = dialect.count_searches(traj.turns)  # F.2: well-formed searches in ALL turns
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


# -- Algorithm 1: iterations of three stages ----------------------------------------------------------------
#
# runs/<name>/iter_NN/challenger/  rollouts, solver_rollouts, metrics, adapter (or model), DONE   Stage 1
# runs/<name>/iter_NN/pool/        candidates, chunks, tasks, DONE                                 Stage 2
# runs/<name>/iter_NN/solver/      rollouts, metrics, adapter (or model), DONE                     Stage 3
#
# A finished stage (DONE) is skipped. A training stage that was interrupted restarts from its own start: its
# folder is cleared and the role's weights are those of the last finished stage (loaded from disk in a new
# process). The task pool resumes batch by batch: a candidate batch counts once its marker is in
# chunks.jsonl; records of an unfinished batch are dropped and the batch is redone, so nothing is lost or
# duplicated. Every stage has its own seed, so a resumed run writes the same records as an uninterrupted one.

STAGE_OFFSETS = {"challenger": 1, "pool": 2, "solver": 3}


def stage_seed(params: Params, iteration: int, stage: str) -> int:
    """The seed of one stage of one iteration (data order, rollouts, trainer)."""
    return params.selfplay.seed + 10 * (iteration - 1) + STAGE_OFFSETS[stage]


@dataclass
class SelfPlayRun:
    """Everything Algorithm 1 works with, loaded once per process."""

    params: Params
    passages: list
    retriever: Retriever
    dialect: Dialect
    policy: Any          # scope_lib.training.Policy
    judge: Judge
    engine: Engine       # rollouts of both roles (the policy's engine unless a test gives another)
    alarms: list[dict] = field(default_factory=list)

    @property
    def run_dir(self):
        return self.params.run_dir

    def stage(self, iteration: int, name: str):
        from scope_lib.runs import Stage, iteration_dir

        return Stage(iteration_dir(self.run_dir, iteration) / name)


def open_run(params: Params, *, engine: Engine | None = None, judge: Judge | None = None,
             retriever: Retriever | None = None, policy=None) -> SelfPlayRun:
    """Load the corpus, index, policy (restoring the newest saved roles) and Judge; write the manifest."""
    from scope_lib.corpus import read_corpus
    from scope_lib.dialects import get_dialect
    from scope_lib.engines import make_engine
    from scope_lib.judge import judge_models, make_judge
    from scope_lib.retrieval import check_index, open_retriever
    from scope_lib.runs import write_manifest
    from scope_lib.training import Policy

    r = params.retrieval
    passages = read_corpus(params.corpus_path, on_error=r.on_error, max_passages=r.max_passages).passages
    retriever = retriever or open_retriever(params)
    report = check_index(params, retriever=retriever)  # before any GPU hour: canaries, fingerprints, results
    log.info("%s", report.table())
    report.raise_if_failed()
    if engine is None and params.engine.backend != "hf" and params.model.finetuning == "full":
        raise ParamsError("model.finetuning: full trains separate weights per role, which a LoRA-serving engine "
                          "cannot generate from: use engine.backend: hf, or LoRA (model.finetuning: lora)")
    policy = policy or Policy.load(params)
    if engine is None:
        # hf: generate with the model being trained. vllm / openai: a serving engine over M0 that generates for
        # each role from its published adapter (adapter-only sync every step, importance-sampling correction)
        engine = policy.engine if params.engine.backend == "hf" else make_engine(params, "policy",
                                                                                 tokenizer=policy.tokenizer)
    if judge is None:
        judges: dict[str, Engine] = {}

        def engine_for(name: str) -> Engine:
            if name == params.model.base:
                return engine  # the Judge is M0: the policy engine with adapters off
            if name not in judges:  # another Judge model (judge scaling): its own engine, often a served one
                judges[name] = make_engine(params, "judge", name=name)
            return judges[name]

        judge = make_judge(params, engine_for)
    fingerprint = getattr(retriever, "fingerprint", None)  # chroma: corpus, embedder and index settings
    write_manifest(params.run_dir, params.to_yaml(), science=science_yaml(params), model=params.model.base,
                   finetuning=params.model.finetuning,
                   seeds={"selfplay": params.selfplay.seed, "grpo": params.grpo.seed},
                   judge_models=judge_models(params), index=fingerprint,
                   corpus={"path": str(params.corpus_path), "passages": len(passages),
                           "sha256": (fingerprint or {}).get("corpus_sha256")})
    run = SelfPlayRun(params, passages, retriever, get_dialect(params.model.dialect, params.model.base), policy,
                      judge, engine)
    _restore_roles(run)
    return run


def science_yaml(params: Params) -> str:
    """The parameters that decide training results: everything but `run` (names and folders, so a run folder
    can be moved and still resume) and `evaluation` (how checkpoints are measured afterwards)."""
    import yaml

    return yaml.safe_dump({k: v for k, v in params.model_dump(mode="json").items() if k not in ("run", "evaluation")},
                          sort_keys=True)


def _restore_roles(run: SelfPlayRun) -> None:
    """Load each role's newest finished checkpoint (a new process resuming, or a later iteration)."""
    from scope_lib.training import ROLES

    for role in ROLES:
        for t in range(run.params.selfplay.iterations, 0, -1):
            stage = run.stage(t, role)
            saved = [stage.path / name for name in ("adapter", "model") if (stage.path / name).is_dir()]
            if stage.done and saved:
                run.policy.load_role(role, saved[0])
                break


def run(params: Params, *, iterations: int | None = None, **components) -> SelfPlayRun:
    """`scope train`: Algorithm 1 for `selfplay.iterations` iterations (or `iterations`), resuming a run
    that was interrupted. Returns the run (its alarms, its components)."""
    selfplay_run = open_run(params, **components)
    for t in range(1, (iterations or params.selfplay.iterations) + 1):
        run_iteration(selfplay_run, t)
    return selfplay_run


def run_iteration(r: SelfPlayRun, t: int) -> dict[str, dict]:
    """One iteration: Stage 1 (train the Challenger), Stage 2 (the task pool), Stage 3 (train the Solver)."""
    summaries = {"challenger": train_challenger(r, t), "pool": build_pool(r, t), "solver": train_solver(r, t)}
    log.info("iteration %d done: %s", t, {k: {n: v for n, v in s.items() if not isinstance(v, (list, dict))}
                                          for k, s in summaries.items()})
    return summaries


def publish_roles(r: SelfPlayRun, t: int, stage: str, roles: tuple[str, ...]) -> None:
    """Register the roles' current weights with a serving engine (vLLM, `vllm serve`) before a stage uses them;
    nothing to do when the engine generates with the trained model itself (hf)."""
    from scope_lib.training import serves_adapters

    if not serves_adapters(r.engine):
        return
    for role in roles:
        r.policy.publish(role, r.stage(t, stage).path / "serving" / role, r.engine)


def documents_start(r: SelfPlayRun, t: int) -> int:
    """Where iteration t's documents begin in the run's permutation: after everything earlier iterations used."""
    if t == 1:
        return 0
    previous = r.stage(t - 1, "pool").summary
    if "documents" not in previous:
        raise RuntimeError(f"iteration {t - 1}'s task pool is not finished; run the iterations in order")
    return previous["documents"][1]


def _stage_context(r: SelfPlayRun, t: int, role: str, stage):
    from scope_lib.training import StageContext

    return StageContext(r.params, t, role, r.policy, r.retriever, r.dialect, r.judge, stage,
                        seed=stage_seed(r.params, t, "challenger" if role == "challenger" else "solver"),
                        engine=r.engine, alarms=r.alarms)


def train_challenger(r: SelfPlayRun, t: int) -> dict:
    """Stage 1 (Algorithm 1 lines 4-17): GRPO on R_C against S_{t-1}, over fresh documents."""
    from scope_lib.corpus import document_range
    from scope_lib.rollout import make_challenger_prompts
    from scope_lib.training import train_role

    stage = r.stage(t, "challenger")
    if stage.done:
        return stage.summary
    start = documents_start(r, t)
    sp = r.params.selfplay
    if not sp.co_evolution and t > 1:
        summary = {"frozen_at": 1, "documents": [start, start],
                   "note": "selfplay.co_evolution is false: the Challenger stays at its iteration-1 checkpoint"}
        stage.mark_done(summary)
        return summary
    stage.reset()
    publish_roles(r, t, "challenger", ("solver",))  # S_{t-1} estimates the difficulty (the Challenger syncs itself)
    seed = stage_seed(r.params, t, "challenger")
    documents = document_range(r.passages, start, sp.challenger_prompts, sp.seed)
    prompts = make_challenger_prompts(documents, sp.task_types, sp.search_turn_strata, seed,
                                      tokenizer=r.policy.tokenizer, document_max_tokens=sp.document_max_tokens,
                                      id_prefix=f"i{t:02d}-c")
    result = train_role(_stage_context(r, t, "challenger", stage), {p.id: p for p in prompts})
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2),
               "documents": [start, start + len(documents)], "saved": result.saved.name,
               "reward": [m.get("reward") for m in result.metrics]}
    stage.mark_done(summary)
    return summary


def build_pool(r: SelfPlayRun, t: int) -> dict:
    """Stage 2 (Algorithm 1 lines 19-27, App. G): C_t writes candidate tasks over fresh documents, batch by
    batch; gates, rubrics, N_filter rollouts of S_{t-1} at the filter sampling; tasks with l <= g-bar <= u are
    kept, one per document, until `target_tasks` (or the documents, or `max_candidate_batches`, run out)."""
    from tqdm.auto import tqdm

    from scope_lib import health
    from scope_lib.corpus import document_range
    from scope_lib.rollout import challenger_trajectories, make_challenger_prompts

    stage = r.stage(t, "pool")
    if stage.done:
        return stage.summary
    p, sp = r.params, r.params.selfplay
    candidates, chunks, tasks = stage.records("candidates"), stage.records("chunks"), stage.records("tasks")
    finished = {c["chunk"] for c in chunks}
    candidates.retain(lambda rec: rec["chunk"] in finished)  # drop a batch a kill left half-written
    tasks.retain(lambda rec: rec["chunk"] in finished)
    first = r.stage(t, "challenger").summary["documents"][1]  # right after Stage 1's documents
    publish_roles(r, t, "pool", ("challenger", "solver"))    # C_t writes, S_{t-1} estimates the difficulty
    seed, size = stage_seed(p, t, "pool"), sp.candidate_batch_size
    k = len(finished)
    available = max(0, (len(r.passages) - first) // size)  # whole batches of unused documents
    limit = min(available, sp.max_candidate_batches) if sp.max_candidate_batches else available
    bar = tqdm(total=sp.target_tasks, initial=min(len(tasks), sp.target_tasks), desc=f"iteration {t} task pool",
               unit="task", leave=False)
    while len(tasks) < sp.target_tasks and k < limit:
        started, judge_before = time.perf_counter(), r.judge.stats.totals()
        documents = document_range(r.passages, first + k * size, size, sp.seed)
        prompts = make_challenger_prompts(documents, sp.task_types, sp.search_turn_strata, seed * 1000 + k,
                                          tokenizer=r.policy.tokenizer, document_max_tokens=sp.document_max_tokens,
                                          id_prefix=f"i{t:02d}-p{k:04d}-")
        trajectories = challenger_trajectories(prompts, r.dialect, r.policy.tokenizer)
        limits = challenger_limits(p)
        limits.seed = seed * 1000 + k
        written = run_rollouts(trajectories, r.engine, r.retriever, r.dialect, limits, adapter="challenger")
        evals, _graded, solved = evaluate_tasks(
            trajectories, {q.id: q for q in prompts}, params=p, judge=r.judge, solver_engine=r.engine,
            retriever=r.retriever, dialect=r.dialect, n_solver=sp.solver_rollouts_filter, solver_adapter="solver",
            filtering=True, grading_temperature=p.judge.difficulty_grading_temperature, seed=seed * 1000 + 500 + k)
        kept = filter_tasks(evals, sp.difficulty_window, sp.tasks_per_document)
        room = sp.target_tasks - len(tasks)
        kept_ids = {e.challenger_id for e in kept[:room]}
        traj_by_id = {q.id: q for q in trajectories}
        candidates.append({"id": e.challenger_id, "chunk": k, "iteration": t, "kept": e.challenger_id in kept_ids,
                           "evaluation": e.to_record(), "trajectory": traj_by_id[e.challenger_id].to_record()}
                          for e in evals)
        tasks.append({**e.to_record(), "id": e.challenger_id, "iteration": t, "chunk": k}
                     for e in kept[:room])
        judge_after = r.judge.stats.totals()
        chunks.append([{"id": f"chunk-{k:04d}", "chunk": k, "candidates": len(evals),
                        "with_task": sum(e.task is not None for e in evals),
                        "passed_gates": sum(e.gates_passed for e in evals),
                        "in_window": len(kept), "kept": len(kept_ids),
                        "yield": len(kept) / len(evals) if evals else 0.0,
                        "engine_calls": written.engine_calls + solved.engine_calls,
                        "judge_calls": judge_after["calls"] - judge_before["calls"],
                        "time_total_s": time.perf_counter() - started,
                        "time_generation_s": written.generation_s + solved.generation_s,
                        "time_retrieval_s": written.retrieval_s + solved.retrieval_s,
                        "time_judge_s": judge_after["seconds"] - judge_before["seconds"]}])
        bar.update(len(kept_ids))
        k += 1
    bar.close()
    summary = {"tasks": len(tasks), "candidates": len(candidates), "chunks": k,
               "documents": [first, first + k * size],
               "yield": len(tasks) / len(candidates) if len(candidates) else 0.0,
               "stopped": "target" if len(tasks) >= sp.target_tasks else
               ("max_candidate_batches" if sp.max_candidate_batches and k >= sp.max_candidate_batches
                else "documents ran out")}
    for alarm in health.check_pool({**summary, "iteration": t}):
        r.alarms.append(alarm)
        health.report(alarm, r.run_dir)
    stage.mark_done(summary)
    return summary


def train_solver(r: SelfPlayRun, t: int) -> dict:
    """Stage 3 (Algorithm 1 lines 28-33): GRPO on R_S over iteration t's task pool."""
    from scope_lib.training import train_role

    stage = r.stage(t, "solver")
    if stage.done:
        return stage.summary
    stage.reset()
    pool = {rec["id"]: TaskEvaluation.from_record(rec) for rec in r.stage(t, "pool").records("tasks")}
    if not pool:
        summary = {"skipped": "empty task pool", "steps": 0,
                   "note": "no task survived the filter; the Solver keeps S_{t-1} (see the health alarms)"}
        log.warning("iteration %d: the task pool is empty; Stage 3 trains nothing", t)
        stage.mark_done(summary)
        return summary
    result = train_role(_stage_context(r, t, "solver", stage), pool)
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2), "tasks": len(pool),
               "saved": result.saved.name, "reward": [m.get("reward") for m in result.metrics],
               "rubric_score": [m.get("rubric_score") for m in result.metrics]}
    stage.mark_done(summary)
    return summary
