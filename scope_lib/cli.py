"""`scope`: the command line.

    scope run PARAMS [-o key=value ...]          every notebook via papermill -> <run>/reports/ (+ HTML, index.html)
    scope train PARAMS [-o key=value ...]        Algorithm 1: every iteration, resuming an interrupted run
    scope train PARAMS --processes N             the same over N ranks (torchrun; docs/gpus.md for accelerate)
    scope train PARAMS --accept-untrusted-judge  train although a Judge stage failed its probe (else exit 4)
    scope plan --params P [--gpu-gib 80]         GPU memory per GPU: weights, adapters, activations, vLLM
    scope params show PARAMS [-o key=value ...]  the resolved parameters with their documentation
    scope data fetch [--params P]                download the wiki-18 corpus (or a slice of it)
    scope index plan --params P                  memory, disk and build time of every index type, side by side
    scope index build --params P [--rebuild]     build or reuse the retrieval index (refused if it cannot fit)
    scope index check --params P                 canary queries, results and fingerprints: pass/fail table
    scope serve retrieval --params P             Search-R1 compatible /retrieve server (any backend)
    scope serve model --params P [--port 8000]   vLLM's OpenAI server for M0 with runtime LoRA loading (CPU or GPU)
    scope eval PARAMS [--checkpoint C ...] [--benchmarks B ...] [--accept-untrusted-judge]
                                                 benchmarks -> <run>/eval/<checkpoint>/ (exit 4: a judge failed
                                                 its calibration probe; its scores are written marked untrusted)
    scope runs verify RUN                        checksums and tensors of every checkpoint and record of a run
    scope learning-check build PARAMS            the held-out task set (M0's tasks on documents training never samples)
    scope learning-check evaluate PARAMS --checkpoint base iter_01/solver   per-task scores on it -> the set's cache
    scope learning-check compare PARAMS --after iter_01/solver [--control RUN/iter_01/solver]   gain, 95% CI, verdict
    scope learning-check compare PARAMS --role challenger --after iter_02/challenger [--control C] [--frozen C]
                                                 the Challenger's check: window share over M0's Challenger, verdict
    scope learning-check play PARAMS --challenger base iter_01/challenger --solver base iter_01/solver
                                                 held-out cross-checkpoint play: Challenger_i's tasks x Solver_j
    scope learning-check pool RUN [RUN ...]      the seeds' checks pooled (seeds, then tasks), the pooled verdict
    scope learning-check examples RUN [RUN ...]  the first 3 held-out tasks by id, M0's and each trained answer (md)
    scope compare-methods PARAMS                 every method of compare.methods and its control trained under one
                                                 budget, scored on the held-out set -> <run>/comparison.{json,md}

train, run, eval and compare-methods hold the run's lock (one writer per run, docs/runs.md). A failure a user can cause or meet
(bad parameters, a missing or damaged file, disk full, permissions, a locked run, a server down) ends in one
line naming the file or endpoint and what to do (exit 2); `scope --debug ...` shows the traceback. SIGTERM
stops a command at the next safe point with one line saying how to resume (exit 143).
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import shlex
import signal
import sqlite3
import sys

from scope_lib.config import LearningCheckConfig, ParamsError, describe_fields, load_params
from scope_lib.models.noise import quiet_library_noise

log = logging.getLogger("scope")
DEFAULT_PARAMS = "params/smoke.yaml"


def _params(args):
    """The command's parameters, validated (light: no torch, no chromadb)."""
    return load_params(args.params, args.override)


def _torch_params(args, *, models: bool = False, corpus: bool = False, judges: bool = False):
    """Parameters for a command that runs torch (embedders, models): `engine.torch_threads` applied and, with
    `models`, every model the loader cannot build itself prepared first (the smoke warm start). `corpus`: the
    corpus must hold a passage, checked before anything reads it (the warm start, the index build)."""
    from scope_lib.models.loading import apply_torch_threads

    params = _params(args)
    if corpus:
        from scope_lib.retrieval.corpus import require_passages

        require_passages(params.corpus_path, params.retrieval.on_error)
    apply_torch_threads(params)
    if models:
        from scope_lib.smoke.warm_start import prepare

        prepare(params, judges=judges)
    return params


def writes_run(command):
    """Commands that write to the run folder hold its lock for the life of the process (`runs.lock_run`) and log
    to its run.log (`runs.log_to_run_file`: every INFO record, the libraries' too)."""
    @functools.wraps(command)
    def guarded(args) -> int:
        from scope_lib.runs import lock_run, log_to_run_file
        from scope_lib.selfplay.ranks import is_main

        run_dir = _params(args).run_dir
        if is_main():  # several ranks (issue 24): rank 0 holds it; the others never write to the run folder
            lock_run(run_dir)
        log_to_run_file(run_dir)  # every rank's records, each line with its process id
        return command(args)

    return guarded


