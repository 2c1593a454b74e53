"""The yardstick's gold-answer slice: held-out questions with verified gold answers, scored with no judge (issue 49
item 2; docs/methods.md, "Methods compared"; not in any of the papers).

    gold = gold_slice(spec, held_out, components)     # built once beside the held-out set, read back after
    gold.tasks, gold.summary["invalid_reasons"]       # the questions; why every other attempt was invalid
    evaluate_checkpoint(spec, gold, policy, components, grade=grade_gold)   # 1[verified] per rollout

The builder is SPICE's Challenger (`compare.gold.builder: spice`; arXiv 2510.24684 §2.2, App. E), run by M0
(adapters off) on the held-out set's reserved documents (`held_out.held_out_candidates`: documents no method trains
on), through the method's own prompts and parser (`protocol.spice.challenger_prompt`, `parse_task`): each document
gets an answer type (apportioned over the seven, as `spice.format_choice: apportioned` does) and up to
`compare.gold.attempts` attempts, each round at its own seed, until one is a valid task whose typed gold answer the
rule verifier accepts in its own written form (`spice.answer_matches`; else `gold_not_verifiable`). A question
already in the slice is `duplicate_question`. Every attempt is stored with why it was invalid. Documents are taken
batch by batch (`learning_check.batch_size`) until `compare.gold.tasks` questions are kept or
`compare.gold.documents` documents are used; a killed build resumes batch by batch (`runs.finished_chunks`, as the
held-out set's build does). The slice lives in <held-out set>/gold-<key>/, keyed by everything that shapes its
questions, so a second comparison loads no model for it.

Why SPICE's Challenger and not SSP's Proposer: its task is closed-form with a typed gold answer checked by rule,
and writing it needs no search and no second model call (SSP's needs a multi-turn search and a RAG verification by
the Solver per question), so the slice costs one Challenger turn per attempt.

Answering: every checkpoint answers a slice question as it answers the held-out tasks (`learning_check.
evaluate_checkpoint`: the spec's Solver prompt and budgets, K rollouts at the check's seeds), the question being the
Reasoner's text (with its options) and one sentence saying what form the answer takes (ANSWER_FORMS). `grade_gold`
verifies the final answer (the last `\\boxed{}` inside it if any, else the whole `<answer>`) by SPICE's rule against
the gold: exact match per type (`spice.answer_matches`). No judge.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scope_lib.config import Params
from scope_lib.evaluation.held_out import (
    CheckComponents,
    HeldOutSet,
    corpus_passages,
    held_out_candidates,
    seed_of,
)
from scope_lib.protocol import spice
from scope_lib.protocol import verification as V
from scope_lib.protocol.prompts import template_version
from scope_lib.runs import RecordLog, RunError, Stage, atomic_write_json, finished_chunks
from scope_lib.selfplay.methods.spice import task_from_record, task_record
from scope_lib.selfplay.rollout import make_challenger_prompts, new_trajectory, run_rollouts
from scope_lib.selfplay.tasks import GradedSolverRollout, challenger_limits

log = logging.getLogger(__name__)

#: Bump when what a slice question is changes in code: every cached slice is rebuilt.
GOLD_VERSION = 1
#: Why an attempt is not in the slice: SPICE's parse reasons, then the slice's own two.
INVALID_REASONS = (*spice.INVALID_REASONS, "gold_not_verifiable", "duplicate_question")
#: The sentence after a slice question saying what form the answer takes (one per SPICE answer type).
ANSWER_FORMS: dict[str, str] = {
    "multiple_choice": "Answer with the letter of the correct option only.",
    "integer": "Answer with the number only, in digits.",
    "float": "Answer with the number only, in decimal notation.",
    "expression": "Answer with the expression only.",
    "string": f"Answer with the name or term only (1 to {spice.MAX_STRING_WORDS} words).",
    "list": "Answer with the items only, separated by commas, in the order the question asks for.",
    "boolean": "Answer with true or false only.",
}


@dataclass(frozen=True)
class GoldTask:
    """One slice question as the yardstick's evaluation reads a held-out task (`challenger_id`, `document_id`,
    `task`: what the Solver is asked) and its gold (`gold`: the SPICE task)."""

    challenger_id: str
    document_id: str
    task: str
    gold: spice.SpiceTask

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> GoldTask:
        return cls(record["id"], record["document_id"], record["question"], task_from_record(record["gold"]))


def solver_question(task: spice.SpiceTask) -> str:
    """What the Solver is asked: the question (with its options) and the form its answer takes."""
    return f"{task.reasoner_text}\n\n{ANSWER_FORMS[task.answer_type]}"


def gold_text(task: spice.SpiceTask) -> str:
    """The gold answer written as an answer would write it: a list's items joined by commas, a boolean in words."""
    if isinstance(task.answer, tuple):
        return ", ".join(task.answer)
    if isinstance(task.answer, bool):
        return "true" if task.answer else "false"
    return str(task.answer)


