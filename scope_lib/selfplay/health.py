"""Health checks: a run that trains on nothing must say so loudly.

Each check reads one step's metrics (or a stage summary) and returns alarms; `report` logs an alarm as a
WARNING and appends it to runs/<name>/health.jsonl, which notebook 04's health panel shows.

| alarm                 | fires when                                                                   |
|-----------------------|------------------------------------------------------------------------------|
| empty_retrieval       | at least 10% of a step's searches came back with no passage                  |
| zero_spread           | every GRPO group of a step has the same reward for all members (no signal)   |
| mostly_zero_spread    | at least half the groups had zero spread for 3 steps running (little signal) |
| truncated             | at least 90% of a step's rollouts ran out of tokens                          |
| no_searches           | a step's rollouts made no search at all                                      |
| judge_parse_failures  | more than 20% of a step's Judge replies never parsed                         |
| no_reward             | no row of a step could be scored                                             |
| empty_pool            | no candidate task survived the gates and the difficulty window               |
| no_valid_task         | none of a stage's Challenger attempts was a valid task (SPICE, SSP)          |
| untrusted_judge       | the Judge's per-rubric grader failed its calibration probe when the run      |
|                       | opened: separation below judge.calibration.min_separation, or more invalid   |
|                       | replies than judge.calibration.max_invalid_rate (selfplay.grader_probe)       |
| untrusted_gate        | a quality gate, as judge.gates_by decides it, failed its calibration probe   |
|                       | when the run opened: it cannot tell a task about the source's names from one |
|                       | about another document's, or a named task from a generic one                  |
|                       | (selfplay.stage_probes)                                                       |
| untrusted_rubric_writer | the rubric writer failed its calibration probe when the run opened: its    |
|                       | rubrics do not name the source's facts, or name another document's, or do     |
|                       | not parse (selfplay.stage_probes)                                             |
| untrusted_answer_check | SSP's Correct/Wrong answer check (ssp.answer_check: judge) failed its        |
|                       | calibration probe when the run opened: it cannot tell the ground truth, said |
|                       | or restated, from another fact of its kind (selfplay.stage_probes)            |
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EMPTY_RETRIEVAL_SHARE = 0.10
TRUNCATED_SHARE = 0.90
JUDGE_FAILURE_SHARE = 0.20
#: mostly_zero_spread: the share of zero-spread groups that counts as "most" ...
ZERO_SPREAD_MOST = 0.5
#: ... and how many steps running it must hold (`zero_spread_share`: `training.zero_spread_share`).
ZERO_SPREAD_STEPS = 3


def _alarm(name: str, metrics: dict[str, Any], value: Any, threshold: Any, message: str) -> dict[str, Any]:
    return {"alarm": name, "role": metrics.get("role"), "iteration": metrics.get("iteration"),
            "step": metrics.get("step"), "value": value, "threshold": threshold, "message": message}


def check_step(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Alarms for one training step's metrics (the records of iter_NN/<role>/metrics.jsonl)."""
    alarms = []
    empty = m.get("empty_retrieval_rate")
    if empty is not None and empty >= EMPTY_RETRIEVAL_SHARE:
        alarms.append(_alarm("empty_retrieval", m, empty, EMPTY_RETRIEVAL_SHARE,
                             f"{empty:.0%} of searches returned no passage: check the index (`scope index check`)"))
    spread = m.get("zero_spread_share")
    if spread is not None and spread >= 1.0:
        alarms.append(_alarm("zero_spread", m, spread, 1.0,
                             "every group has identical rewards: all advantages are 0, the step learns nothing"))
    truncated = m.get("truncation_rate")
    if truncated is not None and truncated >= TRUNCATED_SHARE:
        alarms.append(_alarm("truncated", m, truncated, TRUNCATED_SHARE,
                             f"{truncated:.0%} of rollouts ran out of tokens: raise the token budgets"))
    searches = m.get("searches_per_rollout")
    if searches is not None and m.get("rollouts") and searches == 0:
        alarms.append(_alarm("no_searches", m, searches, 0,
                             "no rollout searched: the policy does not use retrieval"))
    failures = m.get("judge_parse_failure_rate")
    if failures is not None and failures > JUDGE_FAILURE_SHARE:
        alarms.append(_alarm("judge_parse_failures", m, failures, JUDGE_FAILURE_SHARE,
                             f"{failures:.0%} of Judge replies never parsed: gates fail, rubrics are missing, "
                             "verdicts count 0"))
    if m.get("rollouts") and m.get("reward") is None:
        alarms.append(_alarm("no_reward", m, None, None, "no row of the step could be scored"))
    return alarms


