"""The learning check (scope_lib/evaluation/held_out.py, learning_check.py): held-out documents training never samples, the
held-out task set built once, cached and resumed, checkpoints evaluated on it, the paired bootstrap comparison,
the judge-free measures and the verdict. A scripted engine that follows the protocol plays every model over the real
Wikipedia sample; its Solver carries a planted signal: M0 answers like the scripted Solver but (seeded) half the
time "I do not know", the 'trained' adapter names every entity of the task, the 'dumper' adapter lists the names
of the passages it retrieved (issue 47: what a Solver that learned to please a name-counting grader writes)."""

from __future__ import annotations

import math
import os
import random
import re
from dataclasses import replace

import pytest
from scripted_engine import ScriptedEngine, scripted_run_params
from test_calibration import name_list_grader

from scope_lib.config import CalibrationConfig, ParamsError
from scope_lib.evaluation.evaluate import Checkpoint, Policy
from scope_lib.evaluation.held_out import (
    CheckComponents,
    held_out_candidates,
    held_out_set,
    model_identity,
    probe_held_out_grader,
    screen_window,
)
from scope_lib.evaluation.learning_check import (
    Comparison,
    JudgeFree,
    compare_evaluations,
    evaluate_checkpoint,
    judge_free_measures,
    learning_verdict,
    paired_bootstrap,
)
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.corpus import (
    document_range,
    held_out_documents,
    read_corpus,
    teacher_documents,
    training_documents,
)
from scope_lib.selfplay.grader_probe import ProbeItem, calibrate
from scope_lib.selfplay.judge import Judge

DIALECT = get_dialect("qwen2.5")
CHECK = {"learning_check.held_out_documents": 40, "learning_check.tasks": 10, "learning_check.samples": 2,
         "learning_check.batch_size": 8, "learning_check.eval_batch_tasks": 6,
         "learning_check.bootstrap_samples": 1000}


def task_names(context: str) -> list[str]:
    question = context.split("Question:", 1)[-1].split("<|im_end|>", 1)[0]
    names = question.split("Explain how ", 1)[-1].split(" are connected", 1)[0].split(" and ")
    return [n.strip() for n in names if n.strip()]


_RESULT = re.compile(r"Doc \d+ \(Title: (.+?)\)\n(.*?)(?=\nDoc \d+ \(Title|<\|im_end\|>|$)", re.S)
_CAPITALISED = re.compile(r"(?<=[a-z,] )[A-Z][a-z]+(?: [A-Z][a-z]+)*")


def retrieved_names(context: str, leave_out: list[str] = ()) -> list[str]:
    """The names of the passages a Solver retrieved: each result's title, then the capitalised words of its text."""
    names: list[str] = []
    for title, text in _RESULT.findall(context.split("Question:", 1)[-1]):
        for name in [title, *_CAPITALISED.findall(text)]:
            if name not in names and not any(x in name or name in x for x in leave_out):
                names.append(name)
    return names


class PlantedEngine(ScriptedEngine):
    """The scripted engine with a planted Solver signal: M0 (adapter None) answers "I do not know" in half of its
    final answers (seeded by the call's seed and the row), an adapter in `trained` names every entity of the task
    (every rubric holds), the adapter 'dumper' lists up to 25 names of the passages it retrieved, 'blind dumper'
    the same less the task's entities; any other adapter answers like M0. `grader` plays the Judge's grader
    instead of the scripted one (which reads: a rubric holds when the answer names its entity)."""

    def __init__(self, *args, trained=("trained",), grader=None, **kwargs):
        super().__init__(*args, override=grader, **kwargs)
        self.trained = set(trained)

    def generate(self, prompt_token_ids, sampling, adapter=None):
        out = super().generate(prompt_token_ids, sampling, adapter)
        for i, ids in enumerate(prompt_token_ids):
            context = self.tokenizer.decode(ids)
            if self.role(context) != "solver" or "<answer>" not in out[i].text:
                continue
            if adapter in self.trained:
                named = ", ".join(task_names(context) + ["the source document"])
                out[i] = self._complete(f"<think>I know this.</think>\n<answer>It is about {named}.</answer>",
                                        sampling)
            elif adapter in ("dumper", "blind dumper"):
                names = retrieved_names(context, task_names(context) if adapter == "blind dumper" else [])
                out[i] = self._complete(f"<think>List them.</think>\n<answer>It covers {', '.join(names[:25])}."
                                        "</answer>", sampling)
            elif random.Random(f"{sampling.seed}/{i}").random() < 0.5:
                out[i] = self._complete("<think>Unsure.</think>\n<answer>I do not know.</answer>", sampling)
        return out


