"""HF `generate` on prompts of mixed lengths, as judge calls send them (a criterion-grader prompt holds a whole
benchmark answer: 250 to 1,300 tokens in the smoke evaluation, 150 to 6,000 across its judges): one left-padded
chunk against the length chunks `HFEngine` makes (`hf_engine.length_chunks`: a new chunk where a prompt is under
half its chunk's longest).

    python benchmarks/judge_prompts.py                       # SmolLM2-135M-shaped random model, 24 prompts
    python benchmarks/judge_prompts.py --prompts 48 --longest 3000

Prompt lengths run geometrically from `--shortest` to `--longest` tokens; each prompt gets `--new-tokens` greedy
tokens (a judge's verdict). Both ways must give the same tokens (checked). Prints a markdown table and the CPU line
(put them in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--shortest", type=int, default=250)
    parser.add_argument("--longest", type=int, default=1300)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = parser.parse_args()

    import torch
    from engines import build_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scope_lib.models import hf_engine
    from scope_lib.models.cpu import cpu_description
    from scope_lib.models.engine import Sampling

    torch.set_num_threads(args.threads)
    corpus = Path(os.environ.get("SCOPE_DATA_DIR", REPO.parent / "shared" / "data")) / "wiki18_sample.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), corpus, "float32")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = hf_engine.HFEngine(model, tokenizer)
    rng = random.Random(0)
    ratio = (args.longest / args.shortest) ** (1 / max(1, args.prompts - 1))
    lengths = [round(args.shortest * ratio ** i) for i in range(args.prompts)]
    prompts = [[rng.randrange(100, 20000) for _ in range(n)] for n in lengths]
    sampling = Sampling(max_new_tokens=args.new_tokens, temperature=0.0, logprobs=False)
    chunked = hf_engine.length_chunks

    def one_chunk(order, *_args):
        return [list(order)]

    rows, outputs = [], {}
    for name, split in [("one padded chunk", one_chunk), ("length chunks", chunked)]:
        hf_engine.length_chunks = split
        engine.generate(prompts[:2], sampling)  # warm-up
        started = time.perf_counter()
        outputs[name] = [c.token_ids for c in engine.generate(prompts, sampling)]
        seconds = time.perf_counter() - started
        order = sorted(range(len(prompts)), key=lambda i: -lengths[i])
        chunks = split(order, lengths, None, args.new_tokens)
        padded = sum(len(c) * lengths[c[0]] for c in chunks)
        rows.append((name, len(chunks), padded, seconds))
    hf_engine.length_chunks = chunked
    same = outputs["one padded chunk"] == outputs["length chunks"]
    print(f"CPU: {cpu_description()}, {args.threads} threads")
    print(f"{args.prompts} prompts of {args.shortest}-{args.longest} tokens ({sum(lengths):,} in all), "
          f"{args.new_tokens} new tokens each; same tokens both ways: {same}\n")
    print("| generate | chunks | padded prompt tokens | seconds |")
    print("|---|---|---|---|")
    for name, n, padded, seconds in rows:
        print(f"| {name} | {n} | {padded:,} | {seconds:.1f} |")
    if not same:
        sys.exit("the two ways gave different tokens")


if __name__ == "__main__":
    main()
