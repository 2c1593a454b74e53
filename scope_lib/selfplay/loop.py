"""Algorithm 1: iterations of three stages, resumable.

    run(params)            # `scope train`: every iteration, resuming an interrupted run

runs/<name>/iter_NN/challenger/  rollouts, solver_rollouts, metrics, adapter (or model), DONE   Stage 1
runs/<name>/iter_NN/pool/        candidates, chunks, tasks, DONE                                 Stage 2
runs/<name>/iter_NN/solver/      rollouts, metrics, adapter (or model), DONE                     Stage 3

A finished stage (DONE) is skipped. A training stage that was interrupted resumes from its newest mid-stage
checkpoint when `run.checkpoint_steps` is set (scope_lib.selfplay.checkpoints); otherwise it restarts from its
own start (a log line says how many finished steps that discards): its folder is cleared and the role's
weights are those of the last finished stage (loaded from disk in a new process). The task pool resumes batch by batch: a candidate batch counts once its marker is in
chunks.jsonl; records of an unfinished batch are dropped and the batch is redone, so nothing is lost or
duplicated. Every stage has its own seed, so a resumed run writes the same records as an uninterrupted one.

Several ranks (`scope train --processes N`, torchrun, accelerate launch; `scope_lib.selfplay.ranks`): every rank
runs every stage on its share of the prompts; the main rank alone writes records, sentinels and adapters, and the
others wait at a barrier before reading them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from scope_lib.config import GRPOConfig, Params, ParamsError
from scope_lib.models.engine import Engine
from scope_lib.models.loading import make_engine
from scope_lib.protocol.dialects import Dialect, get_dialect
from scope_lib.retrieval.api import Retriever
from scope_lib.retrieval.check import check_index
from scope_lib.retrieval.corpus import (
    CorpusError,
    document_range,
    empty_corpus_message,
    read_corpus,
    training_documents,
)
from scope_lib.retrieval.index import open_retriever
from scope_lib.runs import Stage, finished_chunks, iteration_dir, write_manifest
from scope_lib.selfplay import health, ranks
from scope_lib.selfplay.checkpoints import latest_checkpoint
from scope_lib.selfplay.grader_probe import Calibration, probe_self_judge
from scope_lib.selfplay.judge import Judge, judge_models, make_judge
from scope_lib.selfplay.policy import ROLES, Policy, serves_adapters
from scope_lib.selfplay.rollout import make_challenger_prompts
from scope_lib.selfplay.stage_probes import StageProbes, UntrustedJudge, probe_judge_stages, refusal
from scope_lib.selfplay.tasks import TaskEvaluation, candidate_batch, filter_tasks
from scope_lib.selfplay.training import StageContext, train_role

log = logging.getLogger(__name__)


STAGE_OFFSETS = {"challenger": 1, "pool": 2, "solver": 3}


#: grpo.seed's default: a run with another grpo.seed is a replicate (`stage_seed`).
GRPO_SEED_DEFAULT = GRPOConfig.model_fields["seed"].default


def stage_seed(params: Params, iteration: int, stage: str) -> int:
    """The seed of one stage of one iteration (data order, rollouts, trainer). `selfplay.seed` fixes the documents
    (their permutation, the learning check's held-out tail); `grpo.seed` (with the LoRA initialisation) shifts every
    stage's sampling and data order, so runs that differ only in it are replicates on the same documents, which
    the learning check compares on the same held-out tasks. At its default it shifts nothing."""
    replicate = params.grpo.seed - GRPO_SEED_DEFAULT
    return params.selfplay.seed + 10 * (iteration - 1) + STAGE_OFFSETS[stage] + 1000 * replicate


@dataclass
class SelfPlayRun:
    """Everything Algorithm 1 works with, loaded once per process."""

    params: Params
    passages: list
    retriever: Retriever
    dialect: Dialect
    policy: Policy
    judge: Judge
    engine: Engine       # rollouts of both roles (the policy's engine unless a test gives another)
    alarms: list[dict] = field(default_factory=list)

    @property
    def run_dir(self):
        return self.params.run_dir

    def stage(self, iteration: int, name: str):
        return Stage(iteration_dir(self.run_dir, iteration) / name)

    @property
    def training_documents(self) -> int:
        """How many positions of the document permutation training may sample (`corpus.training_documents`)."""
        return training_documents(self.params, len(self.passages))


def open_run(params: Params, *, engine: Engine | None = None, judge: Judge | None = None,
             retriever: Retriever | None = None, policy=None) -> SelfPlayRun:
    """Load the corpus, index, policy (restoring the newest saved roles) and Judge; write the manifest."""
    ranks.init(params.run.collective_timeout_s, cpu=_on_cpu(params))
    if engine is None:
        ranks.check_generation_layout(params.engine.backend)
    r = params.retrieval
    passages = read_corpus(params.corpus_path, on_error=r.on_error, max_passages=r.max_passages).passages
    if not passages:  # before an index is built from it: an empty index would be kept
        raise CorpusError(empty_corpus_message(params.corpus_path, r.on_error))
    if retriever is None:  # the main rank builds (or opens) the index first; the others then open what it built
        retriever = open_retriever(params) if ranks.is_main() else None
        ranks.barrier()
        retriever = retriever or open_retriever(params)
    report = check_index(params, retriever=retriever)  # before any GPU hour: canaries, fingerprints, results
    log.log(logging.INFO if report.passed else logging.ERROR, "%s", report.table())  # once; a failure then says
    report.raise_if_failed()                                                         # which rows, in one line
    if engine is None and params.engine.backend != "hf" and params.model.finetuning == "full":
        raise ParamsError("model.finetuning: full trains separate weights per role, which a LoRA-serving engine "
                          "cannot generate from: use engine.backend: hf, or LoRA (model.finetuning: lora)")
    policy = policy or Policy.load(params)
    if engine is None:
        # hf: generate with the model being trained. vllm / openai: a serving engine over M0 that generates for
        # each role from its published adapter (adapter-only sync every step, importance-sampling correction);
        # Unsloth's fast_inference engine lives on the policy's model
        engine = policy.engine if params.engine.backend == "hf" else make_engine(
            params, "policy", model=policy.model, tokenizer=policy.tokenizer)
    if ranks.distributed() and hasattr(engine, "adapter_tag"):  # ranks sharing servers publish their own copies
        engine.adapter_tag = f"rank{ranks.rank()}-"
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
    calibration, stages = None, None
    if ranks.is_main() and params.judge.calibration.enabled:  # every Judge stage is probed before its verdicts count
        calibration = probe_self_judge(params, judge, passages)
        stages = probe_judge_stages(params, judge, passages)
    if ranks.is_main():
        _write_manifest(params, judge, passages, fingerprint, calibration, stages)
    ranks.barrier()
    run = SelfPlayRun(params, passages, retriever, get_dialect(params.model.dialect, params.model.base), policy,
                      judge, engine)
    alarms = health.check_calibration(calibration.summary()) if calibration is not None else []
    alarms += health.check_stage_calibration(stages.to_record()) if stages is not None else []
    for alarm in alarms:
        run.alarms.append(alarm)
        health.report(alarm, run.run_dir)
    untrusted = ([calibration] if calibration is not None and not calibration.trusted else []) + (
        stages.untrusted() if stages is not None else [])
    stop = ranks.broadcast(refusal(untrusted, params.judge.calibration) if ranks.is_main() else None)
    if stop:  # before any training step: `scope train` exits 4 (cli.UNTRUSTED_JUDGE_EXIT)
        raise UntrustedJudge(stop)
    _restore_roles(run)
    return run


def _on_cpu(params: Params) -> bool:
    import torch

    return not (torch.cuda.is_available() and params.engine.device != "cpu")


def _write_manifest(params: Params, judge: Judge, passages: list, fingerprint: dict | None,
                    calibration: Calibration | None = None, stages: StageProbes | None = None) -> None:
    started = _started_with_iterations(params)
    earlier = () if started is None else (science_yaml(params, counted_iterations=started),)
    write_manifest(params.run_dir, params.to_yaml(), science=science_yaml(params), earlier_science=earlier,
                   model=params.model.base,
                   finetuning=params.model.finetuning, reward_control=params.grpo.reward_control,
                   held_out={"documents": params.learning_check.held_out_documents,
                             "permutation_seed": params.selfplay.seed},
                   seeds={"selfplay": params.selfplay.seed, "grpo": params.grpo.seed},
                   judge_models=judge_models(params), index=fingerprint,
                   judge_calibration=calibration.to_record() if calibration is not None else None,
                   judge_stage_calibration=stages.to_record() if stages is not None else None,
                   corpus={"path": str(params.corpus_path), "passages": len(passages),
                           "sha256": (fingerprint or {}).get("corpus_sha256")},
                   processes=ranks.world_size())


def science_yaml(params: Params, *, counted_iterations: int | None = None) -> str:
    """The parameters that decide training results: everything but `run` (names and folders, so a run folder
    can be moved and still resume), `evaluation` and `learning_check` (how checkpoints are measured afterwards;
    but the documents the check holds out from training count), `model.loader` (transformers and Unsloth load the
    same M0 and the same adapters: a run resumes with either), `judge.calibration` (the probes of the Judge's
    stages when the run opens: they change no verdict) and `selfplay.iterations` (iteration t never reads the
    count: a finished run continues with more). Options added after runs existed are left out at their default
    (`grpo.reward_control: none`, `challenger.no_rubrics_reward: format`, `judge.gates_by: judge`, no held-out
    documents), so those runs still resume. `counted_iterations`: the form before the count left the hash, for
    runs started then."""
    import yaml

    science = {k: v for k, v in params.model_dump(mode="json").items()
               if k not in ("run", "evaluation", "learning_check")}
    science["model"].pop("loader")
    science["judge"].pop("calibration")
    science["selfplay"].pop("iterations")
    if counted_iterations is not None:
        science["selfplay"]["iterations"] = counted_iterations
    if science["grpo"]["reward_control"] == "none":
        science["grpo"].pop("reward_control")
    if science["challenger"]["no_rubrics_reward"] == "format":
        science["challenger"].pop("no_rubrics_reward")
    if science["judge"]["gates_by"] == "judge":
        science["judge"].pop("gates_by")
    if params.learning_check.held_out_documents:
        science["learning_check"] = {"held_out_documents": params.learning_check.held_out_documents}
    return yaml.safe_dump(science, sort_keys=True)


def _started_with_iterations(params: Params) -> int | None:
    """The `selfplay.iterations` the run folder was started with (its params.yaml); None for a new folder."""
    import yaml

    path = params.run_dir / "params.yaml"
    try:
        started = (yaml.safe_load(path.read_text()) or {}).get("selfplay", {}).get("iterations")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return started if isinstance(started, int) else None


def _restore_roles(run: SelfPlayRun) -> None:
    """Load each role's newest finished checkpoint (a new process resuming, or a later iteration)."""
    for role in ROLES:
        for t in range(run.params.selfplay.iterations, 0, -1):
            stage = run.stage(t, role)
            saved = [stage.path / name for name in ("adapter", "model") if (stage.path / name).is_dir()]
            if stage.done and saved:
                stage.verify()  # checksums of DONE; load_role checks the tensors parse and are finite
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
    if not serves_adapters(r.engine):
        return
    folder = r.stage(t, stage).path / "serving"
    if ranks.distributed():  # each rank publishes to its own engine from its own folder
        folder = folder / f"rank{ranks.rank()}"
    for role in roles:
        r.policy.publish(role, folder / role, r.engine)


def documents_start(r: SelfPlayRun, t: int) -> int:
    """Where iteration t's documents begin in the run's permutation: after everything earlier iterations used."""
    if t == 1:
        return 0
    previous = r.stage(t - 1, "pool").summary
    if "documents" not in previous:
        raise RuntimeError(f"iteration {t - 1}'s task pool is not finished; run the iterations in order")
    return previous["documents"][1]


def _reset(r: SelfPlayRun, t: int, stage) -> None:
    """Before a training stage, the main rank resumes or clears what an interrupted attempt left
    (`restart_or_resume`); then every rank goes on."""
    if ranks.is_main():
        restart_or_resume(r, t, stage)
    ranks.barrier()


def _mark_done(stage, summary: dict, saved=None) -> None:
    """Write the stage's DONE sentinel (the main rank; with the checksums of `saved` weights); every rank goes on
    once it is there."""
    if ranks.is_main():
        stage.mark_done(summary, saved=saved)
    ranks.barrier()


def _stage_context(r: SelfPlayRun, t: int, role: str, stage):
    return StageContext(r.params, t, role, r.policy, r.retriever, r.dialect, r.judge, stage,
                        seed=stage_seed(r.params, t, "challenger" if role == "challenger" else "solver"),
                        engine=r.engine, alarms=r.alarms)


def train_challenger(r: SelfPlayRun, t: int) -> dict:
    """Stage 1 (Algorithm 1 lines 4-17): GRPO on R_C against S_{t-1}, over fresh documents."""
    stage = r.stage(t, "challenger")
    if stage.done:
        return stage.summary
    start = documents_start(r, t)
    sp = r.params.selfplay
    if not sp.co_evolution and t > 1:
        summary = {"frozen_at": 1, "documents": [start, start],
                   "note": "selfplay.co_evolution is false: the Challenger stays at its iteration-1 checkpoint"}
        _mark_done(stage, summary)
        return summary
    _reset(r, t, stage)
    publish_roles(r, t, "challenger", ("solver",))  # S_{t-1} estimates the difficulty (the Challenger syncs itself)
    seed = stage_seed(r.params, t, "challenger")
    documents = document_range(r.passages, start, sp.challenger_prompts, sp.seed, limit=r.training_documents)
    prompts = make_challenger_prompts(documents, sp.task_types, sp.search_turn_strata, seed,
                                      tokenizer=r.policy.tokenizer, document_max_tokens=sp.document_max_tokens,
                                      id_prefix=f"i{t:02d}-c")
    result = train_role(_stage_context(r, t, "challenger", stage), {p.id: p for p in prompts})
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2),
               "documents": [start, start + len(documents)], "saved": result.saved.name,
               "reward": [m.get("reward") for m in result.metrics]}
    _mark_done(stage, summary, result.saved)
    return summary


