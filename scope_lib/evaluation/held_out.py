"""The learning check's held-out task set: M0's tasks on documents training never samples (not in the paper).

    held_out = held_out_set(params)    # or: scope learning-check build PARAMS
    held_out.tasks, held_out.window, held_out.grader

The last `learning_check.held_out_documents` documents of the run's document permutation
(`retrieval.corpus.held_out_documents`), which training never samples (`retrieval.corpus.training_documents`), less
the documents a warm-started M0's teacher wrote traces from (`held_out_candidates`: M0 may have memorised them). M0's
Challenger (adapters off: the iteration-0 Challenger) writes one task per document, batch by batch, through the
task pool's batch step (`selfplay.tasks.candidate_batch`): the frozen Judge gates it and writes its rubrics; K
rollouts of M0's Solver at the training sampling, graded by the Judge, give M0's mean rubric score ḡ; tasks with ḡ
in the difficulty window widened by `window_margin` are kept, one per document, until `learning_check.tasks`, each
with its source document's text (the learning check's judge-free measures read it). Built once per (M0's weights,
corpus bytes, every parameter that shapes a task or its score) under $SCOPE_CACHE_DIR/heldout/ (or
~/.cache/scope/heldout/), resumed batch by batch like the task pool (`runs.finished_chunks`), reused by every run
and checkpoint of that configuration.

Once per set the frozen Judge's per-rubric grader answers the calibration probe (`probe_held_out_grader`,
`selfplay.grader_probe.probe_self_judge`: a rubric's fact stated, removed or swapped in sentences of the corpus),
stored beside the set: the check (`evaluation.learning_check`) scores with that grader and says whether to trust it.
The Judge's gates and rubric writer answer their probes too (`probe_held_out_stages`, `selfplay.stage_probes`), stored
beside it (`held_out_stage_probes` reads them back): the gates chose the set's tasks, the rubric writer their rubrics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scope_lib.config import Params, ParamsError, cache_dir
from scope_lib.models.engine import Engine
from scope_lib.models.loading import make_engine, model_source
from scope_lib.protocol import prompts
from scope_lib.protocol.dialects import Dialect, get_dialect
from scope_lib.retrieval.corpus import held_out_documents, read_corpus, training_documents
from scope_lib.retrieval.index import cached_corpus_sha256, open_retriever
from scope_lib.runs import RunError, Stage, atomic_write_json, finished_chunks, read_json
from scope_lib.selfplay.grader_probe import Calibration, probe_self_judge, unseen_by_teacher
from scope_lib.selfplay.judge import Judge, make_judge
from scope_lib.selfplay.stage_probes import StageProbes, probe_judge_stages
from scope_lib.selfplay.tasks import TaskEvaluation, candidate_batch, filter_tasks

log = logging.getLogger(__name__)

#: Bump when what a held-out task is changes in code (not in params or prompts): every cached set is rebuilt.
#: 2: teacher documents left out, source documents stored, the grader probe's name-list negatives (issue 47).
HELD_OUT_VERSION = 2


def seed_of(*parts: Any) -> int:
    """A stable 31-bit seed from named parts (the same in every process and Python version)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


# -- the set ---------------------------------------------------------------------------------------


@dataclass
class HeldOutSet:
    """The frozen held-out tasks (gated, with rubrics, M0's pre-screen in `solver_scores` / `mean_score`) and the
    folder they live in."""

    path: Path
    key: str
    tasks: list[TaskEvaluation]
    summary: dict[str, Any]
    grader: Calibration | None = None  # the frozen Judge's grader probe (`grader_probe`), None until it ran
    documents: dict[str, str] = field(default_factory=dict)  # document id -> its text (title and passage)
    model: str = ""  # M0's identity (`model_identity`): what M0's own evaluation is keyed by

    @property
    def window(self) -> tuple[float, float]:
        lo, hi = self.summary["window"]
        return lo, hi


def screen_window(params: Params) -> tuple[float, float]:
    """The pre-screen's window: selfplay.difficulty_window widened by `learning_check.window_margin` on each side,
    clipped to [0, 1]."""
    lo, hi = params.selfplay.difficulty_window
    margin = params.learning_check.window_margin
    return max(0.0, round(lo - margin, 6)), min(1.0, round(hi + margin, 6))