class CrashingEngine(PlantedEngine):
    """Dies at its `crash_at`-th generate call (a kill in the middle of a build)."""

    def __init__(self, *args, crash_at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.crash_at = crash_at

    def generate(self, prompt_token_ids, sampling, adapter=None):
        if self.calls + 1 == self.crash_at:
            raise KeyboardInterrupt("killed")
        return super().generate(prompt_token_ids, sampling, adapter)


@pytest.fixture(scope="module")
def params(wiki_sample, tmp_path_factory):
    return scripted_run_params(wiki_sample.parent, tmp_path_factory.mktemp("runs"), **CHECK)


def components(params, retriever, passages, tokenizer, engine_class=PlantedEngine, **kwargs):
    engine = engine_class(tokenizer, DIALECT, **kwargs)
    return CheckComponents(engine, Judge(engine, params.judge, seed=params.selfplay.seed), retriever, DIALECT,
                           passages)


@pytest.fixture(scope="module")
def built(params, retriever, passages, tiny_tokenizer, tmp_path_factory):
    """The held-out set built once (root: a temporary cache folder) and the components it was built with."""
    c = components(params, retriever, passages, tiny_tokenizer)
    root = tmp_path_factory.mktemp("heldout")
    held_out = held_out_set(params, c, model_id="scripted", root=root, progress=False)
    return held_out, c, root, c.engine.calls


def policy(name: str, engine, adapter: str | None) -> Policy:
    kind = "base" if adapter is None else "adapter"
    return Policy(Checkpoint(name, kind, None, name), engine, adapter)


def test_training_never_samples_a_held_out_document(params, passages):
    limit = training_documents(params, len(passages))
    held = {p.id for p in held_out_documents(passages, params.learning_check.held_out_documents, params.selfplay.seed)}
    assert limit == len(passages) - 40 and len(held) == 40
    reached = set()
    for start in range(0, limit + 60, 7):          # past the limit too: training's ranges wrap inside it
        reached |= {p.id for p in document_range(passages, start, 13, params.selfplay.seed, limit=limit)}
    assert not reached & held
    assert reached | held == {p.id for p in passages}   # every other document stays reachable
    # the reserved tail is the end of the same permutation training walks from its start
    assert [p.id for p in document_range(passages, limit, 40, params.selfplay.seed)] == \
        [p.id for p in held_out_documents(passages, 40, params.selfplay.seed)]
    with pytest.raises(ParamsError, match="held_out_documents"):
        training_documents(params.model_copy(update={"learning_check": params.learning_check.model_copy(
            update={"held_out_documents": len(passages)})}), len(passages))


def test_the_held_out_set_is_m0s_tasks_on_reserved_documents_near_the_window(built, params, passages):
    held_out, *_ = built
    reserved = {p.id for p in held_out_documents(passages, 40, params.selfplay.seed)}
    lo, hi = screen_window(params)
    assert (lo, hi) == (pytest.approx(0.05), pytest.approx(0.95)) and held_out.window == (lo, hi)
    assert len(held_out.tasks) == params.learning_check.tasks == held_out.summary["tasks"]
    assert len({t.document_id for t in held_out.tasks}) == len(held_out.tasks)        # one per document
    for task in held_out.tasks:
        assert task.document_id in reserved and task.gates_passed and task.rubrics
        assert len(task.solver_scores) == params.learning_check.samples and lo <= task.mean_score <= hi
    assert held_out.summary["stopped"] == "target" and held_out.summary["candidates"] > len(held_out.tasks)
    assert held_out.summary["built"] >= len(held_out.tasks)                  # whole batches: maybe a few more
    assert (held_out.path / "fingerprint.json").is_file()


def test_the_held_out_set_leaves_out_the_teacher_documents(built, params, passages):
    """Issue 47: a warm-started M0's teacher wrote traces from its own documents, which M0 may have memorised: no
    held-out candidate, hence no held-out task, is one of them; the rest of the reserved tail keeps its order. Each
    task carries its source document's text (the judge-free measures read it)."""
    import json

    held_out, *_ = built
    corpus = read_corpus(params.corpus_path, on_error="skip").passages
    teacher = {p.id for p in teacher_documents(corpus, params.model.warm_start)}
    reserved = held_out_documents(passages, params.learning_check.held_out_documents, params.selfplay.seed)
    assert params.model.warm_start.enabled and teacher & {p.id for p in reserved}       # the tail holds some
    candidates = held_out_candidates(params, passages)
    assert not teacher & {p.id for p in candidates}
    assert [p.id for p in candidates] == [p.id for p in reserved if p.id not in teacher]
    with open(held_out.path / "candidates.jsonl") as f:
        written = {json.loads(line)["evaluation"]["document_id"] for line in f}
    assert written and not written & teacher and not {t.document_id for t in held_out.tasks} & teacher
    assert held_out.summary["teacher_documents_left_out"] == len(reserved) - len(candidates)
    by_id = {p.id: p for p in passages}
    assert all(held_out.documents[t.document_id] == by_id[t.document_id].contents for t in held_out.tasks)


def test_an_m0_rebuilt_in_place_with_other_weights_is_evaluated_again(built, params, tmp_path, monkeypatch):
    """Issue 47: M0's identity hashes its weights' bytes, not only its folder's name and file sizes, and M0's stored
    evaluation is keyed by it: an M0 rebuilt in place (same folder, same sizes, other bytes) is evaluated again, an
    unchanged one is read back. Each file is hashed once, cached by (path, size, mtime)."""
    held_out, c, *_ = built
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "m0"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\x01" * 4096)
    m0 = params.model_copy(deep=True)
    m0.use_local_model(m0.model.base, folder)
    first = model_identity(m0)
    assert model_identity(m0) == first and len(list((tmp_path / "cache" / "digests").iterdir())) == 2
    base = policy("base", c.engine, None)
    store = replace(held_out, path=tmp_path / "set", model=first)
    assert evaluate_checkpoint(params, store, base, c, progress=False).engine_calls > 0
    assert evaluate_checkpoint(params, store, base, c, progress=False).engine_calls == 0       # read back
    before = weights.stat()
    weights.write_bytes(b"\x02" * 4096)                                # rebuilt in place: same name and size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    second = model_identity(m0)
    assert second != first and second.rsplit("|", 1)[0] == first.rsplit("|", 1)[0]
    again = evaluate_checkpoint(params, replace(store, model=second), base, c, progress=False)
    assert again.engine_calls > 0


def test_the_held_out_set_is_cached_and_reused(built, params, retriever, passages, tiny_tokenizer):
    held_out, _, root, _ = built
    again = components(params, retriever, passages, tiny_tokenizer)
    reused = held_out_set(params, lambda: pytest.fail("a cached set opens no model"), model_id="scripted",
                          root=root, progress=False)
    reused = held_out_set(params, again, model_id="scripted", root=root, progress=False)
    assert again.engine.calls == 0                                                # nothing generated
    assert [t.to_record() for t in reused.tasks] == [t.to_record() for t in held_out.tasks]
    # other parameters that shape a task or its score are another set, in another folder
    other = params.model_copy(deep=True)
    other.solver.temperature = 0.5
    opened = []
    different = held_out_set(other, lambda: opened.append(1) or again, model_id="scripted", root=root,
                             progress=False)
    assert opened == [1] and different.path != held_out.path


def test_a_killed_build_resumes_without_losing_or_duplicating_tasks(built, params, retriever, passages,
                                                                    tiny_tokenizer, tmp_path):
    held_out, _, _, build_calls = built
    crashing = components(params, retriever, passages, tiny_tokenizer, CrashingEngine, crash_at=12)
    with pytest.raises(KeyboardInterrupt):
        held_out_set(params, crashing, model_id="scripted", root=tmp_path, progress=False)
    folder = next(tmp_path.glob("tiny-*"))
    assert not (folder / "DONE").exists() and (folder / "chunks.jsonl").read_text().strip()   # a batch was kept
    with open(folder / "tasks.jsonl", "a") as f:   # the kill landed while batch 1's records were being written
        f.write('{"id": "h0001-0/g0", "chunk": 1, "task": "half a batch"}\n{"id": "h0001-1/g0", "ch')
    resumed = components(params, retriever, passages, tiny_tokenizer)
    again = held_out_set(params, resumed, model_id="scripted", root=tmp_path, progress=False)
    ids = [t.challenger_id for t in again.tasks]
    assert len(ids) == len(set(ids))
    assert [t.to_record() for t in again.tasks] == [t.to_record() for t in held_out.tasks]
    assert resumed.engine.calls < build_calls    # the batch finished before the kill was not redone


def test_two_identical_checkpoints_are_not_called_different(built, params):
    held_out, c, *_ = built
    m0 = policy("base", c.engine, None)
    first = evaluate_checkpoint(params, held_out, m0, c, seed=0, progress=False)
    second = evaluate_checkpoint(params, held_out, m0, c, seed=1, progress=False)   # the same weights, new samples
    assert [r.task_id for r in first.results] == [t.challenger_id for t in held_out.tasks]
    assert first.mean_score != second.mean_score                                    # sampling noise is there ...
    comparison = compare_evaluations(first, second, n_samples=1000, seed=0)
    lo, hi = comparison.ci95
    assert lo < 0 < hi                                                              # ... and the interval covers it
    verdict = learning_verdict(comparison, compare_evaluations(first, first, n_samples=1000, seed=0), held_out.grader)
    assert not verdict.learned and "not learned" in verdict.reason
    same = compare_evaluations(first, first)
    assert same.gain == 0 and same.ci95 == (0.0, 0.0) and not learning_verdict(same).learned


def planted_check(params, held_out, c, after: str = "trained"):
    """M0, the planted adapter `after` and a drift 'control' (M0 sampled with other seeds) on the held-out set:
    their evaluations, the gains over M0 and the judge-free measures."""
    evaluations = {
        "before": evaluate_checkpoint(params, held_out, policy("base", c.engine, None), c, progress=False),
        "after": evaluate_checkpoint(params, held_out, policy(after, c.engine, after), c, progress=False),
        "control": evaluate_checkpoint(params, held_out, policy("control", c.engine, None), c, seed=3, progress=False)}
    gain, control = (compare_evaluations(evaluations["before"], evaluations[role], n_samples=1000, seed=0)
                     for role in ("after", "control"))
    return evaluations, gain, control, judge_free_measures(held_out, evaluations, n_samples=1000)


def test_a_planted_signal_is_found_and_only_above_its_control_it_is_learning(built, params):
    held_out, c, *_ = built
    evaluations, comparison, control, judge_free = planted_check(params, held_out, c)
    m0, trained = evaluations["before"], evaluations["after"]
    assert trained.engine_calls > 0
    assert trained.mean_score == pytest.approx(1.0) and trained.success_rate == 1.0
    assert comparison.ci95[0] > 0 and comparison.gain == pytest.approx(1.0 - m0.mean_score)
    grader = held_out.grader   # the held-out set carries its grader's probe: the scripted grader reads
    assert grader is not None and grader.trusted and grader.n_items == 60 and grader.name_list_separation == 1.0
    verdict = learning_verdict(comparison, control, grader, judge_free=judge_free)
    assert verdict.learned and verdict.meets_target and "learned:" in verdict.reason
    assert verdict.over_control_ci95[0] > 0 and verdict.judge_trusted is True and "separation" in verdict.judge
    # read without the grader: the answers state the rubrics' facts, and name what the source names
    recall, precision = (judge_free.comparisons["trained"][m] for m in ("fact_recall", "name_precision"))
    assert recall.ci95[0] > 0 and precision.ci95[1] >= 0
    assert judge_free.mean("after", "answered") == judge_free.mean("before", "answered") == 1.0
    assert any(line.startswith("rubric-fact recall +") for line in verdict.judge_free)
    # without a control, without judge-free measures or without a probe of the grader: not shown
    assert learning_verdict(comparison, None, grader, judge_free=judge_free).outcome == "not shown"
    assert learning_verdict(comparison, control, grader).outcome == "not shown"
    unprobed = learning_verdict(comparison, control, None, judge_free=judge_free)
    assert unprobed.outcome == "not shown" and "never probed" in unprobed.reason
    # a control that gained as much is drift, whatever the interval: trained − control is 0
    same = learning_verdict(comparison, comparison, grader, judge_free=judge_free)
    assert same.outcome == "not learned" and "trained − control" in same.reason
    # the stored evaluation is read back without any model call
    calls = c.engine.calls
    assert evaluate_checkpoint(params, held_out, policy("trained", c.engine, "trained"), c,
                               progress=False).engine_calls == 0 and c.engine.calls == calls


@pytest.mark.parametrize("grader", ["reads", "likes name lists"])
def test_a_solver_that_dumps_the_names_it_retrieved_is_not_called_learned(grader, built, params, retriever,
                                                                        passages, tiny_tokenizer, tmp_path):
    """Issue 47: a Solver that lists the names of its retrieved passages gains on the grader's rubric score, beside
    a control, but not learned. With a grader that reads, its answers hold the rubrics' names among many others:
    name precision against the source falls. With a grader a name list satisfies, and a dumper that leaves the
    task's own names out, the probe's name lists fail the grader and rubric-fact recall does not rise."""
    held_out, *_ = built
    dumper = "dumper" if grader == "reads" else "blind dumper"
    c = components(params, retriever, passages, tiny_tokenizer,
                   grader=None if grader == "reads" else name_list_grader)
    if grader != "reads":   # scored by another grader: its own probe, its own evaluations
        held_out = replace(held_out, path=tmp_path, grader=probe_held_out_grader(params, c))
        assert not held_out.grader.trusted and held_out.grader.separation >= 0.5      # the old probe's numbers pass
        assert held_out.grader.name_list_separation < 0.5 and "name-list separation" in held_out.grader.reasons[0]
    _, gain, control, judge_free = planted_check(params, held_out, c, after=dumper)
    verdict = learning_verdict(gain, control, held_out.grader, judge_free=judge_free)
    assert gain.ci95[0] > 0 and verdict.over_control_ci95[0] > 0       # the grader's score says it gained ...
    assert not verdict.learned                                          # ... the check does not call it learned
    names = judge_free.comparisons["trained"]["names"]
    assert names.ci95[0] > 0                                            # it names more, and says why:
    if grader == "reads":
        assert verdict.outcome == "not learned" and "name precision against the source document fell" in verdict.reason
        assert judge_free.comparisons["trained"]["name_precision"].ci95[1] < 0
    else:
        assert verdict.outcome == "not shown" and "rubric-fact recall did not rise" in verdict.reason
        assert "calibration probe (name-list separation" in verdict.reason
    # the planted Solver that states the facts, scored by the same grader, is still found
    if grader == "reads":
        _, gain, control, judge_free = planted_check(params, held_out, c)
        assert learning_verdict(gain, control, held_out.grader, judge_free=judge_free).learned


def judge_free_passing(task_ids: list[str]) -> JudgeFree:
    """Judge-free measures that pass the verdict's guards: recall rises, name precision holds."""
    recall = Comparison("base", "trained", "fact_recall", task_ids, [0.4] * len(task_ids), [0.6] * len(task_ids),
                        (0.1, 0.3))
    precision = Comparison("base", "trained", "name_precision", task_ids, [0.8] * len(task_ids),
                           [0.8] * len(task_ids), (-0.05, 0.05))
    return JudgeFree(None, {}, {"trained": {"fact_recall": recall, "name_precision": precision}})


def test_the_verdict_rests_on_trained_minus_control():
    """The earlier warm start's numbers (docs/results.md): on 48 tasks the trained run gained +0.049 [+0.017,
    +0.083] and its shuffled-reward control +0.031 [+0.002, +0.059]: both above 0, the trained one above the
    control's, but the two intervals overlap and the paired trained − control interval reaches 0: not learned."""
    import numpy as np

    rng = np.random.default_rng(47)

    def standard(n):
        z = rng.normal(size=n)
        return (z - z.mean()) / z.std()

    ids = [f"t{i:02d}" for i in range(48)]
    before = [0.5] * 48
    trained_after = list(0.5 + 0.049 + 0.1165 * standard(48))
    control_after = list(0.5 + 0.031 + 0.0985 * standard(48))
    trained = Comparison("base", "trained", "score", ids, before, trained_after,
                         paired_bootstrap([a - 0.5 for a in trained_after], 2000, 0))
    control = Comparison("base", "control", "score", ids, before, control_after,
                         paired_bootstrap([a - 0.5 for a in control_after], 2000, 0))
    assert trained.gain == pytest.approx(0.049) and control.gain == pytest.approx(0.031)
    assert trained.ci95 == (pytest.approx(0.017, abs=0.004), pytest.approx(0.083, abs=0.004))
    assert control.ci95 == (pytest.approx(0.002, abs=0.004), pytest.approx(0.059, abs=0.004))
    reads = [ProbeItem(f"p{i}", "stated" if i % 2 else "removed", bool(i % 2), yes=bool(i % 2)) for i in range(40)]
    grader = calibrate("self-Judge grader", "grader", "m0", "grader@1", reads, CalibrationConfig())
    verdict = learning_verdict(trained, control, grader, judge_free=judge_free_passing(ids))
    assert verdict.outcome == "not learned" and verdict.ratio > 1                   # above the control's gain ...
    lo, hi = verdict.over_control_ci95
    assert lo < 0 < hi and verdict.over_control == pytest.approx(0.018)             # ... but not told apart from it
    assert "trained − control +0.018" in verdict.reason and "cannot be told from its shuffled-reward control" in \
        verdict.reason
    assert verdict.to_record()["over_control_ci95"] == [lo, hi]
    # the same trained run beside a control that did not move is learned; without a probe it is not shown
    flat = Comparison("base", "control", "score", ids, before, before, (0.0, 0.0))
    assert learning_verdict(trained, flat, grader, judge_free=judge_free_passing(ids)).learned
    # a control whose mean moved by float rounding alone did not gain (not "1e17x the control's +0.000")
    rounding = Comparison("base", "control", "score", ids, [0.3] * 48, [0.1 + 0.2] * 48, (0.0, 0.0))
    assert 0 < rounding.gain < 1e-15
    beside_rounding = learning_verdict(trained, rounding, grader, judge_free=judge_free_passing(ids))
    assert beside_rounding.ratio == math.inf and "the control did not gain" in beside_rounding.reason
    assert learning_verdict(trained, flat, None, judge_free=judge_free_passing(ids)).outcome == "not shown"


@pytest.mark.parametrize("grader", ["always yes", "garbage"])
def test_a_gain_scored_by_an_untrusted_grader_is_not_called_learned(grader, built, params, passages, tiny_tokenizer):
    """The same planted gain, beside the same control, scored by a grader that fails its probe (one that says yes
    to everything, one that replies garbage): "not shown" naming the probe, unless the untrusted judge is accepted."""
    held_out, c, *_ = built
    _, comparison, control, judge_free = planted_check(params, held_out, c)
    reply = "<think>skip</think>\n<score>1</score>" if grader == "always yes" else "I would rather not say."
    bad = ScriptedEngine(tiny_tokenizer, DIALECT, override=lambda role, context: reply if role == "grader" else None)
    probe = probe_held_out_grader(params, CheckComponents(bad, Judge(bad, params.judge, seed=1), None, DIALECT, passages))
    assert not probe.trusted and bad.batch_sizes[0] == 60
    verdict = learning_verdict(comparison, control, probe, judge_free=judge_free)
    assert not verdict.learned and verdict.reason.startswith("not shown:") and "calibration probe" in verdict.reason
    assert verdict.judge_trusted is False and verdict.to_record()["judge"] == probe.numbers()
    accepted = learning_verdict(comparison, control, probe, accept_untrusted_judge=True, judge_free=judge_free)
    assert accepted.learned and "accepted" in accepted.reason


def test_paired_bootstrap_is_seeded_and_needs_two_tasks():
    differences = [0.1, -0.2, 0.3, 0.0, 0.25, -0.05]
    assert paired_bootstrap(differences, 500, 1) == paired_bootstrap(differences, 500, 1)
    lo, hi = paired_bootstrap(differences, 2000, 0)
    assert lo < sum(differences) / len(differences) < hi
    assert paired_bootstrap([0.5] * 4, 100, 0) == (0.5, 0.5)
    with pytest.raises(ValueError, match="at least 2 tasks"):
        paired_bootstrap([0.3], 100, 0)


def fake_run(folder, params, control: str):
    """A run folder as `scope train` leaves it, for the check's bookkeeping: params.yaml, manifest.json and an
    iteration-1 Solver adapter (its weights never load: the scripted engine plays it by name)."""
    trained = params.model_copy(deep=True)
    trained.grpo.reward_control = control
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(trained.to_yaml())
    (folder / "manifest.json").write_text(f'{{"reward_control": "{control}"}}')
    adapter = folder / "iter_01" / "solver" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(control.encode())
    return folder / "iter_01" / "solver"


def test_scope_learning_check_compare(params, retriever, passages, tiny_tokenizer, tmp_path, monkeypatch, capsys):
    """`scope learning-check compare` end to end: a trained run and its shuffled-reward control, the verdict
    printed and written, everything reused by a second call (no model opened), and the refusals."""
    import json

    from scope_lib.cli import main
    from scope_lib.evaluation import held_out, learning_check

    scripted = PlantedEngine(tiny_tokenizer, DIALECT, trained={"iter_01-solver"})
    opened = []

    def open_policies(params, checkpoints, engine=None):   # the scripted engine stands in for M0 and the adapters
        opened.append([ck.name for ck in checkpoints])
        return {ck.name: Policy(ck, scripted, None if ck.kind == "base" else ck.name) for ck in checkpoints}

    monkeypatch.setattr(learning_check, "open_policies", open_policies)
    monkeypatch.setattr(held_out, "model_identity", lambda params: "scripted")
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(tmp_path / "cache"))
    run = params.model_copy(deep=True)
    run.run.runs_dir = str(tmp_path / "runs")
    run.model.warm_start.enabled = False           # M0 is the scripted engine: nothing to warm-start
    fake_run(run.run_dir, run, "none")
    control = fake_run(tmp_path / "runs" / "control", run, "shuffled")
    (tmp_path / "p.yaml").write_text(run.to_yaml())
    args = ["learning-check", "compare", str(tmp_path / "p.yaml"), "--after", "iter_01/solver"]
    assert main(args + ["--control", str(control)]) == 0
    out = capsys.readouterr().out
    assert "learned: the gain" in out and "control-iter_01-solver" in out and "-> trusted" in out
    # the judge-free measures beside the rubric score: per checkpoint, each gain with its interval, in the JSON too
    assert "judge-free measures, read from the stored answers without the grader" in out
    recall_line = next(line for line in out.splitlines() if line.startswith("rubric-fact recall"))
    assert len(recall_line.split("[")) == 4 and "n=10" in recall_line
    written = json.loads((run.run_dir / "learning_check" / "iter_01-solver-vs-base.json").read_text())
    assert written["verdict"]["learned"] and written["trained"]["ci95"][0] > 0 and written["control"]["tasks"] == 10
    assert written["grader_calibration"]["trusted"] and written["verdict"]["judge_trusted"]
    judge_free = written["judge_free"]
    assert set(judge_free["means"]) == {"before", "after", "control"} and judge_free["means"]["after"]["answered"] == 1
    assert judge_free["comparisons"]["trained"]["fact_recall"]["ci95"][0] > 0
    assert judge_free["comparisons"]["over_control"]["names"]["before"] == "control-iter_01-solver"
    assert written["verdict"]["over_control_ci95"][0] > 0 and len(written["verdict"]["judge_free"]) == 6
    # the trained checkpoint against the control's, paired over the same tasks: the gains' difference, its interval
    over = written["over_control"]
    assert over["before"] == "control-iter_01-solver" and over["after"] == "iter_01-solver" and over["tasks"] == 10
    assert over["gain"] == pytest.approx(written["trained"]["gain"] - written["control"]["gain"])
    assert over["ci95"][0] <= over["gain"] <= over["ci95"][1] and over["ci95"][0] > 0
    assert f"trained - control, paired over the 10 tasks: {over['gain']:+.3f}" in out
    assert opened == [["base", "iter_01-solver", "control-iter_01-solver"]]
    calls = scripted.calls
    assert main(args + ["--control", str(control)]) == 0                      # everything stored: nothing opened
    assert scripted.calls == calls and len(opened) == 1 and "learned: the gain" in capsys.readouterr().out
    # a verdict on the success rate from the stored answers: its own file, the rubric score's left as it was
    assert main(args + ["--control", str(control), "--metric", "success"]) == 0 and scripted.calls == calls
    assert "iter_01-solver-vs-base-success.json" in capsys.readouterr().out
    folder = run.run_dir / "learning_check"
    assert json.loads((folder / "iter_01-solver-vs-base-success.json").read_text())["trained"]["metric"] == "success"
    assert json.loads((folder / "iter_01-solver-vs-base.json").read_text()) == written
    (folder / "iter_01-solver-vs-base-success.json").unlink()     # the pool below reads the folder's one check
    # the written check pooled (one seed) and its first held-out answers shown verbatim: stored files, no model
    assert main(["learning-check", "pool", str(run.run_dir), "--bootstrap-samples", "500"]) == 0
    pooled = capsys.readouterr().out
    assert "pooled (1 seed)" in pooled and "pooled: learned: the gain" in pooled
    assert main(["learning-check", "examples", str(run.run_dir)]) == 0
    shown = capsys.readouterr().out
    assert shown.count("### h0000-") == 3 and "**M0** (g = " in shown and "> It is about " in shown
    assert f"**trained Solver ({run.run_dir.name})** (g = 1.00, rubric-fact recall" in shown
    assert scripted.calls == calls and len(opened) == 1
    # a trained run given as the control, a control given as the trained run, no reserved documents
    assert main(args + ["--control", "iter_01/solver"]) == 2
    assert "its Solver trained on its rewards, so it is no control" in capsys.readouterr().err
    assert main(["learning-check", "compare", str(tmp_path / "p.yaml"), "--after", str(control)]) == 2
    assert "give it as the control" in capsys.readouterr().err
    assert main(args + ["-o", "learning_check.held_out_documents=0"]) == 2
    assert "held_out_documents is 0" in capsys.readouterr().err
    assert main(args + ["-o", "learning_check.held_out_documents=80"]) == 2   # the run reserved only 40
    assert "may come from training documents" in capsys.readouterr().err