def restart_or_resume(r: SelfPlayRun, t: int, stage) -> None:
    """Before a training stage: keep what an interrupted attempt left when it has a complete mid-stage checkpoint
    (`run.checkpoint_steps`; train_role resumes from it), otherwise clear the folder, saying how many finished
    steps are discarded."""
    if r.params.run.checkpoint_steps and latest_checkpoint(stage.path / "trainer") is not None:
        return
    metrics = stage.path / "metrics.jsonl"
    finished = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.is_file() else 0
    if finished:
        log.warning("iteration %d %s: an interrupted attempt finished %d step(s) but left no mid-stage checkpoint: "
                    "the stage restarts from its first step (set run.checkpoint_steps to resume mid-stage)", t,
                    stage.path.name, finished)
    stage.reset()


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
    _mark_done(stage, summary)
    return summary


def train_solver(r: SelfPlayRun, t: int) -> dict:
    """Stage 3 (Algorithm 1 lines 28-33): GRPO on R_S over iteration t's task pool."""
    stage = r.stage(t, "solver")
    if stage.done:
        return stage.summary
    _reset(r, t, stage)
    pool = {rec["id"]: TaskEvaluation.from_record(rec) for rec in r.stage(t, "pool").records("tasks")}
    if not pool:
        summary = {"skipped": "empty task pool", "steps": 0,
                   "note": "no task survived the filter; the Solver keeps S_{t-1} (see the health alarms)"}
        log.warning("iteration %d: the task pool is empty; Stage 3 trains nothing", t)
        _mark_done(stage, summary)
        return summary
    result = train_role(_stage_context(r, t, "solver", stage), pool)
    summary = {"steps": result.steps, "seconds": round(result.seconds, 2), "tasks": len(pool),
               "saved": result.saved.name, "reward": [m.get("reward") for m in result.metrics],
               "rubric_score": [m.get("rubric_score") for m in result.metrics]}
    _mark_done(stage, summary, result.saved)
    return summary
