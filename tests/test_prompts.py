"""Prompt templates (App. H): every placeholder filled for every task type and search dialect, JSON braces
survive, the gates carry their few-shot examples, missing values are clear errors."""

from __future__ import annotations

import re
import typing
from importlib import resources

import pytest

from scope_lib.config import PAPER_TASK_TYPES, TaskType
from scope_lib.protocol import prompts
from scope_lib.protocol.dialects import DIALECTS
from scope_lib.protocol.parsing import parse_score

SEARCH_EXAMPLES = {
    "qwen2.5": "<search>your query</search>",
    "qwen3": '<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>',
    "olmo3": '<function_calls>search(query="...")</function_calls>',
}
DOC = "(Title: Lake Ohrid) Lake Ohrid straddles the border of North Macedonia and Albania."
TASK = "Explain how the Via Egnatia shaped trade around Lake Ohrid in Roman times, in about 400 words."
PLACEHOLDER = re.compile(r"\$(\w+|\{)")


def _no_placeholders(text: str) -> None:
    assert not PLACEHOLDER.search(text), f"unfilled placeholder: {PLACEHOLDER.search(text).group()}"
    assert "$" not in text


# -- templates on disk ----------------------------------------------------------------------------------


def test_every_template_file_is_registered_and_loads():
    folder = resources.files("scope_lib.protocol").joinpath("prompts")
    on_disk = sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".txt"))
    assert on_disk == sorted(prompts.TEMPLATE_NAMES)
    for name in prompts.TEMPLATE_NAMES:
        assert prompts.load_template(name).template == prompts.load_template(f"{name}.txt").template
        assert prompts.load_template(name) is prompts.load_template(name)  # cached


def test_unknown_template_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown prompt template 'nope'.*challenger"):
        prompts.load_template("nope")


def test_task_types_match_the_config_schema():
    assert set(prompts.TASK_TYPES) == set(typing.get_args(TaskType))
    assert {k for k, v in prompts.TASK_TYPES.items() if v.paper_default} == set(PAPER_TASK_TYPES)
    assert not prompts.TASK_TYPES["short_form_qa"].paper_default
    for key, spec in prompts.TASK_TYPES.items():
        assert spec.key == key and spec.name and len(spec.description.split()) >= 12


# -- Challenger ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_type", list(prompts.TASK_TYPES))
@pytest.mark.parametrize("dialect", list(SEARCH_EXAMPLES))
def test_challenger_prompt_renders(task_type, dialect):
    example = SEARCH_EXAMPLES[dialect]
    text = prompts.challenger_prompt(DOC, task_type, 2, example)
    _no_placeholders(text)
    spec = prompts.TASK_TYPES[task_type]
    for piece in (DOC, spec.name, spec.description, "**2**", example, "<task>", "</task>", "<think>",
                  "## Source Document", "## Task Type", "## Instructions", "PREVIOUS", "EVERY",
                  "English only", "acronyms"):
        assert piece in text, piece
    # the search-turn format is <think> then the dialect's search action
    assert text.index("## Search Turn Format") < text.index(example) < text.index("## Final Task Format")
    # the checklist sits inside the final <think>, before <task>
    final = text[text.index("## Final Task Format"):]
    assert final.index("<think>") < final.index("- [ ]") < final.index("</think>") < final.index("<task>")
    assert final.count("- [ ]") == 7


@pytest.mark.parametrize("name, dialect", [(n, d) for n, d in DIALECTS.items()])
def test_challenger_and_solver_take_the_real_dialect_examples(name, dialect):
    text = prompts.challenger_prompt(DOC, "planning", 3, dialect.search_example)
    assert dialect.search_example in text
    solver = prompts.solver_prompt(TASK, 5, dialect.search_example, dialect.results_description)
    assert dialect.search_example in solver and dialect.results_description in solver
    _no_placeholders(text)
    _no_placeholders(solver)