def model_identity(params: Params) -> str:
    """M0 as the cache key sees it: its name, and for a local folder (the tiny, warm-started and `pypi:` models
    live in folders named by their own cache keys) the folder's name and the sha256 of its config.json and of each
    weight file's bytes (`file_sha256`), so an M0 rebuilt in place with other weights is another M0. A hub id
    stays its name (its weights are the hub's). Call `smoke.warm_start.prepare(params)` first for a warm-started
    M0 (the `scope` commands and notebooks do)."""
    source = Path(model_source(params))
    if not source.is_dir():
        return params.model.base
    digest = hashlib.sha256()
    files = [source / "config.json"] + sorted(source.glob("*.safetensors")) + sorted(source.glob("*.bin"))
    for file in (f for f in files if f.is_file()):
        digest.update(f"{file.name}:{file_sha256(file)}\n".encode())
    return f"{params.model.base}|{source.name}|{digest.hexdigest()[:16]}"


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read once and cached under the `digests` cache folder by (absolute path, size,
    mtime in ns): a 7B model's 15 GB are read once, then each check costs one stat per file. A
    file rewritten in place gets a new mtime, so it is read again."""
    stat = path.stat()
    resolved = str(path.resolve())
    stamp = {"path": resolved, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    record = cache_dir("digests") / f"{hashlib.sha256(resolved.encode()).hexdigest()[:24]}.json"
    if record.is_file():
        try:
            cached = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError):
            cached = {}
        if {k: cached.get(k) for k in stamp} == stamp and cached.get("sha256"):
            return cached["sha256"]
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    atomic_write_json(record, {**stamp, "sha256": sha})
    return sha


_RETRIEVAL_OPERATIONAL = {"corpus_url", "corpus_sha256", "fetch_max_passages", "index_dir", "memory_budget_gb",
                          "chroma_mode", "chroma_host", "chroma_port", "server_url", "timeout_s", "embed_batch_size",
                          "add_batch_size", "embedding_cache", "shard_passages", "embedder_device", "faiss_gpu"}
#: The Judge's settings that decide no verdict of the set: how many answer-check probes run when a run opens.
_JUDGE_OPERATIONAL: dict = {"calibration": {"answer_match_items"}}


def held_out_fingerprint(params: Params, model_id: str, corpus_sha256: str) -> dict[str, Any]:
    """Everything a held-out task and M0's pre-screen depend on: M0, the corpus bytes and slice, the document
    permutation, the reserved documents, K, the batch size, the window, the Challenger's and Solver's prompts,
    sampling and budgets, the Judge, retrieval and the generation back end (vLLM and transformers sample
    differently). Not `learning_check.tasks`: asking for more tasks extends the same set."""
    p, lc = params, params.learning_check
    return {
        "version": HELD_OUT_VERSION, "model": model_id, "dialect": p.model.dialect, "dtype": p.model.dtype,
        "max_model_len": p.model.max_model_len, "engine": p.engine.backend,
        "corpus": {"sha256": corpus_sha256, "max_passages": p.retrieval.max_passages,
                   "on_error": p.retrieval.on_error},
        "permutation_seed": p.selfplay.seed, "window": list(screen_window(p)),
        "learning_check": lc.model_dump(mode="json", include={"held_out_documents", "samples", "batch_size"}),
        "selfplay": p.selfplay.model_dump(mode="json", include={"task_types", "search_turn_strata",
                                                                "document_max_tokens", "rollout_prompt_tokens"}),
        "challenger": p.challenger.model_dump(mode="json", include={"max_prompt_tokens", "max_turns",
                                                                    "max_new_tokens_per_turn", "max_response_tokens",
                                                                    "temperature", "top_p"}),
        "solver": p.solver.model_dump(mode="json", include={"max_prompt_tokens", "max_searches", "max_turns",
                                                            "prompt", "max_new_tokens_per_turn",
                                                            "max_response_tokens", "temperature", "top_p"}),
        "judge": p.judge.model_dump(mode="json", exclude=_JUDGE_OPERATIONAL | (  # SCOPE's stages; an option added
            {} if p.judge.distinct_rubrics else {"distinct_rubrics": True})),  # later counts away from its default
        "retrieval": p.retrieval.model_dump(mode="json", exclude=_RETRIEVAL_OPERATIONAL),
        "prompts": prompts.protocol_fingerprint(),
    }


def held_out_folder(params: Params, model_id: str, corpus_sha256: str, root: str | Path | None = None
                    ) -> tuple[Path, str, dict[str, Any]]:
    """(folder, key, fingerprint) of the held-out set these params ask for: <root>/<model>-<key>, root defaulting to
    the cache folder `heldout` ($SCOPE_CACHE_DIR/heldout, else ~/.cache/scope/heldout)."""
    fingerprint = held_out_fingerprint(params, model_id, corpus_sha256)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", params.model.base)[-40:].strip("-.") or "model"  # no leading '-
    base = Path(root) if root is not None else cache_dir("heldout")
    return base / f"{slug}-{key}", key, fingerprint


@dataclass
class CheckComponents:
    """What the check runs on: M0's engine (adapters off: the pre-screen's Challenger and Solver; adapters on it
    serve checkpoints), the frozen Judge, the retriever, the dialect, and the corpus (read when a build needs it)."""

    engine: Engine
    judge: Judge
    retriever: Any
    dialect: Dialect
    passages: list | None = None


def open_components(params: Params, *, engine: Engine | None = None, judge: Judge | None = None, retriever=None,
                    passages: list | None = None, dialect: Dialect | None = None) -> CheckComponents:
    """The check's components from the params, each one given being used as it is. The Judge is M0 on `engine`
    (another model only where `judge.model` names one), as in training."""
    engine = engine or make_engine(params, "policy")
    if judge is None:
        others: dict[str, Engine] = {}

        def engine_for(name: str) -> Engine:
            if name == params.model.base:
                return engine
            if name not in others:
                others[name] = make_engine(params, "judge", name=name)
            return others[name]

        judge = make_judge(params, engine_for)
    return CheckComponents(engine, judge, retriever or open_retriever(params, progress=False),
                           dialect or get_dialect(params.model.dialect, params.model.base), passages)


def _corpus_sha256(params: Params, root: Path) -> str:
    corpus = Path(params.corpus_path)
    if not corpus.is_file():
        raise ParamsError(f"corpus {corpus} not found: run `scope data fetch --params PARAMS`, or point "
                          "retrieval.corpus (or $SCOPE_DATA_DIR) at the corpus the run trained on")
    slot = hashlib.sha256(str(corpus.resolve()).encode()).hexdigest()[:12]
    return cached_corpus_sha256(corpus, root / ".corpus" / slot)


def check_reserved(params: Params) -> None:
    """Refuse params that hold no document out of training: the check has nothing to run on."""
    if params.learning_check.held_out_documents == 0:
        raise ParamsError("learning_check.held_out_documents is 0: no documents are held out from training, so "
                          "there are none to check on. Set it (e.g. -o learning_check.held_out_documents=200) and "
                          "train the runs you compare with the same value")


def held_out_set(params: Params, components: CheckComponents | Any = None, *, model_id: str | None = None,
                 root: str | Path | None = None, progress: bool = True) -> HeldOutSet:
    """The held-out task set of these params, built on first use (module docstring, 1) and read back after.
    `components` (or a function returning them, called only when something must be built) default to
    `open_components(params)`; `model_id` to `model_identity(params)`; `root` to the `heldout` cache folder. A
    build killed mid-way resumes batch by batch; a set built for fewer tasks is extended with more batches; two
    processes building the same set wait for each other."""
    from filelock import FileLock

    check_reserved(params)
    folder, key, fingerprint = held_out_location(params, model_id, root)
    stage = Stage(folder)

    def short() -> bool:  # built, but for fewer tasks than asked while reserved documents remain
        summary = stage.summary
        return summary.get("stopped") == "target" and summary["tasks"] < params.learning_check.tasks

    opened: list[CheckComponents] = []

    def lent() -> CheckComponents:  # opened once, and only when something must be built or probed
        if not opened:
            opened.append(open_components(params) if components is None
                          else components() if callable(components) else components)
        return opened[0]

    if not stage.done or short():
        with FileLock(str(folder / ".lock")):
            if stage.done and short():
                (folder / "DONE").unlink()
            if not stage.done:
                atomic_write_json(folder / "fingerprint.json", fingerprint)
                stage.mark_done(_build(params, stage, lent(), key, progress))
    probe_beside(folder, params, lent)
    return load_held_out(folder, params)


def held_out_location(params: Params, model_id: str | None = None, root: str | Path | None = None
                      ) -> tuple[Path, str, dict[str, Any]]:
    """(folder, key, fingerprint) of the held-out set these params ask for, `model_id` defaulting to
    `model_identity(params)` and `root` to the `heldout` cache folder (`held_out_folder`; the corpus hashed once)."""
    base = Path(root) if root is not None else cache_dir("heldout")
    return held_out_folder(params, model_id or model_identity(params), _corpus_sha256(params, base), base)


def probe_beside(folder: Path, params: Params, lent) -> None:
    """The frozen Judge's grader probe and its gate and rubric-writer probes, run once and stored in `folder` (the
    held-out set's) unless there already; `lent()` returns the components, called only when a probe must run."""
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    for name, probe in ((GRADER_PROBE, probe_held_out_grader), (STAGE_PROBES, probe_held_out_stages)):
        if not (folder / name).is_file():
            with FileLock(str(folder / ".lock")):
                if not (folder / name).is_file():
                    atomic_write_json(folder / name, probe(params, lent()).to_record())


