"""The four methods side by side under one budget, on one held-out yardstick (issue 49, items 2-4; docs/methods.md,
"Methods compared").

    comparison = compare_methods("params/compare-smoke.yaml")    # or: scope compare-methods params/compare-smoke.yaml
    comparison.methods["spice"]["measures"]["score"]["trained"]  # SPICE's Reasoner against M0: gain, 95% interval
    comparison.markdown()                                        # the table; runs/<name>/comparison.{json,md}

Not in any of the papers: each compares itself with baselines on its own stack, so no two of their tables can be
read together. Here one spec (a params file with a `compare` section) fixes for every method:

1. **One base, corpus, index, seed and budget** (`method_params`): each method's own params file (`compare.methods`)
   with the spec's values of SHARED_SECTIONS and SHARED_KEYS laid over it: the base model M0, the corpus and the
   index (one index folder for all), `selfplay.seed` (so every run reserves the same held-out documents) and
   `grpo.seed`, and the budget, BUDGET: the same iterations and optimiser steps per role for every method. Tokens
   generated and wall time are not fixed but reported (`run_costs`, from each run's metrics).
2. **Each method trained, and its control** (`train_runs`): `<name>-<method>` and, with `compare.controls`,
   `<name>-<method>-control` (`grpo.reward_control: shuffled`: the Solver's rewards permuted within each batch), each
   by `scope train` itself (`cli.train_run`: the run's resolved params in a process of its own), which resumes a
   stopped run; a run whose every stage is DONE with these parameters is not opened again.
3. **One yardstick** (`evaluate_methods`): the learning check's held-out set of the spec (M0's tasks on documents
   no method trains on), every method's answering checkpoint (`answering_checkpoint`: the Solver, SPICE's Reasoner;
   with a shared policy the newest adapter either role trained) and its control's answering the held-out tasks
   under one protocol (the spec's Solver prompt and budgets, K rollouts at the same seeds), scored by the frozen
   M0 grader (the rubric score, eq. 1) and the judge-free measures (`evaluation.judge_free`), each paired against
   M0 and against the control with the check's bootstrap (`learning_check.check_of`, one check per method). Beside
   them, with no judge: the gold-answer slice (`evaluation.gold_slice`: held-out questions with typed gold answers
   written once by M0 with SPICE's Challenger, answered under the same protocol at the same seeds, verified by
   SPICE's rule; `compare.gold`), and the short-form QA benchmarks of `scope eval` (`compare.benchmarks`: exact
   match and F1, `benchmark_values`), each paired the same way (`paired_measure`).
4. **Home ground** (HOME_GROUND): SCOPE and SCORE train on judged rubric-like scores, so the rubric score is their
   home ground; SPICE and SSP train on verified gold answers, so the gold-answer slice is theirs.
5. **Two verdicts per method**, both by the check's rule (`learning_check.learning_verdict`): on the rubric score
   (`verdict`, the check's own) and on the method's home measure (`home_verdict`): for SCOPE and SCORE the same
   verdict; for SPICE and SSP the gold slice's pass rate under the rule without its judge gates (no judge scored it).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from scope_lib.config import Params, ParamsError, load_params
from scope_lib.evaluation.benchmarks import BENCHMARKS, select_items
from scope_lib.evaluation.evaluate import (
    Checkpoint,
    answered_from,
    eval_dir,
    load_summary,
    resolve_checkpoint,
    run_solver,
    score_items,
    write_benchmark_results,
)
from scope_lib.evaluation.gold_slice import empty_reason, gold_slice, gold_text, grade_gold
from scope_lib.evaluation.held_out import HeldOutSet
from scope_lib.evaluation.judge_free import fact_recall
from scope_lib.evaluation.learning_check import (
    CheckpointEvaluation,
    Comparison,
    LearningCheck,
    Verdict,
    check_of,
    check_training,
    checkpoint_fingerprint,
    compare_evaluations,
    compare_values,
    evaluate_checkpoint,
    evaluate_checkpoints,
    learning_verdict,
    opener,
    stored_evaluation,
    unique_names,
)
from scope_lib.evaluation.pooled_check import LABELS, first_rollouts, task_order
from scope_lib.runs import (
    RunError,
    atomic_write_json,
    atomic_write_text,
    iteration_dir,
    params_hash,
    read_json,
    read_jsonl,
)

log = logging.getLogger(__name__)

#: Sections the spec sets whole on every method: one corpus and index, one held-out set, one machine.
SHARED_SECTIONS = ("retrieval", "learning_check", "engine")
#: Keys the spec sets on every method: M0, the seeds, the budget, where runs and data live and how often a stage
#: saves a resumable checkpoint (`run.checkpoint_steps`, outside the parameter hash: it changes no result).
SHARED_KEYS = ("model.base", "model.dialect", "model.dtype", "model.max_model_len", "model.tiny", "model.warm_start",
               "selfplay.seed", "grpo.seed", "selfplay.iterations", "selfplay.steps_per_role",
               "selfplay.challenger_steps", "run.runs_dir", "run.data_dir", "run.checkpoint_steps")
#: The budget: optimiser steps per role (iterations x steps per role; the Challenger's where they differ).
BUDGET = ("selfplay.iterations", "selfplay.steps_per_role", "selfplay.challenger_steps")
#: What each method trains on, and which of the yardstick's measures is its home ground (None: none is).
HOME_GROUND: dict[str, tuple[str | None, str]] = {
    "scope": ("score", "judged rubric scores: the frozen Judge grades the Solver's answer on the Challenger's "
              "rubrics (eq. 1, 6)"),
    "score": ("score", "judged rubric-like scores: its own Evaluator's weighted rubric dimensions (§3.5)"),
    "spice": ("gold", "verified gold answers: the Reasoner's answer checked by rule against the Challenger's typed "
              "answer (§2.3)"),
    "ssp": ("gold", "verified gold answers: the Solver's answer checked against the Proposer's ground-truth "
            "answer (eq. 6)"),
}
#: The gold-answer slice's measure: the share of a question's K answers the rule verifies (exact match per type).
GOLD, GOLD_LABEL = "gold", "gold-answer pass rate"
#: Each short-form benchmark's measures (`scorers.QAMetrics`): exact match and token F1.
BENCHMARK_METRICS = {"em": "EM", "f1": "F1"}
#: The yardstick's measures in the table's order: the rubric score, then the judge-free measures.
MEASURES = tuple(LABELS)
#: The comparisons of each method: trained and control against M0, trained against control.
PAIRS = ("trained", "control", "over_control")
#: Where the comparison is written, in the spec's run folder.
JSON_NAME, MARKDOWN_NAME, WALL_NAME = "comparison.json", "comparison.md", "training_wall.json"


# -- the spec and each method's params ---------------------------------------------------------------------------


def load_spec(path: str | Path, overrides: list[str] | dict[str, Any] | None = None) -> Params:
    """A comparison's spec: a params file whose `compare.methods` names registered methods."""
    from scope_lib.selfplay.methods import METHODS

    spec = load_params(path, overrides or [])
    if not spec.compare.methods:
        raise ParamsError(f"{path}: compare.methods is empty: name each method's params file (e.g. "
                          "params/compare-smoke.yaml)")
    unknown = [m for m in spec.compare.methods if m not in METHODS]
    if unknown:
        raise ParamsError(f"{path}: compare.methods names {', '.join(unknown)}: not a registered method "
                          f"({', '.join(METHODS)})")
    short = [b for b, s in BENCHMARKS.items() if s.kind == "short_form"]
    other = [b for b in spec.compare.benchmarks if b not in short]
    if other:
        raise ParamsError(f"{path}: compare.benchmarks names {', '.join(other)}: not a short-form QA benchmark "
                          f"scored by exact match ({', '.join(short)})")
    return spec


