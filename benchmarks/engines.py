"""vLLM (its CPU build here, `make install`) against HF `generate` on the same batched multi-turn rollouts, our
overhead over a bare `LLM.generate`, and the cost of publishing an adapter to vLLM after an optimiser step.

    python benchmarks/engines.py                     # SmolLM2-135M-shaped random model, 64 prompts
    python benchmarks/engines.py --prompts 16 --new-tokens 32 --dtype float32

Rollouts: every prompt (a Solver question in the chat template) runs `--turns` turns; each turn is one batched
`engine.generate` call (greedy, `--new-tokens` new tokens, no stop: every row generates the same number of
tokens on both engines), then a fixed environment reply (an <information> block of `--env-tokens` tokens) is
appended, as the rollout loop does after a search. tokens/s = new tokens / seconds of generate calls.
Targets (issue 20): vLLM >= 2.5x HF on CPU; our engine within 10% of a bare `LLM.generate` on the same prompts.
The adapter sync is what `AdapterSync` does once per step: save the LoRA adapter, register it as a new version,
and the first generate that loads it, minus the same generate with the adapter already loaded.
The dtype defaults to the CPU's: bf16 where the CPU has it natively (AVX512-BF16, AMX), else float32 (bf16 is
emulated there, 2-4x slower; scope_lib.models.cpu). Prints a markdown table (put it in docs/benchmarks.md, with
the CPU line it prints).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: SmolLM2-135M's shape (Llama: 30 layers, width 576, 9 heads of 64, 3 key/value heads, 49152 tokens, tied).
SMOLLM2 = ("HuggingFaceTB/SmolLM2-135M", (30, 576, 1536, 9, 3, 64, 49152))


def build_model(folder: Path, corpus: Path, dtype: str) -> Path:
    from scope_lib.models.gpu_plan import KNOWN, Architecture
    from scope_lib.models.random_models import build_shaped_model

    name, shape = SMOLLM2
    KNOWN.setdefault(name, Architecture(*shape, tied_embeddings=True))
    return build_shaped_model(name, folder / f"smollm2-135m-{dtype}", corpus, dtype=dtype)


def questions(n: int) -> list[str]:
    import json

    path = Path(os.environ.get("SCOPE_DATA_DIR", REPO.parent / "shared" / "data")) / "qa" / "nq.jsonl"
    rows = [json.loads(line) for line in path.open()] if path.is_file() else []
    texts = [r.get("question") or r.get("query") or "" for r in rows]
    texts = [t for t in texts if t] or ["Which river flows through the city?"]
    return [texts[i % len(texts)] for i in range(n)]


def rollouts(engine, tokenizer, prompts: list[list[int]], turns: int, new_tokens: int, env: list[int]):
    """(new tokens, seconds in generate) over `turns` batched turns."""
    from scope_lib.models.engine import Sampling

    sampling = Sampling(max_new_tokens=new_tokens, temperature=0.0, logprobs=True)
    contexts, tokens, seconds = [list(p) for p in prompts], 0, 0.0
    for _ in range(turns):
        started = time.perf_counter()
        out = engine.generate(contexts, sampling)
        seconds += time.perf_counter() - started
        tokens += sum(len(c.token_ids) for c in out)
        contexts = [c + o.token_ids + env for c, o in zip(contexts, out, strict=True)]
    return tokens, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--env-tokens", type=int, default=96)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 where the CPU has it natively, else float32")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--model", type=Path, default=None, help="a local model folder (default: SmolLM2-shaped)")
    parser.add_argument("--repeats", type=int, default=5, help="overhead and sync: medians over this many tries")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF rollouts (overhead and sync only)")
    args = parser.parse_args()
    from scope_lib.models.cpu import cpu_description, native_bf16

    args.dtype = args.dtype or ("bfloat16" if native_bf16() else "float32")

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scope_lib.models.engine import Sampling
    from scope_lib.models.hf_engine import HFEngine
    from scope_lib.models.vllm_engine import VLLMEngine

    torch.set_num_threads(args.threads)
    data = Path(os.environ.get("SCOPE_DATA_DIR", REPO.parent / "shared" / "data"))
    work = Path(tempfile.gettempdir()) / "scope-bench-engines"
    model_dir = args.model or build_model(work, data / "wiki18_sample.jsonl", args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in questions(args.prompts)]
    env = tokenizer.encode("\n<information>" + " the river city" * (args.env_tokens // 3) + "</information>\n",
                           add_special_tokens=False)
    rows = []

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    if not args.no_hf:
        hf = HFEngine(model, tokenizer)
        rollouts(hf, tokenizer, prompts[:2], 1, 4, env)   # first-call warm-up, as for vLLM below
        hf_tokens, hf_s = rollouts(hf, tokenizer, prompts, args.turns, args.new_tokens, env)
        rows.append(("HF generate", hf_tokens, hf_s))
        print(f"HF: {hf_tokens} tokens in {hf_s:.1f} s", file=sys.stderr, flush=True)
    engine = VLLMEngine(model_dir, tokenizer=tokenizer, enable_lora=True, max_loras=2, max_lora_rank=8,
                        max_model_len=4096, dtype=args.dtype, threads=args.threads, kv_cache_gib=1)
    rollouts(engine, tokenizer, prompts[:2], 1, 4, env)   # first-call warm-up
    v_tokens, v_s = rollouts(engine, tokenizer, prompts, args.turns, args.new_tokens, env)
    rows.append(("vLLM (VLLMEngine)", v_tokens, v_s))
    print(f"vLLM: {v_tokens} tokens in {v_s:.1f} s", file=sys.stderr, flush=True)

    # our overhead: the same first turn through VLLMEngine and through a bare LLM.generate, alternating
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = Sampling(max_new_tokens=args.new_tokens, temperature=0.0)
    bare_params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, logprobs=0, skip_special_tokens=False)
    ours_s, bare_s = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        ours = engine.generate(prompts, sampling)
        ours_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        bare = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], bare_params,
                                   use_tqdm=False)
        bare_s.append(time.perf_counter() - started)
    assert [c.token_ids for c in ours][:4] == [list(o.outputs[0].token_ids)[:len(c.token_ids)]
                                               for c, o in zip(ours[:4], bare[:4], strict=True)]

    # adapter sync: save + register a new version + the generate that loads it, minus a generate with it loaded
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    turn = prompts[:8]
    small = Sampling(max_new_tokens=8, temperature=0.0)
    sync_s, loaded_s = [], []
    for version in range(args.repeats):
        started = time.perf_counter()
        folder = work / "published" / f"v{version}"
        peft.save_pretrained(folder)
        engine.add_adapter("solver", folder)
        engine.generate(turn, small, adapter="solver")
        sync_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.generate(turn, small, adapter="solver")
        loaded_s.append(time.perf_counter() - started)
    engine.close()

    print(f"CPU: {cpu_description()}")
    print(f"{args.prompts} prompts x {args.turns} turns x {args.new_tokens} new tokens (greedy, {args.dtype}, "
          f"{args.threads} threads, env reply {len(env)} tokens), model {model_dir.name}\n")
    print("| engine | new tokens | seconds | tokens/s |\n|---|---:|---:|---:|")
    for name, tokens, seconds in rows:
        print(f"| {name} | {tokens} | {seconds:.1f} | {tokens / seconds:.0f} |")
    if not args.no_hf:
        print(f"\nvLLM / HF: {(v_tokens / v_s) / (hf_tokens / hf_s):.2f}x")
    ours_m, bare_m = statistics.median(ours_s), statistics.median(bare_s)
    print(f"\nour overhead over a bare LLM.generate (one turn, median of {args.repeats}): {ours_m:.2f} s vs "
          f"{bare_m:.2f} s = {100 * (ours_m - bare_m) / bare_m:+.1f}%")
    print(f"adapter sync per optimiser step (save + register + the generate that loads it, minus the same generate "
          f"with it loaded; median of {args.repeats}): {statistics.median(sync_s) - statistics.median(loaded_s):.3f} s"
          f" ({statistics.median(sync_s):.3f} s vs {statistics.median(loaded_s):.3f} s)")


if __name__ == "__main__":
    main()