@writes_run
def cmd_run(args) -> int:
    from scope_lib.reports.export import run_notebooks
    from scope_lib.reports.index_page import write_index
    from scope_lib.reports.notebook import repo_root

    params = _params(args)  # validate before starting any kernel
    root = repo_root()      # relative paths are the repository's, as in the notebooks
    reports = root / (args.reports_dir or params.run_dir / "reports")
    try:
        outputs = run_notebooks(args.params, args.override, notebooks=args.notebooks, html=not args.no_html,
                                reports_dir=reports)
    finally:
        index = write_index(root / params.run_dir, reports)  # also after a failing notebook: it says failed
    for path in outputs:
        print(path)
    print(index)
    return 0


@writes_run
def cmd_train(args) -> int:
    import os

    from scope_lib.models.loading import import_training_loader

    if args.processes > 1 and "WORLD_SIZE" in os.environ:
        raise ParamsError("--processes starts the ranks itself: leave it out under torchrun or accelerate launch")
    params = _torch_params(args, models=True, corpus=True)
    if params.run.checkpoint_steps and (args.processes > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ParamsError("run.checkpoint_steps (mid-stage resume) runs with one process only so far: leave it out "
                          "with several ranks (a killed stage then restarts from its first step)")
    if args.processes > 1:  # models prepared once, here; then the ranks
        return launch_ranks(args)
    import_training_loader(params)  # Unsloth, when chosen, before the loop imports transformers and TRL
    from scope_lib.selfplay import ranks
    from scope_lib.selfplay.health import read_alarms
    from scope_lib.selfplay.loop import run
    from scope_lib.selfplay.stage_probes import UntrustedJudge

    if args.accept_untrusted_judge:
        params.judge.calibration.accept_untrusted = True
    try:
        result = run(params)
    except UntrustedJudge as exc:  # before any training step; the probes are in the manifest, the alarms logged
        if ranks.is_main():
            print(f"error: {exc}", file=sys.stderr)
        return UNTRUSTED_JUDGE_EXIT
    if ranks.is_main():
        print(f"{result.run_dir}: {result.params.selfplay.iterations} iteration(s) done, "
              f"{len(read_alarms(result.run_dir))} health alarm(s) in {result.run_dir / 'health.jsonl'}")
    return 0


# -- several ranks (issue 24) ----------------------------------------------------------------------------------
def launch_ranks(args) -> int:
    """`scope train --processes N`: this same command as N ranks under torchrun on this machine (gloo on CPU,
    NCCL on GPUs); one clear line if a rank fails. Several machines: `accelerate launch` (docs/gpus.md)."""
    import subprocess

    from scope_lib.runs import Stopped

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.processes}",
               "-m", "scope_lib.cli", "train", args.params]
    for override in args.override:
        command += ["-o", override]
    if args.accept_untrusted_judge:
        command.append("--accept-untrusted-judge")
    launcher = subprocess.Popen(command)
    try:
        code = launcher.wait()
    except (Stopped, KeyboardInterrupt):  # torchrun passes SIGTERM on to its ranks, which stop as one process does
        launcher.send_signal(signal.SIGTERM)
        launcher.wait()
        raise
    if code:
        print(f"error: {args.processes}-process training stopped (exit code {code}; a rank failed, its error is "
              "above); run the same command to resume", file=sys.stderr)
    return code


def _lost_rank(exc: BaseException) -> str | None:
    """One line for a collective that failed because another rank died (None for any other error)."""
    from scope_lib.selfplay import ranks

    return ranks.lost_rank_message(exc) if ranks.is_collective_failure(exc) else None


def cmd_plan(args) -> int:
    from scope_lib.models.gpu_plan import cluster_table, plan_cluster, plan_gpu

    if args.cluster:  # every layout on a cluster of N GPUs (issue 24)
        options = plan_cluster(_params(args), gpus=args.cluster, gpu_gib=args.gpu_gib)
        print(cluster_table(_params(args), options))
        return 0 if any(o.fits for o in options) else 1
    report = plan_gpu(_params(args), gpu_gib=args.gpu_gib, gpus=args.gpus, engine=args.engine,
                      sleep=not args.no_sleep, layout=args.layout)
    print(report.table())
    return 0 if report.fits else 1


def cmd_params_show(args) -> int:
    params = _params(args)
    values = params.model_dump(mode="json")
    for key, _default, doc in describe_fields():
        node = values
        for part in key.split("."):
            node = node[part]
        print(f"{key} = {node!r}  # {doc}")
    return 0


def cmd_data_fetch(args) -> int:
    from scope_lib.retrieval.corpus import fetch_data

    overrides = list(args.override)
    if args.url:
        overrides.append(f"retrieval.corpus_url={args.url}")
    if args.max_passages:
        overrides.append(f"retrieval.fetch_max_passages={args.max_passages}")
    path = fetch_data(load_params(args.params, overrides), overwrite=args.force)
    print(path)
    return 0


def cmd_index_build(args) -> int:
    from scope_lib.retrieval.index import build_or_open_index

    retriever = build_or_open_index(_torch_params(args), rebuild=args.rebuild, force=args.force)
    print(f"index ready: {retriever.describe()}")
    return 0


def cmd_index_plan(args) -> int:
    from scope_lib.retrieval.plan import plan_index

    plan = plan_index(_torch_params(args), measure=not args.no_measure, n_passages=args.passages,
                      factories=args.factories)
    print(plan)
    return 0