def dotted_value(params: Params, key: str) -> Any:
    """The value at a dotted key of `params` (`selfplay.seed`), a section as its JSON-ready dict."""
    node: Any = params
    for part in key.split("."):
        node = getattr(node, part)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


def method_params(spec: Params, spec_path: str | Path, method: str, *, control: bool = False) -> Params:
    """`method`'s params file (relative to the spec's folder) with the spec's shared sections and keys, its run
    named `<spec name>-<method>[-control]` (the control: `grpo.reward_control: shuffled`) and the index in the
    spec's index folder (`retrieval.index_dir`, default <spec run>/index) for all."""
    shared = {s: dotted_value(spec, s) for s in SHARED_SECTIONS} | {k: dotted_value(spec, k) for k in SHARED_KEYS}
    shared["retrieval"]["index_dir"] = spec.retrieval.index_dir or str(spec.run_dir / "index")
    shared["run.name"] = f"{spec.run.name}-{method}" + ("-control" if control else "")
    shared["grpo.reward_control"] = "shuffled" if control else "none"
    path = Path(spec_path).parent / spec.compare.methods[method]
    params = load_params(path, shared)
    if params.method != method:
        raise ParamsError(f"compare.methods.{method}: {path} trains method {params.method!r}, not {method!r}")
    return params


def run_finished(params: Params) -> bool:
    """Every stage of every iteration DONE, and the run's manifest hashed from these parameters (a run started with
    others is opened by `scope train`, which refuses it, saying so)."""
    from scope_lib.selfplay.loop import science_yaml
    from scope_lib.selfplay.methods import method_for

    manifest = params.run_dir / "manifest.json"
    if not manifest.is_file() or read_json(manifest).get("params_hash") != params_hash(science_yaml(params)):
        return False
    return all((iteration_dir(params.run_dir, t) / spec.name / "DONE").is_file()
               for t in range(1, params.selfplay.iterations + 1) for spec in method_for(params).stages)


def train_runs(spec: Params, spec_path: str | Path, train: Callable[[Params], Any]) -> dict[str, dict[str, Params]]:
    """Train every method and its control (module docstring, 2) with `train(params)` (`scope compare-methods`:
    `scope train` in a process of its own, `cli.train_run`), skipping finished runs. Each run's wall time, summed
    over the calls that trained it (a call stopped or failed mid-run included; one whose `compare-methods` was
    killed outright adds nothing), is kept in <spec run>/training_wall.json.
    Returns method -> {"trained": params, "control": params}."""
    from scope_lib.runs import lock_run, log_to_run_file

    wall_file = spec.run_dir / WALL_NAME
    runs = {m: {kind: method_params(spec, spec_path, m, control=kind == "control")
                for kind in ("trained", "control") if kind == "trained" or spec.compare.controls}
            for m in spec.compare.methods}
    for kinds in runs.values():
        for params in kinds.values():
            if run_finished(params):
                log.info("%s: every stage DONE with these parameters: not trained again", params.run_dir)
                continue
            lock_run(params.run_dir)
            log_to_run_file(params.run_dir)
            started = time.perf_counter()
            try:
                train(params)
            finally:  # a call stopped or failed mid-run spent its time too
                walls = read_json(wall_file) if wall_file.is_file() else {}
                walls[params.run.name] = round(walls.get(params.run.name, 0.0) + time.perf_counter() - started, 2)
                atomic_write_json(wall_file, walls)
    log_to_run_file(spec.run_dir)
    return runs


