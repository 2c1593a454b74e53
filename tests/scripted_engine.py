"""A test double of the generation engine that follows the SCOPE protocol.

It reads each decoded context, recognises the role from the prompt templates, and writes what a
well-behaved model would: the Challenger searches real entities named in the retrieved passages and then
writes a task naming them; the Solver searches and answers with facts from its results; the Judge gates,
writes rubrics about the task's entities, grades a rubric 1 when the answer names its entity, and (the
answerability gate) answers a task without searching by naming those of its entities its documents mention. Token
ids are the tokenizer's encoding of that text, so masks and budgets are checked for real.

Only for tests: it drives the pipeline's logic; it is never the product.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from scope_lib.models.engine import Completion, Sampling
from scope_lib.protocol.dialects import Dialect
from scope_lib.protocol.prompts import load_template

_TITLE = re.compile(r"Doc \d+ \(Title: (.+)\)\n")


def _opening(name: str) -> str:
    return load_template(name).template.strip().splitlines()[0][:60]


def _rest_of_turn(text: str, context: str) -> str:
    """What is left to write of `text` when the context already holds the start of it: a turn that stopped inside
    thinking and continues from its own tokens (the rollout's next round) gets the rest, not the whole turn again."""
    written = context.rsplit("<|im_start|>assistant\n", 1)[-1] if "<|im_start|>assistant\n" in context else ""
    return text[len(written):] if written and text.startswith(written) else text


class ScriptedEngine:
    """Engine protocol: `generate(prompt_token_ids, sampling, adapter=None) -> list[Completion]`."""

    name = "scripted"

    def __init__(self, tokenizer, dialect: Dialect, *, solver_searches: int = 1,
                 override: Callable[[str, str], str | None] | None = None):
        self.tokenizer = tokenizer
        self.dialect = dialect
        self.solver_searches = solver_searches
        self.override = override          # (role, context) -> text to write instead, or None
        self.calls = 0
        self.batch_sizes: list[int] = []
        self.roles: list[str] = []
        self.markers = {role: _opening(name) for role, name in [
            ("challenger", "challenger"), ("solver", "solver"), ("rubrics", "rubric_writer"),
            ("grader", "grader"), ("gate_entity", "gate_entity_identifiability"),
            ("gate_source", "gate_source_relevance"), ("answerability", "answerability")]}

    # -- engine protocol ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling, adapter: str | None = None):
        self.calls += 1
        self.batch_sizes.append(len(prompt_token_ids))
        out = []
        for ids in prompt_token_ids:
            context = self.tokenizer.decode(ids)
            role = self.role(context)
            self.roles.append(role)
            text = (self.override(role, context) if self.override else None)
            if text is None:
                text = getattr(self, f"_{role}")(context)
            out.append(self._complete(_rest_of_turn(text, context), sampling))
        return out

    def _complete(self, text: str, sampling: Sampling) -> Completion:
        finish = "eos"
        cut = [text.find(s) + len(s) for s in sampling.stop if s in text]
        if cut:
            text, finish = text[:min(cut)], "stop"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[:sampling.max_new_tokens], "length"
        return Completion(token_ids=ids, text=self.tokenizer.decode(ids), logprobs=[-1.0] * len(ids),
                          finish_reason=finish)

    def role(self, context: str) -> str:
        first_user = context.split("<|im_start|>user\n", 1)[-1]
        for role, marker in self.markers.items():
            if first_user.startswith(marker):
                return role
        return "unknown"

    # -- roles -------------------------------------------------------------------------------------
    def _turns_so_far(self, context: str) -> int:
        return context.count("<|im_start|>assistant") - 1

    def _searched(self, context: str) -> list[str]:
        return [a.query for a in map(self.dialect.parse_search, context.split("<|im_start|>assistant")[1:])
                if a.valid]

    def _latest_titles(self, context: str) -> list[str]:
        last_env = context.rsplit("<|im_start|>assistant", 2)[-2] if self._turns_so_far(context) else context
        return _TITLE.findall(last_env)

    def _challenger(self, context: str) -> str:
        expected = int(re.search(r"exactly \*\*(\d+)\*\*", context).group(1))
        searched = self._searched(context)
        if len(searched) < expected:
            if searched:
                seen = self._latest_titles(context)
                candidates = [t for t in seen if t not in searched] or seen
            else:
                candidates = re.findall(r"\(Title: (.+)\)\n", context)
            entity = candidates[0] if candidates else f"topic {len(searched)}"
            return (f"<think>The results name {entity}; I will follow it.</think>\n"
                    f"{self.dialect.format_search(entity)}")
        names = " and ".join(searched)
        return ("<think>Task check: every search contributed a fact; entities are named in full.</think>\n"
                f"<task>Explain how {names} are connected, citing what each search revealed. "
                "Answer in two paragraphs.</task>")

    def _solver(self, context: str) -> str:
        question = context.split("Question:", 1)[-1].split("<|im_end|>", 1)[0].strip()
        searched = self._searched(context)
        if len(searched) < self.solver_searches:
            query = question.split(" are connected", 1)[0].removeprefix("Explain how ")[:80] or "history"
            return f"<think>I need facts about this.</think>\n{self.dialect.format_search(query)}"
        found = _TITLE.findall(context)
        return ("<think>I have enough information.</think>\n"
                f"<answer>The sources discuss {', '.join(found[:2]) or 'nothing useful'}.</answer>")

    def _rubrics(self, context: str) -> str:
        task = context.split("## Task Prompt", 1)[-1].split("##", 1)[0]
        names = task.split("Explain how ", 1)[-1].split(" are connected", 1)[0].split(" and ")
        names = [n.strip() for n in names if n.strip()][:3]
        while len(names) < 3:
            names.append("the source document")
        rubrics = "".join(f'<rubric priority="critical">Identifies {n} by name.</rubric>' for n in names)
        return f"<think>Rubrics from the task's entities.</think>\n<rubrics>{rubrics}</rubrics>"

    def _grader(self, context: str) -> str:
        response = context.split("<response>", 1)[-1].split("</response>", 1)[0]
        rubric = context.split("<rubric>", 1)[-1].split("</rubric>", 1)[0]
        entity = rubric.removeprefix("Identifies ").removesuffix(" by name.")
        return f"<think>Checking for {entity}.</think>\n<score>{int(entity in response)}</score>"

    def _gate_entity(self, context: str) -> str:
        return "<think>Entities are named in full.</think>\n<score>1</score>"

    def _gate_source(self, context: str) -> str:
        return "<think>The task follows the source.</think>\n<score>1</score>"

    def _answerability(self, context: str) -> str:
        documents = context.split("<documents>", 1)[-1].split("</documents>", 1)[0]
        task = context.split("<task>", 1)[-1].split("</task>", 1)[0]
        names = task.split("Explain how ", 1)[-1].split(" are connected", 1)[0].split(" and ")
        found = [n.strip() for n in names if n.strip() and n.strip() in documents]
        return f"<answer>The documents mention {', '.join(found) or 'none of them'}.</answer>"

    def _unknown(self, context: str) -> str:
        return "I do not know what to do."


def scripted_run_params(data_dir, runs_dir, **overrides):
    """The smoke params with turn and Judge budgets roomy enough for the scripted engine's replies (hashing
    embedder, no model download); `overrides` are more dotted keys."""
    from pathlib import Path

    from scope_lib.config import load_params

    return load_params(Path(__file__).resolve().parents[1] / "params" / "smoke.yaml", {
        "run.runs_dir": str(runs_dir), "run.data_dir": str(data_dir),
        "retrieval.embedder": "hashing", "challenger.max_new_tokens_per_turn": 256,
        "challenger.max_response_tokens": 4096, "solver.max_new_tokens_per_turn": 256,
        "solver.max_response_tokens": 4096, "retrieval.max_result_tokens": 200,
        "judge.rubric_max_tokens": 512, "judge.gate_max_tokens": 64, "judge.grading_max_tokens": 64, **overrides})
