"""Wall time of one smoke iteration of `scope train` with 1 process against `--processes 2` (torchrun, gloo):
the random tiny model, the hashing embedder, 1 GRPO step per role, batch 2 x group 2 (the settings of
tests/test_multiprocess.py), each run in a fresh run folder, the two alternating.

    python benchmarks/ranks.py [--repeats 2] [--steps 1]

Prints a markdown table (median seconds per run, and the stage seconds the run recorded); asserts nothing. On
a CPU machine the ranks share its cores and each imports the stack and loads the model: this measures that
overhead, not the GPU speed-up of one rank per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "model.tiny": "{}", "challenger.temperature": 1.0, "solver.temperature": 1.0, "retrieval.embedder": "hashing",
    "selfplay.challenger_prompts": 4, "selfplay.candidate_batch_size": 4, "selfplay.target_tasks": 3,
    "selfplay.max_candidate_batches": 2, "selfplay.solver_rollouts_train": 2, "selfplay.solver_rollouts_filter": 2,
    "challenger.batch_size": 2, "solver.batch_size": 2, "grpo.group_size": 2, "grpo.per_device_batch_size": 2,
}


def run(processes: int, steps: int, cache: Path) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as runs:
        args = [sys.executable, "-m", "scope_lib.cli", "train", str(REPO / "params" / "smoke.yaml"),
                "--processes", str(processes)]
        for key, value in {**SETTINGS, "selfplay.steps_per_role": steps, "run.runs_dir": runs}.items():
            args += ["-o", f"{key}={value}"]
        data = os.environ.get("SCOPE_DATA_DIR") or str(REPO.parent / "shared" / "data")
        env = {**os.environ, "SCOPE_DATA_DIR": data, "SCOPE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        started = time.perf_counter()
        done = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"scope train --processes {processes} failed:\n{done.stderr[-3000:]}")
        seconds = time.perf_counter() - started
        stages = {s: json.loads((Path(runs) / "smoke" / "iter_01" / s / "DONE").read_text()).get("seconds")
                  for s in ("challenger", "solver")}
        return seconds, stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="scope-ranks-cache-"))
    run(1, args.steps, cache)  # build the tiny model once, outside the timings
    times: dict[int, list[float]] = {1: [], 2: []}
    stages: dict[int, dict] = {}
    for _ in range(args.repeats):
        for processes in (1, 2):
            seconds, stages[processes] = run(processes, args.steps, cache)
            times[processes].append(seconds)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| processes | wall s (median) | runs | Stage 1 s (challenger) |")
    print("|---|---|---|---|")
    for processes, values in times.items():
        print(f"| {processes} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{stages[processes]['challenger']} |")


if __name__ == "__main__":
    main()
