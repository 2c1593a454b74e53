"""SCORE as a method of the library (`selfplay.methods.score`, issue 49 item 1): one iteration end to end on the tiny
model with real GRPO (Solver) and REINFORCE (Evaluator) updates of one shared adapter, a scripted engine that
writes SCORE's rubrics, reports and evaluations, a kill in the Evaluator's second step and the resume; the
meta-harness's schedule and its rejected reply; the alarm when no Evaluator reply scored anything."""

from __future__ import annotations

import json

import pytest
from scripted_engine import ScriptedEngine
from training_helpers import FAST, REPO, load_policy

from scope_lib.config import load_params
from scope_lib.protocol import score
from scope_lib.protocol.dialects import get_dialect
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.runs import read_jsonl
from scope_lib.selfplay.harness import SelfPlayRun
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.loop import run
from scope_lib.selfplay.methods import METHODS
from scope_lib.selfplay.methods import score as score_method

DIALECT = get_dialect("qwen2.5")
RUBRIC = ('<dimensions><dim name="factuality"/><dim name="coherence" weight="0.2"/>'
          '<dim name="insight" weight="0.25"/><dim name="readability" weight="0.15"/></dimensions>')
#: The rubric's weights by hand: the additional ones as written, factuality the rest, 1 - 0.6.
WEIGHTS = {"factuality": 0.4, "coherence": 0.2, "insight": 0.25, "readability": 0.15}
#: The Evaluator's scores of report 1 and report 2 of every query, and their rewards by hand (§3.5):
#: 1 + 0.4·0.8 + 0.2·0.6 + 0.25·0.4 + 0.15·1.0 = 1.69 and 1 + 0.4·0.2 + 0.2·0.4 + 0.25·0.6 + 0.15·0.8 = 1.43.
SCORES = ({"factuality": 8, "coherence": 6, "insight": 4, "readability": 10},
          {"factuality": 2, "coherence": 4, "insight": 6, "readability": 8})
HAND_REWARDS = (1.69, 1.43)
CONCLUSIONS = ("Alpha beta gamma matter most.", "Delta epsilon zeta differ.")   # no word in common: cosine 0
EVALUATION = "<report_evaluations>" + "".join(
    f'<report id="{k}"><scores>' + "".join(f'<score dim="{d}" value="{v}"/>' for d, v in s.items())
    + "</scores></report>" for k, s in enumerate(SCORES, 1)) + "</report_evaluations>"


def score_script(*, rubrics_valid: bool = True):
    """(role, context) -> text. The Evaluator's rubric: RUBRIC, except the second query's (no dimensions); its
    scoring call searches on the 1st, 3rd, ... call and not on the 2nd, 4th (the verifier zeroes those), then scores
    with SCORES. The Solver searches once, then reports with a conclusion cycling A, A, B over its answers; every
    fifth answer has no <answer> (a(r) = 0). `rubrics_valid=False`: no rubric is ever valid."""
    calls = {"rubric": 0, "evaluator": 0, "answer": 0}

    def script(role: str, context: str) -> str | None:
        first_user = context.split("<|im_start|>user\n", 1)[-1]
        turns = context.count("<|im_start|>assistant") - 1
        if first_user.startswith("You are a professional evaluator") and "Before any report" in first_user:
            calls["rubric"] += 1
            return RUBRIC if rubrics_valid and calls["rubric"] != 2 else "I cannot choose."
        if first_user.startswith("You are a professional evaluator"):
            if turns == 0:
                calls["evaluator"] += 1
                if calls["evaluator"] % 2:
                    return "<think>Check the claims.</think>\n" + DIALECT.format_search("alpha beta")
            return EVALUATION
        if first_user.startswith("You are a professional deep researcher"):
            if turns == 0:
                return "<think>I need sources.</think>\n" + DIALECT.format_search("research topic")
            n, calls["answer"] = calls["answer"], calls["answer"] + 1
            if n % 5 == 4:
                return "I could not finish the report."
            return f"<answer>## Findings\nSome facts.\n\n## Conclusion\n{CONCLUSIONS[n % 3 == 2]}</answer>"
        return None

    return script


def score_params(tmp_path, data_dir, **overrides):
    return load_params(REPO / "params" / "score-smoke.yaml", {
        "run.runs_dir": str(tmp_path), "run.data_dir": str(data_dir), **FAST, "selfplay.iterations": 1,
        "challenger.max_new_tokens_per_turn": 400, "solver.max_new_tokens_per_turn": 160, **overrides})


