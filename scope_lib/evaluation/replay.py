"""The replay ablation (paper §5, Table 4): the search trajectory of checkpoint X, the answer written by Y.

Starting from X's stored evaluation trajectory of an item, everything up to X's final answer turn is kept — every
search turn and every retrieved result, token for token (ids and env mask intact) — and Y writes the answer turn
from there. Off-diagonal pairs measure retrieval (X varies) and synthesis (Y varies); the diagonal X = Y is X's
own evaluation (Tables 2-3), as in the paper.

The paper leaves two things open; both are named options and recorded with the results:
- `see_thinking`: does Y see X's <think> text? False (default) = X's turns with thinking removed, which is what
  Qwen3 — the paper's only Table 4 model — sees anyway, since its chat template drops earlier thinking (App. E).
  True = X's exact token stream (no effect for Qwen3, whose template strips earlier thinking regardless).
- `allow_search`: may Y search again? False (default) = the searches are X's; a search attempt by Y ends the
  rollout without an answer. True = Y may search up to the remaining budget (`evaluation.max_searches`).

Results go to runs/<name>/eval/replay/<X>__<Y>__<options>/<benchmark>/ (trajectories, items, summary).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from scope_lib.config import Params
from scope_lib.evaluation.benchmarks import BENCHMARKS, select_items
from scope_lib.evaluation.evaluate import (
    Policy,
    answered_from,
    base_engine,
    eval_dir,
    eval_limits,
    evaluate,
    force_answer,
    load_summary,
    load_trajectory,
    make_benchmark_judge,
    open_policies,
    resolve_checkpoint,
    run_solver,
    score_items,
    store_record,
    write_benchmark_results,
)
from scope_lib.protocol.dialects import Dialect, get_dialect, strip_thinking
from scope_lib.retrieval.index import open_retriever
from scope_lib.runs import RecordLog
from scope_lib.selfplay.rollout import Trajectory, new_trajectory, run_rollouts


@dataclass(frozen=True)
class ReplayOptions:
    """What the answering checkpoint Y may see and do (the paper does not say; see the module docstring)."""

    see_thinking: bool = False
    allow_search: bool = False

    @property
    def tag(self) -> str:
        return f"think-{'on' if self.see_thinking else 'off'}_search-{'on' if self.allow_search else 'off'}"


def replay_prefix(traj: Trajectory, new_id: str, *, see_thinking: bool, dialect: Dialect, tokenizer,
                  max_searches: int) -> Trajectory:
    """A new trajectory that holds X's rollout up to its answer turn, ready for another policy to continue.

    The final turn is removed unless the environment answered it (then the rollout ended right after a search and
    everything is kept). With `see_thinking` the kept part is X's exact token stream: prompt ids, completion ids and
    env mask unchanged. Without it the kept conversation, thinking removed from its assistant turns, is re-rendered
    by the chat template into the prompt, and the continuation starts fresh. X's searches are kept either way, so
    they count against `max_searches`."""
    last_span_end = traj.turn_spans[-1][1] if traj.turn_spans else 0
    drop_last = bool(traj.turns) and last_span_end == len(traj.completion_ids)
    kept_turns = len(traj.turns) - (1 if drop_last else 0)
    cut = traj.turn_spans[kept_turns][0] if drop_last else len(traj.completion_ids)
    messages = [dict(m) for m in (traj.messages[:-1] if drop_last else traj.messages)]
    n_actions = sum(dialect.parse_search(t, starts_in_think=traj.opens_think).kind != "none"
                    for t in traj.turns[:kept_turns])
    searches = copy.deepcopy(traj.searches[:n_actions])
    meta = {**traj.meta, "search_trajectory_id": traj.id, "prefix_tokens": cut, "kept_turns": kept_turns,
            "see_thinking": see_thinking}
    if see_thinking:   # replace() keeps every other field of X's trajectory (e.g. how its template opened)
        return replace(traj, id=new_id, messages=messages, max_searches=max_searches, meta=meta,
                       completion_ids=traj.completion_ids[:cut], env_mask=traj.env_mask[:cut], logprobs=[0.0] * cut,
                       turns=list(traj.turns[:kept_turns]), turn_spans=list(traj.turn_spans[:kept_turns]),
                       turn_prompt_ids=[], searches=searches, finish="", task=None, answer=None,
                       stops_in_thinking=0)
    visible = [{**m, "content": strip_thinking(m["content"])} if m["role"] == "assistant" else m for m in messages]
    fresh = new_trajectory(new_id, "solver", visible, tokenizer, max_searches=max_searches,
                           meta={**meta, "prefix_tokens": 0, "prompt_turns": kept_turns})
    fresh.searches = searches
    return fresh


def default_pairs(checkpoints: list[str]) -> list[tuple[str, str]]:
    """The paper's design between the earliest and latest trained Solver (Table 4: iter-1 and iter-3): X/X, X/Y,
    Y/X, Y/Y. With one trained Solver, base and that Solver; with none, base x base only."""
    trained = [c for c in checkpoints if c != "base"]
    if not trained:
        return [("base", "base")]
    first, last = (trained[0], trained[-1]) if len(trained) > 1 else ("base", trained[0])
    return [(first, first), (first, last), (last, first), (last, last)]


def replay_dir(params: Params, search: str, answer: str, options: ReplayOptions, benchmark: str) -> Path:
    return params.run_dir / "eval" / "replay" / f"{search}__{answer}__{options.tag}" / benchmark


def replay_benchmark(params: Params, search: Policy, answer: Policy, benchmark: str, options: ReplayOptions, *,
                     retriever, dialect: Dialect, judge) -> dict[str, Any]:
    """Y's answers on X's search trajectories for one benchmark, judged like any evaluation. X's trajectories come
    from (or are added to) X's evaluation store; replayed trajectories are stored and reused."""
    e = params.evaluation
    items, manifest = select_items(params, benchmark)
    source = run_solver(params, search, benchmark, items, retriever=retriever, dialect=dialect)
    folder = replay_dir(params, search.checkpoint.name, answer.checkpoint.name, options, benchmark)
    store = RecordLog(folder / "trajectories.jsonl")
    done = {(r["meta"]["item_id"], r["meta"]["seed"]): load_trajectory(r) for r in store}
    tokenizer = answer.engine.tokenizer
    effective = options.see_thinking and not dialect.strips_earlier_thinking
    todo = []
    for key, traj in source.items():
        if key in done:
            continue
        prefix = replay_prefix(traj, f"replay/{search.checkpoint.name}>{answer.checkpoint.name}/{traj.id}",
                               see_thinking=effective, dialect=dialect, tokenizer=tokenizer,
                               max_searches=e.max_searches if options.allow_search else traj.n_valid_searches)
        prefix.meta.update(answer_checkpoint=answer.checkpoint.name, search_checkpoint=search.checkpoint.name)
        todo.append(prefix)
    by_seed: dict[int, list[Trajectory]] = {}
    for t in todo:
        by_seed.setdefault(t.meta["seed"], []).append(t)
    for seed, trajs in by_seed.items():
        for start in range(0, len(trajs), e.rollout_batch_size):
            batch = trajs[start:start + e.rollout_batch_size]
            turns = {max(1, e.max_searches - t.n_valid_searches + 1) if options.allow_search else 1 for t in batch}
            for n_turns in sorted(turns):
                group = [t for t in batch if (max(1, e.max_searches - t.n_valid_searches + 1)
                                              if options.allow_search else 1) == n_turns]
                limits = replace(eval_limits(params, dialect, seed), max_turns=n_turns)
                run_rollouts(group, answer.engine, retriever, dialect, limits, adapter=answer.adapter)
                if e.force_answer:
                    force_answer(group, answer, retriever, dialect, limits, e.force_answer)
            store.append(store_record(t) for t in batch)
            done.update(((t.meta["item_id"], seed), t) for t in batch)
    replays = {key: done[key] for key in source}
    label = f"{search.checkpoint.name}>{answer.checkpoint.name}"
    records, per_scorer = score_items(params, benchmark, answered_from(benchmark, items, replays), judge, label=label)
    extra = {"replay": {"search": search.checkpoint.name, "answer": answer.checkpoint.name, **asdict(options),
                        "effective_see_thinking": effective, "dialect": dialect.name}}
    return write_benchmark_results(params, folder, label, benchmark, records, per_scorer, manifest, judge, extra)


