"""Evaluation on the paper's 15 benchmarks (§4.1, Tables 2-3): checkpoints -> Solver rollouts -> judged scores.

    params = load_params("params/qwen3-8b.yaml")
    evaluate(params, ["base", "iter_03/solver"], ["nq", "healthbench"])      # or: scope eval PARAMS ...
    tables.results_table(params, ["base", "iter_03-solver"], "open_ended")   # Table 2 layout

Any checkpoint (`resolve_checkpoint`: 'base' = M0, 'iter_NN/solver', or a path to an adapter or model folder)
answers every benchmark item with the Solver protocol of §4.1: at most `evaluation.max_searches` searches (and one
more turn to answer), 3 documents x 500 tokens per search, the answer budget, greedy decoding except Qwen3 at
T 1.0 — batched through `rollout.run_rollouts` like training. Trajectories are stored by (checkpoint, benchmark,
item, seed) and reused by re-scoring and by the replay ablation (`scope_lib.evaluation.replay`). Answers are judged by
`scorers` through a cached judge (`scope_lib.evaluation.judge`); `tables` shows the results.

Layout, under runs/<name>/eval/:

    manifests/<benchmark>.json            the sampled item ids (shared by every checkpoint)
    judge_cache.sqlite                    every judge reply, keyed by the full request
    <checkpoint>/<benchmark>/trajectories.jsonl   one Solver trajectory per (item, seed)
    <checkpoint>/<benchmark>/items.jsonl          per item: question, trajectory id, answer, judge replies, scores
    <checkpoint>/<benchmark>/summary.json         per scorer: score, bootstrap 95% CI, invalid counts, judge usage
    <checkpoint>/<benchmark>/manifest.json        copy of the manifest the scores were computed on
    <checkpoint>/summary.json                     every benchmark's scores for this checkpoint
"""

from __future__ import annotations

import logging
import re
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from tqdm.auto import tqdm

from scope_lib.config import JUDGE_ADAPTER_MODEL, Params
from scope_lib.evaluation import judge_probes as C
from scope_lib.evaluation import scorers as S
from scope_lib.evaluation.benchmarks import (
    BENCHMARKS,
    BenchmarkDataError,
    Item,
    load_benchmark,
    select_items,
    solver_conversation,
)
from scope_lib.evaluation.judge import (
    BenchmarkJudge,
    ChatCompletionsBackend,
    JudgeCache,
    JudgeSettings,
    LocalEngineBackend,
    ask_with_retries,
)
from scope_lib.models.engine import Engine
from scope_lib.models.hf_engine import HFEngine
from scope_lib.models.loading import load_model_and_tokenizer, make_engine
from scope_lib.models.vllm_engine import VLLMEngine
from scope_lib.protocol import parsing
from scope_lib.protocol.dialects import Dialect, get_dialect
from scope_lib.retrieval.corpus import read_corpus
from scope_lib.retrieval.index import open_retriever
from scope_lib.runs import RecordLog, Stage, atomic_write_json, load_weights, read_json, write_jsonl
from scope_lib.selfplay.grader_probe import Calibration
from scope_lib.selfplay.rollout import RolloutLimits, Trajectory, new_trajectory, run_rollouts

log = logging.getLogger(__name__)


_ITER_SPEC = re.compile(r"^iter_(\d+)/(solver|challenger)$")


@dataclass(frozen=True)
class Checkpoint:
    """A policy to evaluate: M0 itself, a LoRA adapter folder, or a full model folder. `name` names its result
    folder and, for adapters, the adapter (e.g. "iter_03-solver")."""

    spec: str
    kind: Literal["base", "adapter", "model"]
    path: Path | None
    name: str
    iteration: int | None = None
    role: str | None = None


def _checkpoint_folder(folder: Path) -> tuple[str, Path] | None:
    if (folder / "adapter_config.json").is_file():
        return "adapter", folder
    if (folder / "config.json").is_file():
        return "model", folder
    for kind, sub in (("adapter", "adapter"), ("model", "model")):
        found = _checkpoint_folder(folder / sub) if (folder / sub).is_dir() else None
        if found and found[0] == kind:
            return found
    return None


