"""The learning check pooled over seeds and the held-out answers shown verbatim (scope_lib/evaluation/pooled_check.py):
hand-made checks written by the check's own writer (`LearningCheck.to_record`), the pooled interval against a direct
numpy computation and hand-counted values, the pooled verdict, its coverage, and `scope learning-check pool` /
`examples` on stored files. numpy alone: no model, no tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scope_lib.config import CalibrationConfig
from scope_lib.evaluation.held_out import HeldOutSet
from scope_lib.evaluation.judge_free import MEASURES
from scope_lib.evaluation.learning_check import (
    CheckpointEvaluation,
    JudgeFree,
    LearningCheck,
    compare_values,
    evaluation_file,
    learning_verdict,
)
from scope_lib.evaluation.pooled_check import (
    examples_markdown,
    held_out_examples,
    pool_checks,
    read_seed_check,
    seeds_then_tasks,
    task_order,
)
from scope_lib.selfplay.grader_probe import ProbeItem, calibrate

N_TASKS = 48
IDS = [f"h{i // 16:04d}-{i % 16}" for i in range(N_TASKS)]   # as the held-out set names them: batch, position


def probe(reads: bool = True):
    """A grader probe of 40 items: one that reads (trusted) or one that says yes to everything (untrusted)."""
    items = [ProbeItem(f"p{i}", "stated" if i % 2 else "removed", bool(i % 2), yes=bool(i % 2) or not reads)
             for i in range(40)]
    return calibrate("self-Judge grader", "grader", "m0", "grader@1", items, CalibrationConfig())


def write_check(root, run: str, gains, control_gains, *, recall_gains=None, grader="reads", key="set-1"):
    """A seed's check as `scope learning-check compare` writes it (runs/<run>/learning_check/...json), built by the
    check's own classes: M0's per-task score 0.4, the trained and control checkpoints' 0.4 + their per-task gains;
    the judge-free measures' per-task values the same (rubric-fact recall with `recall_gains`, name precision
    flat at 0.8)."""
    before = dict.fromkeys(IDS, 0.4)
    trained = {t: 0.4 + g for t, g in zip(IDS, gains, strict=True)}
    control = {t: 0.4 + g for t, g in zip(IDS, control_gains, strict=True)}
    recall = {t: 0.4 + g for t, g in zip(IDS, gains if recall_gains is None else recall_gains, strict=True)}
    values = {m: {"before": before, "after": trained, "control": control} for m in MEASURES}
    values["fact_recall"] = {"before": before, "after": recall, "control": before}
    values["name_precision"] = {role: dict.fromkeys(IDS, 0.8) for role in ("before", "after", "control")}
    names = {"before": "base", "after": "iter_01-solver", "control": "control-iter_01-solver"}

    def compared(m, b, a):
        return compare_values(names[b], names[a], m, values[m][b], values[m][a], n_samples=500, seed=0)

    pairs = {"trained": ("before", "after"), "control": ("before", "control"), "over_control": ("control", "after")}
    judge_free = JudgeFree(None, {}, {n: {m: compared(m, b, a) for m in MEASURES} for n, (b, a) in pairs.items()})
    score = {n: compare_values(names[b], names[a], "score", {"before": before, "after": trained, "control": control}[b],
                               {"before": before, "after": trained, "control": control}[a], n_samples=500, seed=0)
             for n, (b, a) in pairs.items()}
    calibration = None if grader is None else probe(grader == "reads")
    verdict = learning_verdict(score["trained"], score["control"], calibration, over_control=score["over_control"],
                               judge_free=judge_free)
    held_out = HeldOutSet(root / "heldout", key, [], {"key": key, "tasks": N_TASKS}, calibration)
    evaluations = {role: CheckpointEvaluation(name, name, f"{role}-{run}-fingerprint", 0, key, 0.5)
                   for role, name in names.items()}
    check = LearningCheck(held_out, evaluations, score["trained"], score["control"], verdict, score["over_control"],
                          judge_free)
    path = root / run / "learning_check" / "iter_01-solver-vs-base.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(check.to_record()))
    return root / run


def noise(seed: int, sd: float = 0.05):
    z = np.random.default_rng(seed).normal(size=N_TASKS)
    return list(sd * (z - z.mean()) / z.std())   # mean exactly 0, spread exactly sd


def test_the_pooled_interval_is_seeds_then_one_draw_of_tasks():
    """`seeds_then_tasks` against a direct computation with the same draws, and against values counted by hand."""
    rng = np.random.default_rng(5)
    d = rng.normal(0.1, 0.2, size=(3, 7))
    n, seed = 400, 11
    draws = np.random.default_rng(seed)
    seeds, tasks = draws.integers(0, 3, size=(n, 3)), draws.integers(0, 7, size=(n, 7))
    means = [d[np.ix_(seeds[b], tasks[b])].mean() for b in range(n)]
    assert seeds_then_tasks(d, n, seed) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])), abs=1e-12)
    # a pair without a value is left out of each resample's mean (a judge-free measure undefined on a task)
    d[1, 2] = d[0, 5] = np.nan
    means = [np.nanmean(d[np.ix_(seeds[b], tasks[b])]) for b in range(n)]
    assert seeds_then_tasks(d, n, seed) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])), abs=1e-12)
    # seeds whose every task gained 0, 0 and 0.3: a resample's mean is 0, 0.1, 0.2 or 0.3; P(0) = 8/27 and
    # P(0.3) = 1/27 both exceed 2.5%, so the interval is [0, 0.3] whatever the task draws
    flat = np.repeat([[0.0], [0.0], [0.3]], 5, axis=1)
    assert seeds_then_tasks(flat, 4000, 0) == pytest.approx((0.0, 0.3))
    assert seeds_then_tasks(np.array([[0.1, 0.3]]), 200, 0)[0] >= 0.1   # one seed: the tasks' bootstrap
    with pytest.raises(ValueError, match="at least 2 values"):
        seeds_then_tasks(np.array([[0.1, np.nan]]), 100, 0)


def test_one_seed_that_gained_beside_two_that_did_not_is_not_learned(tmp_path):
    """Seed 42 gained 0.3 on every task (its own check: learned); seeds 43 and 44 gained 0 (noise about 0). Pooled,
    the gain is 0.1 but a third of the resamples draw only the seeds that did not gain: the interval reaches 0,
    not learned. The same three seeds all gaining are learned."""
    runs = [write_check(tmp_path, "s42", [0.3 + x for x in noise(1)], noise(2)),
            write_check(tmp_path, "s43", noise(3), noise(4)),
            write_check(tmp_path, "s44", noise(5), noise(6))]
    assert read_seed_check(runs[0]).record["verdict"]["outcome"] == "learned"
    pooled = pool_checks(runs, n_samples=2000, seed=0)
    score = pooled.measures["score"]
    trained = score.pooled["trained"]
    assert trained.gain == pytest.approx(0.1) and trained.n_tasks == 3 * N_TASKS
    assert trained.ci95[0] <= 0 < trained.ci95[1]
    assert pooled.verdict.outcome == "not learned"
    assert "over 3 seeds × 48 tasks does not lie above 0" in pooled.verdict.reason
    # the pooled interval is the direct computation over the per-seed per-task differences
    d = np.array([[a - b for a, b in zip(c.values_after, c.values_before, strict=True)]
                  for c in (score.per_seed[r]["trained"] for r in ("s42", "s43", "s44"))])
    assert trained.ci95 == seeds_then_tasks(d, 2000, 0)
    # per seed: each check's own gain and interval, read back as written
    assert score.per_seed["s42"]["trained"].gain == pytest.approx(0.3) and score.per_seed["s42"]["trained"].ci95[0] > 0
    rows = pooled.table()
    assert [r["seed"] for r in rows[:4]] == ["s42", "s43", "s44", "pooled (3 seeds)"] and len(rows) == 4 * 7
    record = pooled.to_record()
    assert record["verdict"]["outcome"] == "not learned" and record["measures"]["score"]["pooled"]["trained"][
        "ci95"] == list(trained.ci95)
    assert set(record["measures"]) == {"score", *MEASURES} and record["checks"][0]["outcome"] == "learned"
    assert record["measures"]["fact_recall"]["per_seed"]["s43"]["trained"]["pairs"] == N_TASKS
    # every seed gained: learned, pooled trained − control above 0 too
    gained = [write_check(tmp_path / "all", f"s{s}", [0.2 + x for x in noise(s)], noise(s + 10)) for s in (1, 2, 3)]
    learned = pool_checks(gained, n_samples=2000, seed=0)
    assert learned.verdict.outcome == "learned" and learned.verdict.over_control_ci95[0] > 0


def test_the_pooled_verdict_keeps_one_seeds_rule(tmp_path):
    """Gains above 0 on every seed, but: one seed's grader failed its probe, or was never probed (not shown); or
    rubric-fact recall did not rise (not learned); or different held-out sets (refused)."""
    def seeds(folder, **kwargs):
        return [write_check(tmp_path / folder, f"s{s}", [0.2 + x for x in noise(s)], noise(s + 10),
                            **(kwargs if s == 3 else {})) for s in (1, 2, 3)]

    failed = pool_checks(seeds("failed", grader="always yes"), n_samples=500)
    assert failed.verdict.outcome == "not shown" and "failed its calibration probe" in failed.verdict.reason
    assert pool_checks(seeds("failed", grader="always yes"), n_samples=500, accept_untrusted_judge=True).verdict.learned
    unprobed = pool_checks(seeds("unprobed", grader=None), n_samples=500)
    assert unprobed.verdict.outcome == "not shown" and "never probed" in unprobed.verdict.reason
    flat_recall = [write_check(tmp_path / "recall", f"s{s}", [0.2 + x for x in noise(s)], noise(s + 10),
                               recall_gains=noise(s + 20)) for s in (1, 2, 3)]
    recall = pool_checks(flat_recall, n_samples=500)
    assert recall.verdict.outcome == "not learned" and "rubric-fact recall did not rise" in recall.verdict.reason
    with pytest.raises(ValueError, match="different held-out sets"):
        pool_checks(seeds("keys", key="set-2"), n_samples=500)
    with pytest.raises(ValueError, match="given twice"):
        pool_checks([tmp_path / "failed" / "s1", tmp_path / "failed" / "s1"], n_samples=500)


def test_the_pooled_interval_covers_a_zero_gain_about_95_times_in_100():
    """Coverage of `seeds_then_tasks`: 400 sets of 3 seeds × 48 tasks whose true gain is 0, each task's gain a part
    common to the seeds (sd 0.1: a task easy to gain on is easy for every seed) plus a part of its own (sd 0.05):
    the 95% interval covers 0 in 93-99% of them. Drawing the tasks apart for each seed (a nested bootstrap) covered
    77% of these sets: it treats the seeds' shared tasks as independent ones."""
    rng = np.random.default_rng(47)
    covered = 0
    for trial in range(400):
        d = 0.1 * rng.normal(size=(1, N_TASKS)) + 0.05 * rng.normal(size=(3, N_TASKS))
        lo, hi = seeds_then_tasks(d, 1000, seed=trial)
        covered += lo <= 0.0 <= hi
    assert 0.93 <= covered / 400 <= 0.99, covered / 400