# -- what each run leaves: its answering checkpoint and its costs ------------------------------------------------


def answering_checkpoint(params: Params) -> Checkpoint | None:
    """The weights that answer for a finished run: the newest saved stage that trained the Solver's weights (the
    Solver's stage; with `model.shared_policy` the newest stage that trained either role, as a resumed run restores
    them); None when no stage saved any (the answering weights are M0's). Named after the run."""
    from scope_lib.selfplay.methods import method_for

    stages = [spec for spec in method_for(params).stages if spec.trains
              and (params.model.shared_policy or spec.trains == "solver")]
    for t in range(params.selfplay.iterations, 0, -1):
        for spec in reversed(stages):
            folder = iteration_dir(params.run_dir, t) / spec.name
            saved = [folder / n for n in ("adapter", "model") if (folder / n).is_dir()]
            if (folder / "DONE").is_file() and saved:
                return replace(resolve_checkpoint(params, str(saved[0])), name=f"{params.run.name}-{t:02d}-{spec.name}")
    return None


def _mean(values: list) -> float | None:
    kept = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None


def run_costs(params: Params, wall_s: float | None) -> dict[str, Any]:
    """What a run spent and the signals of its training, read from its records: per training stage (the role it
    trains, by the stage's name: SCORE's `evaluator`, SPICE's Reasoner in `solver`), optimiser steps,
    tokens generated, seconds of its steps, and the means of its reward, zero-spread share, entropy and every
    validity rate its method records (metrics named `*valid*rate`, SPICE's `task_rate`); the health alarms by
    name; the run's wall time as `compare_methods` measured it (None: trained elsewhere)."""
    from scope_lib.selfplay.health import read_alarms

    by_role: dict[str, list[dict[str, Any]]] = {}
    for metrics in sorted(params.run_dir.glob("iter_[0-9]*/*/metrics.jsonl")):
        for m in read_jsonl(metrics):
            by_role.setdefault(metrics.parent.name, []).append(m)   # the stage: SCORE's Evaluator is its own
    out: dict[str, Any] = {"roles": {}, "alarms": dict(Counter(a.get("alarm") for a in read_alarms(params.run_dir))),
                           "wall_s": wall_s}
    for role, steps in by_role.items():
        validity = sorted({k for m in steps for k in m if ("valid" in k and k.endswith("rate")) or k == "task_rate"})
        out["roles"][role] = {
            "steps": len(steps), "generated_tokens": sum(int(m.get("generated_tokens") or 0) for m in steps),
            "step_s": round(sum(float(m.get("time_step_s") or 0.0) for m in steps), 2),
            "reward": _mean([m.get("reward") for m in steps]),
            "zero_spread_share": _mean([m.get("zero_spread_share") for m in steps]),
            "entropy": _mean([m.get("entropy") for m in steps]),
            "validity": {k: _mean([m.get(k) for m in steps]) for k in validity}}
    out["steps"] = sum(r["steps"] for r in out["roles"].values())
    out["generated_tokens"] = sum(r["generated_tokens"] for r in out["roles"].values())
    out["step_s"] = round(sum(r["step_s"] for r in out["roles"].values()), 2)
    return out


# -- the yardstick ------------------------------------------------------------------------------------------------


def _pair(c: Comparison | None) -> dict[str, Any] | None:
    return None if c is None else {"gain": c.gain, "ci95": list(c.ci95), "tasks": c.n_tasks,
                                   "mean_before": c.mean_before, "mean_after": c.mean_after}


def method_measures(check: LearningCheck, method: str, *, n_samples: int, seed: int) -> dict[str, dict[str, Any]]:
    """Every measure of one method's check: the means of M0, the trained Solver and the control, and the three
    paired comparisons (PAIRS) with their 95% intervals (the success rate's compared here as the check compares
    its rubric score); `home` marks the method's home ground."""
    home = HOME_GROUND.get(method, (None, ""))[0]
    jf, evs = check.judge_free, check.evaluations
    roles = {"M0": "before", "trained": "after", "control": "control"}
    out: dict[str, dict[str, Any]] = {}
    for m in MEASURES:
        if m == "score":
            means = {who: evs[r].mean_score for who, r in roles.items() if r in evs}
            pairs = {"trained": check.trained, "control": check.control, "over_control": check.over_control}
        elif m == "success":
            means = {who: evs[r].success_rate for who, r in roles.items() if r in evs}
            pairs = {name: compare_evaluations(evs[b], evs[a], metric=m, n_samples=n_samples, seed=seed)
                     if a in evs and b in evs else None
                     for name, (b, a) in {"trained": ("before", "after"), "control": ("before", "control"),
                                          "over_control": ("control", "after")}.items()}
        else:
            means = {who: jf.mean(r, m) for who, r in roles.items() if jf and r in jf.values}
            pairs = {name: (jf.comparisons.get(name) or {}).get(m) if jf else None for name in PAIRS}
        out[m] = {"label": LABELS[m], "home": m == home, "means": means,
                  **{name: _pair(pairs[name]) for name in PAIRS}}
    return out