def resolve_checkpoint(params: Params, spec: str) -> Checkpoint:
    """'base' -> M0; 'iter_NN/solver' (or /challenger) -> runs/<name>/iter_NN/<role>/adapter (LoRA mode) or
    /model (full fine-tuning); anything else is a folder holding an adapter (adapter_config.json) or a model
    (config.json), or their parent."""
    spec = str(spec).strip().rstrip("/")
    if spec in ("base", "M0"):
        return Checkpoint("base", "base", None, "base")
    match = _ITER_SPEC.match(spec)
    if match:
        iteration, role = int(match.group(1)), match.group(2)
        folder = params.run_dir / f"iter_{iteration:02d}" / role
        found = _checkpoint_folder(folder) if folder.is_dir() else None
        if found is None:
            raise FileNotFoundError(f"checkpoint {spec!r}: no adapter/ or model/ under {folder} (has training run "
                                    f"iteration {iteration}?); available: "
                                    f"{', '.join(c.spec for c in available_checkpoints(params, role)) or 'base only'}")
        return Checkpoint(spec, found[0], found[1], f"iter_{iteration:02d}-{role}", iteration, role)  # type: ignore[arg-type]
    folder = Path(spec).expanduser()
    found = _checkpoint_folder(folder) if folder.is_dir() else None
    if found is None:
        raise FileNotFoundError(f"checkpoint {spec!r}: not 'base', not iter_NN/solver|challenger, and not a folder "
                                "holding adapter_config.json (a PEFT adapter) or config.json (a model)")
    parts = [p for p in found[1].resolve().parts[-3:] if p not in ("adapter", "model")]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(parts[-2:])).strip("-.") or "checkpoint"
    return Checkpoint(spec, found[0], found[1], name)  # type: ignore[arg-type]


def available_checkpoints(params: Params, role: str = "solver") -> list[Checkpoint]:
    """M0 and every trained `role` checkpoint in the run directory, by iteration."""
    found = [resolve_checkpoint(params, "base")]
    for folder in sorted(params.run_dir.glob(f"iter_[0-9]*/{role}")):
        match = re.fullmatch(r"iter_(\d+)", folder.parent.name)
        if match and _checkpoint_folder(folder):
            found.append(resolve_checkpoint(params, f"iter_{match.group(1)}/{role}"))
    return found


@dataclass
class Policy:
    """A checkpoint ready to generate: the engine and the adapter name to pass to `generate` (None = M0)."""

    checkpoint: Checkpoint
    engine: Engine
    adapter: str | None


def open_policies(params: Params, checkpoints: list[Checkpoint | str], *, engine: Engine | None = None
                  ) -> dict[str, Policy]:
    """Engines for checkpoints, keyed by checkpoint name. Adapters share one base engine:
    hf — M0 is loaded once and each adapter attached under its name (`load_adapter`), selected per call;
    vllm — `VLLMEngine.add_adapter(name, path)`;
    openai — the adapter's name is the served model name (e.g. `vllm serve M0 --enable-lora
    --lora-modules iter_03-solver=runs/<run>/iter_03/solver/adapter`).
    Full-model checkpoints get their own engine (hf, vllm) or are served under their name (openai)."""
    resolved = [c if isinstance(c, Checkpoint) else resolve_checkpoint(params, c) for c in checkpoints]
    for ck in resolved:
        verify_checkpoint(ck)
    base = engine or make_engine(params, "policy")
    backend = params.engine.backend
    policies: dict[str, Policy] = {}
    for ck in resolved:
        if ck.kind == "base":
            policies[ck.name] = Policy(ck, base, None)
        elif backend == "openai":
            policies[ck.name] = Policy(ck, base, ck.name)
        elif ck.kind == "adapter":
            load_adapter(base, ck.name, ck.path)
            policies[ck.name] = Policy(ck, base, ck.name)
        elif backend == "vllm":
            policies[ck.name] = Policy(ck, VLLMEngine(ck.path, max_model_len=params.model.max_model_len,
                                                      gpu_memory_utilization=params.engine.gpu_memory_utilization,
                                                      dtype=params.model.dtype), None)
        else:
            model, tokenizer = load_model_and_tokenizer(str(ck.path), dtype=params.model.dtype,
                                                        device=params.engine.device)
            policies[ck.name] = Policy(ck, HFEngine(model, tokenizer, max_model_len=params.model.max_model_len),
                                       None)
    return policies