def cmd_index_check(args) -> int:
    from scope_lib.retrieval.check import check_index

    report = check_index(_torch_params(args))
    print(report.table())
    return 0 if report.passed else 1


def cmd_serve_retrieval(args) -> int:
    from scope_lib.retrieval.server import serve

    serve(_torch_params(args), host=args.host, port=args.port, force=args.force)
    return 0


def cmd_serve_model(args) -> int:
    """vLLM's OpenAI-compatible server for the `openai` engine (`python -m vllm.entrypoints.openai.api_server`:
    `vllm serve` fails with vLLM's CPU build), in the foreground until stopped."""
    import os

    from scope_lib.models.vllm_server import server_command

    argv, env = server_command(_torch_params(args, models=True), host=args.host, port=args.port)
    print(" ".join(argv), flush=True)
    os.execve(argv[0], argv, env)
    return 0  # not reached


#: `scope eval`'s exit status when a judge failed its calibration probe and was not accepted; `scope train`'s when a
#: stage of its Judge (the grader, a gate, the rubric writer) did, before any training step.
UNTRUSTED_JUDGE_EXIT = 4


@writes_run
def cmd_eval(args) -> int:
    from scope_lib.evaluation.evaluate import evaluate, untrusted_judges
    from scope_lib.evaluation.judge_probes import untrusted_line

    params = _torch_params(args, models=True, judges=True)
    summaries = evaluate(params, args.checkpoint or None, args.benchmarks or None)
    trust = {True: "yes", False: "NO", None: "-"}
    print(f"{'checkpoint':<22} {'benchmark':<16} {'scorer':<12} {'score':>7}  95% CI          invalid  judge trusted")
    for s in summaries:
        for scorer, v in s["scorers"].items():
            value = "-" if v["value"] is None else f"{100 * v['value']:.1f}"
            ci = f"[{100 * v['ci95'][0]:.1f}, {100 * v['ci95'][1]:.1f}]" if v["ci95"] else "-"
            print(f"{s['checkpoint']:<22} {s['benchmark']:<16} {scorer:<12} {value:>7}  {ci:<15} "
                  f"{v['n_invalid_units']}/{v['n_units']:<6} {trust[v.get('trusted')]}")
    print(f"results: {params.run_dir / 'eval'}")
    untrusted = untrusted_judges(summaries)
    accepted = args.accept_untrusted_judge or params.evaluation.accept_untrusted_judge
    for judge_id, (calibration, benchmarks) in untrusted.items():
        print(f"{'warning' if accepted else 'error'}: {untrusted_line(judge_id, calibration, benchmarks)}",
              file=sys.stderr)
    return UNTRUSTED_JUDGE_EXIT if untrusted and not accepted else 0


def cmd_check_build(args) -> int:
    from scope_lib.evaluation.held_out import held_out_set, held_out_stage_probes

    held_out = held_out_set(_torch_params(args, models=True))
    stages = held_out_stage_probes(held_out)
    for c in ([held_out.grader] if held_out.grader else []) + (stages.configured() if stages else []):
        print(f"judge: {c.judge}: {c.numbers()} -> {'trusted' if c.trusted else 'UNTRUSTED'}")
    s = held_out.summary
    lo, hi = s["window"]
    m0 = "-" if s["m0_mean_score"] is None else f"{s['m0_mean_score']:.3f}"
    print(f"held-out set: {s['tasks']} task(s) ({s['built']} built) of {s['candidates']} candidate(s) on {s['documents']} of "
          f"{s['held_out_documents']} reserved document(s); kept where M0's mean rubric score over K = {s['samples']} "
          f"lies in [{lo:g}, {hi:g}] ({s['in_difficulty_window']} inside the difficulty window); M0's mean {m0}")
    print(held_out.path)
    return 0


def _mean_with_interval(values: list[float], params) -> str:
    from scope_lib.evaluation.learning_check import paired_bootstrap

    mean = sum(values) / len(values)
    if len(values) < 2:
        return f"{mean:.3f}"
    lo, hi = paired_bootstrap(values, params.learning_check.bootstrap_samples, params.learning_check.seed)
    return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def cmd_check_evaluate(args) -> int:
    from scope_lib.evaluation.learning_check import evaluate_checkpoints

    params = _torch_params(args, models=True)
    held_out, evaluations = evaluate_checkpoints(params, {c: c for c in args.checkpoint}, seed=args.seed)
    print(f"{'checkpoint':<28} {'tasks':>5}  {'mean rubric score [95% CI]':<28} success rate")
    for ev in evaluations.values():
        print(f"{ev.checkpoint:<28} {len(ev.results):>5}  {_mean_with_interval(list(ev.values('score').values()), params):<28} "
              f"{ev.success_rate:.3f}")
    print(f"held-out set: {held_out.path}")
    return 0


