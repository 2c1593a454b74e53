"""The self-play loop, any method (`selfplay.methods`; SCOPE's is Algorithm 1): iterations of the method's
stages, resumable.

    run(params)            # `scope train`: every iteration, resuming an interrupted run

`open_run` loads what every method shares (corpus, policy, Judge, engines; the index when the method searches:
`Method.uses_index`), probes the Judge stages the method uses (`Method.judge_stages`) and writes the manifest;
`run_iteration` calls the method's stages in order, each in its folder `runs/<name>/iter_NN/<stage>/` (SCOPE's:
`challenger`, `pool`, `solver`; `selfplay.methods.scope`). A finished stage (DONE) is skipped. A training stage that
was interrupted resumes from its newest mid-stage checkpoint when `run.checkpoint_steps` is set
(scope_lib.selfplay.checkpoints); otherwise it restarts from its own start (a log line says how many finished steps
that discards): its folder is cleared and the role's weights are those of the last finished stage (loaded from disk
in a new process, `_restore_roles`). Every stage has its own seed (`harness.stage_seed`), so a resumed run writes
the same records as an uninterrupted one.

Several ranks (`scope train --processes N`, torchrun, accelerate launch; `scope_lib.selfplay.ranks`): every rank
runs every stage on its share of the prompts; the main rank alone writes records, sentinels and adapters, and the
others wait at a barrier before reading them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from scope_lib.config import Params, ParamsError, SpiceConfig, SspConfig
from scope_lib.models.engine import Engine
from scope_lib.models.loading import make_engine
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.api import Retriever
from scope_lib.retrieval.check import check_index
from scope_lib.retrieval.corpus import CorpusError, empty_corpus_message, read_corpus
from scope_lib.retrieval.index import cached_corpus_sha256, open_retriever
from scope_lib.runs import params_hash, read_json, write_manifest
from scope_lib.selfplay import health, ranks
from scope_lib.selfplay.grader_probe import Calibration, probe_self_judge
from scope_lib.selfplay.harness import NoIndex, SelfPlayRun
from scope_lib.selfplay.judge import ANSWER_MATCH, Judge, judge_models, make_judge
from scope_lib.selfplay.judge import STAGES as JUDGE_STAGES
from scope_lib.selfplay.methods import method_for
from scope_lib.selfplay.policy import Policy
from scope_lib.selfplay.stage_probes import (
    MANIFEST_KEY,
    StageProbes,
    UntrustedJudge,
    probe_judge_stages,
    refusal,
)

log = logging.getLogger(__name__)


def open_run(params: Params, *, engine: Engine | None = None, judge: Judge | None = None,
             retriever: Retriever | None = None, policy=None) -> SelfPlayRun:
    """Load the corpus, index (when the method searches: `Method.uses_index`), policy (restoring the newest saved
    roles) and Judge, probe the Judge stages the method uses (`Method.judge_stages`); write the manifest."""
    method = method_for(params)  # an unknown name fails before anything loads
    ranks.init(params.run.collective_timeout_s, cpu=_on_cpu(params))
    if engine is None:
        ranks.check_generation_layout(params.engine.backend)
    r = params.retrieval
    passages = read_corpus(params.corpus_path, on_error=r.on_error, max_passages=r.max_passages).passages
    if not passages:  # before an index is built from it: an empty index would be kept
        raise CorpusError(empty_corpus_message(params.corpus_path, r.on_error))
    retriever = _open_index(params, retriever) if method.uses_index else NoIndex(method.name)
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
    corpus_sha256 = (fingerprint or {}).get("corpus_sha256") if method.uses_index else cached_corpus_sha256(
        params.corpus_path, params.run_dir)                  # no index: the run folder remembers the checksum
    used = method.judge_stages(params)
    calibration, stages = None, None
    if ranks.is_main() and params.judge.calibration.enabled and used:  # each Judge stage the method uses is probed
        calibration, stages = stored_probes(params, used)              # before its verdicts count, once per run: a
        if stages is None:                                             # resume reads them back
            calibration = probe_self_judge(params, judge, passages) if "grading" in used else None
            stages = probe_judge_stages(params, judge, passages, used)
    if ranks.is_main():
        _write_manifest(params, judge, passages, fingerprint, calibration, stages, corpus_sha256=corpus_sha256)
    ranks.barrier()
    run = SelfPlayRun(params, passages, retriever, get_dialect(params.model.dialect, params.model.base), policy,
                      judge, engine, method)
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


def _open_index(params: Params, retriever: Retriever | None) -> Retriever:
    """The run's index (the one given, else built or opened), checked before any GPU hour: canaries, fingerprints,
    results."""
    if retriever is None:  # the main rank builds (or opens) the index first; the others then open what it built
        retriever = open_retriever(params) if ranks.is_main() else None
        ranks.barrier()
        retriever = retriever or open_retriever(params)
    report = check_index(params, retriever=retriever)
    log.log(logging.INFO if report.passed else logging.ERROR, "%s", report.table())  # once; a failure then says
    report.raise_if_failed()                                                         # which rows, in one line
    return retriever


def _on_cpu(params: Params) -> bool:
    import torch

    return not (torch.cuda.is_available() and params.engine.device != "cpu")


def probes_key(params: Params) -> str:
    """What the Judge's probes depend on: every parameter (the Judge's models, prompts and budgets, the corpus, the
    seeds, `judge.calibration`), so a run resumed as it was started reuses them and any change probes again."""
    return params_hash(params.to_yaml())


def stored_probes(params: Params, used: Collection[str] = JUDGE_STAGES
                  ) -> tuple[Calibration | None, StageProbes | None]:
    """The grader's and the Judge stages' probes this run stored when it first opened (`manifest.json`), when its
    parameters have not changed since (`probes_key`) and they hold every stage of `used` (the method's
    `judge_stages`; the grader's is None when it is not used); else (None, None)."""
    path = params.run_dir / "manifest.json"
    manifest = read_json(path, "it is rewritten when the run opens") if path.is_file() else {}
    grader, stages = manifest.get("judge_calibration"), manifest.get(MANIFEST_KEY)
    if manifest.get("probes_key") != probes_key(params) or stages is None:
        return None, None
    probes = StageProbes.from_record(stages)
    held = {"grading": grader is not None, "rubrics": probes.rubrics is not None,
            ANSWER_MATCH: probes.answer_match is not None}
    if not all(held.get(stage, True) for stage in used):
        return None, None
    log.info("the Judge's probes: read back from %s (the run resumes with the parameters it probed with)", path)
    return (Calibration.from_record(grader) if grader is not None and "grading" in used else None), probes


def _write_manifest(params: Params, judge: Judge, passages: list, fingerprint: dict | None,
                    calibration: Calibration | None = None, stages: StageProbes | None = None, *,
                    corpus_sha256: str | None = None) -> None:
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
                   probes_key=probes_key(params) if stages is not None else None,
                   corpus={"path": str(params.corpus_path), "passages": len(passages),
                           "sha256": corpus_sha256},
                   processes=ranks.world_size())


