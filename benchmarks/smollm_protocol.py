"""The protocol table of issue 23: each model's warm start measured by `scope_lib.smoke.protocol_check` on documents
its teacher never read, side by side (by default the tiny smoke model and SmolLM2-135M-Instruct): task rate, answer
rate, Judge parse rate, rubrics naming a fact of their source, answers naming a fact their own searches
retrieved, and the grader's separation (held vs missed fact). With `--answerability`, a second pass per model with
Search Self-Play's answerability gate added: the share of tasks it rejects and the kept tasks' difficulty.

    python benchmarks/smollm_protocol.py [--params params/smoke.yaml params/smollm.yaml] --documents 8
        [--probe-documents 16] [--answerability] [--zero-shot]

Each params file is prepared as a run would (`smoke.warm_start.prepare`: the warm-started model is built on first
use, then reused from the cache) and generates through its own `engine.backend` (vLLM's CPU build for
params/smollm.yaml). `--zero-shot` measures the models without their warm start. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tables import markdown_table  # noqa: E402  (benchmarks/, beside this script)

from scope_lib.config import load_params  # noqa: E402


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.2f} ({part}/{whole})" if whole else "- (0/0)"


def measure(params_path: str, args) -> list[dict]:
    import torch

    from scope_lib.models.loading import apply_torch_threads, make_engine
    from scope_lib.protocol.facts import Names
    from scope_lib.retrieval.corpus import read_corpus, unread_by_teacher
    from scope_lib.retrieval.index import build_or_open_index
    from scope_lib.selfplay.judge import make_judge
    from scope_lib.smoke.protocol_check import grader_sensitivity, measure_protocol
    from scope_lib.smoke.warm_start import prepare

    overrides = ["model.warm_start.enabled=false"] if args.zero_shot else []
    params = load_params(params_path, overrides)
    apply_torch_threads(params)
    started = time.perf_counter()
    prepare(params)
    prepare_s = time.perf_counter() - started
    engine = make_engine(params)
    judge = make_judge(params, lambda _m: engine)
    retriever = build_or_open_index(params, progress=False)
    held_out = unread_by_teacher(read_corpus(params.corpus_path).passages, params.model.warm_start)
    label = f"{Path(params_path).stem} ({params.model.base}{', zero-shot' if args.zero_shot else ''})"
    rows = []
    gate_sets = [list(params.judge.gates)]
    if args.answerability:
        gate_sets.append([*params.judge.gates, "answerability"])
    for gates in gate_sets:
        p = params.model_copy(update={"judge": params.judge.model_copy(update={"gates": gates})})
        torch.manual_seed(0)
        t0 = time.perf_counter()
        rates, evals, graded, _ = measure_protocol(p, engine, make_judge(p, lambda _m: engine), retriever,
                                                    held_out[:args.documents], seed=0)
        seconds = time.perf_counter() - t0
        asked = [e for e in evals if e.answerability is not None]
        kept = [e.mean_score for e in evals if e.mean_score is not None]
        row = {"model": label, "gates": ", ".join(gates),
               "Challenger task rate": _share(rates.challenger_tasks, rates.challenger_rollouts),
               "Solver answer rate": _share(rates.solver_answers, rates.solver_rollouts),
               "Solver endings": ", ".join(f"{k} {v}" for k, v in Counter(g.trajectory.finish for g in graded).most_common()),
               "Judge parse rate": f"{rates.judge_rate():.2f}",
               "rubrics naming a source fact": _share(rates.rubric_facts_in_source, rates.rubric_facts),
               "answers naming a retrieved fact": _share(rates.answers_citing_results, rates.answers_searched),
               "mean g-bar of graded tasks": round(sum(kept) / len(kept), 3) if kept else None,
               "tasks in window": f"{rates.tasks_in_window}/{rates.tasks_graded}"}
        if "answerability" in gates:
            row["answerability rejected"] = _share(sum(not e.gates.get("answerability") for e in asked), len(asked))
        row["s"] = round(seconds, 1)
        rows.append(row)
        for e in evals[:args.show]:
            print(f"- [{label}] task: {e.task!r}\n  rubrics: {[r.text for r in e.rubrics or []]}", flush=True)
    t0 = time.perf_counter()
    names = Names(engine.tokenizer, params.model.warm_start.fact_max_tokens)
    probe = grader_sensitivity(judge, held_out[:args.probe_documents], names)
    rows[0]["grader separation"] = (f"{probe.separation:.2f} ({probe.holds_1}/{probe.holds} vs "
                                    f"{probe.misses_1}/{probe.misses}; {probe.unparsed} unparsed)")
    rows[0]["probe s"] = round(time.perf_counter() - t0, 1)
    rows[0]["warm start ready s"] = round(prepare_s, 1)
    if hasattr(engine, "close"):
        engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", nargs="+", default=[str(REPO / "params" / "smoke.yaml"),
                                                          str(REPO / "params" / "smollm.yaml")])
    parser.add_argument("--documents", type=int, default=8, help="held-out documents for the protocol rates")
    parser.add_argument("--probe-documents", type=int, default=16, help="held-out documents for the grader probe")
    parser.add_argument("--answerability", action="store_true",
                        help="measure a second time with the answerability gate added")
    parser.add_argument("--zero-shot", action="store_true", help="measure the models without their warm start")
    parser.add_argument("--show", type=int, default=3, help="tasks and rubrics to print per measurement")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = [row for path in args.params for row in measure(path, args)]
    print(f"\n## Protocol on {args.documents} held-out documents (prompt seed 0), grader probe on "
          f"{args.probe_documents}; load average {os.getloadavg()[0]:.1f}\n\n" + markdown_table(rows))


if __name__ == "__main__":
    main()
