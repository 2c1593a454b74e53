"""What each method's training costs inside a comparison against its own loop on the same work (issue 49's target:
within 20% a step, so that no method pays for another's machinery).

    python benchmarks/method_costs.py SPEC [-o key=value ...] [--methods spice ssp ...] [--repeats N] [--out FILE.json]

SPEC is a `scope compare-methods` spec whose runs have finished (`scope compare-methods SPEC` first, with the same
overrides). For each of its methods this trains the method's own params file alone, as a user would (`scope train
params/<method file>` in a process of its own), with the spec's budget and seeds (`method_comparison.BUDGET`,
`selfplay.seed`, `grpo.seed`) and nothing else of the spec, `--repeats` times. It then prints, per training stage,
the optimiser steps, the tokens generated and the seconds a step took in the comparison's run and in the own runs
(their median and range: the same command's step time varies by a fifth between processes on sub-second
tiny-model steps), with the ratio of the comparison's to the own runs' median. The comparison lays the spec's
shared sections over the method's file (one corpus and index, one held-out reservation, one engine), so a step's
work may differ a little: the tokens generated say by how much. Run it with nothing else on the machine. Asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scope_lib.config import load_params
from scope_lib.evaluation.method_comparison import (
    BUDGET,
    dotted_value,
    load_spec,
    method_params,
    run_costs,
    run_finished,
)
from scope_lib.models.cpu import cpu_description


def own_run(spec, spec_path: Path, method: str, runs_dir: Path) -> tuple[object, float]:
    """The method's own params file trained alone with the spec's budget and seeds: its params and wall seconds."""
    own_file = spec_path.parent / spec.compare.methods[method]
    keys = (*BUDGET, "selfplay.seed", "grpo.seed")
    overrides = [f"run.runs_dir={runs_dir}", f"run.name=own-{method}",
                 *(f"{k}={json.dumps(dotted_value(spec, k))}" for k in keys)]
    params = load_params(own_file, overrides)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "scope_lib.cli", "train", str(own_file),
                    *(x for o in overrides for x in ("-o", o))], check=True)
    return params, time.perf_counter() - started


def _per_step(role: dict) -> float | None:
    return role["step_s"] / role["steps"] if role.get("steps") else None


def rows(method: str, compared: dict, owns: list[dict]) -> list[dict]:
    """Per training stage: the comparison's run against the own runs (steps and tokens of the first own run)."""
    out = []
    for stage in sorted(set(compared["roles"]).union(*(o["roles"] for o in owns))):
        a = compared["roles"].get(stage, {})
        b = owns[0]["roles"].get(stage, {})
        per_a = _per_step(a)
        per_b = sorted(p for p in (_per_step(o["roles"].get(stage, {})) for o in owns) if p is not None)
        median = statistics.median(per_b) if per_b else None
        out.append({"method": method, "stage": stage, "steps": (a.get("steps"), b.get("steps")),
                    "tokens": (a.get("generated_tokens"), b.get("generated_tokens")),
                    "s_per_step": per_a, "own_s_per_step": per_b,
                    "ratio": per_a / median if per_a and median else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec")
    parser.add_argument("-o", "--override", action="append", default=[],
                        help="key=value laid over the spec, as `scope compare-methods -o` was given")
    parser.add_argument("--methods", nargs="*", help="default: every method of the spec")
    parser.add_argument("--repeats", type=int, default=3, help="own runs per method (default 3)")
    parser.add_argument("--out", help="also write the table as JSON here")
    args = parser.parse_args()
    spec_path = Path(args.spec)
    spec = load_spec(spec_path, args.override)
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods or list(spec.compare.methods):
            compared = method_params(spec, spec_path, method)
            if not run_finished(compared):
                sys.exit(f"{compared.run_dir} has not finished: run `scope compare-methods {spec_path}` first")
            owns = []
            for repeat in range(args.repeats):
                own, wall = own_run(spec, spec_path, method, Path(tmp) / str(repeat))
                owns.append(run_costs(own, wall))
            table += rows(method, run_costs(compared, None), owns)
    print(f"CPU: {cpu_description()}")
    print(f"| method | stage | steps (comparison / own) | tokens generated | s a step, comparison | s a step, own "
          f"({args.repeats} runs: median, range) | ratio to the median |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        own = r["own_s_per_step"]
        own_text = f"{statistics.median(own):.2f} ({own[0]:.2f}-{own[-1]:.2f})" if own else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        mine = f"{r['s_per_step']:.2f}" if r["s_per_step"] else "-"
        print(f"| {r['method']} | {r['stage']} | {r['steps'][0]} / {r['steps'][1]} | {r['tokens'][0]} / "
              f"{r['tokens'][1]} | {mine} | {own_text} | {ratio} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_description(), "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
