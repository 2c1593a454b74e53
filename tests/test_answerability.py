"""The answerability gate (an option: Search Self-Play's RAG check, ../shared/reference/related-methods.md): the Judge
answers each task without searching from the Challenger's own retrieved documents mixed with noise documents, and the
task passes only if that answer reaches `judge.answerability_threshold` on the task's rubrics. Driven by the
scripted engine (tests/scripted_engine.py) over real Wikipedia passages: its Judge answers by naming those of the
task's entities that its documents mention, and grades a rubric 1 when the answer names the rubric's entity."""

from __future__ import annotations

import pytest
from scripted_engine import ScriptedEngine, scripted_run_params

from scope_lib.config import load_params
from scope_lib.protocol import rewards
from scope_lib.protocol.dialects import get_dialect
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.rollout import (
    SearchRecord,
    Trajectory,
    challenger_trajectories,
    make_challenger_prompts,
    run_rollouts,
)
from scope_lib.selfplay.tasks import answerability_contexts, challenger_limits, evaluate_tasks

DIALECT = get_dialect("qwen2.5")


@pytest.fixture(scope="module")
def params(wiki_sample, tmp_path_factory):
    return scripted_run_params(wiki_sample.parent, tmp_path_factory.mktemp("runs"),
                               **{"judge.answerability_max_tokens": 128})


def _gated(params, overrides):
    return params.model_copy(update={"judge": params.judge.model_copy(update=overrides)})


def _run(params, retriever, passages, tok, *, override=None, n=6):
    engine = ScriptedEngine(tok, DIALECT, override=override)
    prompts = make_challenger_prompts(passages[:n], ["long_form_qa", "summarisation", "planning", "writing"],
                                      [4, 3, 2], seed=3, tokenizer=tok, document_max_tokens=96)
    trajs = challenger_trajectories(prompts, DIALECT, tok)
    run_rollouts(trajs, engine, retriever, DIALECT, challenger_limits(params))
    judge = Judge(engine, params.judge)
    engine.roles.clear()
    evals, _graded, _stats = evaluate_tasks(trajs, {p.id: p for p in prompts}, params=params, judge=judge,
                                            solver_engine=engine, retriever=retriever, dialect=DIALECT, n_solver=2)
    return evals, trajs, judge, engine


def test_off_by_default_as_in_the_paper(params, retriever, passages, tiny_tokenizer):
    assert "answerability" not in load_params().judge.gates and load_params().judge.answerability_threshold == 0.5
    evals, _, judge, engine = _run(params, retriever, passages, tiny_tokenizer)
    assert "answerability" not in engine.roles and "answerability" not in judge.stats.stages
    assert all(e.answerability is None and "answerability" not in e.gates for e in evals)


def test_the_gate_keeps_tasks_the_judge_can_answer_from_the_evidence(params, retriever, passages, tiny_tokenizer):
    """One batched answer call and one grading call; each task's score is the share of its rubric entities that
    its context (own evidence + noise) names, and the threshold decides which tasks reach the Solver."""
    p = _gated(params, {"gates": ["entity_identifiability", "source_relevance", "answerability"]})
    evals, trajs, judge, engine = _run(p, retriever, passages, tiny_tokenizer)
    asked = [e for e in evals if e.rubrics]
    assert asked and judge.stats.stage("answerability").calls == 1
    assert judge.stats.stage("answerability").prompts == len(asked)
    assert judge.stats.stage("grading").calls == 2          # the answers, then the Solver rollouts
    contexts = answerability_contexts([t for t in trajs if t.id in {e.challenger_id for e in asked}], trajs,
                                      p.judge.answerability_noise_documents, p.selfplay.seed)
    for e, docs in zip(asked, contexts):
        names = [r.text.removeprefix("Identifies ").removesuffix(" by name.") for r in e.rubrics]
        expected = sum(n in "\n\n".join(docs) for n in names) / len(names)
        assert e.answerability == pytest.approx(expected)
        assert e.gates["answerability"] == int(expected >= 0.5)
        assert e.gates_passed == (e.gates["answerability"] == 1)
        assert bool(e.solver_ids) == e.gates_passed           # only answerable tasks get Solver rollouts
    assert any(e.gates_passed for e in asked)