def held_out_probes(folder: Path) -> tuple[Calibration | None, StageProbes | None]:
    """The grader probe and the gate and rubric-writer probes stored in a held-out folder (None where absent)."""
    grader, stages = Path(folder) / GRADER_PROBE, Path(folder) / STAGE_PROBES
    return (Calibration.from_record(read_json(grader, "delete it; the next check probes the grader again"))
            if grader.is_file() else None,
            StageProbes.from_record(read_json(stages, "delete it; the next check probes the Judge again"))
            if stages.is_file() else None)


#: The frozen Judge's grader probe, stored beside the held-out set it scores.
GRADER_PROBE = "grader_calibration.json"
#: The frozen Judge's gate and rubric-writer probes, stored beside the held-out set their verdicts chose.
STAGE_PROBES = "judge_stage_calibration.json"


def corpus_passages(params: Params, c: CheckComponents) -> list:
    """The corpus the check reads: the components' passages, else the run's corpus file."""
    if c.passages is not None:
        return c.passages
    r = params.retrieval
    return read_corpus(params.corpus_path, on_error=r.on_error, max_passages=r.max_passages).passages


def probe_held_out_stages(params: Params, c: CheckComponents) -> StageProbes:
    """The calibration probes of the frozen Judge's gates and rubric writer (`selfplay.stage_probes`): one batched
    gate call and one rubric call on tasks with known verdicts built from the corpus."""
    return probe_judge_stages(params, c.judge, corpus_passages(params, c))


