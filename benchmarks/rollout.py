"""Rollout and Judge cost with a real engine: engine calls per turn, Judge calls per stage, tokens
generated, and where the time goes (generation, retrieval, Judge, our own overhead).

    python benchmarks/rollout.py --params params/smoke.yaml --documents 16 --questions 16

Targets: exactly one engine call per rollout turn for the whole batch, one Judge call per stage (a second
only when replies did not parse), and our overhead under 10% of generation time. Prints a markdown table.
Under the smoke params the policy is the tiny random model. It would rarely write a search action, so a
logit bias (see `nudge_to_search`, off with --no-nudge) makes it search every turn: the multi-turn loop,
retrieval and environment turns then run for real. Tasks still do not parse, so the Judge stages are
measured on the Solver questions (real prompts, real generation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scope_lib.reports import notebook  # noqa: E402
from scope_lib.selfplay.rollout import new_trajectory, run_rollouts, solver_messages  # noqa: E402
from scope_lib.selfplay.tasks import solver_limits  # noqa: E402


def nudge_to_search(model, tokenizer, dialect, mean_query_tokens: int = 8):
    """Make a random tiny model follow the search protocol often enough to measure multi-turn cost: a
    logit bias (a forward hook on the output layer) opens each turn with the dialect's search tag and then
    closes it after about `mean_query_tokens` tokens. Generation stays real; only its distribution moves.
    For benchmarks only."""
    import math

    open_id = tokenizer.convert_tokens_to_ids(dialect.search_open)
    close_id = tokenizer.convert_tokens_to_ids(dialect.search_close)
    close_bias = math.log(len(tokenizer) / mean_query_tokens)

    state = {"prefill": False}

    def mark(_module, args, kwargs):              # generate() computes logits for the last position only,
        ids = kwargs.get("input_ids", args[0] if args else None)   # so tell prefill by the input length
        state["prefill"] = ids is not None and ids.shape[1] > 1

    def hook(_module, _inputs, logits):
        if state["prefill"]:                      # the turn's first token is the open tag
            logits[:, -1, open_id] += 100.0
        else:
            logits[:, -1, close_id] += close_bias
        return logits

    model.register_forward_pre_hook(mark, with_kwargs=True)
    return model.get_output_embeddings().register_forward_hook(hook)


def questions(data_dir: Path, n: int) -> list[str]:
    path = data_dir / "qa" / "hotpotqa.jsonl"
    with open(path) as f:
        return [json.loads(line)["question"] for line, _ in zip(f, range(n), strict=False)]


def row(name: str, stats, engine_calls: int) -> dict:
    return {"stage": name, "rollouts/prompts": stats["items"], "turns": stats.get("turns", "-"),
            "engine calls": engine_calls, "calls per turn": stats.get("per_turn", "-"),
            "tokens": stats.get("tokens", "-"), "generation s": stats.get("gen", 0.0),
            "retrieval s": stats.get("ret", 0.0), "overhead s": stats.get("over", 0.0),
            "overhead / generation": stats.get("ratio", "-")}


def rollout_row(name: str, n: int, s, engine_calls: int) -> dict:
    """A table row from a run_rollouts RolloutStats."""
    return row(name, {"items": n, "turns": s.turns, "per_turn": round(engine_calls / max(s.turns, 1), 2),
                      "tokens": s.generated_tokens, "gen": round(s.generation_s, 3), "ret": round(s.retrieval_s, 3),
                      "over": round(s.overhead_s, 3), "ratio": f"{s.overhead_s / max(s.generation_s, 1e-9):.1%}"},
               engine_calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params/smoke.yaml")
    parser.add_argument("-o", "--override", action="append", default=[])
    parser.add_argument("--documents", type=int, default=16, help="Challenger rollouts")
    parser.add_argument("--questions", type=int, default=16, help="Solver rollouts (HotpotQA questions)")
    parser.add_argument("--no-nudge", dest="nudge", action="store_false",
                        help="do not bias the tiny model toward search actions (it then rarely searches)")
    args = parser.parse_args()

    params = notebook.init(args.params, args.override)
    c = notebook.components(params)
    rows = []
    if args.nudge:
        nudge_to_search(c.policy.model, c.tokenizer, c.dialect)

    calls = c.policy.calls
    _, trajectories, s = notebook.challenger_batch(c, args.documents)
    rows.append(rollout_row("challenger rollouts", len(trajectories), s, c.policy.calls - calls))

    qs = questions(params.data_dir, args.questions)
    solvers = [new_trajectory(f"q{i}", "solver", solver_messages(q, c.dialect, params.solver.max_searches),
                              c.tokenizer, max_searches=params.solver.max_searches) for i, q in enumerate(qs)]
    calls = c.policy.calls
    s = run_rollouts(solvers, c.policy, c.retriever, c.dialect, solver_limits(params))
    rows.append(rollout_row("solver rollouts", len(solvers), s, c.policy.calls - calls))

    # Judge stages on real prompts: the questions stand in for tasks, their top passages for sources.
    sources = [hits[0].text for hits in c.retriever.search(qs, 1)]
    answers = [t.turns[-1] if t.turns else "" for t in solvers]
    judge = c.judge
    for stage, run in [
        ("judge: gates", lambda: judge.gates(qs, sources)),
        ("judge: rubrics", lambda: judge.rubrics(["long_form_qa"] * len(qs), qs, [[d] for d in sources])),
        ("judge: grading", lambda: judge.grade(qs * 3, answers * 3, ["Identifies the answer."] * (3 * len(qs)))),
    ]:
        calls = c.policy.calls
        t0 = time.perf_counter()
        run()
        elapsed = time.perf_counter() - t0
        st = judge.stats.stages[stage.split(": ")[1]]
        rows.append(row(stage, {"items": st.prompts, "gen": round(elapsed, 3),
                                "per_turn": f"{st.calls} ({st.unparseable} unparseable)"},
                        c.policy.calls - calls))

    header = list(rows[0])
    print(f"\nparams: {args.params}; policy {params.model.base} on {c.policy.name}, "
          f"{params.engine.device}; index {c.retriever.count()} passages\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(r[h]) for h in header) + " |")


if __name__ == "__main__":
    main()