def side_by_side(held_out: HeldOutSet, evaluations: dict[str, CheckpointEvaluation], n: int
                 ) -> list[dict[str, Any]]:
    """The first `n` held-out tasks by task id with their rubrics and each evaluation's first rollout (k0): its
    answer verbatim, rubric score g and rubric-fact recall (`pooled_check.first_rollouts`)."""
    rollouts = {who: first_rollouts(held_out.path, {"checkpoint": ev.checkpoint, "fingerprint": ev.fingerprint,
                                                    "seed": ev.seed})
                for who, ev in evaluations.items()}
    examples = []
    for task in sorted(held_out.tasks, key=lambda t: task_order(t.challenger_id))[:n]:
        rubrics = [r.text for r in task.rubrics or []]
        answers = {}
        for who, by_task in rollouts.items():
            r = by_task.get(task.challenger_id) or {}
            answers[who] = {"answer": r.get("answer"), "score": r.get("rubric_score"),
                            "fact_recall": fact_recall(r.get("answer"), rubrics)}
        examples.append({"task_id": task.challenger_id, "document_id": task.document_id, "task": task.task,
                         "rubrics": rubrics, "answers": answers})
    return examples


@dataclass
class Yardstick:
    """Every answering checkpoint's evaluations, keyed `<method>` / `<method>-control` (and `before` for M0): on the
    held-out set, on the gold-answer slice (None: `compare.gold.tasks` is 0; no evaluation when it is empty), and
    on each benchmark (`benchmark_values`: benchmark -> metric -> item -> value); `left`: what each run left."""

    held_out: HeldOutSet
    evaluations: dict[str, CheckpointEvaluation]
    left: dict[str, dict[str, Any]]
    gold: HeldOutSet | None = None
    gold_evaluations: dict[str, CheckpointEvaluation] = field(default_factory=dict)
    benchmarks: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)


def evaluate_methods(spec: Params, runs: dict[str, dict[str, Params]],
                     lend: Callable[[dict[str, Checkpoint]], dict[str, Any]] | None = None) -> Yardstick:
    """Every run's answering checkpoint and M0 on the spec's held-out set (`learning_check.evaluate_checkpoints`),
    on the gold-answer slice (`gold_evaluations`) and on `compare.benchmarks` (`benchmark_values`), all through one
    opener: one engine for all, stored results read back, nothing loads when all are stored. A run that saved no
    weights answers as M0. `lend(checkpoints)` returns models to lend the evaluation (tests, notebooks)."""
    checkpoints: dict[str, Checkpoint] = {"before": resolve_checkpoint(spec, "base")}
    left: dict[str, dict[str, Any]] = {}
    for method, kinds in runs.items():
        for kind, params in kinds.items():
            key = method if kind == "trained" else f"{method}-control"
            ck = answering_checkpoint(params)
            left[key] = {"run": params.run.name, "checkpoint": ck.name if ck else None,
                         "path": str(Path(params.run.name) / ck.path.relative_to(params.run_dir))
                         if ck and ck.path else None, "untrained": ck is None}
            if ck is not None:
                check_training(spec, ck, "after" if kind == "trained" else "control")
                checkpoints[key] = ck
    checkpoints = unique_names(checkpoints)
    lent = lend(dict(checkpoints)) if lend else {}
    open_all = opener(spec, list(checkpoints.values()), engine=lent.get("engine"),
                      components=lent.get("components"), policies=lent.get("policies"))
    progress = lent.get("progress", True)
    held_out, evaluations = evaluate_checkpoints(spec, checkpoints, opened=open_all, model_id=lent.get("model_id"),
                                                 root=lent.get("root"), progress=progress)
    gold, gold_evs = gold_evaluations(spec, held_out, checkpoints, open_all, progress)
    benches = {key: {b: benchmark_values(spec, ck, b, held_out.model, open_all) for b in spec.compare.benchmarks}
               for key, ck in checkpoints.items()}
    for key in left:  # a run that saved no weights answers as M0
        evaluations.setdefault(key, evaluations["before"])
        benches.setdefault(key, benches["before"])
        if gold_evs:
            gold_evs.setdefault(key, gold_evs["before"])
    return Yardstick(held_out, evaluations, left, gold, gold_evs, benches)


def gold_evaluations(spec: Params, held_out: HeldOutSet, checkpoints: dict[str, Checkpoint],
                     open_all: Callable[[], dict[str, Any]], progress: bool = True
                     ) -> tuple[HeldOutSet | None, dict[str, CheckpointEvaluation]]:
    """The gold-answer slice (`gold_slice.gold_slice`, built once by M0 beside the held-out set) and every
    checkpoint's K answers to its questions, as the held-out tasks are answered (`learning_check.
    evaluate_checkpoint`: the spec's Solver prompt and budgets, the check's seeds), verified by SPICE's rule
    (`gold_slice.grade_gold`), stored and read back as the held-out evaluations are. No slice when
    `compare.gold.tasks` is 0; an empty slice has no evaluation (the table says why)."""
    if not spec.compare.gold.tasks:
        return None, {}
    gold = gold_slice(spec, held_out, lambda: open_all()["components"], progress=progress)
    if not gold.tasks:
        log.warning("the gold-answer slice is %s", empty_reason(gold.summary))
        return gold, {}
    return gold, {key: stored_evaluation(spec, gold, ck) or evaluate_checkpoint(
        spec, gold, open_all()["policies"][ck.name], open_all()["components"], grade=grade_gold, progress=progress)
        for key, ck in checkpoints.items()}


def benchmark_params(spec: Params) -> Params:
    """The spec with `evaluation.max_examples` at `compare.benchmark_items`: the items each benchmark draws."""
    return spec.model_copy(update={"evaluation": spec.evaluation.model_copy(
        update={"max_examples": spec.compare.benchmark_items})})