def held_out_stage_probes(held_out: HeldOutSet) -> StageProbes | None:
    """The gate and rubric-writer probes stored beside a held-out set (None for a set built before they existed)."""
    path = held_out.path / STAGE_PROBES
    return StageProbes.from_record(read_json(path, "delete it; the next check probes the Judge again")) \
        if path.is_file() else None


def probe_held_out_grader(params: Params, c: CheckComponents) -> Calibration:
    """The calibration probe of the frozen Judge's per-rubric grader (module docstring, 4): one batched grading call
    on fact pairs from the corpus, seeded by the document permutation's seed."""
    return probe_self_judge(params, c.judge, corpus_passages(params, c))


def load_held_out(folder: str | Path, params: Params) -> HeldOutSet:
    """A finished held-out set read back from its folder: the first `learning_check.tasks` of its tasks (in batch
    order; `summary["built"]` says how many there are)."""
    stage = Stage(folder)
    summary = stage.summary
    if not summary:
        raise RunError(f"{folder} holds no finished held-out set (no DONE): build it with `scope learning-check "
                       "build PARAMS`")
    records = list(stage.records("tasks"))[:params.learning_check.tasks]
    tasks = [TaskEvaluation.from_record(rec) for rec in records]
    probe = Path(folder) / GRADER_PROBE
    grader = Calibration.from_record(read_json(probe, "delete it; the next check probes the grader again")) \
        if probe.is_file() else None
    fingerprint = Path(folder) / "fingerprint.json"
    model = read_json(fingerprint, "delete the folder; it is built again").get("model", "") \
        if fingerprint.is_file() else ""
    return HeldOutSet(Path(folder), summary["key"], tasks, {**summary, "built": summary["tasks"], "tasks": len(tasks)},
                      grader, {rec["document_id"]: rec["document"] for rec in records if "document" in rec}, model)


def held_out_candidates(params: Params, passages: list) -> list:
    """The documents the held-out set's tasks are written on: the reserved tail of the run's permutation
    (`retrieval.corpus.held_out_documents`) less every document a warm-started M0's teacher wrote traces from
    (`selfplay.grader_probe.unseen_by_teacher`), in the tail's order."""
    reserved = held_out_documents(passages, params.learning_check.held_out_documents, params.selfplay.seed)
    return unseen_by_teacher(params, reserved)


def success_rate(scores: list[float], threshold: float) -> float:
    """The share of rollouts whose rubric score g (eq. 1) reaches `threshold` (0 for no rollout)."""
    return sum(g >= threshold for g in scores) / len(scores) if scores else 0.0