def load_adapter(engine: Engine, name: str, path: str | Path) -> None:
    """Serve the LoRA adapter saved in `path` under `name` on `engine`, beside M0: vLLM registers it
    (`VLLMEngine.add_adapter`); an HF engine's model loads it once (`load_adapter`), selected per call."""
    if isinstance(engine, VLLMEngine):
        engine.add_adapter(name, path)
    elif isinstance(engine, HFEngine):
        model = engine.model
        if name not in (getattr(model, "peft_config", None) or {}):
            with warnings.catch_warnings():  # "multiple adapters in the model": intended, one per checkpoint
                warnings.filterwarnings("ignore", message=".*peft_config.*")
                model.load_adapter(str(path), adapter_name=name)
    else:
        raise ValueError(f"a local adapter ({name}) cannot be loaded into a {type(engine).__name__}: a served "
                         "model takes its adapters at the server (e.g. vllm serve --lora-modules)")


def verify_checkpoint(ck: Checkpoint) -> None:
    """Before a checkpoint is trusted: the checksums its stage's DONE recorded, and its weights parse and are
    finite (RunError naming the file and the remedy otherwise)."""
    if ck.path is None:
        return
    stage = Stage(ck.path.parent)
    if stage.done:
        stage.verify()
    for weights in sorted(ck.path.glob("*.safetensors")):
        load_weights(weights)


def base_engine(policies: dict[str, Policy]) -> Engine | None:
    """The engine that generates with M0 when asked with adapter None (a base or adapter checkpoint's engine), or
    None when every policy is a separate full model."""
    return next((p.engine for p in policies.values() if p.checkpoint.kind in ("base", "adapter")), None)


def judge_settings(params: Params, benchmark: str) -> JudgeSettings:
    """The judge of a benchmark: its override, else the open-ended or short-form judge (§4.1). With the local
    judges' adapter (`evaluation.judge_adapter`) the model is named '<model>+<adapter folder>', so its replies,
    cache entries and calibration are never mistaken for M0's."""
    e = params.evaluation
    cfg = e.benchmark_judges.get(benchmark) or (
        e.short_form_judge if BENCHMARKS[benchmark].kind == "short_form" else e.open_ended_judge)
    model = cfg.model
    if e.judge_backend == "local" and e.judge_adapter.enabled:
        model = f"{model}+{Path(judge_adapter_folder(params)).name}"
    return JudgeSettings(model, cfg.temperature, cfg.reasoning_effort, cfg.max_tokens)


#: The name the local judges' adapter is served under.
JUDGE_ADAPTER_NAME = "eval_judge"


def judge_adapter_folder(params: Params) -> str:
    """The evaluation judges' adapter (`evaluation.judge_adapter`), built by `smoke.warm_start.prepare(params,
    judges=True)`, which `scope eval` and the notebooks that judge call."""
    folder = params.local_model(JUDGE_ADAPTER_MODEL)
    if folder is None:
        raise ValueError("evaluation.judge_adapter is on but was not built: call "
                         "scope_lib.smoke.warm_start.prepare(params, judges=True) first (scope eval does)")
    return folder


def make_benchmark_judge(params: Params, engine: Engine | None = None) -> BenchmarkJudge:
    """The judge client of `evaluation`: an OpenAI-compatible endpoint (the key from $judge_api_key_env only), or
    the local engine (M0 with adapters off, or with the judges' own adapter, `evaluation.judge_adapter`; the
    offline judge of the CPU runs), with the on-disk cache."""
    e = params.evaluation
    cache = JudgeCache(params.run_dir / "eval" / "judge_cache.sqlite") if e.judge_cache else None
    if e.judge_backend == "local":
        engine = engine or make_engine(params, "judge")
        adapter = None
        if e.judge_adapter.enabled:
            load_adapter(engine, JUDGE_ADAPTER_NAME, judge_adapter_folder(params))
            adapter = JUDGE_ADAPTER_NAME
        backend: Any = LocalEngineBackend(engine, adapter=adapter, seed=params.selfplay.seed)
    else:
        backend = ChatCompletionsBackend(e.judge_base_url, api_key_env=e.judge_api_key_env,
                                         concurrency=e.judge_concurrency, timeout_s=e.judge_timeout_s,
                                         max_retries=e.judge_max_retries, token_field=e.judge_token_field)
    return BenchmarkJudge(backend, cache, prices={k: tuple(v) for k, v in e.judge_prices.items()})