def test_the_learning_check_figure_and_table(built, params):
    from scope_lib.evaluation.learning_check import LearningCheck
    from scope_lib.reports.analysis import learning_check_figure, learning_check_table

    held_out, c, *_ = built
    evaluations, gain, control, judge_free = planted_check(params, held_out, c)
    over = compare_evaluations(evaluations["control"], evaluations["after"])
    check = LearningCheck(held_out, evaluations, gain, control,
                          learning_verdict(gain, control, held_out.grader, judge_free=judge_free), over, judge_free)
    table = learning_check_table(check)
    assert table["role"].tolist() == ["before", "after", "control"]
    assert table["gain (score)"].tolist()[1:] == [pytest.approx(gain.gain), pytest.approx(control.gain)]
    assert table["rubric-fact recall"].tolist() == [judge_free.mean(r, "fact_recall") for r in evaluations]
    fig = learning_check_figure(check)
    assert fig.layout.title.text.startswith("Learning check: trained vs base") and "learned" in fig.layout.title.text
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text and fig.layout.yaxis2.title.text
    after = next(t for t in fig.data if t.name == "after: trained")
    assert sorted(after.y) == sorted(gain.values_after) and len(after.x) == gain.n_tasks
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.x[0] for b in bars] == ["trained", "control", "trained − control"]
    assert bars[0].y[0] == pytest.approx(gain.gain) and bars[2].y[0] == pytest.approx(gain.gain - control.gain)
    assert bars[0].error_y.array[0] == pytest.approx(gain.ci95[1] - gain.gain)


