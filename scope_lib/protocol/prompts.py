"""Prompt templates (paper Appendix H) and the functions that fill them.

The templates live in ``scope_lib/protocol/prompts/*.txt`` as `string.Template` text: placeholders are ``$name``,
so the braces of a JSON search example (Qwen3's ``<tool_call>{…}</tool_call>``) pass through untouched, and
a value is never re-read as a template. Each render function fills every placeholder of its template; a
missing value is a ValueError naming the template and the placeholder.

Only the search action differs between model families (Table 11): the Challenger and Solver prompts take
the dialect's `search_example` (and the Solver its `results_description`) from `scope_lib.protocol.dialects`.
Tasks (``<task>``), answers (``<answer>``) and every Judge prompt use the same XML for all models.

| template                         | role       | placeholders                                              |
|----------------------------------|------------|-----------------------------------------------------------|
| challenger                       | Challenger | source_document, task_type_name, task_description,        |
|                                  |            | num_search_turns, search_example                          |
| challenger_after_search          | env        | remaining                                                 |
| challenger_malformed             | env        | remaining                                                 |
| challenger_finish                | env        | —                                                         |
| solver                           | Solver     | question, max_search_turns, search_example,               |
|                                  |            | results_description, answer_instruction,                  |
|                                  |            | budget_instructions                                       |
| solver_answer_paper / _long_form | Solver     | — (the answer instruction: Figure 10's, or long-form)     |
| solver_malformed                 | env        | remaining, search_example                                 |
| rubric_writer                    | Judge      | task_type, task, documents, extra_rules                   |
| rubric_rule_grounding            | Judge      | — (the optional fifth rule, `judge.rubric_prompt`)        |
| judge_retry_score / _rubrics     | Judge      | — (appended to a prompt whose reply did not parse)        |
| grader / grader_native_thinking  | Judge      | task, response, rubric                                    |
| gate_entity_identifiability      | Judge      | task (the task ONLY)                                      |
| gate_source_relevance            | Judge      | source_document, task                                     |
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Any

from scope_lib.protocol.dialects import DIALECTS

__all__ = [
    "TaskTypeSpec", "TASK_TYPES", "GATES", "TEMPLATE_NAMES", "METHOD_TEMPLATE_NAMES", "load_template",
    "render_template", "template_placeholders",
    "template_version", "protocol_fingerprint",
    "challenger_prompt", "challenger_after_search", "challenger_malformed", "challenger_finish",
    "solver_prompt", "solver_malformed", "rubric_prompt", "grader_prompt", "gate_prompt", "format_documents",
    "judge_retry", "SOLVER_PROMPTS", "RUBRIC_PROMPTS",
]


@dataclass(frozen=True)
class TaskTypeSpec:
    """One task type the Challenger can be asked for (App. H, "Task type descriptions")."""

    key: str
    name: str
    description: str
    paper_default: bool = True  # one of the four types the paper trains on (§4.1)


TASK_TYPES: dict[str, TaskTypeSpec] = {spec.key: spec for spec in [
    TaskTypeSpec(
        "long_form_qa", "Long-form QA",
        "A single question about one topic: how something works, why something happened, or what "
        "something is. The answer explains that one topic in connected prose and does not need to be "
        "organised into sections."),
    TaskTypeSpec(
        "summarisation", "Summarisation",
        "Condense or reshape existing material into a shorter or different form, such as an overview, a "
        "brief, a digest or a timeline. The task must rest on source material that the summary is built from."),
    TaskTypeSpec(
        "planning", "Planning",
        "Produce an actionable plan made of concrete steps, with a timeline, milestones or an order of "
        "work that someone could follow."),
    TaskTypeSpec(
        "writing", "Writing",
        "Compose a formal piece with an explicit structure (an introduction, a body and a conclusion), "
        "such as an essay, an article or a report, which may call for citations."),
    TaskTypeSpec(
        "short_form_qa", "Short-form QA",
        "A question with one short answer that can be checked, such as a name, a date, a number or a "
        "brief phrase.",
        paper_default=False),
]}

#: Quality gates QG(q, d) (§3.1) and their templates.
GATES: dict[str, str] = {
    "entity_identifiability": "gate_entity_identifiability",
    "source_relevance": "gate_source_relevance",
}

TEMPLATE_NAMES: tuple[str, ...] = (
    "challenger", "challenger_after_search", "challenger_malformed", "challenger_finish",
    "solver", "solver_answer_paper", "solver_answer_long_form", "solver_malformed", "rubric_writer",
    "rubric_rule_grounding", "grader", "grader_native_thinking", "gate_entity_identifiability",
    "gate_source_relevance", "judge_retry_score", "judge_retry_rubrics", "answerability", "judge_retry_answer",
)
#: The other self-play methods' templates (SPICE, Search Self-Play and SCORE: `protocol.spice`, `protocol.ssp`,
#: `protocol.score`), in prompts/methods/. They stay out of `protocol_fingerprint`, which keys SCOPE's warm starts
#: and held-out sets.
METHOD_TEMPLATE_NAMES: tuple[str, ...] = (
    "spice_challenger", "spice_format_multiple_choice", "spice_format_free_form", "spice_reasoner",
    "spice_format_choice",
    "ssp_proposer", "ssp_solver", "ssp_rag_solver", "ssp_judge", "ssp_judge_retry",
    "score_solver", "score_rubric", "score_evaluator", "score_meta_harness",
)

#: Solver prompt variants (`solver.prompt`): the paper's Figure 10, or a complete long-form answer.
SOLVER_PROMPTS: tuple[str, ...] = ("paper", "long_form")
#: Rubric writer variants (`judge.rubric_prompt`): Figure 12's four rules, or those plus a grounding rule.
RUBRIC_PROMPTS: tuple[str, ...] = ("paper", "grounded")


# -- loading and rendering -----------------------------------------------------------------------------


@functools.cache
def load_template(name: str) -> Template:
    """The template `name` (with or without ".txt") from the package's prompts/ folder (prompts/methods/ for
    METHOD_TEMPLATE_NAMES); cached."""
    stem = name[:-4] if name.endswith(".txt") else name
    if stem not in TEMPLATE_NAMES and stem not in METHOD_TEMPLATE_NAMES:
        raise ValueError(f"unknown prompt template {name!r}; available: "
                         f"{', '.join(TEMPLATE_NAMES + METHOD_TEMPLATE_NAMES)}")
    folder = ("prompts",) if stem in TEMPLATE_NAMES else ("prompts", "methods")
    text = resources.files("scope_lib.protocol").joinpath(*folder, f"{stem}.txt").read_text(encoding="utf-8")
    return Template(text.rstrip("\n"))


def template_version(name: str) -> str:
    """`name@<hash of the template text>`: names the prompt a judge verdict came from (calibration records)."""
    return f"{name}@{hashlib.sha256(load_template(name).template.encode()).hexdigest()[:10]}"


def protocol_fingerprint(digest: Any = None) -> str:
    """A hash of the text protocol every role writes and reads: the prompt templates, the task types and the
    dialects' search syntax (what the learning check's held-out set and the warm start's teacher depend on besides
    their own code). `digest` (a hashlib object, default a new sha256) is updated in place and its hex returned."""
    digest = digest if digest is not None else hashlib.sha256()
    for name in TEMPLATE_NAMES:
        digest.update(name.encode() + b"\0" + load_template(name).template.encode() + b"\0")
    for spec in TASK_TYPES.values():
        digest.update(f"{spec.key}|{spec.name}|{spec.description}".encode())
    for d in DIALECTS.values():
        digest.update(f"{d.name}|{d.search_example}|{d.results_description}|{d.results_role}".encode())
    return digest.hexdigest()


def template_placeholders(name: str) -> list[str]:
    """The placeholder names a template uses, in order of first appearance."""
    template = load_template(name)
    found: list[str] = []
    for match in template.pattern.finditer(template.template):
        key = match.group("named") or match.group("braced")
        if key and key not in found:
            found.append(key)
    return found


def render_template(name: str, **values: Any) -> str:
    """Template `name` with every placeholder filled from `values` (a missing one is a ValueError naming it)."""
    return _render(name, **values)


def _render(name: str, **values: Any) -> str:
    missing = [k for k in template_placeholders(name) if values.get(k) is None]
    if missing:
        raise ValueError(f"prompt template {name!r} needs a value for {', '.join(missing)}")
    try:
        return load_template(name).substitute({k: str(v) for k, v in values.items()})
    except (KeyError, ValueError) as exc:  # a malformed template: say which one
        raise ValueError(f"prompt template {name!r} cannot be rendered: {exc!r}") from None


def _task_type(task_type: str) -> TaskTypeSpec:
    spec = TASK_TYPES.get(task_type) if isinstance(task_type, str) else None
    if spec is None:
        raise ValueError(f"unknown task type {task_type!r}; choose one of {', '.join(TASK_TYPES)}")
    return spec


def _count(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return value


# -- Challenger (App. H, Figure 9) ------------------------------------------------------------------------


def challenger_prompt(source_document: str, task_type: str, num_search_turns: int, search_example: str) -> str:
    """The Challenger's first user message: the source document d, the task type, and exactly N searches."""
    spec = _task_type(task_type)
    return _render("challenger", source_document=_text("source_document", source_document),
                   task_type_name=spec.name, task_description=spec.description,
                   num_search_turns=_count("num_search_turns", num_search_turns, 1),
                   search_example=_text("search_example", search_example))