def solver_temperature(params: Params, dialect: Dialect) -> float:
    """§4.1: Qwen3 decodes at T 1.0 (avoids repetition loops); the other models greedily."""
    t = params.evaluation.temperature
    return t if t is not None else (1.0 if dialect.name == "qwen3" else 0.0)


def eval_limits(params: Params, dialect: Dialect, seed: int | None = None) -> RolloutLimits:
    """§4.1's budgets: max_searches searches plus one turn to answer, the answer budget per turn, the context
    window for everything, 3 documents x 500 tokens per search."""
    e = params.evaluation
    return RolloutLimits(max_turns=e.max_searches + 1, max_new_tokens_per_turn=e.max_answer_tokens,
                         max_response_tokens=e.context_tokens, max_model_len=e.context_tokens,
                         max_prompt_tokens=e.context_tokens, temperature=solver_temperature(params, dialect),
                         top_p=1.0, top_k_docs=params.retrieval.top_k,
                         max_result_tokens=params.retrieval.max_result_tokens, seed=seed)


def answer_of(benchmark: str, traj: Trajectory) -> tuple[str, str]:
    """(answer text for the judge, status). Only the last complete <answer> is judged ("answer"); a trajectory
    without one is judged as the empty reply ("missing"). Benchmarks with a raw prompt take the final turn's text
    outside <think> when there is no <answer> ("final_text")."""
    if traj.answer is not None:
        return traj.answer, "answer"
    if BENCHMARKS[benchmark].answer_source == "final_text" and traj.turns:
        text = parsing.strip_think(traj.turns[-1]).strip()
        if text:
            return text, "final_text"
    return "", "missing"


def store_record(traj: Trajectory) -> dict[str, Any]:
    record = traj.to_record()
    record["turn_prompt_ids"] = []   # per-turn training contexts: large and not needed to judge or replay
    record["logprobs"] = []
    return record


def load_trajectory(record: dict[str, Any]) -> Trajectory:
    traj = Trajectory.from_record(record)
    if len(traj.logprobs) != len(traj.completion_ids):
        traj.logprobs = [0.0] * len(traj.completion_ids)
    return traj


def append_environment(traj: Trajectory, messages: list[dict[str, str]], dialect: Dialect, tokenizer) -> None:
    """Add an environment turn (e.g. a nudge) after the trajectory's last assistant turn: the end of that turn,
    the messages and the next assistant header, all masked 0 — what `run_rollouts` does after a search."""
    ids = tokenizer.encode(dialect.environment_text(tokenizer, messages), add_special_tokens=False)
    traj.completion_ids.extend(ids)
    traj.env_mask.extend([0] * len(ids))
    traj.logprobs.extend([0.0] * len(ids))
    traj.messages.extend(messages)


def force_answer(trajectories: list[Trajectory], policy: Policy, retriever, dialect: Dialect,
                 limits: RolloutLimits, rounds: int) -> int:
    """The authors' code's force-answer option (off in the paper): a rollout that ended without <answer> is told
    it has used its searches and must answer, up to `rounds` times, one batched turn per round. Returns how many
    nudges were sent."""
    nudge = {"role": "user", "content": S.render("force_answer")}
    sent = 0
    for _ in range(rounds):
        todo = [t for t in trajectories if t.answer is None and t.turns
                and t.finish not in ("prompt_too_long", "budget")]
        if not todo:
            break
        for traj in todo:
            append_environment(traj, [nudge], dialect, policy.engine.tokenizer)
            traj.finish = ""
            traj.max_searches = traj.n_valid_searches   # no further search: answer now
            traj.meta["force_answer"] = traj.meta.get("force_answer", 0) + 1
        run_rollouts(todo, policy.engine, retriever, dialect, replace(limits, max_turns=1), adapter=policy.adapter)
        sent += len(todo)
    return sent