def benchmark_values(spec: Params, ck: Checkpoint, benchmark: str, m0: str, open_all: Callable[[], dict[str, Any]]
                     ) -> dict[str, dict[str, float]]:
    """A checkpoint on a short-form benchmark as `scope eval` runs it (`evaluate.select_items`, `run_solver`: the
    benchmark's Solver prompt and §4.1's budgets, `evaluation.seeds`), scored with no judge by its official scorer
    (`scorers.QAMetrics`: exact match and F1), in <spec run>/eval/<checkpoint>-<weights' fingerprint>/<benchmark>/
    (a killed run resumes from its stored trajectories; a finished one is read back). Returns metric (em, f1) ->
    item id -> its mean over the seeds."""
    params = benchmark_params(spec)
    items, manifest = select_items(params, benchmark)
    name = f"{ck.name}-{checkpoint_fingerprint(ck, m0)[:12]}"
    folder = eval_dir(params, name, benchmark)
    summary = load_summary(params, name, benchmark)
    if summary is None or summary["manifest"]["ids_sha256"] != manifest["ids_sha256"] or \
            summary["seeds"] != sorted(params.evaluation.seeds) or not (folder / "items.jsonl").is_file():
        c = open_all()["components"]
        trajectories = run_solver(params, open_all()["policies"][ck.name], benchmark, items, retriever=c.retriever,
                                  dialect=c.dialect, folder=folder)
        records, scores = score_items(params, benchmark, answered_from(benchmark, items, trajectories), None,
                                      scorers=["official"], label=name)
        write_benchmark_results(params, folder, name, benchmark, records, scores, manifest, None)
    per_item: dict[str, list[dict[str, float]]] = {}
    for rec in read_jsonl(folder / "items.jsonl"):
        per_item.setdefault(rec["item_id"], []).append(rec["scores"]["official"]["metrics"])
    return {m: {item: sum(x[m] for x in got) / len(got) for item, got in per_item.items()} for m in BENCHMARK_METRICS}


#: The paired comparisons of a measure: (before, after) of trained − M0, control − M0 and trained − control.
PAIR_ROLES = {"trained": ("M0", "trained"), "control": ("M0", "control"), "over_control": ("control", "trained")}


def paired_comparisons(label: str, values: dict[str, dict[str, float]], *, n_samples: int, seed: int,
                       unit: str = "tasks") -> dict[str, Comparison | None]:
    """The three paired comparisons (PAIR_ROLES) of per-task values of M0, the trained Solver and the control
    (`values`, keyed like PAIR_ROLES) with the check's bootstrap (`learning_check.compare_values`; None under 2
    tasks or without one of the two); `unit`: what the values are over, in the verdict's words."""
    return {name: compare_values(b, a, label, values[b], values[a], n_samples=n_samples, seed=seed, unit=unit)
            if a in values and b in values else None for name, (b, a) in PAIR_ROLES.items()}


def paired_measure(label: str, home: bool, values: dict[str, dict[str, float]], *, n_samples: int, seed: int,
                   note: str | None = None) -> dict[str, Any]:
    """A measure's entry as `method_measures` writes one, from per-task values (`paired_comparisons`): their means
    and the three paired comparisons; `note` says why a measure has no values."""
    pairs = paired_comparisons(label, values, n_samples=n_samples, seed=seed)
    means = {who: _mean(list(v.values())) for who, v in values.items()}
    return {"label": label, "home": home, "means": means, **{name: _pair(c) for name, c in pairs.items()},
            **({"note": note} if note else {})}


def yardstick_measures(spec: Params, ys: Yardstick, keys: dict[str, str], home: str | None
                       ) -> dict[str, dict[str, Any]]:
    """The gold-answer slice's and the benchmarks' measures of one method (`keys`: M0, trained, control -> the
    evaluations' keys), each paired as the held-out measures are (`paired_measure`)."""
    lc = spec.learning_check
    pair = {"n_samples": lc.bootstrap_samples, "seed": lc.seed}
    out: dict[str, dict[str, Any]] = {}
    if ys.gold is not None:
        values, note = gold_values(ys, keys)
        out[GOLD] = paired_measure(GOLD_LABEL, home == GOLD, values, **pair, note=note)
    for b in spec.compare.benchmarks:
        for metric, label in BENCHMARK_METRICS.items():
            values = {who: ys.benchmarks[k][b][metric] for who, k in keys.items()}
            out[f"{b}_{metric}"] = paired_measure(f"{BENCHMARKS[b].column} {label}", False, values, **pair)
    return out


def gold_values(ys: Yardstick, keys: dict[str, str]) -> tuple[dict[str, dict[str, float]], str | None]:
    """Each question's pass rate for M0, the trained Solver and the control (`keys`: who -> the evaluations' keys;
    none for an empty slice), and why the slice can have no paired interval (None when it can)."""
    assert ys.gold is not None
    values = {who: ys.gold_evaluations[k].values("score") for who, k in keys.items() if k in ys.gold_evaluations}
    note = empty_reason(ys.gold.summary) if not ys.gold.tasks else \
        "one question: too few for a paired interval" if len(ys.gold.tasks) < 2 else None
    return values, note