def _judge_free_lines(check) -> list[str]:
    """`compare`'s table of the judge-free measures: per checkpoint, the gain over `before` and the control's, and
    trained - control, each with its paired 95% interval and the tasks it is paired over."""
    from scope_lib.evaluation.judge_free import LABELS, MEASURES

    jf = check.judge_free
    if jf is None:
        return []

    def mean(role: str, m: str) -> str:
        value = jf.mean(role, m) if role in jf.values else None
        return "-" if value is None else f"{value:.3f}"

    def gain(name: str, m: str) -> str:
        c = jf.comparisons.get(name, {}).get(m)
        return "-" if c is None else f"{c.gain:+.3f} [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}] n={c.n_tasks}"

    span = "-" if jf.length_range is None else f"{jf.length_range[0]:g}-{jf.length_range[1]:g}"
    lines = [f"judge-free measures, read from the stored answers without the grader (M0's answer lengths: {span} "
             "tokens; docs/training.md):",
             f"{'measure':<30} {'before':>7} {'after':>7} {'control':>7}  {'gain [95% CI]':<30} "
             f"{'control gain [95% CI]':<30} trained - control [95% CI]"]
    for m in MEASURES:
        lines.append(f"{LABELS[m]:<30} {mean('before', m):>7} {mean('after', m):>7} {mean('control', m):>7}  "
                     f"{gain('trained', m):<30} {gain('control', m):<30} {gain('over_control', m)}")
    return lines


def _challenger_compare(args, params) -> int:
    """`compare --role challenger`: each Challenger's measures, every change with its interval, the verdict."""
    from scope_lib.evaluation.challenger_check import (
        LABELS,
        MEASURES,
        PAIRS,
        check_path,
        run_challenger_check,
    )

    metric = args.metric or "in_window"
    if metric not in ("in_window", "distance"):
        raise ParamsError(f"--metric {metric} is the Solver's: the Challenger's check takes in_window or distance")
    check = run_challenger_check(params, args.after, before=args.before, control=args.control, frozen=args.frozen,
                                 solver=args.solver, metric=metric)
    roles = list(check.evaluations)
    print(f"Challengers on {len(check.evaluations['after'].documents)} held-out documents, answered by "
          f"{check.solver} (K = {params.learning_check.samples}):")
    print(f"{'measure':<24} " + " ".join(f"{check.evaluations[r].challenger[:26]:>26}" for r in roles))
    for m in MEASURES:
        means = [check.evaluations[r].mean(m) for r in roles]
        print(f"{LABELS[m]:<24} " + " ".join(f"{'-' if v is None else f'{v:.3f}':>26}" for v in means))
    print(f"{'change [95% CI] n':<24} " + " ".join(f"{name:<32}" for name in check.comparisons))
    for m in MEASURES:
        cells = []
        for name in check.comparisons:
            c = check.comparisons[name][m]
            cells.append("-" if c is None else f"{c.gain:+.3f} [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}] n={c.n_tasks}")
        print(f"{LABELS[m]:<24} " + " ".join(f"{cell:<32}" for cell in cells))
    print("(" + "; ".join(f"{name}: {a} - {b}" for name, (b, a) in PAIRS.items() if name in check.comparisons) + ")")
    for c in ([check.grader] if check.grader else []) + (check.stages.configured() if check.stages else []):
        print(f"judge: {c.judge}: {c.numbers()} -> {'trusted' if c.trusted else 'UNTRUSTED'}")
    print(check.verdict.reason)
    after, before = check.evaluations["after"].challenger, check.evaluations["before"].challenger
    print(f"written: {check_path(params, after, before, check.solver, metric)}")
    return 0


def cmd_check_play(args) -> int:
    from scope_lib.evaluation.challenger_check import cross_play

    params = _torch_params(args, models=True)
    play = cross_play(params, args.challenger, args.solver)
    print("mean rubric score of Solver j (columns) on Challenger i's held-out tasks (rows), and each Challenger's "
          "gate pass rate:")
    print(play.table().to_string(float_format=lambda v: f"{v:.3f}"))
    print(f"written: {params.run_dir / 'learning_check' / 'cross_play.json'}")
    return 0


def cmd_check_compare(args) -> int:
    from scope_lib.evaluation.learning_check import check_path, run_check

    params = _torch_params(args, models=True)
    if args.accept_untrusted_judge:
        params.learning_check.accept_untrusted_judge = True
    if args.role == "challenger":
        return _challenger_compare(args, params)
    if args.frozen is not None or args.solver != "base":
        raise ParamsError("--frozen and --solver belong to --role challenger")
    args.metric = args.metric or "score"
    if args.metric not in ("score", "success"):
        raise ParamsError(f"--metric {args.metric} is the Challenger's: the Solver's check takes score or success")
    check = run_check(params, args.after, before=args.before, control=args.control, metric=args.metric)
    print(f"{'role':<8} {'checkpoint':<28} {'tasks':>5} {'score':>6} {'success':>8} {'gain':>7}  95% CI")
    for row in check.table():
        gain = row[f"gain ({args.metric})"]
        interval = row["95% interval"]
        print(f"{row['role']:<8} {row['checkpoint']:<28} {row['tasks']:>5} {row['mean rubric score']:>6.3f} "
              f"{row['success rate']:>8.3f} {'' if gain is None else f'{gain:+.3f}':>7}  "
              f"{'' if interval is None else f'[{interval[0]:+.3f}, {interval[1]:+.3f}]'}")
    if check.over_control is not None:
        c = check.over_control
        print(f"trained - control, paired over the {c.n_tasks} tasks: {c.gain:+.3f} [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}]")
    for line in _judge_free_lines(check):
        print(line)
    if check.held_out.grader is not None:
        g = check.held_out.grader
        print(f"judge: the frozen grader's calibration probe: {g.numbers()} -> {'trusted' if g.trusted else 'UNTRUSTED'}")
    print(check.verdict.reason)
    print(f"written: {check_path(params, check.trained.after, check.trained.before, args.metric)}")
    return 0


