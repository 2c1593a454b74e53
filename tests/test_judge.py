"""The Judge: the corrective retry, per-stage thinking from each Judge model's own family, budgets (issue #11)."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine

from scope_lib.config import load_params
from scope_lib.protocol.dialects import get_dialect, thinks_natively
from scope_lib.selfplay.judge import Judge, make_judge

REPO = Path(__file__).resolve().parents[1]
TASKS = ["Explain how Evan Morris and Halliburton are connected."] * 3
DOCS = ["Evan Morris was a lobbyist for Halliburton in Washington."] * 3


class Recording(ScriptedEngine):
    """The scripted engine, remembering each call's sampling and decoded prompts."""

    def __init__(self, tokenizer, name="recording", **kwargs):
        super().__init__(tokenizer, get_dialect("qwen2.5"), **kwargs)
        self.name = name
        self.samplings, self.contexts = [], []

    def generate(self, prompt_token_ids, sampling, adapter=None):
        self.samplings.append(sampling)
        self.contexts.append([self.tokenizer.decode(ids) for ids in prompt_token_ids])
        return super().generate(prompt_token_ids, sampling, adapter)


def _corrected_only(role, context):
    """Garbage on the first ask; a well-formed reply once told what went wrong."""
    if "could not be read" not in context:
        return "I think it is fine, maybe." if role.startswith(("gate", "grader")) else "Some rubrics: good ones."
    return None


def test_retry_with_a_corrective_instruction_rescues_replies(tiny_tokenizer):
    params = load_params(REPO / "params" / "smoke.yaml", ["judge.rubric_max_tokens=512", "judge.gate_max_tokens=64",
                                                         "judge.grading_max_tokens=64"])
    engine = Recording(tiny_tokenizer, override=_corrected_only)
    judge = Judge(engine, params.judge)
    gates = judge.gates(TASKS, DOCS)
    rubrics = judge.rubrics(["long_form_qa"] * 3, TASKS, [[d] for d in DOCS])
    verdicts = judge.grade(TASKS, ["Evan Morris lobbied."] * 3, ["Identifies Evan Morris by name."] * 3)
    assert all(g.passed for g in gates) and all(r and len(r) == 3 for r in rubrics) and verdicts == [1, 1, 1]
    for stage, asked in (("gates", 6), ("rubrics", 3), ("grading", 3)):
        stats = judge.stats.stages[stage]
        assert (stats.calls, stats.retried, stats.rescued, stats.unparseable) == (2, asked, asked, 0)
    # the retry is the original prompt plus the instruction; greedy gates could never be rescued otherwise
    first, retry = engine.contexts[0][0], engine.contexts[1][0]
    assert retry.startswith(first.split("<|im_end|>")[0]) and "could not be read" in retry
    assert "<score>0</score> or <score>1</score>" in retry
    assert any("<rubrics> block" in c for c in engine.contexts[3])
    assert judge.stats.parse_failure_rate() == 0.0
    assert {"rescued by retry", "unparseable"} <= set(judge.stats.table()[0])


def test_replies_that_never_parse_are_counted(tiny_tokenizer):
    params = load_params(REPO / "params" / "smoke.yaml")
    engine = Recording(tiny_tokenizer, override=lambda role, context: "no tags")
    judge = Judge(engine, params.judge)
    assert [g.passed for g in judge.gates(TASKS, DOCS)] == [False] * 3
    stats = judge.stats.stages["gates"]
    assert (stats.rescued, stats.unparseable) == (0, 6) and judge.stats.parse_failure_rate() == 1.0


@pytest.mark.parametrize(("model", "thinks"), [
    ("Qwen/Qwen3-8B", True), ("Qwen/Qwen3-4B-Instruct-2507", False), ("Qwen/Qwen2.5-7B-Instruct", False),
    ("allenai/Olmo-3-7B-Think", True), ("allenai/Olmo-3-7B-Instruct", False), ("tiny", False)])
def test_thinks_natively(model, thinks):
    assert thinks_natively(model) is thinks


