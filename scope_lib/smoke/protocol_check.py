"""Measuring a model on SCOPE's protocol: how much of Algorithm 1's task evaluation parses (tasks, answers,
Judge replies, gates, the difficulty window, reward spread) and, by the scripted teacher's own rules, what the
parsed text says (rubrics naming facts of their source, grades following the answer). This is what the tiny
model's warm start (`scope_lib.tiny`, `scope_lib.smoke.teacher`) is judged by; it lives apart from the teacher so
that editing a measurement does not change the teacher's fingerprint and rebuild cached models.

    rates, evals, graded, trajectories = measure_protocol(params, engine, judge, retriever, documents)
    probe = grader_sensitivity(judge, documents, Names(tokenizer, k))   # do the grades follow the answer?
    grounding = rubric_grounding(judge, documents, Names(tokenizer, k))  # do the rubrics copy the source?
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scope_lib.config import Params
from scope_lib.protocol.dialects import get_dialect
from scope_lib.protocol.facts import Names, mentions
from scope_lib.retrieval.api import Retriever
from scope_lib.retrieval.corpus import Passage
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.rollout import challenger_trajectories, make_challenger_prompts, run_rollouts
from scope_lib.selfplay.tasks import challenger_limits, evaluate_tasks, solver_rewards
from scope_lib.smoke.teacher import rubric_fact


def _share(part: float, whole: float) -> float:
    """part / whole, 0.0 when there is nothing to divide by (no rollouts, no replies)."""
    return part / whole if whole else 0.0


@dataclass
class ProtocolRates:
    """How well a model speaks the protocol over a batch of documents: what the warm start is for."""

    challenger_rollouts: int = 0
    challenger_tasks: int = 0            # rollouts that ended with a parseable <task>
    solver_rollouts: int = 0
    solver_answers: int = 0              # rollouts that ended with a parseable <answer>
    judge: dict[str, dict[str, int]] = field(default_factory=dict)   # stage -> prompts, parsed_first, parsed
    tasks_gated: int = 0                 # tasks with a non-zero format score sent to the gates
    gates_passed: int = 0
    tasks_graded: int = 0                # tasks with rubrics whose Solver rollouts were graded
    tasks_in_window: int = 0             # graded tasks with l <= g-bar <= u
    solver_groups: int = 0
    solver_groups_with_spread: int = 0   # tasks whose Solver rollouts got different rewards R_S
    challenger_groups: int = 0
    challenger_groups_with_spread: int = 0   # prompts whose Challenger rollouts got different rewards R_C
    mean_solver_reward: float = 0.0
    mean_challenger_reward: float = 0.0
    # What the parsed text says, checked by the teacher's own rules (the warm start's content, not its format):
    rubric_facts: int = 0                # rubrics written
    rubric_facts_in_source: int = 0      # rubrics whose fact ("Mentions X.") the source document contains
    grades: int = 0                      # parsed per-rubric verdicts
    grades_agreeing: int = 0             # verdicts equal to the teacher's rule (1 iff the answer holds the fact)
    grades_fact_held: int = 0            # verdicts on an answer that holds the rubric's fact (a reader's 1s)
    answers_searched: int = 0            # Solver answers written after searches that returned results
    answers_citing_results: int = 0      # ... of them naming a fact (not in the task) that those results hold

    @property
    def task_rate(self) -> float:
        return _share(self.challenger_tasks, self.challenger_rollouts)

    @property
    def answer_rate(self) -> float:
        return _share(self.solver_answers, self.solver_rollouts)

    def judge_rate(self, stage: str | None = None, *, first_try: bool = True) -> float:
        """Share of Judge replies that parsed (on the first try, or after the retry), for one stage or all."""
        stages = [stage] if stage else list(self.judge)
        asked = sum(self.judge[s]["prompts"] for s in stages if s in self.judge)
        key = "parsed_first" if first_try else "parsed"
        return _share(sum(self.judge[s][key] for s in stages if s in self.judge), asked)

    def table(self) -> dict[str, Any]:
        """The rates as one row (for a notebook or a benchmark table)."""
        row: dict[str, Any] = {
            "Challenger task rate": round(self.task_rate, 3), "Solver answer rate": round(self.answer_rate, 3),
            "Judge parse rate (first try)": round(self.judge_rate(), 3),
            "gate pass": f"{self.gates_passed}/{self.tasks_gated}",
            "tasks in window": f"{self.tasks_in_window}/{self.tasks_graded}",
            "Solver groups with reward spread": f"{self.solver_groups_with_spread}/{self.solver_groups}",
            "Challenger groups with reward spread": f"{self.challenger_groups_with_spread}/{self.challenger_groups}",
            "mean R_S": round(self.mean_solver_reward, 3), "mean R_C": round(self.mean_challenger_reward, 3),
            "rubric facts in the source": f"{self.rubric_facts_in_source}/{self.rubric_facts}",
            "grades agreeing with the teacher's rule": f"{self.grades_agreeing}/{self.grades}",
            "grades of an answer holding the rubric's fact": f"{self.grades_fact_held}/{self.grades}",
            "answers naming a retrieved fact": f"{self.answers_citing_results}/{self.answers_searched}"}
        for stage in self.judge:
            row[f"Judge {stage} parse rate"] = round(self.judge_rate(stage), 3)
        return row


def measure_protocol(params: Params, policy, judge: Judge, retriever: Retriever, documents: Sequence[Passage], *,
                     group_size: int = 2, seed: int = 0):
    """Run Algorithm 1's task evaluation on `documents` with the run's own pieces (Challenger rollouts in
    groups of `group_size`, gates, rubrics, `selfplay.solver_rollouts_filter` Solver rollouts per task,
    grades, R_C and R_S) and count how much of it parsed. Returns (ProtocolRates, evaluations, graded Solver
    rollouts, Challenger trajectories)."""
    dialect = get_dialect(params.model.dialect, params.model.base)
    sp = params.selfplay
    prompts = make_challenger_prompts(list(documents), sp.task_types, sp.search_turn_strata, seed=seed,
                                      tokenizer=policy.tokenizer, document_max_tokens=sp.document_max_tokens)
    trajectories = challenger_trajectories(prompts, dialect, policy.tokenizer, group_size)
    run_rollouts(trajectories, policy, retriever, dialect, challenger_limits(params))
    before = {stage: (s.prompts, s.retried, s.unparseable) for stage, s in judge.stats.stages.items()}
    evals, graded, _ = evaluate_tasks(trajectories, {p.id: p for p in prompts}, params=params, judge=judge,
                                      solver_engine=policy, retriever=retriever, dialect=dialect,
                                      n_solver=sp.solver_rollouts_filter)
    solver_rewards(graded, params, dialect, policy.tokenizer)
    rates = ProtocolRates(challenger_rollouts=len(trajectories),
                          challenger_tasks=sum(t.task is not None for t in trajectories),
                          solver_rollouts=len(graded), solver_answers=sum(g.trajectory.answer is not None for g in graded))
    for stage, s in judge.stats.stages.items():
        p0, r0, u0 = before.get(stage, (0, 0, 0))
        asked = s.prompts - p0
        rates.judge[stage] = {"prompts": asked, "parsed_first": asked - (s.retried - r0),
                              "parsed": asked - (s.unparseable - u0)}
    lo, hi = sp.difficulty_window
    gated = [e for e in evals if e.task is not None and e.format.total > 0]
    rates.tasks_gated, rates.gates_passed = len(gated), sum(e.gates_passed for e in gated)
    scored = [e for e in evals if e.mean_score is not None]
    rates.tasks_graded = len(scored)
    rates.tasks_in_window = sum(lo <= e.mean_score <= hi for e in scored)
    by_task: dict[str, list[float]] = {}
    for g in graded:
        by_task.setdefault(g.trajectory.meta["challenger_id"], []).append(g.reward)
    rates.solver_groups = len(by_task)
    rates.solver_groups_with_spread = sum(max(v) > min(v) for v in by_task.values())
    rates.mean_solver_reward = _share(sum(g.reward for g in graded), len(graded))
    by_prompt: dict[str, list[float]] = {}
    for traj, e in zip(trajectories, evals, strict=True):
        by_prompt.setdefault(traj.meta["prompt_id"], []).append(e.reward)
    rates.challenger_groups = len(by_prompt)
    rates.challenger_groups_with_spread = sum(max(v) > min(v) for v in by_prompt.values())
    rates.mean_challenger_reward = _share(sum(e.reward for e in evals), len(evals))
    _check_content(rates, evals, graded, {d.id: d.document for d in documents}, Names(policy.tokenizer, params.model.warm_start.fact_max_tokens))
    return rates, evals, graded, trajectories


def _check_content(rates: ProtocolRates, evals, graded, sources: dict[str, str], names: Names) -> None:
    """Count rubrics that name a fact of their source document, verdicts that match the teacher's rule,
    verdicts on answers that hold the rubric's fact (what a grader that reads would score 1), and answers that
    name a fact their own searches retrieved (the Solver copying its evidence)."""
    by_task = {e.challenger_id: e for e in evals}
    for e in evals:
        for rubric in e.rubrics or []:
            rates.rubric_facts += 1
            rates.rubric_facts_in_source += mentions(sources.get(e.document_id, ""), rubric_fact(rubric.text))
    for g in graded:
        traj, e = g.trajectory, by_task[g.trajectory.meta["challenger_id"]]
        for rubric, verdict in zip(e.rubrics or [], g.verdicts, strict=False):
            if verdict is not None:
                held = mentions(traj.answer or "", rubric_fact(rubric.text))
                rates.grades += 1
                rates.grades_fact_held += held
                rates.grades_agreeing += verdict == int(held)
        retrieved = "\n".join(s.results for s in traj.searches if s.valid and s.results)
        if traj.answer is not None and retrieved:
            rates.answers_searched += 1
            facts = names.facts(traj.answer, exclude=names.facts(e.task or ""))
            rates.answers_citing_results += any(mentions(retrieved, f) for f in facts)


@dataclass
class GraderSensitivity:
    """The Judge's grades on controlled pairs: the same answer against a rubric naming a fact it holds and
    one naming a fact it misses. A grader that reads the answer says 1 far more often to the first; one that
    has learned only how often to say 1 says it equally often to both (separation 0)."""

    holds: int = 0          # verdicts parsed for rubrics whose fact the answer holds
    holds_1: int = 0        # ... of them 1
    misses: int = 0         # verdicts parsed for rubrics whose fact the answer misses
    misses_1: int = 0       # ... of them 1
    unparsed: int = 0

    @property
    def rate_holds(self) -> float:
        return _share(self.holds_1, self.holds)

    @property
    def rate_misses(self) -> float:
        return _share(self.misses_1, self.misses)

    @property
    def separation(self) -> float:
        """P(1 | the answer holds the fact) - P(1 | it misses it): 1 for a perfect grader, 0 for a blind one."""
        return self.rate_holds - self.rate_misses

    def table(self) -> dict[str, Any]:
        return {"1s when the answer holds the fact": f"{self.holds_1}/{self.holds}",
                "1s when it misses the fact": f"{self.misses_1}/{self.misses}",
                "separation": round(self.separation, 3), "unparsed": self.unparsed}


@dataclass(frozen=True)
class ProbeCase:
    """One controlled grading case: a task about a document's first fact, an answer in the teacher's form that
    holds its second and third (`held`), and its fourth, which the answer misses (`missing`)."""

    task: str
    answer: str
    held: tuple[str, str]
    missing: str

    @staticmethod
    def rubric(fact: str) -> str:
        """A rubric in the teacher's form naming `fact`."""
        return f"Mentions {fact}."