def test_json_braces_and_dollars_in_values_survive():
    doc = "Budget: $150 million {approx} for ${project}."
    text = prompts.challenger_prompt(doc, "writing", 1, SEARCH_EXAMPLES["qwen3"])
    assert doc in text
    assert '{"name": "search", "arguments": {"query": "..."}}' in text


def test_environment_messages():
    after = prompts.challenger_after_search(2)
    assert "2" in after and "NEW" in after
    assert "person, place or organisation" in after
    bad = prompts.challenger_malformed(1)
    assert "1" in bad and "malformed" in bad and "not run" in bad
    finish = prompts.challenger_finish()
    assert "complete" in finish and "<task>" in finish
    solver_bad = prompts.solver_malformed(3, SEARCH_EXAMPLES["olmo3"])
    assert "3" in solver_bad and SEARCH_EXAMPLES["olmo3"] in solver_bad and "<answer>" in solver_bad
    for text in (after, bad, finish, solver_bad):
        _no_placeholders(text)


# -- Solver -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", list(SEARCH_EXAMPLES))
def test_solver_prompt_renders(dialect):
    text = prompts.solver_prompt(TASK, 4, SEARCH_EXAMPLES[dialect], "between <information> and </information>")
    _no_placeholders(text)
    for piece in (TASK, SEARCH_EXAMPLES[dialect], "<information>", "up to 4", "<think>", "<answer>", "</answer>"):
        assert piece in text
    assert text.rstrip().endswith(f"Question: {TASK}")
    # the paper's Figure 10 by default: a direct answer "without detailed illustrations"
    assert "without detailed illustrations" in text and "<answer> Beijing </answer>" in text
    long_form = prompts.solver_prompt(TASK, 4, SEARCH_EXAMPLES[dialect], "below", variant="long_form")
    assert "illustration" not in long_form and "complete final response" in long_form
    assert long_form.rstrip().endswith(f"Question: {TASK}")
    with pytest.raises(ValueError, match="long_form"):
        prompts.solver_prompt(TASK, 4, SEARCH_EXAMPLES[dialect], "below", variant="essay")


def test_solver_budget_instructions():
    plain = prompts.solver_prompt(TASK, 3, SEARCH_EXAMPLES["qwen2.5"], "below")
    budget = prompts.solver_prompt(TASK, 3, SEARCH_EXAMPLES["qwen2.5"], "below",
                                   budget_instructions="Keep your answer under 800 words.")
    assert "Beijing </answer>.\n\nQuestion:" in plain
    assert "Beijing </answer>. Keep your answer under 800 words.\n\nQuestion:" in budget


# -- Judge --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_type", list(prompts.TASK_TYPES))
def test_rubric_prompt_renders(task_type):
    text = prompts.rubric_prompt(task_type, TASK, [DOC, "A second document."])
    _no_placeholders(text)
    for piece in (prompts.TASK_TYPES[task_type].name, TASK, "Document 1:\n" + DOC, "Document 2:\nA second document.",
                  "3 to 5", "25 words", "critical", "important", "bonus", "THIS task", "objectively",
                  "<rubrics>", "</rubrics>", '<rubric priority="critical">'):
        assert piece in text, piece
    for verb in ("Addresses", "Demonstrates", "Provides", "Incorporates", "Synthesises", "Identifies",
                 "Explains", "Compares", "Evaluates", "Integrates", "Supports", "Applies"):
        assert verb in text
    # Figure 12 has four rules; the grounding rule is the named option `judge.rubric_prompt: grounded`
    assert "4. **Discriminative" in text and "5. **" not in text and "names, numbers, dates" not in text
    assert "is met?\n\n## Output Format" in text
    grounded = prompts.rubric_prompt(task_type, TASK, [DOC], variant="grounded")
    assert "is met?\n5. **Grounding**" in grounded and "names, numbers, dates" in grounded
    _no_placeholders(grounded)