def challenger_after_search(remaining: int) -> str:
    """Environment note after a search while searches remain: follow a new named entity from the results."""
    return _render("challenger_after_search", remaining=_count("remaining", remaining))


def challenger_malformed(remaining: int) -> str:
    """Environment note after a malformed action: it was not run; use exactly the search format."""
    return _render("challenger_malformed", remaining=_count("remaining", remaining))


def challenger_finish() -> str:
    """Environment note after the last search: write the final task."""
    return _render("challenger_finish")


# -- Solver (App. H, Figure 10) -----------------------------------------------------------------------------


def solver_prompt(question: str, max_search_turns: int, search_example: str, results_description: str,
                  budget_instructions: str = "", variant: str = "paper") -> str:
    """The Solver's user message (Figure 10). `variant` "paper" keeps the figure's instruction to answer
    "without detailed illustrations"; "long_form" asks instead for a complete answer in the form the task
    requests (the paper's phrase contradicts long-form tasks; official-implementation facts §11.10)."""
    if variant not in SOLVER_PROMPTS:
        raise ValueError(f"unknown Solver prompt {variant!r}; choose one of {', '.join(SOLVER_PROMPTS)}")
    budget = _text("budget_instructions", budget_instructions).strip()
    return _render("solver", question=_text("question", question),
                   max_search_turns=_count("max_search_turns", max_search_turns),
                   search_example=_text("search_example", search_example),
                   results_description=_text("results_description", results_description),
                   answer_instruction=_render(f"solver_answer_{variant}"),
                   budget_instructions=f" {budget}" if budget else "")