def probe_case(document: Passage, names: Names) -> ProbeCase | None:
    """The probe case of a document with at least four facts (names, years; `Names.facts`), else None."""
    facts = names.facts(document.document.split("\n", 1)[-1])
    if len(facts) < 4:
        return None
    subject, first, second, missing = facts[:4]
    answer = f"{subject} is linked to {first} and {second}."
    if mentions(answer, missing):   # the same word in another case: not a fact the answer misses
        return None
    return ProbeCase(f"Summarise what is known about {subject}.", answer, (first, second), missing)


def grader_sensitivity(judge: Judge, documents: Sequence[Passage], names: Names, *,
                       repeats: int = 2) -> GraderSensitivity:
    """Grade controlled (task, answer, rubric) triples in one Judge call. For each document with at least four
    facts (names, years; `Names.facts`): a task about its first, an answer in the teacher's form linking it to
    the second and third, and `repeats` x two rubrics in the teacher's form, "Mentions <second or third>."
    (held) and "Mentions <fourth>." (missed). The answers hold exactly the facts the rule says they do, so
    the verdicts measure the grader alone, unlike rollouts, whose answers rarely hold any rubric's fact."""
    triples, held = [], []
    for case in filter(None, (probe_case(doc, names) for doc in documents)):
        for k in range(repeats):
            for fact, holds in ((case.held[k % 2], True), (case.missing, False)):
                triples.append((case.task, case.answer, case.rubric(fact)))
                held.append(holds)
    out = GraderSensitivity()
    verdicts = judge.grade([t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples])
    for holds, verdict in zip(held, verdicts, strict=True):
        if verdict is None:
            out.unparsed += 1
        elif holds:
            out.holds, out.holds_1 = out.holds + 1, out.holds_1 + verdict
        else:
            out.misses, out.misses_1 = out.misses + 1, out.misses_1 + verdict
    return out