def replay_table(params: Params, pairs: list[tuple[str, str]], benchmarks: list[str],
                 options: ReplayOptions = ReplayOptions(), *, scorer: str = "scope_paper",
                 policies: dict[str, Policy] | None = None, judge=None, retriever=None,
                 dialect: Dialect | None = None, engine=None):
    """Table 4: one row per (search checkpoint, answer checkpoint) pair, one column per benchmark, x100. A pair
    with X = Y is X's own evaluation; the others are replays. Returns (scores, the replay summaries)."""
    import pandas as pd

    specs = sorted({s for pair in pairs for s in pair})
    checkpoints = {s: resolve_checkpoint(params, s) for s in specs}
    dialect = dialect or get_dialect(params.model.dialect, params.model.base)
    retriever = retriever or open_retriever(params, progress=False)
    policies = dict(policies or {})
    missing = [c for c in checkpoints.values() if c.name not in policies]
    if missing:
        policies.update(open_policies(params, missing, engine=engine))
    owns_judge = judge is None
    judge = judge or make_benchmark_judge(params, engine or base_engine(policies))
    rows, summaries = {}, []
    try:
        for x_spec, y_spec in pairs:
            x, y = policies[checkpoints[x_spec].name], policies[checkpoints[y_spec].name]
            row = {}
            for name in benchmarks:
                if x.checkpoint.name == y.checkpoint.name:
                    summary = load_summary(params, x.checkpoint.name, name)
                    if summary is None or not (eval_dir(params, x.checkpoint.name, name) / "items.jsonl").is_file():
                        summary = evaluate(params, [x.checkpoint], [name], policies=policies, judge=judge,
                                           retriever=retriever, dialect=dialect)[0]
                else:
                    summary = replay_benchmark(params, x, y, name, options, retriever=retriever, dialect=dialect,
                                               judge=judge)
                summaries.append(summary)
                value = summary["scorers"].get(scorer, {}).get("value")
                row[BENCHMARKS[name].column] = math.nan if value is None else 100 * value
            rows[(x.checkpoint.name, y.checkpoint.name)] = row
    finally:
        if owns_judge:
            judge.close()
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index = pd.MultiIndex.from_tuples(table.index, names=["search", "answer"])
    return table, summaries