def science_yaml(params: Params, *, counted_iterations: int | None = None) -> str:
    """The parameters that decide training results: everything but `run` (names and folders, so a run folder
    can be moved and still resume), `evaluation`, `learning_check` and `compare` (how checkpoints are measured and
    compared afterwards; but the documents the check holds out from training count), `model.loader` (transformers
    and Unsloth load the same M0 and the same adapters: a run resumes with either), `judge.calibration` (the probes
    of the Judge's stages when the run opens: they change no verdict) and `selfplay.iterations` (iteration t never reads the
    count: a finished run continues with more). Options added after runs existed are left out at their default
    (`grpo.reward_control: none`, `challenger.no_rubrics_reward: format`, `judge.gates_by: judge`,
    `judge.distinct_rubrics: false`, `method: scope`, `model.shared_policy: false`, `spice` and `ssp` at their
    defaults, `ssp.answer_check: rule` in an SSP run, no held-out documents), so those runs still resume.
    `counted_iterations`: the form before the count left the hash, for runs started then."""
    import yaml

    science = {k: v for k, v in params.model_dump(mode="json").items()
               if k not in ("run", "evaluation", "learning_check", "compare")}
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
    if not science["judge"]["distinct_rubrics"]:
        science["judge"].pop("distinct_rubrics")
    if science["method"] == "scope":
        science.pop("method")
    if not science["model"]["shared_policy"]:
        science["model"].pop("shared_policy")
    if params.spice == SpiceConfig():
        science.pop("spice")
    if params.ssp.answer_check == "rule":   # how every SSP run was checked before the option existed
        science["ssp"].pop("answer_check")
    if params.ssp == SspConfig(answer_check=params.ssp.answer_check) and (
            params.ssp.answer_check == "rule" or params.method != "ssp"):
        science.pop("ssp")
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
    """Load each trained role's newest finished checkpoint (a new process resuming, or a later iteration): the
    newest finished stage that trains it, over the method's stages. With a shared policy both roles are one set
    of weights: the newest stage that trains either."""
    trained = [(t, spec) for t in range(1, run.params.selfplay.iterations + 1) for spec in run.method.stages
               if spec.trains]
    restored: set[str] = set()  # the adapters (one per role, or the one shared) already loaded
    for t, spec in reversed(trained):
        weights = run.policy.adapters[spec.trains]
        if weights in restored:
            continue
        stage = run.stage(t, spec.name)
        saved = [stage.path / name for name in ("adapter", "model") if (stage.path / name).is_dir()]
        if stage.done and saved:
            stage.verify()  # checksums of DONE; load_role checks the tensors parse and are finite
            run.policy.load_role(spec.trains, saved[0])
            restored.add(weights)


def run(params: Params, *, iterations: int | None = None, **components) -> SelfPlayRun:
    """`scope train`: Algorithm 1 for `selfplay.iterations` iterations (or `iterations`), resuming a run
    that was interrupted. Returns the run (its alarms, its components)."""
    selfplay_run = open_run(params, **components)
    for t in range(1, (iterations or params.selfplay.iterations) + 1):
        run_iteration(selfplay_run, t)
    return selfplay_run


def run_iteration(r: SelfPlayRun, t: int) -> dict[str, dict]:
    """One iteration: the method's stages in order (SCOPE: Stage 1 trains the Challenger, Stage 2 builds the task
    pool, Stage 3 trains the Solver)."""
    summaries = {stage.name: stage.run(r, t) for stage in r.method.stages}
    log.info("iteration %d done: %s", t, {k: {n: v for n, v in s.items() if not isinstance(v, (list, dict))}
                                          for k, s in summaries.items()})
    return summaries