def test_rubric_prompt_documents_must_be_a_list():
    with pytest.raises(ValueError, match="list"):
        prompts.rubric_prompt("writing", TASK, DOC)
    assert "(no documents)" in prompts.rubric_prompt("writing", TASK, [])


@pytest.mark.parametrize("native", [False, True])
def test_grader_prompt(native):
    text = prompts.grader_prompt(TASK, "An answer with {braces}.", "Identifies the Via Egnatia.",
                                 native_thinking=native)
    _no_placeholders(text)
    assert f"<prompt>{TASK}</prompt>" in text
    assert "<response>An answer with {braces}.</response>" in text
    assert "<rubric>Identifies the Via Egnatia.</rubric>" in text
    assert "<score>" in text and "0 or 1" in text and "unsure, score 0" in text
    assert ("<think>" in text) is (not native)  # native thinkers are not told to write <think>


@pytest.mark.parametrize("gate", list(prompts.GATES))
def test_gate_prompts_render_with_few_shot_examples(gate):
    text = prompts.gate_prompt(gate, TASK, DOC)
    _no_placeholders(text)
    assert text.rstrip().endswith(f"<task_prompt>{TASK}</task_prompt>")
    examples = text[text.index("Examples"):text.index("Now grade:")]
    scores = re.findall(r"<score>([01])</score>", examples)
    assert 3 <= len(scores) <= 4 and set(scores) == {"0", "1"}
    assert examples.count("<think>") == len(scores) and examples.count("<task_prompt>") == len(scores)
    # each few-shot reply parses as a valid reply would
    for reply in re.findall(r"<think>.*?</think>\s*<score>[01]</score>", examples, re.DOTALL):
        assert parse_score(reply) in (0, 1)


def test_entity_gate_sees_only_the_task_and_relevance_gate_sees_both():
    entity = prompts.gate_prompt("entity_identifiability", TASK, DOC)
    relevance = prompts.gate_prompt("source_relevance", TASK, DOC)
    assert DOC not in entity
    assert f"<source_document>{DOC}</source_document>" in relevance
    assert "Context" in entity or "context" in entity
    assert "acronym" in entity
    assert "does NOT have to be answerable" in relevance and "any document" in relevance


# -- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda: prompts.challenger_prompt(None, "writing", 2, "<search>q</search>"),
    lambda: prompts.challenger_prompt(DOC, "writing", 2, None),
    lambda: prompts.challenger_prompt(DOC, "poetry", 2, "<search>q</search>"),
    lambda: prompts.challenger_prompt(DOC, "writing", 0, "<search>q</search>"),
    lambda: prompts.challenger_after_search(None),
    lambda: prompts.challenger_malformed(-1),
    lambda: prompts.solver_prompt(None, 3, "<search>q</search>", "below"),
    lambda: prompts.solver_prompt(TASK, 3, "<search>q</search>", None),
    lambda: prompts.solver_malformed(2, None),
    lambda: prompts.rubric_prompt("writing", None, [DOC]),
    lambda: prompts.grader_prompt(TASK, None, "Identifies X."),
    lambda: prompts.gate_prompt("novelty", TASK, DOC),
    lambda: prompts.gate_prompt("source_relevance", TASK, None),
])
def test_missing_or_bad_values_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_missing_placeholder_value_names_it(monkeypatch):
    with pytest.raises(ValueError, match="'solver' needs a value for question"):
        prompts._render("solver", max_search_turns=1, search_example="s", results_description="r",
                        answer_instruction="a", budget_instructions="")


@pytest.mark.parametrize("stage", ["gates", "rubrics", "grading"])
def test_judge_retry_adds_a_corrective_instruction(stage):
    base = prompts.grader_prompt(TASK, "An answer.", "Identifies X.")
    text = prompts.judge_retry(base, stage)
    assert text.startswith(base) and len(text) > len(base)
    assert ("<rubrics>" if stage == "rubrics" else "<score>0</score> or <score>1</score>") in text[len(base):]