def check_steps(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Alarms over a stage's steps so far, in step order, the newest last: `mostly_zero_spread` fires on the step
    where at least ZERO_SPREAD_MOST of the groups have had zero reward spread for ZERO_SPREAD_STEPS steps running
    (once per such stretch; a step without the number ends a stretch)."""
    run = 0
    for m in history:
        share = m.get("zero_spread_share")
        run = run + 1 if share is not None and share >= ZERO_SPREAD_MOST else 0
    if run != ZERO_SPREAD_STEPS:
        return []
    last = history[-ZERO_SPREAD_STEPS:]
    shares = ", ".join(f"{m['zero_spread_share']:.2f}" for m in last)
    return [_alarm("mostly_zero_spread", history[-1], run, ZERO_SPREAD_STEPS,
                   f"at least {ZERO_SPREAD_MOST:.0%} of the groups had identical rewards for {run} steps running "
                   f"(shares {shares}): most advantages are 0 and the role learns from few rollouts; raise G or the "
                   "temperature, or keep tasks nearer the difficulty window (docs/training.md, 'Learning "
                   "signals')")]


def check_pool(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Alarms for a finished task pool (Stage 2): no task survived the filter."""
    if summary.get("tasks", 0) == 0:
        return [_alarm("empty_pool", {"role": "pool", **summary}, 0, 1,
                       f"no candidate task survived the gates and the window (of {summary.get('candidates', 0)} "
                       "candidates): the Solver cannot train this iteration")]
    return []


def check_valid_tasks(summary: dict[str, Any], *, writer: str = "Challenger",
                      consequence: str = "the Reasoner cannot train this iteration") -> list[dict[str, Any]]:
    """Alarms for a finished stage whose tasks carry a gold answer (SPICE's Challenger, SSP's Proposer: `writer`, the
    paper's name of the role): no attempt was valid; `consequence` says what that means for the method."""
    if summary.get("valid", 0) == 0:
        reasons = ", ".join(f"{k} {n}" for k, n in sorted((summary.get("invalid_reasons") or {}).items()))
        return [_alarm("no_valid_task", {"role": "challenger", **summary}, 0, 1,
                       f"none of the {writer}'s {summary.get('attempts', 0)} attempts was a valid task ({reasons}): "
                       f"{consequence}")]
    return []


def check_calibration(calibration: dict[str, Any]) -> list[dict[str, Any]]:
    """Alarms for a Judge calibration (`selfplay.grader_probe.Calibration.summary()`): the judge is untrusted."""
    if calibration.get("trusted", True):
        return []
    separation = calibration.get("separation")
    return [_alarm("untrusted_judge", {"role": "judge"}, separation, calibration.get("min_separation"),
                   f"the {calibration.get('judge', 'judge')} ({calibration.get('model')}) failed its calibration "
                   f"probe: {'; '.join(calibration.get('reasons') or [])}. Its grades drive the rewards: check "
                   "the model and prompt before trusting this run (docs/evaluation.md, Judge calibration)")]


def check_stage_calibration(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Alarms for the Judge's stage probes (`selfplay.stage_probes.StageProbes.to_record()`): each gate as
    `judge.gates_by` decides it, the rubric writer and SSP's answer check, that is untrusted."""
    method = record.get("gates_by", "judge")
    found = [("untrusted_gate", gate, by_method.get(method) or {})
             for gate, by_method in record.get("gates", {}).items()]
    if record.get("rubrics"):
        found.append(("untrusted_rubric_writer", "rubrics", record["rubrics"]))
    if record.get("answer_match"):
        found.append(("untrusted_answer_check", "answer_match", record["answer_match"]))
    alarms = []
    for name, role, c in found:
        if c.get("trusted", True):
            continue
        what = {"untrusted_gate": "decides which tasks enter the pool and which Challenger rollouts earn a "
                "difficulty reward: check the model, or decide the gates by rules (judge.gates_by: rules_then_judge)",
                "untrusted_rubric_writer": "writes the rubrics every grade is measured against: check the model and "
                "judge.rubric_prompt",
                "untrusted_answer_check": "decides RAG verification and every Solver reward of SSP: check the model "
                "(judge.grader_model), or check answers by rule (ssp.answer_check: rule)"}[name]
        alarms.append(_alarm(name, {"role": role}, c.get("separation"), c.get("min_separation"),
                             f"the {c.get('judge', role)} ({c.get('model')}) failed its calibration probe: "
                             f"{'; '.join(c.get('reasons') or [])}. It {what} (docs/protocol.md, Judge calibration)"))
    return alarms


def alarm_key(alarm: dict[str, Any]) -> tuple:
    """What makes an alarm one alarm: (iteration, stage, step, alarm). A resumed run that re-checks a step
    finds the same key and does not add it again."""
    return (alarm.get("iteration"), alarm.get("role"), alarm.get("step"), alarm.get("alarm"))


def report(alarm: dict[str, Any], run_dir: str | os.PathLike) -> bool:
    """Log the alarm loudly and append it to <run>/health.jsonl, once per `alarm_key` however many times the
    run is resumed. Returns False for an alarm already recorded."""
    path = Path(run_dir) / "health.jsonl"
    if alarm_key(alarm) in {alarm_key(a) for a in read_alarms(run_dir)}:
        return False
    log.warning("HEALTH ALARM %s (%s, iteration %s, step %s): %s", alarm["alarm"], alarm.get("role"),
                alarm.get("iteration"), alarm.get("step"), alarm["message"])
    from scope_lib.runs import append_jsonl

    path.parent.mkdir(parents=True, exist_ok=True)
    append_jsonl(path, [{**alarm, "time": time.time()}])
    return True


def read_alarms(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The run's alarms, one per `alarm_key` (a file written before alarms were de-duplicated may repeat)."""
    from scope_lib.runs import read_jsonl

    path = Path(run_dir) / "health.jsonl"
    if not path.is_file():
        return []
    alarms: dict[tuple, dict[str, Any]] = {}
    for alarm in read_jsonl(path):
        alarms.setdefault(alarm_key(alarm), alarm)
    return list(alarms.values())
