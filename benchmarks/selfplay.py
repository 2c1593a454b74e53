"""One self-play iteration under the smoke parameters, timed: wall time per stage, split into generation,
retrieval, Judge, Stage 1's Solver rollouts, the GRPO update and our own overhead, with engine and Judge call
counts and the turns they served.

    python benchmarks/selfplay.py [--params params/smoke.yaml] [-o key=value ...]

Targets (issue #6): one engine call per rollout turn, one Judge call per stage (plus one corrective retry call
when replies do not parse), our overhead at most 10% of generation. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from scope_lib.config import load_params
from scope_lib.runs import read_jsonl


def _sum(rows, key):
    return sum(r.get(key) or 0 for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params/smoke.yaml")
    parser.add_argument("-o", "--override", action="append", default=[])
    args = parser.parse_args()
    from scope_lib.selfplay.loop import open_run
    from scope_lib.selfplay.methods.scope import build_pool, train_challenger, train_solver
    from scope_lib.smoke.warm_start import prepare

    with tempfile.TemporaryDirectory() as tmp:
        params = load_params(args.params, [f"run.runs_dir={tmp}", "selfplay.iterations=1", *args.override])
        started = time.perf_counter()
        r = open_run(prepare(params))
        setup_s = time.perf_counter() - started
        stage_s = {}
        for name, fn in (("challenger", train_challenger), ("pool", build_pool), ("solver", train_solver)):
            t0 = time.perf_counter()
            fn(r, 1)
            stage_s[name] = time.perf_counter() - t0
        folder = Path(params.run_dir) / "iter_01"
        rows = []
        for role in ("challenger", "solver"):
            metrics = read_jsonl(folder / role / "metrics.jsonl") if (folder / role / "metrics.jsonl").is_file() else []
            gen = _sum(metrics, "time_generation_s")
            overhead = _sum(metrics, "time_overhead_s")
            rows.append({"stage": f"{role} training", "wall_s": stage_s[role], "steps": len(metrics),
                         "generation_s": gen, "retrieval_s": _sum(metrics, "time_retrieval_s"),
                         "judge_s": _sum(metrics, "time_judge_s"),
                         "solver_rollouts_s": _sum(metrics, "time_solver_rollouts_s"),
                         "update_s": _sum(metrics, "time_update_s"), "overhead_s": overhead,
                         "engine_calls": _sum(metrics, "engine_calls"), "judge_calls": _sum(metrics, "judge_calls"),
                         "overhead_share": overhead / gen if gen else None})
        chunks = read_jsonl(folder / "pool" / "chunks.jsonl")
        gen = _sum(chunks, "time_generation_s")
        other = _sum(chunks, "time_total_s") - gen - _sum(chunks, "time_retrieval_s") - _sum(chunks, "time_judge_s")
        rows.insert(1, {"stage": "task pool", "wall_s": stage_s["pool"], "steps": len(chunks),
                        "generation_s": gen, "retrieval_s": _sum(chunks, "time_retrieval_s"),
                        "judge_s": _sum(chunks, "time_judge_s"), "solver_rollouts_s": 0.0, "update_s": 0.0,
                        "overhead_s": max(0.0, other), "engine_calls": _sum(chunks, "engine_calls"),
                        "judge_calls": _sum(chunks, "judge_calls"),
                        "overhead_share": max(0.0, other) / gen if gen else None})
        print(f"setup (corpus, index, policy, Judge): {setup_s:.1f} s; model {params.model.base}, "
              f"dialect {r.dialect.name}")
        header = ["stage", "wall_s", "steps", "generation_s", "retrieval_s", "judge_s", "solver_rollouts_s",
                  "update_s", "overhead_s", "overhead_share", "engine_calls", "judge_calls"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(_fmt(row[h]) for h in header) + " |")
        print("judge stages:", json.dumps(r.judge.stats.table()))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "–" if value is None else str(value)


if __name__ == "__main__":
    main()