def final_answer(answer: str | None) -> str | None:
    r"""The final answer to verify: the last ``\boxed{}`` inside the Solver's `<answer>` if any, else all of it."""
    return None if answer is None else V.extract_boxed(answer) or answer


def grade_gold(trajectories: list, tasks: dict[str, GoldTask], components: CheckComponents | None = None
               ) -> list[GradedSolverRollout]:
    """Each rollout's score 1[verified] (its one verdict): its final answer checked by SPICE's rule against the
    gold (`spice.answer_matches`, exact match per answer type). No answer is wrong. No judge."""
    out = []
    for traj in trajectories:
        ok = spice.answer_matches(tasks[traj.meta["challenger_id"]].gold, final_answer(traj.answer))
        out.append(GradedSolverRollout(traj, [int(ok)], float(ok)))
    return out


def check_gold(parse: spice.TaskParse, seen: set[str]) -> tuple[str | None, str]:
    """(None, "") for an attempt that joins the slice, else (its reason, a detail): SPICE's parse reason; a gold
    the rule verifier does not accept written out (`gold_not_verifiable`); a question already kept."""
    if not parse.valid:
        return parse.reason, parse.detail
    task = parse.task
    assert task is not None
    if not spice.answer_matches(task, gold_text(task)):
        return "gold_not_verifiable", f"the rule verifier does not accept the gold {gold_text(task)!r} as its answer"
    if " ".join(task.question.lower().split()) in seen:
        return "duplicate_question", "the slice already holds this question"
    return None, ""


# -- where it lives -----------------------------------------------------------------------------------------------


def gold_fingerprint(params: Params) -> dict[str, Any]:
    """What a slice's questions depend on beyond the held-out set's own key: the builder, its targets and
    attempts, the Challenger's sampling and budgets, the document cut, SPICE's prompts and answer-type rules."""
    g = params.compare.gold
    return {"version": GOLD_VERSION, "builder": g.builder, "tasks": g.tasks, "documents": g.documents,
            "attempts": g.attempts, "batch_size": params.learning_check.batch_size,
            "document_max_tokens": params.selfplay.document_max_tokens,
            "challenger": params.challenger.model_dump(mode="json", include={"max_prompt_tokens",
                                                                            "max_new_tokens_per_turn",
                                                                            "max_response_tokens", "temperature",
                                                                            "top_p"}),
            "prompts": [template_version(n) for n in ("spice_challenger", "spice_format_free_form",
                                                      "spice_format_multiple_choice")],
            "answer_types": {k: list(map(str, v)) for k, v in spice.ANSWER_TYPE_RULES.items()},
            "answer_forms": ANSWER_FORMS}


def gold_folder(params: Params, held_out: HeldOutSet) -> tuple[Path, str]:
    """(folder, key) of the slice these params ask for, inside the held-out set's folder."""
    key = hashlib.sha256(json.dumps(gold_fingerprint(params), sort_keys=True).encode()).hexdigest()[:16]
    return held_out.path / f"gold-{key}", key


def gold_slice(params: Params, held_out: HeldOutSet, components: CheckComponents | Any = None, *,
               progress: bool = True) -> HeldOutSet:
    """The slice of these params, built on first use and read back after (module docstring), as a HeldOutSet whose
    tasks are GoldTasks (the check's evaluation reads it as it reads the held-out set). `components` (or a function
    returning them, called only when something must be built) are M0's. An empty slice is a slice: its summary
    counts the attempts' reasons."""
    from filelock import FileLock

    folder, key = gold_folder(params, held_out)
    stage = Stage(folder)
    if not stage.done:
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".lock")):
            if not stage.done:
                atomic_write_json(folder / "fingerprint.json", gold_fingerprint(params))
                c = components() if callable(components) else components
                stage.mark_done(_build(params, held_out, stage, c, key, progress))
    return load_gold(folder, held_out)


def load_gold(folder: str | Path, held_out: HeldOutSet) -> HeldOutSet:
    """A finished slice read back from its folder."""
    stage = Stage(folder)
    if not stage.done:
        raise RunError(f"{folder} holds no finished gold-answer slice (no DONE): `scope compare-methods` builds it")
    tasks = [GoldTask.from_record(rec) for rec in stage.records("tasks")]
    return HeldOutSet(Path(folder), stage.summary["key"], tasks, stage.summary, model=held_out.model)  # type: ignore[arg-type]


# -- the build ----------------------------------------------------------------------------------------------------


def _attempt(params: Params, c: CheckComponents, prompts: list, seed: int, round_: int, k: int) -> list[dict]:
    """One round of attempts, one per prompt, by M0 (adapters off), one turn, no search: each parsed."""
    limits = replace(challenger_limits(params), max_turns=1, seed=seed)
    trajectories = [new_trajectory(f"{p.id}-a{round_}", "challenger",
                                   [{"role": "user", "content": spice.challenger_prompt(p.document, p.task_type)}],
                                   c.engine.tokenizer, max_searches=0) for p in prompts]
    run_rollouts(trajectories, c.engine, c.retriever, c.dialect, limits, adapter=None)
    out = []
    for p, t in zip(prompts, trajectories, strict=True):
        reply = t.turns[-1] if t.turns else ""
        out.append({"id": t.id, "chunk": k, "round": round_, "document_id": p.document_id,
                    "answer_type": p.task_type, "parse": spice.parse_task(reply, starts_in_think=t.opens_think),
                    "reply": reply})
    return out