def solver_malformed(remaining: int, search_example: str) -> str:
    """Environment note after a malformed Solver action: it was not run; how to search or answer."""
    return _render("solver_malformed", remaining=_count("remaining", remaining),
                   search_example=_text("search_example", search_example))


# -- Judge (App. H, Figures 11-14) ---------------------------------------------------------------------------


def format_documents(documents: list[str]) -> str:
    """Context documents for the rubric writer, numbered and separated by blank lines."""
    docs = [d.strip() for d in documents if isinstance(d, str) and d.strip()]
    if not docs:
        return "(no documents)"
    return "\n\n".join(f"Document {i}:\n{d}" for i, d in enumerate(docs, 1))


def rubric_prompt(task_type: str, task: str, documents: list[str], variant: str = "paper") -> str:
    """The rubric writer's prompt (Figure 12): 3-5 rubrics from the task and its context documents (the
    source document d; plus retrieved evidence when `judge.rubric_context` asks for it). `variant`
    "paper" has the figure's four rules; "grounded" adds a fifth asking for the documents' concrete facts."""
    if isinstance(documents, str) or not isinstance(documents, list | tuple):
        raise ValueError(f"documents must be a list of strings, got {type(documents).__name__}")
    if variant not in RUBRIC_PROMPTS:
        raise ValueError(f"unknown rubric prompt {variant!r}; choose one of {', '.join(RUBRIC_PROMPTS)}")
    extra = "\n" + _render("rubric_rule_grounding") if variant == "grounded" else ""
    return _render("rubric_writer", task_type=_task_type(task_type).name, task=_text("task", task),
                   documents=format_documents(list(documents)), extra_rules=extra)


def judge_retry(prompt: str, stage: str) -> str:
    """`prompt` with the corrective instruction for a reply that did not parse: only the required tag."""
    name = {"rubrics": "judge_retry_rubrics", "answerability": "judge_retry_answer",
            "answer_match": "ssp_judge_retry"}.get(stage, "judge_retry_score")
    return f"{_text('prompt', prompt)}\n\n{_render(name)}"


def grader_prompt(task: str, response: str, rubric: str, native_thinking: bool = False) -> str:
    """The strict binary grader for ONE rubric. `native_thinking` drops the <think> instruction for models
    that think on their own (Qwen3)."""
    name = "grader_native_thinking" if native_thinking else "grader"
    return _render(name, task=_text("task", task), response=_text("response", response),
                   rubric=_text("rubric", rubric))


def answerability_prompt(task: str, documents: list[str]) -> str:
    """The answerability gate's prompt (Search Self-Play's RAG check, an option): answer the task from these
    documents alone (the Challenger's retrieved ones mixed with noise), without searching."""
    return _render("answerability", task=_text("task", task), documents=format_documents(list(documents)))


def gate_prompt(gate: str, task: str, source_document: str) -> str:
    """A quality-gate prompt. Entity identifiability sees the task only; source relevance sees both."""
    if gate not in GATES:
        raise ValueError(f"unknown gate {gate!r}; choose one of {', '.join(GATES)}")
    if gate == "entity_identifiability":
        return _render(GATES[gate], task=_text("task", task))
    return _render(GATES[gate], task=_text("task", task),
                   source_document=_text("source_document", source_document))