def home_verdict(spec: Params, ys: Yardstick, keys: dict[str, str], home: str | None, verdict: Verdict
                 ) -> dict[str, Any]:
    """A method's verdict on its home measure (HOME_GROUND) by the learning check's rule
    (`learning_check.learning_verdict`). On the rubric score it is the check's own `verdict`. On the gold-answer
    slice: learned only when trained − M0's and trained − control's 95% intervals over the questions both lie above
    0 (`judged=False`: no grader's probe and no judge-free guard, since no judge scored it); no control: as the
    rule says (a gain above 0 is not shown). No slice asked, an empty or one-question slice, or no home measure:
    "not shown" with the reason (then the record holds `outcome` and `reason` alone, no interval)."""
    if home == "score":  # the rubric score: the check's own verdict
        return {"measure": home, **verdict.to_record()}
    if home != GOLD:
        why = "no home measure on the yardstick is stated for this method"
    elif ys.gold is None:
        why = "no gold-answer slice asked (compare.gold.tasks is 0)"
    else:
        lc = spec.learning_check
        values, note = gold_values(ys, keys)
        pairs = paired_comparisons(GOLD_LABEL, values, n_samples=lc.bootstrap_samples, seed=lc.seed,
                                   unit="questions")
        if pairs["trained"] is not None:
            return {"measure": GOLD, **learning_verdict(pairs["trained"], pairs["control"],
                                                        over_control=pairs["over_control"], judged=False).to_record()}
        why = f"the gold-answer slice has no paired interval ({note or 'no evaluation of the trained Solver'})"
    return {"measure": home, "learned": False, "outcome": "not shown", "reason": f"not shown: {why}"}


def gold_report(spec: Params, ys: Yardstick, methods: list[str]) -> dict[str, Any] | None:
    """The slice for the report: its numbers (questions, attempts, invalid reasons), why it is empty, and its first
    `compare.examples` questions with their gold and the first answer (k0) of M0 and each trained method."""
    if ys.gold is None:
        return None
    lc = spec.learning_check
    summary = {**{k: v for k, v in ys.gold.summary.items() if k != "key"}, "key": ys.gold.key,
               "samples": lc.samples, "seed": lc.seed, "empty": None if ys.gold.tasks else empty_reason(ys.gold.summary)}
    shown = {"M0": "before", **{m: m for m in methods}}
    rollouts = {who: first_rollouts(ys.gold.path, {"checkpoint": ev.checkpoint, "fingerprint": ev.fingerprint,
                                                   "seed": ev.seed})
                for who, key in shown.items() if (ev := ys.gold_evaluations.get(key)) is not None}
    summary["examples"] = [
        {"task_id": t.challenger_id, "document_id": t.document_id, "question": t.task, "answer_type":
         t.gold.answer_type, "gold": gold_text(t.gold),
         "answers": {who: {"answer": (by.get(t.challenger_id) or {}).get("answer"),
                           "verified": (by.get(t.challenger_id) or {}).get("rubric_score")}
                     for who, by in rollouts.items()}}
        for t in sorted(ys.gold.tasks, key=lambda t: task_order(t.challenger_id))[:spec.compare.examples]]
    return summary


# -- the comparison, end to end -----------------------------------------------------------------------------------


@dataclass
class MethodComparison:
    """The spec's comparison: per method its home ground, its runs (checkpoint, costs), its measures, its verdict on
    the rubric score and its verdict on its home measure."""

    spec: dict[str, Any]
    held_out: dict[str, Any]
    methods: dict[str, dict[str, Any]]
    examples: list[dict[str, Any]]
    gold_slice: dict[str, Any] | None = None  # `gold_report`: None when compare.gold.tasks is 0
    benchmarks: dict[str, dict[str, Any]] = field(default_factory=dict)  # benchmark -> title, items, seeds

    def to_record(self) -> dict[str, Any]:
        return {"spec": self.spec, "held_out": self.held_out, "gold_slice": self.gold_slice,
                "benchmarks": self.benchmarks, "methods": self.methods, "examples": self.examples}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> MethodComparison:
        older = [m for m, e in record["methods"].items() if "home_verdict" not in e]
        if older:
            raise RunError(f"this comparison was written before each method had a verdict on its home measure "
                           f"(none for {', '.join(older)}): run the same `scope compare-methods` again (finished "
                           "runs and stored evaluations are read back: nothing trains or evaluates again)")
        return cls(record["spec"], record["held_out"], record["methods"], record["examples"],
                   record.get("gold_slice"), record.get("benchmarks") or {})

    def markdown(self) -> str:
        return comparison_markdown(self)