def _build(params: Params, held_out: HeldOutSet, stage: Stage, c: CheckComponents, key: str, progress: bool
           ) -> dict[str, Any]:
    """Write the slice's records into `stage` (resuming what a killed build left) and return its summary."""
    from tqdm.auto import tqdm

    g, sp, lc = params.compare.gold, params.selfplay, params.learning_check
    attempts, chunks, tasks = stage.records("attempts"), stage.records("chunks"), stage.records("tasks")
    finished = finished_chunks(attempts, chunks, tasks)
    attempts.retain(lambda rec: rec["chunk"] in finished)  # a batch a kill left half-written is redone
    tasks.retain(lambda rec: rec["chunk"] in finished)
    documents = held_out_candidates(params, corpus_passages(params, c))[:g.documents]
    seen = {" ".join(rec["gold"]["question"].lower().split()) for rec in tasks}
    kept = len(list(tasks))
    n_batches = math.ceil(len(documents) / lc.batch_size) if g.tasks else 0
    bar = tqdm(total=n_batches, initial=len(finished), desc="gold-answer slice", unit="batch", leave=False,
               disable=not progress)
    for k in range(n_batches):
        if kept >= g.tasks:
            break
        if k in finished:
            continue
        prompts = make_challenger_prompts(documents[k * lc.batch_size:(k + 1) * lc.batch_size],
                                          list(spice.ANSWER_TYPES), [1], seed_of("gold/types", sp.seed, k),
                                          tokenizer=c.engine.tokenizer, document_max_tokens=sp.document_max_tokens,
                                          id_prefix=f"g{k:04d}-")
        drawn: list[dict] = []
        todo = prompts
        for round_ in range(g.attempts):
            if not todo:
                break
            batch = _attempt(params, c, todo, seed_of("gold/challenger", sp.seed, k, round_), round_, k)
            for rec in batch:
                reason, detail = check_gold(rec["parse"], seen)
                rec.update(valid=reason is None, invalid_reason=reason, invalid_detail=detail)
                if reason is None:
                    seen.add(" ".join(rec["parse"].task.question.lower().split()))
            drawn += batch
            done = {rec["document_id"] for rec in drawn if rec["valid"]}
            todo = [p for p in todo if p.document_id not in done]
        new = [{"id": rec["id"], "chunk": k, "document_id": rec["document_id"],
                "question": solver_question(rec["parse"].task), "answer_type": rec["parse"].task.answer_type,
                "gold": task_record(rec["parse"].task)} for rec in drawn if rec["valid"]]
        attempts.append({**{n: v for n, v in rec.items() if n != "parse"},
                         "task": task_record(rec["parse"].task) if rec["parse"].valid else None} for rec in drawn)
        tasks.append(new)
        chunks.append([{"id": f"chunk-{k:04d}", "chunk": k, "candidates": len(drawn), "kept": len(new),
                        "documents": len(prompts)}])
        finished.add(k)
        kept += len(new)
        bar.update(1)
    bar.close()
    return gold_summary(key, attempts, tasks, chunks, params)


def gold_summary(key: str, attempts: RecordLog, tasks: RecordLog, chunks: RecordLog, params: Params
                 ) -> dict[str, Any]:
    """The slice in numbers: questions kept, attempts, documents, and why each other attempt was invalid."""
    drawn = list(attempts)
    kept = list(tasks)
    reasons = Counter(rec["invalid_reason"] for rec in drawn if not rec["valid"])
    summary = {"key": key, "builder": params.compare.gold.builder, "tasks": len(kept),
               "asked": params.compare.gold.tasks, "attempts": len(drawn),
               "valid": sum(rec["valid"] for rec in drawn),
               "documents": sum(m.get("documents", 0) for m in chunks), "batches": len(list(chunks)),
               "invalid_reasons": dict(reasons.most_common()),
               "answer_types": dict(Counter(rec["answer_type"] for rec in kept))}
    log.info("gold-answer slice %s: %d question(s) from %d attempt(s) on %d held-out document(s)%s", key,
             summary["tasks"], summary["attempts"], summary["documents"],
             f"; invalid: {', '.join(f'{r} x{n}' for r, n in reasons.most_common())}" if reasons else "")
    return summary


def empty_reason(summary: dict[str, Any]) -> str:
    """Why a slice holds no question, in one sentence (the table and the report say it as it is)."""
    if not summary.get("asked"):
        return "no gold-answer slice asked (compare.gold.tasks is 0)"
    reasons = ", ".join(f"{r} ×{n}" for r, n in summary.get("invalid_reasons", {}).items()) or "none drawn"
    return (f"empty: M0 wrote no valid question in {summary.get('attempts', 0)} attempt(s) on "
            f"{summary.get('documents', 0)} held-out document(s) ({reasons})")