def cmd_check_pool(args) -> int:
    from pathlib import Path

    from scope_lib.evaluation.pooled_check import pool_checks, pooled_path
    from scope_lib.runs import atomic_write_json

    pooled = pool_checks(args.checks, n_samples=args.bootstrap_samples, seed=args.seed,
                         accept_untrusted_judge=args.accept_untrusted_judge)

    def cell(c) -> str:
        return "-" if c is None else f"{c.gain:+.3f} [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}] n={c.n_tasks}"

    print(f"{len(pooled.checks)} seeds' checks pooled: the gain over M0 and trained - control per seed (each check's "
          f"own interval) and pooled ({pooled.n_samples} resamples of the seeds, then of the tasks):")
    print(f"{'measure':<30} {'seed':<28} {'gain over M0 [95% CI]':<32} trained - control [95% CI]")
    shown = None
    for row in pooled.table():
        measure = "" if row["measure"] == shown else row["measure"]
        shown = row["measure"]
        print(f"{measure:<30} {row['seed']:<28} {cell(row['trained']):<32} {cell(row['over_control'])}")
    for c in pooled.checks:
        print(f"{c.run}: {c.record['verdict']['reason']}")
    print(f"pooled: {pooled.verdict.reason}")
    out = Path(args.out) if args.out else pooled_path(pooled.checks)
    atomic_write_json(out, pooled.to_record())
    print(f"written: {out}")
    return 0


def cmd_check_examples(args) -> int:
    from scope_lib.evaluation.pooled_check import examples_markdown, held_out_examples
    from scope_lib.runs import atomic_write_text

    text = examples_markdown(held_out_examples(args.checks, args.tasks))
    print(text)
    if args.out:
        atomic_write_text(args.out, text)
        print(f"written: {args.out}")
    return 0


def train_run(params) -> None:
    """One run of a comparison by `scope train` itself, in a process of its own (each run loads its models, vLLM's
    engine among them, and gives their memory back when it ends): the run's resolved parameters are written to
    <run>/compare-params.yaml and trained from there, resuming a stopped run. SIGTERM reaches the run too."""
    import subprocess

    from scope_lib.runs import RunError, Stopped, atomic_write_text

    path = params.run_dir / "compare-params.yaml"
    atomic_write_text(path, params.to_yaml())
    trainer = subprocess.Popen([sys.executable, "-m", "scope_lib.cli", "train", str(path)])
    try:
        code = trainer.wait()
    except (Stopped, KeyboardInterrupt):
        trainer.send_signal(signal.SIGTERM)
        trainer.wait()
        raise
    if code == UNTRUSTED_JUDGE_EXIT:
        raise RunError(f"{params.run_dir}: a Judge stage failed its calibration probe (scope train exited "
                       f"{code}, its reason above): fix the Judge, or accept it in that method's params "
                       "(judge.calibration.accept_untrusted)")
    if code:
        raise RunError(f"scope train {path} failed (exit code {code}; its error is above): run the same "
                       "compare-methods command to resume")


@writes_run
def cmd_compare_methods(args) -> int:
    from scope_lib.evaluation.method_comparison import (
        JSON_NAME,
        MARKDOWN_NAME,
        compare_methods,
        gold_text_lines,
        pair_text,
    )
    from scope_lib.smoke.warm_start import prepare

    spec = _torch_params(args)
    comparison = compare_methods(args.params, args.override, train=train_run, prepare=prepare)
    print(gold_text_lines(comparison.gold_slice).replace("**", ""))
    print(f"{'method':<7} {'home measure':<13} {'rubric score: trained - M0':<28} {'trained - control':<26} "
          f"{'gold: trained - M0':<26} {'steps':>5} {'tokens':>8} {'wall s':>8}  {'verdict':<12} home verdict")
    for method, entry in comparison.methods.items():
        score, trained = entry["measures"]["score"], entry["runs"]["trained"]
        gold = (entry["measures"].get("gold") or {}).get("trained")
        wall = "-" if trained["wall_s"] is None else f"{trained['wall_s']:.0f}"
        print(f"{method:<7} {entry['home_measure'] or 'none':<13} {pair_text(score['trained']):<28} "
              f"{pair_text(score['over_control']):<26} {pair_text(gold):<26} {trained['steps']:>5} "
              f"{trained['generated_tokens']:>8} {wall:>8}  {entry['verdict']['outcome']:<12} "
              f"{entry['home_verdict']['outcome']}")
    print(f"written: {spec.run_dir / JSON_NAME} and {spec.run_dir / MARKDOWN_NAME}")
    return 0