def eval_dir(params: Params, checkpoint: str, benchmark: str | None = None) -> Path:
    folder = params.run_dir / "eval" / checkpoint
    return folder / benchmark if benchmark else folder


def run_solver(params: Params, policy: Policy, benchmark: str, items: list[Item], *, retriever,
               dialect: Dialect, seeds: list[int] | None = None, folder: Path | None = None
               ) -> dict[tuple[str, int], Trajectory]:
    """Solver trajectories for every (item, seed), stored in <folder>/trajectories.jsonl. Pairs already stored are
    read back (a killed run resumes where it stopped); the rest are rolled out in batches of
    `evaluation.rollout_batch_size`, one engine call per turn, and appended as each batch finishes."""
    e = params.evaluation
    spec = BENCHMARKS[benchmark]
    seeds = list(seeds if seeds is not None else e.seeds)
    folder = folder or eval_dir(params, policy.checkpoint.name, benchmark)
    store = RecordLog(folder / "trajectories.jsonl")
    name = policy.checkpoint.name
    by_key: dict[tuple[str, int], Trajectory] = {}
    for record in store:
        traj = load_trajectory(record)
        by_key[(traj.meta["item_id"], traj.meta["seed"])] = traj
    tokenizer = policy.engine.tokenizer
    variant = params.solver.prompt   # the Solver prompt variant (Figure 10 or long-form)
    todo = [(seed, item) for seed in seeds for item in items if (item.id, seed) not in by_key]
    batches = [todo[i:i + e.rollout_batch_size] for i in range(0, len(todo), e.rollout_batch_size)]
    for batch in tqdm(batches, desc=f"{name} on {benchmark}", disable=not batches, leave=False):
        by_seed: dict[int, list[Item]] = {}
        for seed, item in batch:
            by_seed.setdefault(seed, []).append(item)
        for seed, chunk in by_seed.items():
            trajs = [new_trajectory(f"{name}/{benchmark}/{item.id}/s{seed}", "solver",
                                    solver_conversation(spec, item, dialect, e.max_searches, variant), tokenizer,
                                    max_searches=e.max_searches,
                                    meta={"item_id": item.id, "seed": seed, "benchmark": benchmark, "checkpoint": name})
                     for item in chunk]
            limits = eval_limits(params, dialect, seed)
            run_rollouts(trajs, policy.engine, retriever, dialect, limits, adapter=policy.adapter)
            if e.force_answer:
                force_answer(trajs, policy, retriever, dialect, limits, e.force_answer)
            store.append(store_record(t) for t in trajs)
            by_key.update(((t.meta["item_id"], seed), t) for t in trajs)
    return {(item.id, seed): by_key[(item.id, seed)] for seed in seeds for item in items}


@dataclass
class Answered:
    """One (item, seed) to score: the answer text, its status and the trajectory it came from."""

    item: Item
    seed: int
    answer: str
    status: str
    trajectory_id: str
    finish: str = ""
    n_searches: int = 0