def test_thinking_and_budgets_follow_each_judge_model(tiny_tokenizer):
    """A Qwen2.5 policy judged by Qwen3 gets the thinking Judge; a Qwen3 policy judged by tiny does not."""
    engines: dict[str, Recording] = {}

    def engine_for(name):
        return engines.setdefault(name, Recording(tiny_tokenizer, name=name))

    params = load_params(REPO / "params" / "qwen2.5-7b.yaml", [
        "judge.model=Qwen/Qwen3-8B", "judge.rubric_model=Qwen/Qwen2.5-7B-Instruct", "judge.gate_max_tokens=null"])
    judge = make_judge(params, engine_for)
    assert judge.thinking == {"gates": True, "rubrics": False, "grading": True}
    assert judge.gate_max_tokens == 1024                      # fits a thinking Judge by default
    judge.gates(TASKS[:1], DOCS[:1])
    judge.rubrics(["writing"], TASKS[:1], [DOCS[:1]])
    judge.grade(TASKS[:1], ["An answer."], ["Identifies Evan Morris by name."])
    qwen3, qwen25 = engines["Qwen/Qwen3-8B"], engines["Qwen/Qwen2.5-7B-Instruct"]
    assert qwen3.samplings[0].stop == () and qwen3.samplings[0].max_new_tokens == 1024
    assert qwen25.samplings[0].stop == ("</rubrics>",)
    grading_prompt = qwen3.contexts[-1][0]
    assert "<rubric>Identifies Evan Morris" in grading_prompt and "inside <think>" not in grading_prompt

    params = load_params(REPO / "params" / "qwen3-8b.yaml", ["judge.model=tiny"])
    judge = make_judge(params, engine_for)
    assert judge.thinking == dict.fromkeys(("gates", "rubrics", "grading"), False)
    assert judge.gate_max_tokens == 256
    forced = make_judge(load_params(REPO / "params" / "qwen3-8b.yaml", ["judge.model=tiny",
                                                                       "judge.native_thinking=true"]), engine_for)
    assert all(forced.thinking.values()) and forced.gate_max_tokens == 1024   # the explicit setting wins


def _repeats_a_rubric(role, context):
    if role == "rubrics":
        return ('<rubrics><rubric priority="critical">Names Evan Morris.</rubric><rubric priority="critical">'
                'Names Evan Morris.</rubric><rubric>Names Halliburton.</rubric><rubric>Says he lobbied.</rubric>'
                "</rubrics>")
    return None


def test_distinct_rubrics_reaches_the_judges_rubric_stage_and_stays_out_of_every_key_at_its_default(tiny_tokenizer):
    from scope_lib.evaluation.held_out import held_out_fingerprint
    from scope_lib.selfplay.loop import probes_key, science_yaml

    paper = load_params(REPO / "params" / "smoke.yaml")
    distinct = load_params(REPO / "params" / "smoke.yaml", {"judge.distinct_rubrics": True})
    written = [Judge(ScriptedEngine(tiny_tokenizer, get_dialect("qwen2.5"), override=_repeats_a_rubric),
                     p.judge).rubrics(["long_form_qa"], TASKS[:1], [DOCS[:1]])[0] for p in (paper, distinct)]
    assert [r.text for r in written[0]] == ["Names Evan Morris.", "Names Evan Morris.", "Names Halliburton.",
                                            "Says he lobbied."]
    assert [r.text for r in written[1]] == ["Names Evan Morris.", "Names Halliburton.", "Says he lobbied."]
    # at its default the option is in no key: runs, Judge probes and held-out sets from before it are reused
    assert "distinct_rubrics" not in paper.to_yaml() + science_yaml(paper)
    assert "distinct_rubrics" not in str(held_out_fingerprint(paper, "m", "c"))
    assert probes_key(distinct) != probes_key(paper) and science_yaml(distinct) != science_yaml(paper)
    assert held_out_fingerprint(distinct, "m", "c") != held_out_fingerprint(paper, "m", "c")


def test_default_rubric_bounds_are_the_papers():
    params = load_params()
    assert (params.judge.min_rubrics, params.judge.max_rubrics) == (3, 5)
    assert params.judge.rubric_prompt == "paper" and params.solver.prompt == "paper"
