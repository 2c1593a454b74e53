"""GPU speed and memory (needs CUDA, vLLM and the gpu extra; random-initialised models of real shapes).

    python benchmarks/gpu.py [--model Qwen/Qwen3-1.7B] [--contexts 8192 16384] [--rollouts 32]

1. Multi-turn rollouts, tokens/s: the HF engine versus one vLLM engine, same prompts, same budgets (target: vLLM
   at least 10x).
2. One GRPO step per mode (LoRA, full) and context: wall time and peak GPU memory, next to `scope plan`'s
   training-phase figure for the same settings.

Prints tables; asserts nothing. Not run in CI (no GPU there).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def rollout_speed(model_dir: Path, n: int, max_new_tokens: int, turns: int) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scope_lib.models.engine import Sampling
    from scope_lib.models.hf_engine import HFEngine
    from scope_lib.models.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Explain the history of Paris."}],
                                                tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=1.0, seed=0)
    rows = []
    engines = {"hf": lambda: HFEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda(),
                                      tok),
               "vllm": lambda: VLLMEngine(model_dir, tokenizer=tok, gpu_memory_utilization=0.6, max_model_len=16384)}
    for name, make in engines.items():
        engine = make()
        contexts = [list(prompt) for _ in range(n)]
        started, tokens = time.perf_counter(), 0
        for _ in range(turns):  # each turn continues every context, as the rollout loop does
            out = engine.generate(contexts, sampling)
            tokens += sum(len(c.token_ids) for c in out)
            contexts = [c + o.token_ids + prompt[-8:] for c, o in zip(contexts, out, strict=True)]
        seconds = time.perf_counter() - started
        rows.append({"engine": name, "rollouts": n, "turns": turns, "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds})
        del engine
        torch.cuda.empty_cache()
    return rows


def step_cost(model_dir: Path, mode: str, context: int) -> dict:
    """One GRPO step on rows of `context` tokens (half prompt, half completion) with LoRA or full weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scope_lib.config import load_params
    from scope_lib.models.gpu_plan import plan_gpu
    from scope_lib.selfplay.policy import Policy
    from scope_lib.selfplay.training import grpo_args, make_trainer

    params = load_params(None, {"model.base": str(model_dir), "model.finetuning": mode, "engine.device": "cuda",
                                "engine.backend": "hf", "solver.batch_size": 1, "grpo.group_size": 2,
                                "grpo.per_device_batch_size": 2, "solver.max_prompt_tokens": context // 2,
                                "solver.max_response_tokens": context // 2, "model.max_model_len": context,
                                "challenger.max_prompt_tokens": 16, "challenger.max_response_tokens": 16})
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    policy = Policy(params, base, tok)

    def rollout(prompts, trainer):
        half = context // 2
        ids = torch.randint(100, len(tok) - 1, (len(prompts), context)).tolist()
        return {"prompt_ids": [r[:half] for r in ids], "completion_ids": [r[half:] for r in ids],
                "env_mask": [[1] * (context - half) for _ in ids], "logprobs": None,
                "r": [float(i % 2) for i in range(len(prompts))]}

    def reward(prompts, completions, r, **_):
        return r

    with tempfile.TemporaryDirectory() as tmp:
        args = grpo_args(params, "solver", seed=0, output_dir=tmp, steps=1)
        trainer = make_trainer(policy, "solver", args, dataset_ids=["q0", "q1"], rollout_func=rollout,
                               reward_func=reward)
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 1024 ** 3
    planned = plan_gpu(params, gpu_gib=torch.cuda.get_device_properties(0).total_memory / 1024 ** 3).train_peak
    return {"mode": mode, "context": context, "step_s": seconds, "peak_gib": peak, "plan_gib": planned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--contexts", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "wiki18_sample.jsonl"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU")
    from scope_lib.models.random_models import build_shaped_model

    model_dir = build_shaped_model(args.model, Path(tempfile.gettempdir()) / args.model.replace("/", "_"),
                                   Path(args.corpus))
    print(f"GPU: {torch.cuda.get_device_name(0)}; model: random {args.model}")
    print("| engine | rollouts | turns | tokens | seconds | tokens/s |\n|---|---|---|---|---|---|")
    for row in rollout_speed(model_dir, args.rollouts, 256, 3):
        print(f"| {row['engine']} | {row['rollouts']} | {row['turns']} | {row['tokens']} | {row['seconds']:.1f} | "
              f"{row['tokens_per_s']:.0f} |")
    print("| mode | context | step s | peak GiB | plan GiB |\n|---|---|---|---|---|")
    for mode in ("lora", "full"):
        for context in args.contexts:
            try:
                row = step_cost(model_dir, mode, context)
                print(f"| {mode} | {context} | {row['step_s']:.1f} | {row['peak_gib']:.1f} | {row['plan_gib']:.1f} |")
            except torch.cuda.OutOfMemoryError:
                print(f"| {mode} | {context} | out of memory | – | – |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