def _build(params: Params, stage: Stage, c: CheckComponents, key: str, progress: bool) -> dict[str, Any]:
    """Write the held-out set's records into `stage` (resuming what a killed build left) and return its summary."""
    from tqdm.auto import tqdm

    lc, sp = params.learning_check, params.selfplay
    passages = corpus_passages(params, c)
    training_documents(params, len(passages))  # refuses a reservation as large as the corpus
    candidates, chunks, tasks = stage.records("candidates"), stage.records("chunks"), stage.records("tasks")
    finished = finished_chunks(candidates, chunks, tasks)
    candidates.retain(lambda rec: rec["chunk"] in finished)  # a batch a kill left half-written is redone
    tasks.retain(lambda rec: rec["chunk"] in finished)
    kept_per_batch = Counter(rec["chunk"] for rec in tasks)
    reserved = held_out_candidates(params, passages)
    contents = {p.id: p.contents for p in reserved}
    n_batches = math.ceil(len(reserved) / lc.batch_size)
    window = screen_window(params)
    bar = tqdm(total=lc.tasks, initial=min(lc.tasks, sum(kept_per_batch.values())), desc="held-out tasks",
               unit="task", leave=False, disable=not progress)
    stopped = "documents ran out"
    for k in range(n_batches):
        before = sum(n for b, n in kept_per_batch.items() if b < k)
        if before >= lc.tasks:
            stopped = "target"
            break
        if k in finished:
            continue
        unparseable = c.judge.stats.totals()["unparseable"]
        batch = candidate_batch(  # M0 writes (adapters off) and M0 screens, at the training sampling and grading
            reserved[k * lc.batch_size:(k + 1) * lc.batch_size], params=params, engine=c.engine,
            retriever=c.retriever, dialect=c.dialect, judge=c.judge, tokenizer=c.engine.tokenizer,
            prompt_seed=seed_of("held-out", sp.seed, k), id_prefix=f"h{k:04d}-",
            challenger_seed=seed_of("held-out/challenger", sp.seed, k),
            screen_seed=seed_of("held-out/screen", sp.seed, k), n_solver=lc.samples, challenger_adapter=None,
            solver_adapter=None, grading_temperature=params.judge.grading_temperature)
        evals, written, screened = batch.evaluations, batch.written, batch.screened
        kept = filter_tasks(evals, window, 1)  # every one: a set asked for more tasks later grows by whole batches
        kept_ids = {e.challenger_id for e in kept}
        by_id = {t.id: t for t in batch.trajectories}
        candidates.append({"id": e.challenger_id, "chunk": k, "kept": e.challenger_id in kept_ids,
                           "evaluation": e.to_record(), "trajectory": by_id[e.challenger_id].to_record()}
                          for e in evals)
        tasks.append({**e.to_record(), "id": e.challenger_id, "chunk": k, "document": contents[e.document_id],
                      "m0_success_rate": success_rate(e.solver_scores, lc.success_threshold)} for e in kept)
        chunks.append([{"id": f"chunk-{k:04d}", "chunk": k, "candidates": len(evals), "kept": len(kept),
                        "with_task": sum(e.task is not None for e in evals),
                        "passed_gates": sum(e.gates_passed for e in evals),
                        "engine_calls": written.engine_calls + screened.engine_calls,
                        "judge_unparseable": c.judge.stats.totals()["unparseable"] - unparseable}])
        finished.add(k)
        kept_per_batch[k] = len(kept)
        bar.update(min(len(kept), max(0, lc.tasks - bar.n)))
    else:
        if sum(kept_per_batch.values()) >= lc.tasks:
            stopped = "target"
    bar.close()
    kept_records = list(tasks)
    markers = list(chunks)
    scores = [rec["mean_score"] for rec in kept_records]
    lo, hi = sp.difficulty_window
    summary = {"key": key, "tasks": len(kept_records), "asked": lc.tasks, "candidates": len(candidates),
               "batches": len(markers), "documents": sum(m["candidates"] for m in markers),
               "held_out_documents": lc.held_out_documents, "teacher_documents_left_out":
               lc.held_out_documents - len(reserved), "window": list(window),
               "difficulty_window": [lo, hi], "in_difficulty_window": sum(lo <= g <= hi for g in scores),
               "m0_mean_score": sum(scores) / len(scores) if scores else None, "samples": lc.samples,
               "judge_unparseable": sum(m.get("judge_unparseable", 0) for m in markers), "stopped": stopped}
    log.info("held-out set %s: %d task(s) of %d candidate(s) on %d reserved document(s), M0's mean rubric score in "
             "[%.2f, %.2f] (%d inside the difficulty window) -> %s", key, summary["tasks"], summary["candidates"],
             summary["documents"], window[0], window[1], summary["in_difficulty_window"], stage.path)
    if len(kept_records) < 2:
        log.warning("the held-out set has %d task(s): too few to compare checkpoints. M0's tasks fell outside "
                    "[%.2f, %.2f]; raise learning_check.held_out_documents or window_margin", len(kept_records),
                    *window)
    return summary