def test_an_unanswerable_task_is_rejected_and_keeps_only_its_format_reward(params, retriever, passages,
                                                                            tiny_tokenizer):
    p = _gated(params, {"gates": ["answerability"]})

    def cannot_answer(role, context):
        return "<answer>The documents do not say.</answer>" if role == "answerability" else None

    evals, _, judge, engine = _run(p, retriever, passages, tiny_tokenizer, override=cannot_answer)
    assert evals and all(e.answerability == 0.0 and e.gates == {"answerability": 0} for e in evals)
    assert all(e.outcome == "gate failed" and e.mean_score is None for e in evals)
    assert "solver" not in engine.roles                       # no Solver rollout for a rejected task
    assert all(e.reward == pytest.approx(rewards.challenger_reward(e.format, False, None)) for e in evals)


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_the_threshold_is_the_least_rubric_score(threshold, params, retriever, passages, tiny_tokenizer):
    """An answer that names only the task's first entity scores the share of rubrics about it (1/3 for a task
    with three different entities): it passes at 0.3 and fails at 0.5."""
    p = _gated(params, {"gates": ["answerability"], "answerability_threshold": threshold})

    def first_name(task: str) -> str:
        return task.split("Explain how ", 1)[-1].split(" and ", 1)[0].split(" are connected", 1)[0]

    def one_name(role, context):
        if role != "answerability":
            return None
        return f"<answer>Only {first_name(context.split('<task>', 1)[-1])}.</answer>"

    evals, _, _, _ = _run(p, retriever, passages, tiny_tokenizer, override=one_name)
    scores = []
    for e in (e for e in evals if e.rubrics):
        names = [r.text.removeprefix("Identifies ").removesuffix(" by name.") for r in e.rubrics]
        expected = sum(first_name(e.task) in n for n in names) / len(names)
        assert e.answerability == pytest.approx(expected)
        assert e.gates_passed is (expected >= threshold)
        scores.append(expected)
    assert any(s == pytest.approx(1 / 3) for s in scores)   # a task on which the threshold decides


def test_an_unparseable_answer_scores_zero_and_is_counted(params, retriever, passages, tiny_tokenizer):
    p = _gated(params, {"gates": ["answerability"]})
    evals, _, judge, engine = _run(p, retriever, passages, tiny_tokenizer,
                                   override=lambda role, _c: "no tags at all" if role == "answerability" else None)
    stage = judge.stats.stage("answerability")
    assert stage.calls == 2 and stage.retried == stage.unparseable == len(evals)   # asked again once, in one call
    assert all(e.answerability == 0.0 and not e.gates_passed for e in evals)
    assert judge.stats.stage("grading").prompts == 0 and "grader" not in engine.roles


def _traj(i: int, blocks: list[str]) -> Trajectory:
    return Trajectory(id=f"c{i}", role="challenger", prompt_ids=[], messages=[],
                      searches=[SearchRecord(turn=k, query="q", valid=True, results=b) for k, b in enumerate(blocks)]
                      + [SearchRecord(turn=9, query=None, valid=False, results="correction")])


def test_contexts_mix_the_own_evidence_with_other_rollouts_blocks():
    batch = [_traj(0, ["A1", "A2"]), _traj(1, ["B1", "A1"]), _traj(2, ["C1", "C2", "C3"]), _traj(3, [])]
    contexts = answerability_contexts(batch, batch, n_noise=2, seed=5)
    assert contexts == answerability_contexts(batch, batch, n_noise=2, seed=5)       # seeded
    for traj, docs in zip(batch, contexts):
        own = traj.evidence
        assert set(own) <= set(docs) and len(docs) == len(own) + 2 and len(set(docs)) == len(docs)
        assert "correction" not in docs                     # malformed searches retrieved nothing
    assert set(contexts[0]) - {"A1", "A2"} <= {"B1", "C1", "C2", "C3"}   # another rollout's copy of A1 is no noise
    assert len(contexts[3]) == 2                             # no evidence at all: noise only
    assert sorted(answerability_contexts(batch, batch, n_noise=0, seed=5)[2]) == ["C1", "C2", "C3"]
    many = answerability_contexts(batch[:1], batch, n_noise=50, seed=5)[0]
    assert sorted(many) == ["A1", "A2", "B1", "C1", "C2", "C3"]                 # capped by the pool
    orders = {tuple(answerability_contexts(batch, batch, n_noise=2, seed=s)[2]) for s in range(8)}
    assert len(orders) > 1                                   # the order is shuffled, by seed
