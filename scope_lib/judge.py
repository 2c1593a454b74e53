"""The frozen Judge J = M0 (paper §3.1, Appendix G, H): quality gates, rubric writing, per-rubric grading.

Each stage is ONE batched engine call over every prompt of the batch. Replies that do not parse are asked
once more, together in a second call; what still does not parse counts as a failed gate, a task without
rubrics, or a 0 verdict, and is reported in `JudgeStats`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from scope_lib import parsing, prompts
from scope_lib.config import JudgeConfig
from scope_lib.engines import Engine, Sampling
from scope_lib.parsing import Rubric

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class StageStats:
    prompts: int = 0
    calls: int = 0
    retried: int = 0
    unparseable: int = 0
    examples: list[str] = field(default_factory=list)  # a few raw replies that did not parse


@dataclass
class JudgeStats:
    """Per stage (gates, rubrics, grading): prompts, engine calls, retries, replies that never parsed."""

    stages: dict[str, StageStats] = field(default_factory=dict)

    def stage(self, name: str) -> StageStats:
        return self.stages.setdefault(name, StageStats())

    def table(self) -> list[dict[str, Any]]:
        return [{"stage": k, "prompts": v.prompts, "engine calls": v.calls, "retried": v.retried,
                 "unparseable": v.unparseable} for k, v in self.stages.items()]


@dataclass(frozen=True)
class GateOutcome:
    """The quality gate QG(q, d): one verdict per gate (None = unparseable, counted as a fail)."""

    verdicts: dict[str, int | None]

    @property
    def passed(self) -> bool:
        return all(v == 1 for v in self.verdicts.values())


class Judge:
    """Gates, rubrics and grades from frozen models. `engine` serves every stage unless a stage has its own
    (the paper's judge-scaling analysis uses different rubric writers and graders)."""

    def __init__(self, engine: Engine, cfg: JudgeConfig, *, native_thinking: bool = False,
                 rubric_engine: Engine | None = None, grader_engine: Engine | None = None):
        self.cfg = cfg
        self.gate_engine = engine
        self.rubric_engine = rubric_engine or engine
        self.grader_engine = grader_engine or engine
        self.native_thinking = cfg.native_thinking if cfg.native_thinking is not None else native_thinking
        self.stats = JudgeStats()

    # -- the three stages --------------------------------------------------------------------------
    def gates(self, tasks: list[str], source_documents: list[str]) -> list[GateOutcome]:
        """Every configured gate for every task, in one call."""
        gates = list(self.cfg.gates)
        texts = [prompts.gate_prompt(g, task, doc)
                 for task, doc in zip(tasks, source_documents, strict=True) for g in gates]
        sampling = self._sampling(self.cfg.gate_max_tokens, self.cfg.gate_temperature, "</score>")
        scores = self._run("gates", self.gate_engine, texts, sampling, parsing.parse_score)
        return [GateOutcome(dict(zip(gates, scores[i * len(gates):(i + 1) * len(gates)], strict=True)))
                for i in range(len(tasks))]

    def rubrics(self, task_types: list[str], tasks: list[str], documents: list[list[str]]) -> list[list[Rubric] | None]:
        """3-5 rubrics per task from its context documents (the source, or source + evidence), in one call."""
        texts = [prompts.rubric_prompt(tt, task, docs)
                 for tt, task, docs in zip(task_types, tasks, documents, strict=True)]
        sampling = self._sampling(self.cfg.rubric_max_tokens, self.cfg.rubric_temperature, "</rubrics>")

        def parse(reply: str) -> list[Rubric] | None:
            return parsing.parse_rubrics(reply, self.cfg.min_rubrics, self.cfg.max_rubrics)

        return self._run("rubrics", self.rubric_engine, texts, sampling, parse)

    def grade(self, tasks: list[str], answers: list[str], rubrics: list[str], *,
              temperature: float | None = None) -> list[int | None]:
        """One binary verdict per (task, answer, rubric) triple, all in one call."""
        texts = [prompts.grader_prompt(t, a, r, native_thinking=self.native_thinking)
                 for t, a, r in zip(tasks, answers, rubrics, strict=True)]
        temp = self.cfg.grading_temperature if temperature is None else temperature
        sampling = self._sampling(self.cfg.grading_max_tokens, temp, "</score>")
        return self._run("grading", self.grader_engine, texts, sampling, parsing.parse_score)

    def rubric_weights(self, rubrics: list[Rubric]) -> list[float] | None:
        """w_k of eq. 1: None (uniform, the paper) or by priority."""
        if self.cfg.rubric_weights == "uniform":
            return None
        return [self.cfg.priority_weights.get(r.priority, 1.0) for r in rubrics]

    # -- machinery ---------------------------------------------------------------------------------
    def _sampling(self, max_tokens: int, temperature: float, stop: str) -> Sampling:
        # A thinking model may write the closing tag inside its thinking: let it finish instead.
        stops = () if self.native_thinking else (stop,)
        return Sampling(max_new_tokens=max_tokens, temperature=temperature, stop=stops, logprobs=False)

    def _run(self, stage: str, engine: Engine, texts: list[str], sampling: Sampling,
             parse: Callable[[str], T | None]) -> list[T | None]:
        stats = self.stats.stage(stage)
        stats.prompts += len(texts)
        if not texts:
            return []
        ids = [_encode_user(engine.tokenizer, t) for t in texts]
        replies = [c.text for c in engine.generate(ids, sampling)]
        stats.calls += 1
        results = [parse(r) for r in replies]
        todo = [i for i, r in enumerate(results) if r is None]
        for _attempt in range(self.cfg.parse_retries):
            if not todo:
                break
            stats.retried += len(todo)
            again = engine.generate([ids[i] for i in todo], sampling)
            stats.calls += 1
            for i, completion in zip(todo, again, strict=True):
                replies[i] = completion.text
                results[i] = parse(completion.text)
            todo = [i for i in todo if results[i] is None]
        stats.unparseable += len(todo)
        stats.examples.extend(replies[i][:500] for i in todo[: max(0, 3 - len(stats.examples))])
        if todo:
            log.info("judge %s: %d of %d replies unparseable after %d retry(ies)", stage, len(todo), len(texts),
                     self.cfg.parse_retries)
        return results


def _encode_user(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