@pytest.fixture(scope="module")
def retriever(tmp_path_factory, wiki_sample):
    return build_or_open_index(score_params(tmp_path_factory.mktemp("index"), wiki_sample.parent), progress=False)


def run_score(params, tiny_model_dir, retriever, **script):
    policy = load_policy(params, tiny_model_dir)
    engine = ScriptedEngine(policy.tokenizer, DIALECT, override=score_script(**script))
    return run(params, policy=policy, engine=engine, judge=Judge(engine, params.judge, seed=0), retriever=retriever)


def searched(trajectory: dict) -> int:
    return sum("<search>" in turn for turn in trajectory["turns"])


def test_score_iteration_rewards_baseline_and_a_resume_after_a_kill_in_the_evaluator_stage(
        tmp_path, wiki_sample, tiny_model_dir, retriever, monkeypatch, caplog):
    params = score_params(tmp_path, wiki_sample.parent, **{"selfplay.steps_per_role": 2, "run.checkpoint_steps": 1})
    assert METHODS["score"] is score_method.SCORE and params.model.shared_policy
    evaluator = score_method.SCORE.role_rules("challenger")
    real = evaluator.rewards

    def killed_at_step_2(session, trajectories, step):
        if step == 1:
            raise KeyboardInterrupt("killed")
        return real(session, trajectories, step)

    monkeypatch.setattr(evaluator, "rewards", killed_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        run_score(params, tiny_model_dir, retriever)
    folder = params.run_dir / "iter_01"
    assert (folder / "solver" / "DONE").is_file() and not (folder / "evaluator" / "DONE").exists()
    assert [r["step"] for r in read_jsonl(folder / "evaluator" / "rollouts.jsonl")] == [1, 1]
    monkeypatch.setattr(evaluator, "rewards", real)
    caplog.set_level("WARNING", logger="scope_lib.selfplay.training")
    result = run_score(params, tiny_model_dir, retriever)   # a new process's resume: fresh policy and engine
    assert list(result.policy.model.peft_config) == ["policy"]
    for stage in ("rubric", "solver", "evaluator", "harness"):
        assert (folder / stage / "DONE").is_file()

    rubrics = read_jsonl(folder / "rubric" / "rollouts.jsonl")   # B x steps queries, one rubric each
    assert len(rubrics) == 4 and all(r["harness"] == score_method.harness_in_brief(score.DEFAULT_HARNESS)
                                     for r in rubrics)
    assert [(r["valid"], r["invalid_reason"]) for r in rubrics].count((False, "no_dimensions")) == 1
    for r in rubrics:
        if r["valid"]:
            assert dict(zip(r["rubric"]["dimensions"], r["rubric"]["weights"], strict=True)) == pytest.approx(WEIGHTS)

    evaluations = read_jsonl(folder / "solver" / "evaluations.jsonl")
    reports = {r["id"]: r for r in read_jsonl(folder / "solver" / "rollouts.jsonl")}
    assert len(evaluations) == 4 and len(reports) == 8
    valid_rubric = {r["id"]: r["valid"] for r in rubrics}
    kinds = set()
    for e in evaluations:
        finals = [reports[i]["trajectory"]["turns"][-1] for i in e["report_ids"]]
        a = [float("<answer>" in f) for f in finals]
        assert [reports[i]["report_valid"] for i in e["report_ids"]] == [bool(x) for x in a]
        conclusions = [next((c for c in CONCLUSIONS if c in f), "") for f in finals]
        assert e["conclusions"] == conclusions
        assert e["consistency"] == pytest.approx(1.0 if conclusions[0] and conclusions[0] == conclusions[1] else 0.0)
        if not valid_rubric[e["query_id"]]:
            kinds.add("no_rubric")
            assert (e["zeroed"], e["zero_reason"], e["rewards"], e["trajectory"]) == (True, "no_rubric", [0, 0], None)
            assert e["problems"] == {"rubric_invalid": 2}
            continue
        assert e["searches"] == searched(e["trajectory"]) and e["required_searches"] == 1
        assert e["scores"] == list(SCORES) and e["problems"] == {}
        if e["searches"] == 0:   # the search-count verifier (Algorithm 1 line 23)
            kinds.add("too_few_searches")
            assert (e["zeroed"], e["zero_reason"], e["rewards"]) == (True, "too_few_searches", [0, 0])
        else:
            kinds.add("scored")
            assert not e["zeroed"]
            assert e["rewards"] == pytest.approx([x * r for x, r in zip(a, HAND_REWARDS, strict=True)])
        for i, value in zip(e["report_ids"], e["rewards"], strict=True):
            assert reports[i]["reward"] == pytest.approx(value)
    assert kinds == {"no_rubric", "too_few_searches", "scored"}
    metrics = read_jsonl(folder / "solver" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all("zeroed_queries" in m for m in metrics)

    # REINFORCE on the rubrics: R_e = C_q (0 for an invalid rubric), A = R_e - b_{t-1}, b_t = 0.7 b + 0.3 mean R_e
    consistency = {e["query_id"]: e["consistency"] for e in evaluations}
    rows = read_jsonl(folder / "evaluator" / "rollouts.jsonl")
    assert sorted(r["query_id"] for r in rows) == sorted(valid_rubric)      # each rubric once: nothing duplicated
    assert sorted(r["step"] for r in rows) == [1, 1, 2, 2]
    baseline = 0.0
    for step in (1, 2):
        batch = [r for r in rows if r["step"] == step]
        hand = [consistency[r["query_id"]] if valid_rubric[r["query_id"]] else 0.0 for r in batch]
        assert [r["reward_e"] for r in batch] == pytest.approx(hand)
        assert all(r["baseline_before"] == pytest.approx(baseline) for r in batch)
        assert [r["advantage"] for r in batch] == pytest.approx([h - baseline for h in hand])
        baseline = 0.7 * baseline + 0.3 * sum(hand) / len(hand)
        assert all(r["baseline"] == pytest.approx(baseline) for r in batch)
    # the trainer's advantages are the given ones (no group normalisation): its "no signal" share is theirs
    for m in read_jsonl(folder / "evaluator" / "metrics.jsonl"):
        given = [r["advantage"] for r in rows if r["step"] == m["step"]]
        assert m["zero_spread_share"] == pytest.approx(sum(a == 0 for a in given) / len(given))
    assert [m["step"] for m in read_jsonl(folder / "evaluator" / "metrics.jsonl")] == [1, 2]
    assert "challenger: resuming at step 1 of 2" in caplog.text   # the Evaluator trains as `challenger`
    done = json.loads((folder / "evaluator" / "DONE").read_text())
    assert done["baseline"] == pytest.approx(baseline) and done["steps"] == 2
    harness = json.loads((folder / "harness" / "DONE").read_text())   # step 1 of 5: no refresh yet
    assert harness["refreshed"] is False and harness["harness"] == score_method.harness_record(score.DEFAULT_HARNESS)


class MetaHarnessEngine(ScriptedEngine):
    """M0 as the meta-harness: the replies in order; records what it was asked and with which adapter."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, DIALECT, override=lambda role, context: self.replies.pop(0))
        self.replies, self.asked = list(replies), []

    def generate(self, prompt_token_ids, sampling, adapter=None):
        self.asked.append((self.tokenizer.decode(prompt_token_ids[0]), adapter))
        return super().generate(prompt_token_ids, sampling, adapter)


def test_the_meta_harness_runs_every_5_steps_and_a_rejected_reply_keeps_the_harness(tmp_path, wiki_sample,
                                                                                      tiny_model_dir):
    from transformers import AutoTokenizer

    params = score_params(tmp_path, wiki_sample.parent, **{"judge.rubric_max_tokens": 1024})
    new = {"dimension_constraints": {"k": 3, "must_include": ["factuality"], "weight_min": 0.2, "weight_max": 0.3},
           "process_constraints": {"min_number_of_tool_call": 2}, "notes": "Search twice."}
    engine = MetaHarnessEngine(AutoTokenizer.from_pretrained(tiny_model_dir),
                               [json.dumps(new), "The harness is fine as it is."])
    r = SelfPlayRun(params, [], None, DIALECT, None, Judge(engine, params.judge, seed=0), engine,
                    score_method.SCORE)
    for t in range(1, 11):
        r.stage(t, "solver").mark_done({"queries": 2, "reward": [1.5 + t / 100], "valid_evaluations": 1,
                                        "zeroed_queries": 1, "evaluator_searches": 1.0,
                                        "dimension_scores": {"factuality": 5.0}})
        r.stage(t, "evaluator").mark_done({"reward_eval": [0.5], "baseline": 0.1})
        summary = score_method.refresh_harness(r, t)
        assert summary["refreshed"] is (t in (5, 10))
        assert len(engine.asked) == t // 5
    assert [adapter for _, adapter in engine.asked] == [None, None]   # the frozen M0, adapters off
    first = json.loads(engine.asked[0][0].split("## Statistics", 1)[1].split("##", 1)[0])
    assert first["steps"] == [1, 5] and first["solver_mean_reward"] == pytest.approx(1.53)
    assert first["zeroed_reward_share"] == pytest.approx(0.5)
    accepted = json.loads((params.run_dir / "iter_05" / "harness" / "DONE").read_text())
    rejected = json.loads((params.run_dir / "iter_10" / "harness" / "DONE").read_text())
    assert (accepted["accepted"], rejected["accepted"], rejected["reason"]) == (True, False, "no_json")
    assert [score_method.harness_in_force(r, t).k for t in (1, 5, 6, 10, 11)] == [4, 4, 3, 3, 3]
    harness = score_method.harness_in_force(r, 11)
    assert (harness.min_number_of_tool_call, harness.weight_min, harness.notes) == (2, 0.2, "Search twice.")
    assert rejected["harness"] == rejected["previous"] == score_method.harness_record(harness)


def test_no_valid_evaluation_is_an_alarm_and_the_run_goes_on(tmp_path, wiki_sample, tiny_model_dir, retriever):
    params = score_params(tmp_path, wiki_sample.parent)
    result = run_score(params, tiny_model_dir, retriever, rubrics_valid=False)
    assert "no_valid_evaluation" in [a["alarm"] for a in result.alarms]
    assert "no_valid_evaluation" in (params.run_dir / "health.jsonl").read_text()
    folder = params.run_dir / "iter_01"
    assert (folder / "harness" / "DONE").is_file()                       # every stage ran
    assert all(r["reward"] == 0.0 for r in read_jsonl(folder / "solver" / "rollouts.jsonl"))
    rows = read_jsonl(folder / "evaluator" / "rollouts.jsonl")
    assert rows and all(r["reward_e"] == 0.0 and r["advantage"] == 0.0 for r in rows)


def test_one_rollout_per_prompt_is_a_trainer_config_without_groups(tmp_path):
    """The Evaluator's REINFORCE (rollout 1, Table 2): TRL's config takes no group of one, so it is set after its
    checks; a step is then the Evaluator's batch of rows, one per query, and the trainer gives the rewards as the
    advantages (`ScopeGRPOTrainer.reinforce`, checked on a real step above)."""
    from scope_lib.selfplay.training import grpo_args

    paper = load_params(REPO / "params" / "score-qwen2.5-7b.yaml", {"run.runs_dir": str(tmp_path)})
    evaluator = grpo_args(paper, "challenger", seed=3, output_dir=tmp_path,
                          group_size=score_method.SCORE.role_rules("challenger").group_size)
    assert evaluator.num_generations == 1
    assert evaluator.per_device_train_batch_size * evaluator.gradient_accumulation_steps == 64
    assert evaluator.temperature == 0.8 and evaluator.max_completion_length == 2048
    solver = grpo_args(paper, "solver", seed=3, output_dir=tmp_path)
    assert solver.num_generations == 8 and solver.per_device_train_batch_size * solver.gradient_accumulation_steps \
        == 64 * 8


def test_why_a_query_was_zeroed():
    from scope_lib.selfplay.rollout import Trajectory

    rubric = score.Rubric(("factuality", "coherence"), (0.8, 0.2))
    parsed = score.parse_evaluation("", score.DEFAULT_HARNESS, 2, rubric=rubric)   # a rubric, no scores, no search
    too_long = Trajectory(id="e", role="solver", prompt_ids=[1], messages=[], finish="prompt_too_long")
    ran = Trajectory(id="e", role="solver", prompt_ids=[1], messages=[], turns=["<report_evaluations/>"],
                     finish="no_action")
    assert score_method.zero_reason(None, None) == "no_rubric"
    assert score_method.zero_reason(parsed, too_long) == "evaluation_not_run"
    assert score_method.zero_reason(parsed, ran) == "too_few_searches"


def test_the_paper_settings_fit_one_80_gib_gpu_with_lora(tmp_path):
    from scope_lib.models.gpu_plan import plan_gpu

    report = plan_gpu(load_params(REPO / "params" / "score-qwen2.5-7b.yaml", {"run.runs_dir": str(tmp_path)}),
                      gpu_gib=80)
    assert report.fits and not any("frozen second adapter" in row.item for row in report.rows)   # one shared actor