def cmd_runs_verify(args) -> int:
    from pathlib import Path

    from scope_lib.runs import verify_run

    run_dir = Path(args.run)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder (give <runs_dir>/<name>, e.g. runs/smoke)")
    results = verify_run(run_dir)
    for stage, verdict in results:
        print(f"{str(stage.relative_to(run_dir)):<24} {verdict}")
    failed = [v for _, v in results if v.startswith("FAIL")]
    print(f"{run_dir}: {len(results)} finished stage(s) and record file(s), {len(failed)} failed")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scope", description="SCOPE toolkit (arXiv 2605.31433)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_params(p, positional=False):
        if positional:
            p.add_argument("params", help="params YAML (e.g. params/qwen3-8b.yaml)")
        else:
            p.add_argument("--params", default=DEFAULT_PARAMS, help=f"params YAML (default {DEFAULT_PARAMS})")
        p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, e.g. -o grpo.learning_rate=2e-6 (repeatable)")
        return p

    run = with_params(sub.add_parser("run", help="execute the notebooks with papermill"), positional=True)
    run.add_argument("--notebooks", nargs="*", default=None, help="only these (e.g. 01 02); default all")
    run.add_argument("--no-html", action="store_true", help="skip the HTML copies")
    run.add_argument("--reports-dir", default=None,
                     help="write the reports and index.html here (default <run>/reports; keeps earlier reports)")
    run.set_defaults(func=cmd_run)

    train = with_params(sub.add_parser("train", help="run (or resume) self-play training"), positional=True)
    train.add_argument("--processes", type=int, default=1, metavar="N",
                       help="train over N ranks on this machine (torchrun; gloo on CPU, NCCL on GPUs)")
    train.add_argument("--accept-untrusted-judge", action="store_true",
                       help="train although a Judge stage (grader, gate, rubric writer) failed its calibration probe "
                       "(exit 4 otherwise, before training; params: judge.calibration.accept_untrusted)")
    train.set_defaults(func=cmd_train)

    gpu = with_params(sub.add_parser("plan", help="GPU memory of a run, per GPU (exit 1 if it cannot fit)"))
    gpu.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (H100: 80, H200: 141)")
    gpu.add_argument("--gpus", type=int, default=1, help="GPUs the trainer is spread over")
    gpu.add_argument("--engine", choices=["hf", "vllm"], default=None, help="generation engine (default: params)")
    gpu.add_argument("--no-sleep", action="store_true", help="vLLM stays awake while the trainer steps")
    gpu.add_argument("--layout", choices=["ddp", "zero2", "fsdp2", "zero3"], default=None,
                     help="how the trainer spreads over --gpus (default: ddp for LoRA, zero3 for full)")
    gpu.add_argument("--cluster", type=int, default=None, metavar="N",
                     help="compare every layout on N GPUs (trainer GPUs + vllm serve GPUs); says which fit")
    gpu.set_defaults(func=cmd_plan)

    params = sub.add_parser("params", help="inspect parameters").add_subparsers(dest="what", required=True)
    with_params(params.add_parser("show", help="print resolved parameters"), positional=True).set_defaults(
        func=cmd_params_show)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="what", required=True)
    fetch = with_params(data.add_parser("fetch", help="download the wiki-18 corpus"))
    fetch.add_argument("--url", help="override retrieval.corpus_url")
    fetch.add_argument("--max-passages", type=int, help="keep only the first N passages")
    fetch.add_argument("--force", action="store_true", help="download again even if the file exists")
    fetch.set_defaults(func=cmd_data_fetch)

    index = sub.add_parser("index", help="retrieval index").add_subparsers(dest="what", required=True)
    build = with_params(index.add_parser("build", help="build or reuse the retrieval index"))
    build.add_argument("--rebuild", action="store_true", help="rebuild even if an index exists")
    build.add_argument("--force", action="store_true", help="build even if the memory plan says it won't fit")
    build.set_defaults(func=cmd_index_build)
    plan = with_params(index.add_parser("plan", help="memory, disk and build time per index type"))
    plan.add_argument("--passages", type=int, help="plan for this many passages (default: the corpus's)")
    plan.add_argument("--factories", nargs="+", help="faiss factory strings to compare (default: a standard set)")
    plan.add_argument("--no-measure", action="store_true", help="do not time the embedder (no build times)")
    plan.set_defaults(func=cmd_index_plan)
    check = with_params(index.add_parser("check", help="canary queries and fingerprints; exit 1 on failure"))
    check.set_defaults(func=cmd_index_check)

    serve = sub.add_parser("serve", help="servers").add_subparsers(dest="what", required=True)
    retr = with_params(serve.add_parser("retrieval", help="Search-R1 compatible /retrieve server"))
    retr.add_argument("--host", default="127.0.0.1")
    retr.add_argument("--port", type=int, default=8000)
    retr.add_argument("--force", action="store_true", help="build the index even if the plan says it won't fit")
    retr.set_defaults(func=cmd_serve_retrieval)
    model = with_params(serve.add_parser("model", help="vLLM's OpenAI server for M0 (runtime LoRA loading)"))
    model.add_argument("--host", default="127.0.0.1")
    model.add_argument("--port", type=int, default=8000)
    model.set_defaults(func=cmd_serve_model)
    ev = with_params(sub.add_parser("eval", help="evaluate checkpoints on the paper's benchmarks (§4.1)"),
                     positional=True)
    ev.add_argument("--checkpoint", nargs="*", default=None, metavar="C",
                    help="base, iter_NN/solver or a path (default: evaluation.checkpoints)")
    ev.add_argument("--benchmarks", nargs="*", default=None, metavar="B",
                    help="benchmark names (default: evaluation.benchmarks)")
    ev.add_argument("--accept-untrusted-judge", action="store_true",
                    help="exit 0 although a judge failed its calibration probe (its scores stay marked untrusted; "
                         "params: evaluation.accept_untrusted_judge)")
    ev.set_defaults(func=cmd_eval)

    check = sub.add_parser("learning-check", help="did a run's Solver (or Challenger) learn? held-out tasks, a control, a verdict")
    check = check.add_subparsers(dest="what", required=True)
    with_params(check.add_parser("build", help="build (or reuse) the held-out task set"),
                positional=True).set_defaults(func=cmd_check_build)
    check_eval = with_params(check.add_parser("evaluate", help="score checkpoints on the held-out set"),
                             positional=True)
    check_eval.add_argument("--checkpoint", nargs="+", required=True, metavar="C",
                            help="base, iter_NN/solver or a path to an adapter or model folder")
    check_eval.add_argument("--seed", type=int, default=None, help="rollout seed (default learning_check.seed)")
    check_eval.set_defaults(func=cmd_check_evaluate)
    compare = with_params(check.add_parser("compare", help="paired gain with a 95%% interval, and the verdict"),
                          positional=True)
    compare.add_argument("--role", choices=["solver", "challenger"], default="solver",
                         help="whose check: the Solver's (default) or the Challenger's (docs/training.md)")
    compare.add_argument("--after", required=True, metavar="C",
                         help="the trained checkpoint (e.g. iter_01/solver, or iter_01/challenger with --role challenger)")
    compare.add_argument("--before", default="base", metavar="C", help="what it is compared with (default base = M0)")
    compare.add_argument("--control", default=None, metavar="C",
                         help="the same checkpoint of a run trained with -o grpo.reward_control=shuffled (the "
                         "Challenger's: shuffled_challenger)")
    compare.add_argument("--frozen", default=None, metavar="C",
                         help="--role challenger: the Challenger of the frozen-Challenger ablation "
                         "(-o selfplay.co_evolution=false), to beat too")
    compare.add_argument("--solver", default="base", metavar="C",
                         help="--role challenger: the fixed Solver that answers every Challenger's tasks (default base)")
    compare.add_argument("--metric", choices=["score", "success", "in_window", "distance"], default=None,
                         help="the Solver's: per-task mean rubric score (default) or success rate; the Challenger's: "
                         "window share (default) or mean |g - tau|")
    compare.add_argument("--accept-untrusted-judge", action="store_true",
                         help="call a gain learned even when the Judge's grader failed its calibration probe "
                         "(params: learning_check.accept_untrusted_judge)")
    compare.set_defaults(func=cmd_check_compare)
    play = with_params(check.add_parser("play", help="cross-checkpoint play on held-out documents: Challenger_i's "
                                        "tasks x Solver_j's mean score"), positional=True)
    play.add_argument("--challenger", nargs="+", required=True, metavar="C", help="base, iter_NN/challenger or a path")
    play.add_argument("--solver", nargs="+", required=True, metavar="C", help="base, iter_NN/solver or a path")
    play.set_defaults(func=cmd_check_play)
    pool = check.add_parser("pool", help="the seeds' checks pooled: per seed and pooled (seeds, then tasks), "
                            "the pooled verdict (reads what compare wrote; no model)")
    pool.add_argument("checks", nargs="+", metavar="CHECK",
                      help="each seed's run folder (runs/<name>, its learning_check/ holding one Solver check) or "
                      "the check's JSON")
    pool.add_argument("--out", default=None, metavar="FILE",
                      help="the pooled JSON (default <runs>/learning_check_pooled/<run>+<run>+....json)")
    pool.add_argument("--bootstrap-samples", type=int, default=LearningCheckConfig().bootstrap_samples, metavar="N",
                      help="resamples for the pooled 95%% intervals (default learning_check.bootstrap_samples' default)")
    pool.add_argument("--seed", type=int, default=LearningCheckConfig().seed, help="the bootstrap's seed")
    pool.add_argument("--accept-untrusted-judge", action="store_true",
                      help="call a pooled gain learned even when a seed's grader failed its calibration probe")
    pool.set_defaults(func=cmd_check_pool)
    examples = check.add_parser("examples", help="held-out tasks verbatim: the first N by task id, their rubrics, "
                                "M0's and each trained Solver's first answer, as markdown (no model)")
    examples.add_argument("checks", nargs="+", metavar="CHECK", help="as for pool: each seed's run folder or check")
    examples.add_argument("--tasks", type=int, default=3, metavar="N", help="how many tasks (default 3)")
    examples.add_argument("--out", default=None, metavar="FILE.md", help="also write the markdown there")
    examples.set_defaults(func=cmd_check_examples)

    compare_methods = with_params(sub.add_parser(
        "compare-methods", help="train every method of a spec (compare.methods) and its shuffled-reward control "
        "under one budget, score all on the held-out set, write one table"), positional=True)
    compare_methods.set_defaults(func=cmd_compare_methods)

    runs = sub.add_parser("runs", help="run folders").add_subparsers(dest="what", required=True)
    verify = runs.add_parser("verify", help="check every saved checkpoint and record of a run; exit 1 on a damaged one")
    verify.add_argument("run", help="the run folder, e.g. runs/smoke")
    verify.set_defaults(func=cmd_runs_verify)
    return parser