@dataclass
class RubricGrounding:
    """The rubric writer on controlled tasks: how many of its rubrics name a fact ("Mentions X.") that the source
    document holds. Copying a fact from the source is reading; a model that does not read names facts from
    elsewhere (the tiny model: frequent names of its training traces) or writes nothing that parses."""

    tasks: int = 0
    unparsed: int = 0        # rubric sets that did not parse (after the Judge's retry)
    rubrics: int = 0
    in_source: int = 0       # ... whose fact the source holds (other than the task's own subject)

    @property
    def rate(self) -> float:
        return _share(self.in_source, self.rubrics)

    def table(self) -> dict[str, Any]:
        return {"rubrics naming a source fact": f"{self.in_source}/{self.rubrics}", "rate": round(self.rate, 3),
                "rubric sets unparsed": f"{self.unparsed}/{self.tasks}"}


def rubric_grounding(judge: Judge, documents: Sequence[Passage], names: Names, *,
                     task_type: str = "summarisation") -> RubricGrounding:
    """Rubrics for the probe task of each document with at least four facts (`probe_case`: "Summarise what is
    known about <its first fact>.") from that document as the source, in one Judge call; counts the rubrics
    whose fact the source holds, other than the subject the task already names (copying that needs no reading
    of the source)."""
    cases = [(doc, case) for doc in documents if (case := probe_case(doc, names)) is not None]
    sets = judge.rubrics([task_type] * len(cases), [case.task for _doc, case in cases],
                         [[doc.document] for doc, _case in cases])
    out = RubricGrounding(tasks=len(cases))
    for (doc, case), rubrics in zip(cases, sets, strict=True):
        if rubrics is None:
            out.unparsed += 1
            continue
        for rubric in rubrics:
            fact = rubric_fact(rubric.text)
            out.rubrics += 1
            out.in_source += mentions(doc.document, fact) and not mentions(case.task, fact)
    return out
