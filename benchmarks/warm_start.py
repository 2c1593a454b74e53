"""The warm-started smoke model: how long the warm start takes, how fast the model generates, and how well it
speaks the protocol on documents the teacher never read.

    python benchmarks/warm_start.py --params params/smoke.yaml --builds 2 --documents 16 --repeats 3

Each build runs in a fresh temporary cache (the teacher's index is rebuilt too, as on a first run); the load
average is printed with each build because the 2 CPU cores are shared. The protocol rates are measured with
`scope_lib.smoke.protocol_check.measure_protocol` (Challenger groups of 2, the run's Solver rollouts per task, gates,
rubrics, grades, R_C and R_S) under the run's sampling, `--repeats` times with different prompt seeds (task types, search counts);
then `grader_sensitivity`: the Judge's verdicts on controlled answers that hold or miss the rubric's fact.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tables import markdown_table  # noqa: E402  (benchmarks/, beside this script)

from scope_lib.config import load_params  # noqa: E402
from scope_lib.models.loading import load_model_and_tokenizer  # noqa: E402
from scope_lib.models.tiny import describe_tiny  # noqa: E402
from scope_lib.smoke.warm_start import describe_warm_start, warm_model_path  # noqa: E402


def time_builds(params, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        with tempfile.TemporaryDirectory() as cache:
            load = os.getloadavg()[0]
            started = time.perf_counter()
            path = warm_model_path(params.corpus_path, params.model.tiny, params.model.warm_start, cache_dir=cache)
            total = time.perf_counter() - started
            info = describe_warm_start(path)
            rows.append({"build": i + 1, "total s": round(total, 1), "SFT steps": info["SFT steps"],
                         "loss (last logs)": info["loss (last 5 logs)"],
                         "load average before": round(load, 1), "load average after": round(os.getloadavg()[0], 1)})
    return rows


def generation_speed(engine, tokenizer, contexts: list[list[int]], max_new_tokens: int) -> dict:
    from scope_lib.models.engine import Sampling

    started = time.perf_counter()
    out = engine.generate(contexts, Sampling(max_new_tokens=max_new_tokens, temperature=1.0, seed=0))
    seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in out)
    return {"batch": len(contexts), "context tokens": max(len(c) for c in contexts),
            "tokens generated": tokens, "s": round(seconds, 2), "tokens/s": round(tokens / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default=str(REPO / "params" / "smoke.yaml"))
    parser.add_argument("--builds", type=int, default=1, help="fresh warm-start builds to time")
    parser.add_argument("--documents", type=int, default=16, help="held-out documents for the protocol rates")
    parser.add_argument("--repeats", type=int, default=1, help="protocol measurements (prompt seeds 0..)")
    parser.add_argument("--probe-documents", type=int, default=100,
                        help="held-out documents for the grader-sensitivity probe")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from scope_lib.models.hf_engine import HFEngine
    from scope_lib.protocol.facts import Names
    from scope_lib.retrieval.corpus import read_corpus, unread_by_teacher
    from scope_lib.retrieval.index import build_or_open_index
    from scope_lib.selfplay.judge import make_judge
    from scope_lib.selfplay.rollout import challenger_trajectories, make_challenger_prompts
    from scope_lib.smoke.protocol_check import grader_sensitivity, measure_protocol

    params = load_params(args.params)
    if args.builds:
        print("## Warm-start build (fresh cache each time)\n")
        print(markdown_table(time_builds(params, args.builds)) + "\n")

    path = warm_model_path(params.corpus_path, params.model.tiny, params.model.warm_start)
    model, tokenizer = load_model_and_tokenizer(path, dtype="float32", device="cpu")
    engine = HFEngine(model, tokenizer)
    print("## Model\n")
    print(markdown_table([{**describe_tiny(path), **describe_warm_start(path)}]) + "\n")

    passages = read_corpus(params.corpus_path).passages
    documents = unread_by_teacher(passages, params.model.warm_start)[:args.documents]
    from scope_lib.protocol.dialects import get_dialect

    sp = params.selfplay
    prompts = make_challenger_prompts(documents, sp.task_types, sp.search_turn_strata, seed=0, tokenizer=tokenizer,
                                      document_max_tokens=sp.document_max_tokens)
    contexts = [t.prompt_ids for t in challenger_trajectories(prompts, get_dialect(params.model.dialect), tokenizer)]
    print("## Generation speed (HF engine, one batched call, sampling at T = 1)\n")
    print(markdown_table([generation_speed(engine, tokenizer, contexts[:1], 48),
                  generation_speed(engine, tokenizer, contexts, 48)]) + "\n")

    retriever = build_or_open_index(params, progress=False)
    rows = []
    for seed in range(args.repeats):
        torch.manual_seed(seed)
        started = time.perf_counter()
        rates, *_ = measure_protocol(params, engine, make_judge(params, lambda _m: engine), retriever, documents,
                                     seed=seed)
        rows.append({"seed": seed, **rates.table(), "s": round(time.perf_counter() - started, 1)})
    print(f"## Protocol rates on {len(documents)} held-out documents\n")
    print(markdown_table(rows) + "\n")

    # Do the grades follow the answer? Controlled pairs on more held-out documents (the rollouts' own answers
    # rarely hold a rubric's fact, so their grades cannot tell a reading grader from a blind one).
    probe_documents = unread_by_teacher(passages, params.model.warm_start)[:args.probe_documents]
    probe = grader_sensitivity(make_judge(params, lambda _m: engine), probe_documents, Names(tokenizer))
    print(f"## Grader sensitivity on {len(probe_documents)} held-out documents (grading temperature "
          f"{params.judge.grading_temperature}; the Judge seeds itself, so one run)\n")
    print(markdown_table([probe.table()]))


if __name__ == "__main__":
    main()