def compare_methods(spec_path: str | Path, overrides: list[str] | dict[str, Any] | None = None, *,
                    train: Callable[[Params], Any], prepare: Callable[[Params], Any] | None = None,
                    lend: Callable[[dict[str, Checkpoint]], dict[str, Any]] | None = None,
                    write: bool = True) -> MethodComparison:
    """`scope compare-methods SPEC`: every method and its control trained (or resumed, or skipped when finished),
    scored on the held-out yardstick, one check per method (`learning_check.check_of`) and a verdict on its home
    measure (`home_verdict`), written to
    <spec run>/comparison.json and comparison.md. `train(params)` trains one run (`scope train`'s path);
    `prepare(spec)` readies the models the loader cannot build itself (the smoke warm start) after the runs have
    trained and before the yardstick loads M0: a warm start not yet built is built by the first run's own process,
    which gives its memory back when it ends, never by this one, which lives through every run (SmolLM2's SFT keeps
    about 13 GB, and a second process beside it ran a 24 GB machine out of memory); `lend` lends models to the
    evaluation (tests, notebooks)."""
    spec = load_spec(spec_path, overrides)
    runs = train_runs(spec, spec_path, train)
    if prepare is not None:
        prepare(spec)
    ys = evaluate_methods(spec, runs, lend)
    held_out, evaluations, left = ys.held_out, ys.evaluations, ys.left
    wall_file = spec.run_dir / WALL_NAME
    walls = read_json(wall_file) if wall_file.is_file() else {}
    lc = spec.learning_check
    methods: dict[str, dict[str, Any]] = {}
    for method, kinds in runs.items():
        roles = {"before": evaluations["before"], "after": evaluations[method]}
        if "control" in kinds:
            roles["control"] = evaluations[f"{method}-control"]
        check = check_of(spec, held_out, roles)
        home, trains_on = HOME_GROUND.get(method, (None, "not stated"))
        keys = {"M0": "before", "trained": method, **({"control": f"{method}-control"} if "control" in kinds else {})}
        methods[method] = {
            "trains_on": trains_on, "home_measure": home, "params": spec.compare.methods[method],
            "runs": {kind: {**left[method if kind == "trained" else f"{method}-control"],
                            **run_costs(p, walls.get(p.run.name))} for kind, p in kinds.items()},
            "measures": {**method_measures(check, method, n_samples=lc.bootstrap_samples, seed=lc.seed),
                         **yardstick_measures(spec, ys, keys, home)},
            "verdict": check.verdict.to_record(),
            "home_verdict": home_verdict(spec, ys, keys, home, check.verdict)}
    grader = held_out.grader
    comparison = MethodComparison(
        spec={"name": spec.run.name, "params": spec.show_path(spec_path), "model": spec.model.base,
              "corpus": spec.retrieval.corpus, "index": spec.retrieval.backend, "selfplay_seed": spec.selfplay.seed,
              "grpo_seed": spec.grpo.seed, "budget": {k: dotted_value(spec, k) for k in BUDGET},
              "controls": spec.compare.controls},
        held_out={"tasks": len(held_out.tasks), "samples": lc.samples, "seed": lc.seed,
                  "key": held_out.key, "bootstrap_samples": lc.bootstrap_samples,
                  "m0_mean_score": evaluations["before"].mean_score,
                  "grader": grader.numbers() if grader else None,
                  "grader_trusted": grader.trusted if grader else None},
        methods=methods,
        examples=side_by_side(held_out, {"M0": evaluations["before"],
                                         **{m: evaluations[m] for m in runs}}, spec.compare.examples),
        gold_slice=gold_report(spec, ys, list(runs)),
        benchmarks={b: {"title": BENCHMARKS[b].title, "items": spec.compare.benchmark_items,
                        "seeds": list(spec.evaluation.seeds)} for b in spec.compare.benchmarks})
    if write:
        atomic_write_json(spec.run_dir / JSON_NAME, comparison.to_record())
        atomic_write_text(spec.run_dir / MARKDOWN_NAME, comparison.markdown())
    return comparison


def read_comparison(path: str | Path) -> MethodComparison:
    """A written comparison: its JSON file or the folder holding it."""
    path = Path(path)
    return MethodComparison.from_record(read_json(path / JSON_NAME if path.is_dir() else path,
                                                  "delete it; `scope compare-methods` writes it again"))


# -- the table ---------------------------------------------------------------------------------------------------


def pair_text(pair: dict[str, Any] | None) -> str:
    """A comparison in one cell: "+0.123 [+0.045, +0.201]" ("-" when it could not be made)."""
    if pair is None:
        return "-"
    lo, hi = pair["ci95"]
    return f"{pair['gain']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _number(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def measure_rows(comparison: MethodComparison) -> list[dict[str, Any]]:
    """One row per (method, measure): the means of M0, trained and control, the three paired comparisons as text,
    and whether the measure is the method's home ground."""
    rows = []
    for method, entry in comparison.methods.items():
        for v in entry["measures"].values():
            rows.append({"method": method, "measure": v["label"], "home ground": "yes" if v["home"] else "",
                         "M0": v["means"].get("M0"), "trained": v["means"].get("trained"),
                         "control": v["means"].get("control"), "trained − M0": pair_text(v["trained"]),
                         "control − M0": pair_text(v["control"]), "trained − control": pair_text(v["over_control"])})
    return rows


def cost_rows(comparison: MethodComparison) -> list[dict[str, Any]]:
    """One row per run: optimiser steps per role, tokens generated, seconds of the steps and wall time, the mean
    zero-spread share and entropy over its steps, its validity rates and alarms."""
    rows = []
    for method, entry in comparison.methods.items():
        for kind, run in entry["runs"].items():
            roles = run.get("roles", {})
            validity = {f"{role} {k}": v for role, r in roles.items() for k, v in r["validity"].items()}
            rows.append({"method": method, "run": kind, "answering checkpoint": run["checkpoint"] or "M0 (none saved)",
                         "steps": ", ".join(f"{role} {r['steps']}" for role, r in roles.items()) or "0",
                         "tokens generated": run["generated_tokens"], "step seconds": run["step_s"],
                         "wall seconds": run["wall_s"],
                         "zero-spread share": _mean([r["zero_spread_share"] for r in roles.values()]),
                         "entropy": _mean([r["entropy"] for r in roles.values()]),
                         "validity": ", ".join(f"{k} {_number(v, 2)}" for k, v in validity.items()) or "-",
                         "alarms": ", ".join(f"{k} ×{n}" for k, n in run["alarms"].items()) or "-"})
    return rows


def _one_line(text: str | None) -> str:
    return "*(no answer)*" if text is None else " ".join(text.split())[:300]


def _markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(none)"]
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_number(r[c]).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return lines


def home_label(entry: dict[str, Any]) -> str:
    """A method's home measure as the table names it: its label, or why there is none here."""
    measure = entry["measures"].get(entry["home_measure"]) if entry["home_measure"] else None
    if measure is None:
        return "none: every measure is away" if not entry["home_measure"] else \
            f"{entry['home_measure']} (not measured here)"
    return measure["label"] + (f" ({measure['note']})" if measure.get("note") else "")