#: The loggers whose INFO records the terminal shows: this package's (and a script's own). Every other library's
#: INFO (httpx logs one line per judge request) goes to the run's log file only; its warnings still show.
TERMINAL_INFO_LOGGERS = ("scope", "scope_lib", "__main__")


def _own_or_warning(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or record.name.split(".")[0] in TERMINAL_INFO_LOGGERS


def terminal_logging() -> None:
    """What `scope` shows on the terminal: this package's INFO records and everyone's warnings, without the known
    library notices (`models.noise`). The run's log file (`runs.log_to_run_file`, attached by the commands that
    write a run) takes every record at INFO and above. A root logger that already has handlers (a caller's, a
    test's) is left as it is."""
    quiet_library_noise()
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_own_or_warning)
    root.addHandler(handler)
    root.setLevel(logging.INFO)


#: The exit status after SIGTERM (128 + 15, what a shell reports for a process SIGTERM ended).
STOPPED_EXIT = 128 + signal.SIGTERM


def main(argv: list[str] | None = None) -> int:
    from scope_lib.runs import Stopped, stop_on_sigterm

    args = build_parser().parse_args(argv)
    terminal_logging()
    if argv is None and args.command != "serve":  # the command line (not a caller's main([...])); a server stops
        stop_on_sigterm()                             # on SIGTERM as it always did
    if args.debug:
        return args.func(args)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    except Stopped:  # a fresh line: a progress bar may be half drawn
        command = "scope " + shlex.join(sys.argv[1:] if argv is None else argv)
        print(f"\nstopped: SIGTERM received; everything written is kept (a write under way was finished first): "
              f"run `{command}` to resume", file=sys.stderr)
        return STOPPED_EXIT
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line; --debug shows the traceback
        lost = _lost_rank(exc) if args.command == "train" else None
        if lost is not None:
            print(f"\nerror: {lost}", file=sys.stderr)  # a fresh line: a progress bar may be half drawn
            return 3
        user, line = one_line(exc)
        print(f"error: {line}" if user else f"error: {type(exc).__name__}: {exc} (an internal error: rerun with "
              "--debug and report the traceback)", file=sys.stderr)
        return 2 if user else 1


