"""A GRPO step with `model.loader: unsloth` against `model.loader: hf` (transformers + PEFT): the same random
Qwen3, the same LoRA roles (same initial weights), the same fixed batch of rollouts, through the project's own
trainer (`scope_lib.selfplay.training.make_trainer`).

    python benchmarks/loaders.py [--sizes 128x3 512x8] [--steps 4] [--rows 8] [--tokens 256] [--repeats 2]

Importing Unsloth patches transformers, PEFT and TRL for the whole process, so every measurement runs in a
fresh process (`--child`), the loaders alternating. A size is `hidden x layers` of the offline tiny Qwen3
(`scope_lib.models.tiny`: a BPE tokenizer of the smoke run's vocabulary trained on the corpus, random weights,
MLP 3 x hidden), built once and cached. Step time is the median over the steps after the first; memory is the
process's resident set (psutil, sampled every 5 ms): after loading, and the peak while the steps ran. Without a
GPU Unsloth runs its CPU backend (stock transformers and PEFT underneath): this measures that backend, not
Unsloth's GPU kernels. Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tables import markdown_table  # noqa: E402  (benchmarks/, beside this script)

LOADERS = ("hf", "unsloth")


class PeakRSS:
    """The process's resident memory, sampled in a thread while a block runs."""

    def __init__(self, every_s: float = 0.005):
        import psutil

        self.process, self.every_s, self.peak, self._stop = psutil.Process(), every_s, 0, threading.Event()

    def now(self) -> int:
        return self.process.memory_info().rss

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.every_s)

    def __enter__(self):
        self.peak = self.now()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def child(loader: str, size: str, steps: int, rows: int, tokens: int, checkpointing: bool, threads: int) -> dict:
    """One loader, one model size, `steps` GRPO steps on a fixed batch, in this (fresh) process."""
    import torch

    torch.set_num_threads(threads)
    from scope_lib.config import load_params
    from scope_lib.models.loading import import_training_loader

    hidden, layers = (int(x) for x in size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        params = load_params(REPO / "params" / "smoke.yaml", {
            "run.runs_dir": tmp, "model.loader": loader, "model.warm_start.enabled": False,
            "model.tiny.hidden_size": hidden, "model.tiny.num_layers": layers,
            "model.tiny.num_heads": max(2, hidden // 64), "grpo.group_size": 2, "solver.batch_size": rows // 2,
            "grpo.per_device_batch_size": rows, "grpo.gradient_checkpointing": checkpointing,
            "selfplay.steps_per_role": steps, "grpo.learning_rate": 1e-4})
        import_training_loader(params)  # Unsloth first, as `scope train` does; then what both loaders import
        import peft  # noqa: F401
        import trl  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401

        from scope_lib.selfplay.policy import Policy
        from scope_lib.selfplay.training import grpo_args, make_trainer

        memory = PeakRSS()
        started = time.perf_counter()
        policy = Policy.load(params)
        load_s, loaded = time.perf_counter() - started, memory.now()
        vocab = len(policy.tokenizer)
        generator = torch.Generator().manual_seed(0)  # the same batch in every process
        prompt = [torch.randint(10, vocab, (tokens // 2,), generator=generator).tolist() for _ in range(rows)]
        completion = [torch.randint(10, vocab, (tokens // 2,), generator=generator).tolist() for _ in range(rows)]
        end = policy.tokenizer.convert_tokens_to_ids(policy.tokenizer.eos_token)

        def rollout_func(prompts, trainer):
            return {"prompt_ids": prompt[:len(prompts)], "completion_ids": [c + [end] for c in completion[:len(prompts)]],
                    "env_mask": [[1] * len(c) + [0] for c in completion[:len(prompts)]], "logprobs": None}

        def reward(prompts, completions, completion_ids, **_):
            return [float(i % 2) for i in range(len(prompts))]  # every group of 2 has spread: advantages +-1

        times: list[float] = []
        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                times.append(time.perf_counter() - self.t0)

        args = grpo_args(params, "solver", seed=0, output_dir=Path(tmp) / "trainer")
        trainer = make_trainer(policy, "solver", args, dataset_ids=[f"p{i}" for i in range(rows // 2)],
                               rollout_func=rollout_func, reward_func=reward, callbacks=[Clock()])
        with memory:
            trainer.train()
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        parameters = sum(p.numel() for p in policy.base.parameters())
    return {"loader": loader, "size": size, "parameters": parameters, "load_s": load_s,
            "step_s": statistics.median(times[1:] or times), "first_step_s": times[0], "rss_loaded": loaded,
            "rss_peak": memory.peak, "grad_norm": norms[0] if norms else None, "unsloth_imported": "unsloth" in sys.modules}


def run_child(loader: str, size: str, args) -> dict:
    command = [sys.executable, __file__, "--child", loader, "--sizes", size, "--steps", str(args.steps),
               "--rows", str(args.rows), "--tokens", str(args.tokens), "--threads", str(args.threads)]
    if args.checkpointing:
        command.append("--checkpointing")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{loader} {size} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["128x3", "512x8"], help="hidden x layers of the random Qwen3")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per measurement (the first is not timed)")
    parser.add_argument("--rows", type=int, default=8, help="rollouts per step (groups of 2), one micro-batch")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rollout (half prompt, half completion)")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per loader and size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--checkpointing", action="store_true", help="grpo.gradient_checkpointing on")
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.sizes[0], args.steps, args.rows, args.tokens, args.checkpointing,
                               args.threads)))
        return

    rows = []
    for size in args.sizes:
        runs = {loader: [] for loader in LOADERS}
        for _ in range(args.repeats):
            for loader in LOADERS:
                load = os.getloadavg()[0]
                result = run_child(loader, size, args)
                result["load"] = load
                runs[loader].append(result)
        hf_step = statistics.median(r["step_s"] for r in runs["hf"])
        for loader in LOADERS:
            step = statistics.median(r["step_s"] for r in runs[loader])
            mib = 1024 ** 2
            rows.append({
                "model": f"Qwen3 {size} ({runs[loader][0]['parameters'] / 1e6:.1f}M)", "loader": loader,
                "step s (median)": f"{step:.3f}", "vs hf": f"{step / hf_step:.2f}x",
                "first step s": f"{statistics.median(r['first_step_s'] for r in runs[loader]):.2f}",
                "load s": f"{statistics.median(r['load_s'] for r in runs[loader]):.1f}",
                "RSS after load MiB": f"{statistics.median(r['rss_loaded'] for r in runs[loader]) / mib:.0f}",
                "peak RSS in steps MiB": f"{statistics.median(r['rss_peak'] for r in runs[loader]) / mib:.0f}",
                "step-1 grad norm": f"{runs[loader][0]['grad_norm']:.5f}",
                "Unsloth imported": runs[loader][0]["unsloth_imported"],
                "load avg": f"{min(r['load'] for r in runs[loader]):.1f}-{max(r['load'] for r in runs[loader]):.1f}"})
    print(f"{args.rows} rollouts x {args.tokens} tokens per step, {args.steps} steps, {args.threads} torch "
          f"thread(s), checkpointing {'on' if args.checkpointing else 'off'}, {args.repeats} processes per cell\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
