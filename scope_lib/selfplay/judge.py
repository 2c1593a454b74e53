"""The frozen Judge J = M0 (paper §3.1, Appendix G, H): quality gates, rubric writing, per-rubric grading.

Each stage is ONE batched engine call over every prompt of the batch. Replies that do not parse are asked
again, together in one more call, with a short corrective instruction (reply with only the required tag);
what still does not parse counts as a failed gate, a task without rubrics, or a 0 verdict, and is reported
in `JudgeStats` (with how many replies the retry rescued).

The `answerability` gate (an option: Search Self-Play's RAG check) is a fourth call on the gate model, made
after the rubrics exist: `answer` writes one no-search answer per task, which `grade` then scores against the
task's rubrics (`scope_lib.selfplay.tasks.answerability_check`).

`answers_match` is Search Self-Play's LLM-as-a-judge (App. E): one Correct/Wrong per (question, predicted answer,
ground truth), all in one call on the grader's model (`ssp.answer_check: judge`).

`judge.gates_by` (an option) decides the two prompt gates by word rules instead (`protocol.gate_rules`), or by the
rules first and the Judge only for the tasks they pass (`rules_then_judge`: fewer gate prompts).

Whether a Judge model thinks natively (Qwen3: its own <think> blocks) is decided per stage from that
stage's own model, not the policy's: it picks the grader variant, the stop strings and the gate budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from scope_lib.config import JudgeConfig, Params
from scope_lib.models.engine import Engine, Sampling
from scope_lib.protocol import parsing, prompts, ssp
from scope_lib.protocol.dialects import thinks_natively
from scope_lib.protocol.gate_rules import rule_verdicts
from scope_lib.protocol.parsing import Rubric

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The Judge's three stages, each one batched engine call (plus one retry call).
STAGES: tuple[str, ...] = ("gates", "rubrics", "grading")
#: The gate that is not one prompt per task but an answer graded on the rubrics (Judge.answer + Judge.grade).
ANSWERABILITY = "answerability"
#: Search Self-Play's answer check (Judge.answers_match), a call on the grader's model.
ANSWER_MATCH = "answer_match"
#: Gate reply budgets when `judge.gate_max_tokens` is None (the authors' settings).
GATE_TOKENS_THINKING, GATE_TOKENS_PLAIN = 1024, 256


@dataclass
class StageStats:
    prompts: int = 0
    calls: int = 0
    retried: int = 0
    rescued: int = 0      # replies that parsed only after the corrective retry
    unparseable: int = 0
    seconds: float = 0.0  # wall time of this stage's engine calls
    examples: list[str] = field(default_factory=list)  # a few raw replies that did not parse


@dataclass
class JudgeStats:
    """Per stage (gates, rubrics, grading): prompts, engine calls, retries, replies that never parsed."""

    stages: dict[str, StageStats] = field(default_factory=dict)

    def stage(self, name: str) -> StageStats:
        return self.stages.setdefault(name, StageStats())

    def table(self) -> list[dict[str, Any]]:
        return [{"stage": k, "prompts": v.prompts, "engine calls": v.calls, "retried": v.retried,
                 "rescued by retry": v.rescued, "unparseable": v.unparseable} for k, v in self.stages.items()]

    def totals(self) -> dict[str, float]:
        """Prompts, engine calls, unparseable replies and seconds over every stage (for per-step deltas)."""
        return {"prompts": sum(v.prompts for v in self.stages.values()),
                "calls": sum(v.calls for v in self.stages.values()),
                "unparseable": sum(v.unparseable for v in self.stages.values()),
                "seconds": sum(v.seconds for v in self.stages.values())}

    def parse_failure_rate(self) -> float:
        """Share of Judge replies that never parsed, over every stage (0 when nothing was asked)."""
        asked = sum(v.prompts for v in self.stages.values())
        return sum(v.unparseable for v in self.stages.values()) / asked if asked else 0.0


@dataclass(frozen=True)
class GateOutcome:
    """The quality gate QG(q, d): one verdict per gate (None = unparseable, counted as a fail)."""

    verdicts: dict[str, int | None]

    @property
    def passed(self) -> bool:
        return all(v == 1 for v in self.verdicts.values())


class Judge:
    """Gates, rubrics and grades from frozen models. `engine` serves every stage unless a stage has its own
    (the paper's judge-scaling analysis uses different rubric writers and graders). `native_thinking` is one
    flag for every stage or a {stage: flag} mapping; `judge.native_thinking` in the config overrides it.

    With a `seed`, every call is seeded from the seed, the stage and the prompts themselves, so the same
    batch gets the same replies in any process (a resumed run re-judges exactly as an uninterrupted one)."""

    def __init__(self, engine: Engine, cfg: JudgeConfig, *, native_thinking: bool | dict[str, bool] = False,
                 rubric_engine: Engine | None = None, grader_engine: Engine | None = None,
                 seed: int | None = None):
        self.cfg = cfg
        self.seed = seed
        self.engines = {"gates": engine, "rubrics": rubric_engine or engine, "grading": grader_engine or engine}
        flags = native_thinking if isinstance(native_thinking, dict) else dict.fromkeys(STAGES, native_thinking)
        self.thinking = {stage: bool(cfg.native_thinking if cfg.native_thinking is not None else flags.get(stage))
                         for stage in STAGES}
        self.stats = JudgeStats()

    @property
    def gate_engine(self) -> Engine:
        return self.engines["gates"]

    @property
    def rubric_engine(self) -> Engine:
        return self.engines["rubrics"]

    @property
    def grader_engine(self) -> Engine:
        return self.engines["grading"]

    @property
    def gate_max_tokens(self) -> int:
        if self.cfg.gate_max_tokens is not None:
            return self.cfg.gate_max_tokens
        return GATE_TOKENS_THINKING if self.thinking["gates"] else GATE_TOKENS_PLAIN

    # -- the three stages --------------------------------------------------------------------------
    def gates(self, tasks: list[str], source_documents: list[str]) -> list[GateOutcome]:
        """Every configured prompt gate for every task, decided as `judge.gates_by` says: by the Judge's prompts in
        one call (the paper), by the word rules of `protocol.gate_rules`, or by the rules first and the Judge only
        for the tasks they pass (a task the rules reject costs no Judge call). The answerability gate runs later,
        once the task has rubrics (`answer`)."""
        if self.cfg.gates_by == "judge":
            return self.judge_gates(tasks, source_documents)
        gates = [g for g in self.cfg.gates if g != ANSWERABILITY]
        ruled = [rule_verdicts(task, doc, gates) for task, doc in zip(tasks, source_documents, strict=True)]
        if self.cfg.gates_by == "rules":
            return [GateOutcome(v) for v in ruled]
        asked = [i for i, v in enumerate(ruled) if all(x == 1 for x in v.values())]
        judged = self.judge_gates([tasks[i] for i in asked], [source_documents[i] for i in asked])
        if len(asked) < len(tasks):
            log.info("gates: %d of %d tasks failed the rules, rejected without a Judge call", len(tasks) - len(asked),
                     len(tasks))
        by_task = {i: outcome.verdicts for i, outcome in zip(asked, judged, strict=True)}
        return [GateOutcome(combine_gates(self.cfg.gates_by, v, by_task.get(i))) for i, v in enumerate(ruled)]

    def judge_gates(self, tasks: list[str], source_documents: list[str]) -> list[GateOutcome]:
        """The Judge's verdicts on every configured prompt gate for every task, in one call (the paper's gates,
        whatever `judge.gates_by` says: the gate probe also measures the Judge alone)."""
        gates = [g for g in self.cfg.gates if g != ANSWERABILITY]
        texts = [prompts.gate_prompt(g, task, doc)
                 for task, doc in zip(tasks, source_documents, strict=True) for g in gates]
        sampling = self._sampling("gates", self.gate_max_tokens, self.cfg.gate_temperature, "</score>")
        scores = self._run("gates", texts, sampling, parsing.parse_score)
        return [GateOutcome(dict(zip(gates, scores[i * len(gates):(i + 1) * len(gates)], strict=True)))
                for i in range(len(tasks))]

    def rubrics(self, task_types: list[str], tasks: list[str], documents: list[list[str]]) -> list[list[Rubric] | None]:
        """3-5 rubrics per task from its context documents (the source, or source + evidence), in one call."""
        texts = [prompts.rubric_prompt(tt, task, docs, variant=self.cfg.rubric_prompt)
                 for tt, task, docs in zip(task_types, tasks, documents, strict=True)]
        sampling = self._sampling("rubrics", self.cfg.rubric_max_tokens, self.cfg.rubric_temperature, "</rubrics>")

        def parse(reply: str) -> list[Rubric] | None:
            return parsing.parse_rubrics(reply, self.cfg.min_rubrics, self.cfg.max_rubrics,
                                         distinct=self.cfg.distinct_rubrics)

        return self._run("rubrics", texts, sampling, parse)

    def grade(self, tasks: list[str], answers: list[str], rubrics: list[str], *,
              temperature: float | None = None) -> list[int | None]:
        """One binary verdict per (task, answer, rubric) triple, all in one call."""
        texts = [prompts.grader_prompt(t, a, r, native_thinking=self.thinking["grading"])
                 for t, a, r in zip(tasks, answers, rubrics, strict=True)]
        temp = self.cfg.grading_temperature if temperature is None else temperature
        sampling = self._sampling("grading", self.cfg.grading_max_tokens, temp, "</score>")
        return self._run("grading", texts, sampling, parsing.parse_score)

    def answer(self, tasks: list[str], documents: list[list[str]]) -> list[str | None]:
        """The answerability gate's answers: each task answered from its documents alone, no search, in one call
        (None = no parseable <answer>)."""
        texts = [prompts.answerability_prompt(task, docs) for task, docs in zip(tasks, documents, strict=True)]
        sampling = self._sampling(ANSWERABILITY, self.cfg.answerability_max_tokens, self.cfg.gate_temperature,
                                  "</answer>")
        return self._run(ANSWERABILITY, texts, sampling, parsing.extract_answer)

    def answers_match(self, questions: list[str], predictions: list[str], references: list[str]
                      ) -> list[int | None]:
        """Search Self-Play's r(a, a*) by the LLM judge (§3.2, App. E): 1 (Correct) or 0 (Wrong) per (question,
        predicted answer, ground-truth answer), all in one call on the grader's model at its temperature and budget
        (None = unparseable after the retries, counted in the `answer_match` stage's stats)."""
        texts = [ssp.judge_prompt(q, p, r) for q, p, r in zip(questions, predictions, references, strict=True)]
        sampling = self._sampling(ANSWER_MATCH, self.cfg.grading_max_tokens, self.cfg.grading_temperature, None)
        return self._run(ANSWER_MATCH, texts, sampling, parsing.parse_correct_wrong)

    def rubric_weights(self, rubrics: list[Rubric]) -> list[float] | None:
        """w_k of eq. 1: None (uniform, the paper) or by priority."""
        if self.cfg.rubric_weights == "uniform":
            return None
        return [self.cfg.priority_weights.get(r.priority, 1.0) for r in rubrics]

    # -- machinery ---------------------------------------------------------------------------------
    def _sampling(self, stage: str, max_tokens: int, temperature: float, stop: str | None) -> Sampling:
        # A thinking model may write the closing tag inside its thinking: let it finish instead.
        stops = () if self.thinking[_model_stage(stage)] or stop is None else (stop,)
        return Sampling(max_new_tokens=max_tokens, temperature=temperature, stop=stops, logprobs=False)

    def _seeded(self, sampling: Sampling, stage: str, texts: list[str]) -> Sampling:
        if self.seed is None:
            return sampling
        digest = hashlib.sha256(f"{self.seed}|{stage}".encode())
        for text in texts:
            digest.update(text.encode("utf-8", "replace") + b"\0")
        return dataclasses.replace(sampling, seed=int.from_bytes(digest.digest()[:4], "little"))

    def _run(self, stage: str, texts: list[str], sampling: Sampling,
             parse: Callable[[str], T | None]) -> list[T | None]:
        engine = self.engines[_model_stage(stage)]
        stats = self.stats.stage(stage)
        stats.prompts += len(texts)
        if not texts:
            return []
        started = time.perf_counter()
        replies = [c.text for c in engine.generate([_encode_user(engine.tokenizer, t) for t in texts],
                                                   self._seeded(sampling, stage, texts))]
        stats.calls += 1
        results = [parse(r) for r in replies]
        todo = [i for i, r in enumerate(results) if r is None]
        for _attempt in range(self.cfg.parse_retries):
            if not todo:
                break
            stats.retried += len(todo)
            retry_texts = [prompts.judge_retry(texts[i], stage) for i in todo]
            again = engine.generate([_encode_user(engine.tokenizer, t) for t in retry_texts],
                                    self._seeded(sampling, stage, retry_texts))
            stats.calls += 1
            for i, completion in zip(todo, again, strict=True):
                replies[i] = completion.text
                results[i] = parse(completion.text)
            stats.rescued += sum(results[i] is not None for i in todo)
            todo = [i for i in todo if results[i] is None]
        stats.unparseable += len(todo)
        stats.seconds += time.perf_counter() - started
        stats.examples.extend(replies[i][:500] for i in todo[: max(0, 3 - len(stats.examples))])
        if todo:
            log.info("judge %s: %d of %d replies unparseable after %d retry(ies)", stage, len(todo), len(texts),
                     self.cfg.parse_retries)
        return results


def combine_gates(gates_by: str, rules: dict[str, int], judged: dict[str, int | None] | None
                  ) -> dict[str, int | None]:
    """One task's gate verdicts under `judge.gates_by`, from the rules' verdicts and the Judge's (None: the Judge was
    not asked). 'rules_then_judge': a task that fails any rule keeps the rules' verdicts (the Judge is not asked);
    one that passes them all gets the Judge's."""
    if gates_by == "rules" or (gates_by == "rules_then_judge" and not all(v == 1 for v in rules.values())):
        return dict(rules)
    if judged is None:
        raise ValueError(f"judge.gates_by {gates_by!r} needs the Judge's verdicts for a task the rules pass")
    return dict(judged)


def _model_stage(stage: str) -> str:
    """The stage whose model (engine, thinking) serves a call: the answerability gate's answers come from the
    gate model, Search Self-Play's answer checks from the grader's."""
    return {ANSWERABILITY: "gates", ANSWER_MATCH: "grading"}.get(stage, stage)


def judge_models(params: Params) -> dict[str, str]:
    """The model behind each stage: `judge.model` (None = M0) unless `judge.rubric_model` /
    `judge.grader_model` names another."""
    j = params.judge
    main = j.model or params.model.base
    return {"gates": main, "rubrics": j.rubric_model or main, "grading": j.grader_model or main}


def make_judge(params: Params, engine_for: Callable[[str], Engine]) -> Judge:
    """The Judge of a run: each stage on `engine_for(its model)`, thinking natively when its own model does."""
    models = judge_models(params)
    return Judge(engine_for(models["gates"]), params.judge,
                 native_thinking={stage: thinks_natively(name) for stage, name in models.items()},
                 rubric_engine=engine_for(models["rubrics"]), grader_engine=engine_for(models["grading"]),
                 seed=params.selfplay.seed)


def _encode_user(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