def answered_from(benchmark: str, items: list[Item], trajectories: dict[tuple[str, int], Trajectory]
                  ) -> list[Answered]:
    by_id = {item.id: item for item in items}
    out = []
    for (item_id, seed), traj in trajectories.items():
        text, status = answer_of(benchmark, traj)
        out.append(Answered(by_id[item_id], seed, text, status, traj.id, traj.finish, traj.n_valid_searches))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def score_items(params: Params, benchmark: str, answered: list[Answered], judge: BenchmarkJudge | None, *,
                scorers: list[str] | None = None, label: str = "") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Score every answer with every scorer. All judge units of the benchmark go to the judge together (identical
    requests, e.g. HealthBench's two scorers, are sent once); unparseable replies are re-sampled in batched rounds
    (`judge_parse_retries`); what stays invalid follows `judge_invalid`. Returns the per-item records and the
    per-scorer summary. Judge usage is accounted under "<label>/<benchmark>/<scorer>" (label: the checkpoint)."""
    e = params.evaluation
    spec = BENCHMARKS[benchmark]
    names = [n for n in (scorers or e.scorers) if n in spec.scorers]
    # only a judged scorer needs the judge's settings (and, with `evaluation.judge_adapter`, the adapter built)
    settings = judge_settings(params, benchmark) if any(spec.scorers[n].judged for n in names) else None
    units: dict[tuple[int, str], list[S.Unit]] = {}
    for i, a in enumerate(answered):
        for n in names:
            units[(i, n)] = spec.scorers[n].units(a.item, a.answer) if spec.scorers[n].judged else []
    flat = [(key, u) for key, us in units.items() for u in us]
    if flat and judge is None:
        raise ValueError(f"{benchmark}: scorers {names} need a judge")
    asked = ask_with_retries(judge, settings, [((*key, u.key), u, f"{label}/{benchmark}/{key[1]}") for key, u in flat],
                             e.judge_parse_retries) if flat else {}  # type: ignore[arg-type]
    verdicts = {slot: a.verdict for slot, a in asked.items() if a.verdict is not None}
    history = {slot: a.history() for slot, a in asked.items()}
    invalid = {slot for slot, a in asked.items() if a.verdict is None}
    records, per_scorer = [], {n: [] for n in names}
    for i, a in enumerate(answered):
        record = {"id": f"{a.item.id}/s{a.seed}", "item_id": a.item.id, "seed": a.seed, "benchmark": benchmark,
                  "question": a.item.question, "trajectory_id": a.trajectory_id, "answer": a.answer,
                  "answer_status": a.status, "finish": a.finish, "n_searches": a.n_searches, "scores": {}}
        for n in names:
            scorer = spec.scorers[n]
            got: dict[str, Any] = {}
            unit_rows = []
            for unit in units[(i, n)]:
                slot = (i, n, unit.key)
                bad = slot in invalid
                value = verdicts.get(slot)
                if bad and e.judge_invalid == "worst":
                    value = unit.worst
                if value is not None:
                    got[unit.key] = value
                unit_rows.append({"key": unit.key, "verdict": _jsonable(value), "invalid": bad,
                                  "policy": (e.judge_invalid if bad else None), **history.get(slot, {})})
            score = scorer.combine(a.item, a.answer, got)
            score.n_units = len(units[(i, n)])
            score.n_invalid = sum(r["invalid"] for r in unit_rows)
            per_scorer[n].append(score)
            record["scores"][n] = {"value": score.value, "parts": _jsonable(score.parts), "metrics": score.metrics,
                                   "n_units": score.n_units, "n_invalid": score.n_invalid, "reason": score.reason,
                                   "units": unit_rows}
        records.append(record)
    summary = {n: _scorer_summary(params, spec.scorers[n], per_scorer[n], settings if spec.scorers[n].judged else None)
               for n in names}
    return records, summary


def bootstrap_ci(scorer: S.Scorer, scores: list[S.ItemScore], n_samples: int, seed: int = 0
                 ) -> tuple[float, float] | None:
    """95% percentile interval of the scorer's aggregate over items resampled with replacement."""
    import numpy as np

    kept = [s for s in scores if s.value is not None]
    if n_samples < 1 or len(kept) < 2:
        return None
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_samples):
        sample = [kept[i] for i in rng.integers(0, len(kept), len(kept))]
        value = scorer.aggregate(sample)
        if value is not None:
            values.append(value)
    if not values:
        return None
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def _scorer_summary(params: Params, scorer: S.Scorer, scores: list[S.ItemScore], settings: JudgeSettings | None
                    ) -> dict[str, Any]:
    value = scorer.aggregate(scores)
    ci = bootstrap_ci(scorer, scores, params.evaluation.bootstrap_samples, params.evaluation.sample_seed)
    reasons = Counter(s.reason for s in scores if s.reason)
    return {"value": value, "ci95": list(ci) if ci else None, "n": len(scores),
            "n_scored": sum(s.value is not None for s in scores),
            "n_dropped": sum(s.value is None for s in scores), "not_scorable": dict(reasons),
            "n_units": sum(s.n_units for s in scores), "n_invalid_units": sum(s.n_invalid for s in scores),
            "invalid_policy": params.evaluation.judge_invalid, "parse_retries": params.evaluation.judge_parse_retries,
            "metrics": scorer.summary_metrics(scores), "description": scorer.description,
            "judge": vars(settings) if settings else None}


