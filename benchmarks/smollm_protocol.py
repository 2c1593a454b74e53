"""SmolLM2-135M-Instruct zero-shot on SCOPE's protocol (issue 23): the GGUF conversion's time, generation speed, the
protocol rates of `scope_lib.smoke.protocol_check.measure_protocol` on documents the tiny model's teacher never read,
the grader-sensitivity probe, and the share of tasks the answerability gate rejects. Numbers only, no targets: the
warm start that would teach SmolLM2 the protocol is not built yet.

    python benchmarks/smollm_protocol.py --documents 2 --probe-documents 8 [--answerability]

Uses params/smollm.yaml (HF engine, `engine.torch_threads`); the conversion runs in a fresh temporary cache with
`--fresh`, else it is reused from ~/.cache/scope/packaged. Prints markdown tables.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default=str(REPO / "params" / "smollm.yaml"))
    parser.add_argument("--documents", type=int, default=4, help="held-out documents for the protocol rates")
    parser.add_argument("--probe-documents", type=int, default=16, help="held-out documents for the grader probe")
    parser.add_argument("--fresh", action="store_true", help="time the conversion in a fresh temporary cache")
    parser.add_argument("--answerability", action="store_true",
                        help="measure a second time with the answerability gate added")
    parser.add_argument("--no-speed", action="store_true", help="skip the generation-speed table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from scope_lib.models import packaged
    from scope_lib.models.engine import Sampling
    from scope_lib.models.hf_engine import HFEngine
    from scope_lib.models.loading import apply_torch_threads, load_model_and_tokenizer
    from scope_lib.retrieval.corpus import read_corpus
    from scope_lib.retrieval.index import build_or_open_index
    from scope_lib.selfplay.judge import make_judge
    from scope_lib.smoke.protocol_check import grader_sensitivity, measure_protocol
    from scope_lib.smoke.teacher import Names, held_out_documents

    params = load_params(args.params)
    apply_torch_threads(params)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        path = packaged.packaged_model_path(params.model.base, cache_dir=cache if args.fresh else None)
        convert_s = time.perf_counter() - started
        model, tokenizer = load_model_and_tokenizer(path, dtype=params.model.dtype, device="cpu")
    print(f"## Conversion\n\n{'fresh' if args.fresh else 'cached'}: {convert_s:.1f} s (load average {load:.1f}), "
          f"torch threads {torch.get_num_threads()}\n")
    engine = HFEngine(model, tokenizer, max_model_len=params.model.max_model_len)

    passages = read_corpus(params.corpus_path).passages
    held_out = held_out_documents(passages, params.model.tiny.warm_start)
    documents = held_out[:args.documents]

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": documents[0].document[:600]}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    rows = []
    for batch in () if args.no_speed else (1, 8):
        t0 = time.perf_counter()
        out = engine.generate([ids] * batch, Sampling(max_new_tokens=64, temperature=1.0, seed=0))
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in out)
        rows.append({"batch": batch, "context tokens": len(ids), "tokens": tokens, "s": round(seconds, 1),
                     "tokens/s": round(tokens / seconds, 1)})
    if rows:
        print("## Generation speed (HF engine, sampling at T = 1)\n\n" + markdown_table(rows) + "\n", flush=True)

    retriever = build_or_open_index(params, progress=False)
    rows = []
    variants = [list(params.judge.gates)] + ([[*params.judge.gates, "answerability"]] if args.answerability else [])
    for gates in variants:
        p = params.model_copy(update={"judge": params.judge.model_copy(update={"gates": gates})})
        torch.manual_seed(0)
        t0 = time.perf_counter()
        rates, evals, _graded, _ = measure_protocol(p, engine, make_judge(p, lambda _m: engine), retriever,
                                                    documents, seed=0)
        asked = [e for e in evals if e.answerability is not None]
        rows.append({"gates": ", ".join(gates), **rates.table(),
                     "answerability rejected": f"{sum(not e.gates.get('answerability') for e in asked)}/{len(asked)}",
                     "answerability scores": [round(e.answerability, 2) for e in asked],
                     "s": round(time.perf_counter() - t0, 1)})
        for e in evals[:4]:
            print(f"- task: {e.task!r}\n  rubrics: {[r.text for r in e.rubrics or []]}\n", flush=True)
    print(f"## Protocol rates on {len(documents)} held-out documents (prompt seed 0)\n\n" + markdown_table(rows) + "\n")

    probe_documents = held_out[:args.probe_documents]
    t0 = time.perf_counter()
    probe = grader_sensitivity(make_judge(params, lambda _m: engine), probe_documents, Names(tokenizer))
    print(f"## Grader sensitivity on {len(probe_documents)} held-out documents "
          f"({time.perf_counter() - t0:.0f} s)\n\n" + markdown_table([probe.table()]))


if __name__ == "__main__":
    main()