def one_line(exc: BaseException) -> tuple[bool, str]:
    """(whether a user can cause or fix it, one line naming the file or endpoint and what to do)."""
    from scope_lib.evaluation.benchmarks import BenchmarkDataError
    from scope_lib.evaluation.judge import JudgeUnavailable
    from scope_lib.retrieval.api import RetrievalError
    from scope_lib.retrieval.corpus import CorpusError
    from scope_lib.runs import RunError, is_disk_full

    if is_disk_full(exc):  # an OSError, or a library's own error (safetensors, SQLite) that says so
        return True, _disk_full_line(exc)
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return True, (f"{exc.filename or exc} is on a read-only file system: write somewhere writable "
                      "(-o run.runs_dir=DIR, retrieval.index_dir=DIR, $SCOPE_CACHE_DIR) or remount it read-write")
    if isinstance(exc, PermissionError):
        return True, f"permission denied: {exc.filename or exc}: check the folder's owner and mode"
    if isinstance(exc, IsADirectoryError):
        return True, f"{exc.filename} is a folder where a file was expected: check the path"
    if isinstance(exc, OSError):
        return True, f"{exc.strerror or exc}: {exc.filename}" if exc.filename else f"{exc}"
    if isinstance(exc, sqlite3.DatabaseError):
        return True, f"a SQLite database is damaged ({exc}): it is a cache; delete it to rebuild"
    if isinstance(exc, json.JSONDecodeError):
        return True, f"damaged JSON ({exc}): delete the damaged file to regenerate it"
    if type(exc).__name__ == "SafetensorError":
        return True, f"a .safetensors file is damaged ({exc}): `scope runs verify <run>` names it"
    if isinstance(exc, ParamsError | CorpusError | BenchmarkDataError | JudgeUnavailable | RetrievalError |
                  RunError | ValueError):
        return True, str(exc)
    return False, str(exc)


def _disk_full_line(exc: BaseException) -> str:
    """`disk full writing <file> (what the library said): free space and ...`, the file taken from the first
    exception of the chain that names one."""
    from scope_lib.runs import exception_chain

    named = next((e for e in exception_chain(exc) if isinstance(e, OSError) and e.filename), None)
    where = named.filename if named is not None else "a file of the run (the library that failed did not say which)"
    said = named.strerror if named is not None and named.strerror else \
        (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (f"disk full writing {where} ({said}): free space and run the same command again (it resumes from what "
            "was written; nothing half-written is trusted)")


if __name__ == "__main__":
    sys.exit(main())