def write_benchmark_results(params: Params, folder: Path, checkpoint: str, benchmark: str, records, scorer_summary,
                            manifest: dict[str, Any], judge: BenchmarkJudge | None, extra: dict[str, Any] | None = None
                            ) -> dict[str, Any]:
    e = params.evaluation
    write_jsonl(folder / "items.jsonl", records)
    atomic_write_json(folder / "manifest.json", manifest)
    statuses = Counter(r["answer_status"] for r in records)
    usage = {}
    if judge is not None:
        prefix = f"{checkpoint}/{benchmark}/"
        usage = {tag[len(prefix):]: vars(u) for tag, u in judge.usage.items() if tag.startswith(prefix)}
    summary = {"benchmark": benchmark, "checkpoint": checkpoint, "n_items": len({r["item_id"] for r in records}),
               "seeds": sorted({r["seed"] for r in records}), "answer_status": dict(statuses),
               "finishes": dict(Counter(r["finish"] for r in records)),
               "mean_searches": (sum(r["n_searches"] for r in records) / len(records)) if records else None,
               "scorers": scorer_summary, "judge_usage": usage,
               "judge_backend": e.judge_backend, "judge_base_url": e.judge_base_url,
               "solver": {"max_searches": e.max_searches, "max_answer_tokens": e.max_answer_tokens,
                          "context_tokens": e.context_tokens, "temperature": e.temperature,
                          "force_answer": e.force_answer, "top_k": params.retrieval.top_k,
                          "max_result_tokens": params.retrieval.max_result_tokens},
               "manifest": {k: manifest.get(k) for k in ("n_total", "n_selected", "ids_sha256", "method", "seed")},
               **(extra or {})}
    atomic_write_json(folder / "summary.json", summary)
    return summary