def verdict_lines(comparison: MethodComparison) -> list[str]:
    """Each method's two verdicts as markdown items: on the rubric score, and on its home measure (one item when the
    rubric score is its home measure: the verdict is the same)."""
    lines = []
    for m, e in comparison.methods.items():
        home = e["home_verdict"]["measure"]
        if home == "score":
            lines.append(f"- **{m}** on the rubric score, its home measure: {e['verdict']['reason']}")
            continue
        label = e["measures"][home]["label"] if home in e["measures"] else home or "none stated"
        lines += [f"- **{m}** on the rubric score: {e['verdict']['reason']}",
                  f"- **{m}** on its home measure, the {label}: {e['home_verdict']['reason']}"]
    return lines


def gold_text_lines(gold: dict[str, Any] | None) -> str:
    """The gold-answer slice in one sentence: its questions and attempts, or why it is empty."""
    if gold is None:
        return "Gold-answer slice: none asked (compare.gold.tasks is 0)."
    reasons = ", ".join(f"{r} ×{n}" for r, n in gold["invalid_reasons"].items()) or "none"
    head = (f"Gold-answer slice ({gold['builder'].upper()}'s Challenger, written by M0 on the held-out documents, verified by "
            f"rule; K = {gold['samples']}, seed {gold['seed']}, no judge): ")
    if gold["empty"]:
        return head + f"**{gold['empty']}**; no method is scored on it."
    return head + (f"{gold['tasks']} question(s) from {gold['attempts']} attempt(s) on {gold['documents']} "
                   f"document(s) ({gold['valid']} valid; invalid: {reasons}).")


def gold_lines(comparison: MethodComparison) -> list[str]:
    """The slice's sentence and the benchmarks', each a paragraph."""
    lines = [gold_text_lines(comparison.gold_slice), ""]
    if comparison.benchmarks:
        lines += ["Short-form QA benchmarks (`scope eval`'s Solver protocol, exact match and F1, no judge): " + ", ".join(
            f"{b['title']} ({b['items']} items × seeds {b['seeds']})" for b in comparison.benchmarks.values()) + ".",
                  ""]
    return lines


def comparison_markdown(comparison: MethodComparison) -> str:
    """The comparison as markdown: the spec, what each method trains on, the verdicts, every measure with its
    intervals, the costs, and the held-out answers side by side."""
    s, h = comparison.spec, comparison.held_out
    budget = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in s["budget"].items())
    lines = [f"# Methods compared: {s['name']}", "",
             f"M0 `{s['model']}`, corpus `{s['corpus']}` ({s['index']} index), selfplay.seed {s['selfplay_seed']}, "
             f"grpo.seed {s['grpo_seed']}; budget: {budget} for every method; shuffled-reward controls: "
             f"{'yes' if s['controls'] else 'no'}.",
             f"Yardstick: {h['tasks']} held-out tasks (documents no method trains on) × K = {h['samples']} rollouts "
             f"(seed {h['seed']}), every Solver under one protocol (the spec's Solver prompt and budgets), M0's mean "
             f"rubric score {h['m0_mean_score']:.3f}; the frozen M0 grader: {h['grader'] or 'not probed'} "
             f"({'trusted' if h['grader_trusted'] else 'NOT trusted' if h['grader_trusted'] is False else '-'}); "
             f"95% intervals from {h['bootstrap_samples']} resamples of the tasks.", "", *gold_lines(comparison),
             "## What each method trains on (home ground)", ""]
    lines += _markdown_table([{"method": m, "trains on": e["trains_on"], "home measure here": home_label(e),
                               "verdict (rubric score)": e["verdict"]["outcome"],
                               "verdict (home measure)": e["home_verdict"]["outcome"]}
                              for m, e in comparison.methods.items()])
    lines += ["", "## The yardstick's measures (gain and 95% interval)", ""] + _markdown_table(measure_rows(comparison))
    lines += ["", "## Cost and signals", ""] + _markdown_table(cost_rows(comparison))
    lines += ["", "## Verdicts (the learning check's rule)", ""] + verdict_lines(comparison)
    lines += ["", "## Gold-answer slice: questions and first answers", ""]
    gold = comparison.gold_slice or {}
    for ex in gold.get("examples", []):
        lines += [f"### {ex['task_id']} (document {ex['document_id']}, {ex['answer_type']}; gold `{ex['gold']}`)",
                  "", *[f"> {x}".rstrip() for x in ex["question"].splitlines()], ""]
        lines += [f"- **{who}** ({'verified' if a['verified'] else 'wrong'}): {_one_line(a['answer'])}"
                  for who, a in ex["answers"].items()]
        lines.append("")
    if not gold.get("examples"):
        lines += [gold_text_lines(comparison.gold_slice), ""]
    lines += ["## Held-out answers side by side", ""]
    for ex in comparison.examples:
        lines += [f"### {ex['task_id']} (document {ex['document_id']})", "", f"> {ex['task']}", "", "Rubrics:"]
        lines += [f"{k}. {r}" for k, r in enumerate(ex["rubrics"], 1)] or ["(none)"]
        for who, a in ex["answers"].items():
            text = a["answer"] if a["answer"] is not None else "*(no answer)*"
            lines += ["", f"**{who}** (g = {_number(a['score'], 2)}, rubric-fact recall {_number(a['fact_recall'], 2)}):",
                      "", *[f"> {line}".rstrip() for line in text.splitlines()]]
        lines.append("")
    return "\n".join(lines) + "\n"