def test_asking_for_more_tasks_extends_the_set(built, params, retriever, passages, tiny_tokenizer, tmp_path):
    held_out, _, root, _ = built
    more = params.model_copy(deep=True)
    more.learning_check.tasks = held_out.summary["built"] + 4
    grown_with = components(params, retriever, passages, tiny_tokenizer)
    grown = held_out_set(more, grown_with, model_id="scripted", root=root, progress=False)
    assert grown.path == held_out.path and len(grown.tasks) == more.learning_check.tasks
    assert [t.to_record() for t in grown.tasks[:len(held_out.tasks)]] == [t.to_record() for t in held_out.tasks]
    fresh_with = components(params, retriever, passages, tiny_tokenizer)
    fresh = held_out_set(more, fresh_with, model_id="scripted", root=tmp_path, progress=False)
    assert [t.to_record() for t in fresh.tasks] == [t.to_record() for t in grown.tasks]   # as if built at once
    assert 0 < grown_with.engine.calls < fresh_with.engine.calls                       # only the new batches ran


def test_the_smollm_recipe_and_its_control_share_one_held_out_set():
    """params/smollm-learn.yaml (`make learning-smollm`): the trained run, its shuffled-reward control and another
    seed are checked on the same held-out tasks (one cached set, one M0 evaluation), and training leaves them
    their documents."""
    from pathlib import Path

    from scope_lib.config import load_params
    from scope_lib.evaluation.held_out import held_out_fingerprint

    path = Path(__file__).resolve().parents[1] / "params" / "smollm-learn.yaml"
    trained = load_params(path)
    keys = [held_out_fingerprint(load_params(path, o), "m0", "corpus")
            for o in ({}, {"grpo.reward_control": "shuffled"}, {"grpo.seed": 43})]
    assert keys[0] == keys[1] == keys[2]
    assert trained.learning_check.held_out_documents >= 400 and trained.learning_check.tasks >= 48
    assert trained.grpo.reward_control == "none" and trained.solver.temperature >= 1.0
    assert training_documents(trained, 1000) == 1000 - trained.learning_check.held_out_documents


def test_the_paired_interval_covers_a_zero_gain_about_95_times_in_100():
    """Coverage of `paired_bootstrap` (issue 47): 1,000 held-out sets of 48 tasks whose true gain is 0, each task's
    difference that of two checkpoints' mean rubric scores over K = 4 rollouts (the same success rate on both
    sides, drawn per task): the 95% interval covers 0 in 93-97% of them. Wrong percentiles (90% or 99% intervals),
    resampling rollouts instead of tasks, or a shrunken spread would fall outside."""
    import numpy as np

    rng = np.random.default_rng(47)
    covered = 0
    for trial in range(1000):
        p = rng.uniform(0.0, 0.6, 48)
        differences = (rng.binomial(4, p) - rng.binomial(4, p)) / 4
        lo, hi = paired_bootstrap(list(differences), 2000, seed=trial)
        covered += lo <= 0.0 <= hi
    # measured 0.935 here (0.945-0.95 with other seeds): the percentile interval runs a little short at 48 tasks
    assert 0.93 <= covered / 1000 <= 0.97, covered / 1000