def evaluate(params: Params, checkpoints: list[str | Checkpoint] | None = None, benchmarks: list[str] | None = None,
             *, policies: dict[str, Policy] | None = None, judge: BenchmarkJudge | None = None, retriever=None,
             dialect: Dialect | None = None, engine: Engine | None = None) -> list[dict[str, Any]]:
    """Evaluate checkpoints on benchmarks (defaults: `evaluation.checkpoints`, `evaluation.benchmarks`): sample
    items (manifest), roll the Solver out (stored trajectories are reused), judge, and write items.jsonl and
    summary.json for each pair. Returns the summaries."""
    e = params.evaluation
    benchmarks = list(benchmarks or e.benchmarks)
    unknown = [b for b in benchmarks if b not in BENCHMARKS]
    if unknown:
        raise BenchmarkDataError(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    resolved = [c if isinstance(c, Checkpoint) else resolve_checkpoint(params, c)
                for c in (checkpoints or e.checkpoints)]
    dialect = dialect or get_dialect(params.model.dialect, params.model.base)
    retriever = retriever or open_retriever(params, progress=False)
    if policies is None or any(c.name not in policies for c in resolved):
        policies = {**(policies or {}), **open_policies(params, [c for c in resolved
                                                                 if c.name not in (policies or {})], engine=engine)}
    owns_judge = judge is None
    if judge is None:
        judge = make_benchmark_judge(params, engine or base_engine(policies))
    summaries = []
    try:
        selected = {name: select_items(params, name) for name in benchmarks}
        trust = calibrate_benchmark_judges(params, judge, {n: items for n, (items, _) in selected.items()})
        for name in benchmarks:
            items, manifest = selected[name]
            for ck in resolved:
                policy = policies[ck.name]
                folder = eval_dir(params, ck.name, name)
                trajectories = run_solver(params, policy, name, items, retriever=retriever, dialect=dialect,
                                          folder=folder)
                records, per_scorer = score_items(params, name, answered_from(name, items, trajectories), judge,
                                                  label=ck.name)
                for scorer, summary in per_scorer.items():  # every score says whether its judge passed its probe
                    jid, calibration = trust.get((name, scorer), (None, None))
                    summary.update(C.scorer_trust(calibration, jid))
                extra = {"judge_agreement": C.em_agreement(records)} if BENCHMARKS[name].kind == "short_form" else {}
                summaries.append(write_benchmark_results(params, folder, ck.name, name, records, per_scorer,
                                                         manifest, judge, extra))
                _write_checkpoint_summary(params, ck.name)
    finally:
        if owns_judge:
            judge.close()
    return summaries


#: Passages read from the start of the corpus to build the criterion graders' fact probes.
PROBE_PASSAGES = 2000


def calibrate_benchmark_judges(params: Params, judge: BenchmarkJudge, items: dict[str, list[Item]]
                               ) -> dict[tuple[str, str], tuple[str, Calibration]]:
    """Probe every judge the benchmarks in `items` need (`evaluation.calibration`; `scope_lib.evaluation.judge_probes`)
    and record the results in runs/<name>/eval/calibration.json (merged with earlier judges). Returns
    (benchmark, scorer) -> (judge id, calibration); empty when calibration is off."""
    cfg = params.evaluation.calibration
    if not cfg.enabled:
        return {}
    uses = C.judge_uses(params, {name: judge_settings(params, name) for name in items})
    # short-form and pairwise probes draw on the whole benchmark, questions outside the scored sample first
    pool = {name: load_benchmark(params, name).items if any(u.role in ("short_form", "pairwise") and name in
                                                             u.benchmarks for u in uses.values()) else scored
            for name, scored in items.items()}
    evaluated = {i.id for scored in items.values() for i in scored}
    passages, note = None, ""
    if any(u.role in ("criterion", "researchrubrics") for u in uses.values()):
        path = params.corpus_path
        if path.is_file():
            passages = read_corpus(path, on_error="skip", max_passages=PROBE_PASSAGES).passages
        else:
            note = f"the corpus {path} (retrieval.corpus) is not on this machine"
    results = C.calibrate_judges(params, judge, uses, pool, passages, note, evaluated)
    path = params.run_dir / "eval" / "calibration.json"
    known = read_json(path, "delete it; the next `scope eval` probes the judges again (cached replies)")["judges"] \
        if path.is_file() else {}
    known.update({jid: {**results[jid].to_record(), "id": jid, "benchmarks": use.benchmarks,
                        "scorers": [list(p) for p in use.scorers], "settings": vars(use.settings)}
                  for jid, use in uses.items()})
    atomic_write_json(path, {"thresholds": cfg.model_dump(), "judges": known})
    return {pair: (jid, results[jid]) for jid, use in uses.items() for pair in use.scorers}


def load_calibration(params: Params) -> dict[str, Any]:
    """The judges' calibrations recorded by `scope eval` (runs/<name>/eval/calibration.json), by judge id."""
    path = params.run_dir / "eval" / "calibration.json"
    return read_json(path, "delete it; the next `scope eval` probes the judges again")["judges"] \
        if path.is_file() else {}


def untrusted_judges(summaries: list[dict[str, Any]]) -> dict[str, tuple[Calibration, list[str]]]:
    """The judges of these summaries that failed their probe: id -> (calibration, the benchmarks they scored)."""
    found: dict[str, tuple[Calibration, list[str]]] = {}
    for s in summaries:
        for v in s["scorers"].values():
            if v.get("trusted") is False:
                calibration = Calibration.from_record(v["calibration"])
                benchmarks = found.setdefault(v["judge_id"], (calibration, []))[1]
                if s["benchmark"] not in benchmarks:
                    benchmarks.append(s["benchmark"])
    return found


def _write_checkpoint_summary(params: Params, checkpoint: str) -> None:
    folder = eval_dir(params, checkpoint)
    merged = {}
    for path in sorted(folder.glob("*/summary.json")):
        s = read_json(path, "delete it; the next `scope eval` rewrites it from the stored records")
        merged[s["benchmark"]] = {n: {k: v.get(k) for k in ("value", "ci95", "n_scored", "n_invalid_units", "trusted")}
                                  for n, v in s["scorers"].items()}
    atomic_write_json(folder / "summary.json", {"checkpoint": checkpoint, "benchmarks": merged})


def load_summary(params: Params, checkpoint: str, benchmark: str) -> dict[str, Any] | None:
    path = eval_dir(params, checkpoint, benchmark) / "summary.json"
    return read_json(path, "delete it; the next `scope eval` rewrites it from the stored records") \
        if path.is_file() else None