def stored_evaluation(folder, name: str, fingerprint: str, answers: dict[str, list[str | None]]):
    """An evaluation as the check stores it beside the held-out set: per task its K rollouts' answers and scores."""
    path = evaluation_file(folder, name, fingerprint, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for task_id, texts in answers.items():
            rollouts = [{"id": f"{name}/{task_id}/k{j}", "answer": a, "verdicts": [1, 0], "rubric_score": 0.5 * j,
                         "finish": "answer", "searches": []} for j, a in enumerate(texts)]
            f.write(json.dumps({"id": task_id, "chunk": 0, "document_id": f"d-{task_id}", "scores": [0.0, 0.5],
                                "answered": sum(a is not None for a in texts), "rollouts": rollouts}) + "\n")


def test_scope_learning_check_pool_and_examples(tmp_path, capsys):
    """`scope learning-check pool` prints the table and the verdicts and writes the JSON; `examples` prints the first
    three held-out tasks by task id with M0's and each trained Solver's first answer, verbatim, from stored files."""
    from scope_lib.cli import main

    runs = [write_check(tmp_path, f"s{s}", [0.2 + x for x in noise(s)], noise(s + 10)) for s in (1, 2)]
    out = tmp_path / "pooled.json"
    assert main(["learning-check", "pool", *map(str, runs), "--out", str(out), "--bootstrap-samples", "500"]) == 0
    printed = capsys.readouterr().out
    assert "pooled (2 seeds)" in printed and "rubric-fact recall" in printed and "pooled: learned:" in printed
    assert "s1: learned:" in printed and json.loads(out.read_text())["verdict"]["outcome"] == "learned"
    assert main(["learning-check", "pool", *map(str, runs), "--bootstrap-samples", "500"]) == 0
    assert (tmp_path / "learning_check_pooled" / "s1+s2.json").is_file()
    capsys.readouterr()
    assert main(["learning-check", "pool", str(tmp_path / "nowhere")]) == 2
    assert "no such check or run folder" in capsys.readouterr().err
    # the held-out set's tasks (out of id order) and the evaluations the checks name
    folder = tmp_path / "heldout"
    tasks = IDS[::-1]                                     # stored out of order
    folder.mkdir()
    with (folder / "tasks.jsonl").open("w") as f:
        for t in tasks:
            f.write(json.dumps({"id": t, "document_id": f"d-{t}", "task": f"Who built the tower of {t}?\nSay why.",
                                "rubrics": [{"text": "Identifies Gustave Eiffel by name.", "priority": "critical"},
                                            {"text": "Mentions 1889.", "priority": "important"}]}) + "\n")
    checks = [read_seed_check(r).record["evaluations"] for r in runs]
    stored_evaluation(folder, "base", checks[0]["before"]["fingerprint"],
                      {t: [f"M0 on {t}: I do not know.", "M0's second sample"] for t in tasks})
    for s, ev in zip((1, 2), checks, strict=True):
        stored_evaluation(folder, "iter_01-solver", ev["after"]["fingerprint"],
                          {t: [None if (s, t) == (2, "h0000-2") else f"Gustave Eiffel, 1889 (s{s}, {t}).", "k1"]
                           for t in tasks})
    md = tmp_path / "examples.md"
    assert main(["learning-check", "examples", *map(str, runs), "--out", str(md)]) == 0
    printed = capsys.readouterr().out
    assert [line for line in printed.splitlines() if line.startswith("### ")] == [
        "### h0000-0 (document d-h0000-0)", "### h0000-1 (document d-h0000-1)",
        "### h0000-2 (document d-h0000-2)"]
    assert "> Who built the tower of h0000-0?\n> Say why." in printed
    assert "1. (critical) Identifies Gustave Eiffel by name.\n2. (important) Mentions 1889." in printed
    assert "**M0** (g = 0.00, rubric-fact recall 0.00):\n\n> M0 on h0000-0: I do not know." in printed
    assert "**trained Solver (s1)** (g = 0.00, rubric-fact recall 1.00):\n\n> Gustave Eiffel, 1889 (s1, h0000-0)." \
        in printed
    assert "**trained Solver (s2)** (g = 0.00, rubric-fact recall 0.00):\n\n*(no answer)*" in printed
    assert "second sample" not in printed and "k1" not in printed and "h0000-10" not in printed
    assert md.read_text() == printed.split("written:")[0].removesuffix("\n")
    # "by task id" reads the id's numbers as numbers: the set's build order (batch, then position in the batch)
    assert sorted(["h0001-0", "h0000-10", "h0000-2"], key=task_order) == ["h0000-2", "h0000-10", "h0001-0"]
    examples = held_out_examples(runs, n=1)
    assert len(examples) == 1 and [a.who for a in examples[0].answers] == ["M0", "trained Solver (s1)",
                                                                          "trained Solver (s2)"]
    assert examples_markdown(examples).count("### ") == 1
