"""The scripted teacher: protocol traces for the tiny model's warm start (smoke demos only; not in the paper).

A random tiny model writes nothing parseable, so a CPU smoke run shows zeros. The warm start (`scope_lib.smoke.warm_start`)
fine-tunes it on traces that this teacher writes from the corpus, for every role SCOPE has:

- Challenger: search for an entity (the source document's title or a name in its text, then a title from
  the previous results), ..., then a task of the requested type naming what was searched.
- Solver: search for a name from the task, ..., then an answer built from retrieved sentences.
- Judge: gate verdicts, three rubrics with priorities (each naming one fact of the source document), and one
  `<score>` per (answer, rubric) that is 1 exactly when the answer contains the rubric's fact.

The replies are as plain as the protocol allows (no <think> blocks, bare `<score>` verdicts, the fewest rubrics
the paper permits): what a model of a few hundred thousand weights learns reliably in minutes on a CPU.

Every example is made by the library itself: the teacher is an `Engine` that the real rollout loop
(`rollout.run_rollouts`, over a real retrieval index) and the real `Judge` call, so the contexts it is trained on
are token for token the ones the warmed model gets at run time (prompt templates, chat template, dialect, the
environment's between-turn messages, result formatting and token budgets). The teacher only decides what the
assistant writes, from structured state (the trajectory, its searches and their hits), never by reading the
prompt templates' wording.

The Judge's replies are as faithful as the teacher can make them. The policies' are deliberately mixed in
quality (fewer searches, tasks naming fewer entities, generic tasks, answers holding more or fewer retrieved
facts), so that sampled rollouts of the warmed model differ within a GRPO group and better behaviour earns
more reward: a perfect teacher would leave self-play nothing to improve.

    examples, stats = teacher_examples(tokenizer, corpus_path, params.model.warm_start, index_dir)
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scope_lib.config import Params, WarmStartConfig, validate_params
from scope_lib.models.engine import Completion, Sampling
from scope_lib.protocol import facts, prompts
from scope_lib.protocol.dialects import DIALECTS, Dialect, get_dialect
from scope_lib.protocol.facts import Names, fact_pairs, fact_responses, is_year, mentions
from scope_lib.retrieval.api import Retriever
from scope_lib.retrieval.corpus import Passage, read_corpus, teacher_documents
from scope_lib.retrieval.index import build_or_open_index
from scope_lib.selfplay.judge import ANSWERABILITY, make_judge
from scope_lib.selfplay.rollout import (
    ChallengerPrompt,
    RolloutLimits,
    Trajectory,
    challenger_trajectories,
    make_challenger_prompts,
    new_trajectory,
    run_rollouts,
    solver_messages,
)
from scope_lib.selfplay.tasks import challenger_limits, solver_limits

log = logging.getLogger(__name__)

#: Bump when what the teacher writes changes, so cached warm-started models are rebuilt.
TEACHER_VERSION = 1

#: Judge reply budgets the teacher's replies fit in (params/smoke.yaml's judge.*_max_tokens are these).
GATE_MAX_TOKENS = 32
RUBRIC_MAX_TOKENS = 128
GRADING_MAX_TOKENS = 32
#: ... and with `model.warm_start.grade_reasoning` (params/smollm.yaml's judge.grading_max_tokens), which lists at
#: most GRADE_FACTS facts of the answer.
REASONED_GRADING_MAX_TOKENS = 96
GRADE_FACTS = 5

#: The quality mix of the policies' traces (see the module docstring).
CHALLENGER_TASKS = {"full": 0.6, "partial": 0.25, "generic": 0.15}   # how many searched names the task uses
CHALLENGER_FEWER_SEARCHES = 0.1      # share of Challenger rollouts that write the task one search early
SOLVER_SEARCHES = {0: 0.15, 1: 0.45, 2: 0.4}   # searches before answering (capped at the allowed number)
SOLVER_ANSWER_FACTS = {0: 0.2, 1: 0.5, 2: 0.3}  # retrieved sentences the answer is built from
SOLVER_ROLLOUTS = 2                  # Solver rollouts per task (a GRPO group in the smoke run)
GATE_EXAMPLES_KEPT = 0.5             # share of gate examples trained on (one-token verdicts, long prompts)
SOURCE_MISMATCH_SHARE = 0.15         # extra source-relevance examples pairing a task with another document
NEGATIVE_GRADES_KEPT = 0.3           # share of 0-verdict grades kept (the Solver's answers mostly miss facts)
RUBRICS_PER_TASK = 3                 # the fewest the paper allows: the least a tiny model must write
GOOD_ANSWERS = 3                     # extra grades per task of an answer quoting the rubric's source sentence


class TeacherError(RuntimeError):
    """The teacher could not write a trace that fits the protocol (a bug or an impossible configuration)."""


@dataclass
class Example:
    """One SFT example: the token stream and which tokens are the assistant's (the loss mask)."""

    role: str
    input_ids: list[int]
    completion_mask: list[int]


@dataclass
class TeacherStats:
    """What the teacher wrote: examples and tokens per role, and how its Challenger tasks fared."""

    documents: int = 0
    examples: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, list[int]] = field(default_factory=dict)   # stage -> [n0, n1]

    def add(self, example: Example) -> None:
        r = example.role
        self.examples[r] = self.examples.get(r, 0) + 1
        self.tokens[r] = self.tokens.get(r, 0) + len(example.input_ids)
        self.completion_tokens[r] = self.completion_tokens.get(r, 0) + sum(example.completion_mask)

    def count(self, stage: str, verdict: int) -> None:
        self.verdicts.setdefault(stage, [0, 0])[verdict] += 1


def title_words(title: str) -> list[str]:
    return [w.strip(",.()") for w in title.split()]


#: The teacher's reasoning, one fixed sentence per kind of turn. Names appear only where the protocol needs
#: them (search queries, tasks, answers, rubrics), each followed by text its own few preceding tokens decide,
#: which is what a tiny model can learn to continue.
THINK = {
    "challenger_source": "Search the document.",
    "challenger_results": "Search the results.",
    "challenger_task": "Write the task.",
    "solver_search": "Search the question.",
    "solver_answer": "Answer from the results.",
    "solver_guess": "Answer briefly.",
}


#: Whether the policies' turns open with a <think> block. Off: a model of a few hundred thousand weights learns
#: the bare protocol (search, task, answer) far more reliably, at the cost of the format score's think credit.
POLICY_THINKS = False


def _think(kind: str) -> str:
    return f"<think>{THINK[kind]}</think>\n" if POLICY_THINKS else ""


# -- the engine ----------------------------------------------------------------------------------------


class TeacherEngine:
    """An `Engine` whose "sampling" is the teacher writing. Two modes:

    - `script(trajectories, write, limits)`: inside `run_rollouts`; each context is matched to its live
      trajectory and `write(trajectory, budget)` gives the turn's text (budget = the turn's token budget).
    - `queue(replies)`: inside a `Judge` stage; the replies are returned in prompt order, and every
      (prompt ids, reply ids) pair is kept in `judge_examples`.

    Completions are the tokenizer's encoding of the text (what the warmed model learns to write), ending at
    the stop string the text ends with. Text that does not fit its budget is a TeacherError.
    """

    name = "teacher"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0
        self._trajectories: list[Trajectory] | None = None
        self._write: Callable[[Trajectory, int], str] | None = None
        self._limits: RolloutLimits | None = None
        self._replies: list[str] | None = None
        self._stage = ""
        self.judge_examples: list[Example] = []

    def script(self, trajectories: list[Trajectory], write: Callable[[Trajectory, int], str],
               limits: RolloutLimits) -> None:
        self._trajectories, self._write, self._limits, self._replies = trajectories, write, limits, None

    def queue(self, stage: str, replies: list[str]) -> None:
        self._replies, self._stage, self._trajectories = list(replies), stage, None

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None = None) -> list[Completion]:
        self.calls += 1
        if self._replies is not None:
            return self._from_queue(prompt_token_ids, sampling)
        if self._trajectories is None or self._write is None or self._limits is None:
            raise TeacherError("TeacherEngine.generate called before script() or queue()")
        live = [t for t in self._trajectories if not t.done]
        if len(live) != len(prompt_token_ids):
            raise TeacherError(f"{len(prompt_token_ids)} contexts for {len(live)} live trajectories")
        out = []
        for traj, context in zip(live, prompt_token_ids, strict=True):
            if context[:len(traj.prompt_ids)] != traj.prompt_ids:
                raise TeacherError(f"context does not continue trajectory {traj.id}")
            lim = self._limits
            budget = min(lim.max_new_tokens_per_turn, lim.max_response_tokens - len(traj.completion_ids),
                         lim.max_model_len - len(context))
            out.append(self._completion(self._write(traj, budget), budget, sampling))
        return out

    def _from_queue(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        replies = self._replies or []
        if len(replies) != len(prompts):
            raise TeacherError(f"judge stage {self._stage!r}: {len(prompts)} prompts for {len(replies)} replies")
        self._replies = None
        out = []
        for ids, text in zip(prompts, replies, strict=True):
            completion = self._completion(text, sampling.max_new_tokens, sampling)
            out.append(completion)
            self.judge_examples.append(Example(self._stage, list(ids) + completion.token_ids,
                                               [0] * len(ids) + [1] * len(completion.token_ids)))
        return out

    def _completion(self, text: str, budget: int, sampling: Sampling) -> Completion:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > budget:
            raise TeacherError(f"teacher text of {len(ids)} tokens exceeds the budget of {budget}: {text!r}")
        if not any(text.endswith(s) for s in sampling.stop) and sampling.stop:
            raise TeacherError(f"teacher text does not end with a stop string {sampling.stop}: {text!r}")
        return Completion(token_ids=ids, text=self.tokenizer.decode(ids), logprobs=[0.0] * len(ids),
                          finish_reason="stop")


def fit(tokenizer, candidates: Sequence[str], budget: int) -> str:
    """The first candidate text that fits in `budget` tokens (candidates go from richest to plainest)."""
    for text in candidates:
        if len(tokenizer.encode(text, add_special_tokens=False)) <= budget:
            return text
    raise TeacherError(f"no candidate fits in {budget} tokens: {candidates[-1]!r}")


def _shorten(tokenizer, text: str, max_tokens: int) -> str:
    """`text` cut at a word boundary to at most `max_tokens` tokens."""
    words = text.split()
    while words and len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > max_tokens:
        words.pop()
    return " ".join(words).rstrip(",;:")


def _choice(rng: random.Random, weights: dict[Any, float]) -> Any:
    keys = list(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


# -- Challenger ----------------------------------------------------------------------------------------

_TASKS = {
    "long_form_qa": ["Explain in one paragraph the connection between {names}."],
    "summarisation": ["Summarise in a short paragraph what is known about {names}."],
    "planning": ["Plan with a timeline a three-step study of {names}."],
    "writing": ["Write a report with an introduction, body and conclusion on {names}."],
    "short_form_qa": ["Name in a few words the link between {names}."],
}
_GENERIC_TASKS = {
    "long_form_qa": "Explain the main idea of the document, in one paragraph.",
    "summarisation": "Summarise the key points of the document, in a few paragraphs.",
    "planning": "Plan a study of the topic, with a timeline.",
    "writing": "Write an essay on the topic, with an introduction, body and conclusion.",
    "short_form_qa": "Name the main topic, in a few words.",
}


def _join(names: Sequence[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _query(name: str) -> str:
    """A search query for a name, with the leading space it has inside text (the same single token);
    every dialect's parser strips it."""
    return " " + name


@dataclass
class _ChallengerPlan:
    searches: int
    grounding: str
    template: int


class ChallengerTeacher:
    """Writes Challenger turns: N searches, the first for a name in the source document, each next one for a
    name in the previous results that the source does not mention; then a task naming what was searched."""

    def __init__(self, names: Names, dialect: Dialect, prompts: dict[str, ChallengerPrompt],
                 passages: dict[str, Passage], seed: int):
        self.names, self.tokenizer = names, names.tokenizer
        self.dialect, self.prompts, self.passages, self.seed = dialect, prompts, passages, seed
        self.plans: dict[str, _ChallengerPlan] = {}
        self.task_names_used: dict[str, list[str]] = {}

    def plan(self, traj: Trajectory) -> _ChallengerPlan:
        if traj.id not in self.plans:
            rng = random.Random(f"{self.seed}/challenger/{traj.id}")
            n = traj.expected_searches or 1
            fewer = n > 1 and rng.random() < CHALLENGER_FEWER_SEARCHES
            self.plans[traj.id] = _ChallengerPlan(searches=n - 1 if fewer else n,
                                                  grounding=_choice(rng, CHALLENGER_TASKS),
                                                  template=rng.randrange(2))
        return self.plans[traj.id]

    def document(self, traj: Trajectory) -> str:
        return self.prompts[traj.meta["prompt_id"]].document

    def next_query(self, traj: Trajectory) -> tuple[str, str] | None:
        """(name, where it came from) for the next search, or None when nothing is left to follow."""
        document = self.document(traj)
        title, body = document.split("\n", 1) if "\n" in document else ("", document)
        searched = [s.query.strip() for s in traj.searches if s.query]
        if not traj.searches:
            found = self.names.names(body, exclude=title_words(title)) or self.names.names(title)
            return (found[0], "source") if found else None
        fresh = [n for n in self.names.names(traj.searches[-1].results)
                 if n not in searched and not mentions(document, n)]
        fresh = fresh or [n for n in self.names.names(traj.searches[-1].results) if n not in searched]
        return (fresh[0], "results") if fresh else None

    def write(self, traj: Trajectory, budget: int) -> str:
        plan = self.plan(traj)
        if traj.n_valid_searches < plan.searches:
            found = self.next_query(traj)
            if found is not None:
                name, where = found
                call = self.dialect.format_search(_query(name))
                think = "challenger_source" if where == "source" else "challenger_results"
                return fit(self.tokenizer, [f"{_think(think)}{call}"], budget)
        return self.task_turn(traj, plan, budget)

    def task_turn(self, traj: Trajectory, plan: _ChallengerPlan, budget: int) -> str:
        task_type = traj.meta["task_type"]
        searched = list(dict.fromkeys(s.query.strip() for s in traj.searches if s.valid and s.query))
        thinks = [_think("challenger_task")]
        if plan.grounding == "generic" or not searched:
            options = [([], _GENERIC_TASKS[task_type])]
        else:
            names = searched if plan.grounding == "full" else searched[:1]
            templates = _TASKS[task_type]
            template = templates[plan.template % len(templates)]
            options = [(names[:k], template.format(names=_join(names[:k]))) for k in range(len(names), 0, -1)]
        candidates = [(names, f"{think}<task>{task}</task>") for names, task in options for think in thinks]
        text = fit(self.tokenizer, [c for _, c in candidates], budget)
        self.task_names_used[traj.id] = next(n for n, c in candidates if c == text)
        return text


# -- Solver --------------------------------------------------------------------------------------------


@dataclass
class _SolverPlan:
    searches: int
    facts: int


class SolverTeacher:
    """Writes Solver turns: searches for the names in the task, in order, then an answer that links the task's
    first name to facts (names, years) from the top result of each search (how many searches and facts is
    drawn per rollout)."""

    def __init__(self, names: Names, dialect: Dialect, seed: int, guesses: bool = True,
                 facts_mix: dict[int, float] | None = None):
        self.names, self.tokenizer, self.dialect, self.seed = names, names.tokenizer, dialect, seed
        self.plans: dict[str, _SolverPlan] = {}
        # Without guesses (`model.warm_start.solver_guesses` off) every rollout searches and answers with facts.
        facts_mix = facts_mix or SOLVER_ANSWER_FACTS  # `model.warm_start.solver_answer_facts`
        self.searches_mix = SOLVER_SEARCHES if guesses else {k: w for k, w in SOLVER_SEARCHES.items() if k}
        self.facts_mix = facts_mix if guesses else {k: w for k, w in facts_mix.items() if k}

    def plan(self, traj: Trajectory) -> _SolverPlan:
        if traj.id not in self.plans:
            rng = random.Random(f"{self.seed}/solver/{traj.id}")
            searches = min(_choice(rng, self.searches_mix), traj.max_searches or 0)
            self.plans[traj.id] = _SolverPlan(searches, _choice(rng, self.facts_mix) if searches else 0)
        return self.plans[traj.id]

    def write(self, traj: Trajectory, budget: int) -> str:
        plan = self.plan(traj)
        names = self.names.names(traj.meta["task"])
        if traj.n_valid_searches < min(plan.searches, max(1, len(names))):
            query = names[traj.n_valid_searches] if traj.n_valid_searches < len(names) else None
            if query is None:  # a generic task: search its topic words
                query = " ".join(traj.meta["task"].split()[1:5]).strip(",.")
            call = self.dialect.format_search(_query(query))
            return fit(self.tokenizer, [f"{_think('solver_search')}{call}"], budget)
        return self.answer_turn(traj, plan, names, budget)

    def retrieved_facts(self, traj: Trajectory, exclude: Sequence[str]) -> list[str]:
        """Facts from the top result of each search, most recent search first."""
        found: list[str] = []
        for search in reversed(traj.searches):
            top = search.results.split("\n\n", 1)[0]
            found += [f for f in self.names.facts(top, exclude=list(exclude) + found)]
        return found

    def answer_turn(self, traj: Trajectory, plan: _SolverPlan, names: list[str], budget: int) -> str:
        subject = names[0] if names else "The topic"
        facts = self.retrieved_facts(traj, exclude=names)[:plan.facts]
        if facts:
            think = _think("solver_answer")
            bodies = [f" {subject} is linked to {_join(facts[:k])}." for k in range(len(facts), 0, -1)]
        else:
            think = _think("solver_guess")
            bodies = [f" {subject} is a well-known subject."]
        return fit(self.tokenizer, [f"{think}<answer>{b}</answer>" for b in bodies]
                   + [f"<answer>{b}</answer>" for b in bodies], budget)


# -- Judge -------------------------------------------------------------------------------------------------

_RUBRIC_VERBS = {"name": ["Mentions {fact}."], "year": ["Mentions {fact}."]}
#: Priorities by rubric count: the last rubric is always the one "bonus", so a model learns where to stop.
_PRIORITIES = {3: ["critical", "important", "bonus"], 4: ["critical", "important", "important", "bonus"],
               5: ["critical", "critical", "important", "important", "bonus"]}


#: Rubric wordings of the sentence grades (`model.warm_start.sentence_grades`): several, so that the grader reads
#: the fact rather than one phrase. The calibration probes' wording ("Identifies X by name.",
#: `selfplay.grader_probe.FACT_RUBRIC`) is deliberately not among them.
SENTENCE_RUBRICS = ("Mentions {fact}.", "States {fact}.", "Names {fact}.", "Gives {fact}.", "Includes {fact}.")


def rubric_fact(rubric: str) -> str:
    """The fact a teacher rubric names (the text after its verb phrase, without the final period)."""
    for patterns in [*_RUBRIC_VERBS.values(), SENTENCE_RUBRICS]:
        for pattern in patterns:
            head = pattern.split("{fact}")[0]
            if rubric.startswith(head) and rubric.endswith("."):
                return rubric[len(head):-1]
    return rubric.rstrip(".")


class JudgeTeacher:
    """Writes the frozen Judge's replies: gates, rubrics and grades, decided from structured inputs."""

    def __init__(self, names: Names, reasoning: bool = False):
        self.names, self.tokenizer, self.reasoning = names, names.tokenizer, reasoning

    def gate(self, gate: str, task: str, document: str) -> tuple[int, str]:
        """A gate verdict and reply: entity identifiability passes a task that names something; source
        relevance passes one that names something the source document mentions."""
        named = self.names.names(task)
        if gate == "entity_identifiability":
            verdict = int(bool(named))
        else:
            verdict = int(any(mentions(document, n) for n in named))
        return verdict, f"<score>{verdict}</score>"

    def rubrics(self, task: str, document: str, rng: random.Random) -> tuple[list[str], str]:
        """(rubric texts, reply): 3-5 rubrics, each naming one fact of the source that the task does not."""
        title, body = document.split("\n", 1) if "\n" in document else ("", document)
        facts = [f for f in self.names.facts(body) if not mentions(task, f)]
        facts += [f for f in self.names.facts(body) + self.names.names(title) if f not in facts]
        chosen = facts[:RUBRICS_PER_TASK]
        if len(chosen) < 3:
            raise TeacherError(f"fewer than three facts in the document: {document[:80]!r}")
        texts = [rng.choice(_RUBRIC_VERBS["year" if is_year(f) else "name"]).format(fact=f) for f in chosen]
        for n in range(len(texts), 2, -1):
            reply = "<rubrics>\n" + "".join(f'<rubric priority="{p}">{r}</rubric>\n'
                                             for p, r in zip(_PRIORITIES[n], texts, strict=False)) + "</rubrics>"
            if len(self.tokenizer.encode(reply, add_special_tokens=False)) <= RUBRIC_MAX_TOKENS:
                return texts[:n], reply
        raise TeacherError(f"three rubrics do not fit in {RUBRIC_MAX_TOKENS} tokens: {texts}")

    def grade(self, answer: str, rubric: str) -> tuple[int, str]:
        """A verdict (1 if the answer mentions the rubric's fact) and reply. With `reasoning` (the grader prompt's
        <think>), the reply first lists the answer's facts, each marked "(named)" (at most GRADE_FACTS, the
        rubric's among them if held), then the rubric's fact: "X (named)" if held, "X, not named" if not. The
        marker after X is then what followed X's last mention, a copy a pretrained model makes by induction,
        and the score follows from the words just before it."""
        fact = rubric_fact(rubric)
        verdict = int(mentions(answer, fact))
        if not self.reasoning:
            return verdict, f"<score>{verdict}</score>"
        facts = listed_facts(self.names.facts(answer), answer, fact if verdict else None)
        if len(facts) > GRADE_FACTS:
            held = [f for f in facts[GRADE_FACTS - 1:] if f.lower() == fact.lower()]
            facts = facts[:GRADE_FACTS - len(held)] + held
        listed = _join([f"{f} (named)" for f in facts]) if facts else "no name or year"
        asked = f"{fact} (named)" if verdict else f"{fact}, not named"
        return verdict, (f"<think>The response names {listed}. The rubric asks for {asked}.</think>\n"
                         f"<score>{verdict}</score>")


def listed_facts(facts: list[str], answer: str, held: str | None) -> list[str]:
    """The facts a reasoned grade lists for `answer` (`facts`: what `Names` finds in it), with the rubric's fact
    `held` spelled as the rubric spells it when the answer holds it: a fact of the source's own sentences can be
    longer than `Names` reads ("Chachoengsao Province", found as two names), and the verdict is a copy of its mark."""
    if held is None or any(f.lower() == held.lower() for f in facts):
        return facts
    kept = [f for f in facts if f.lower() not in held.lower()] + [held]
    return sorted(kept, key=lambda f: answer.lower().find(f.lower()))


# -- name swapping ---------------------------------------------------------------------------------------

#: Names are swapped (`model.warm_start.name_swap_share` of the examples), consistently within an example, for
#: other names of the vocabulary (the entity anonymisation of reading-comprehension datasets). Without it a tiny
#: model memorises which name goes with which document; with it the only way to lower the loss is to copy
#: names from the context, which is what every role needs. They are drawn from the SWAP_POOL most frequent ones.
SWAP_POOL = 1000
_SWAPPABLE = re.compile(r"^ [A-Z][a-z]{2,}$")


def swappable_names(tokenizer) -> list[int]:
    """Token ids that are a capitalised word with a leading space and appear in no prompt template and no
    fixed phrase of the teacher (so swapping them never changes the protocol's own text)."""
    fixed = [prompts.load_template(n).template for n in prompts.TEMPLATE_NAMES]
    fixed += [t for ts in _TASKS.values() for t in ts] + list(_GENERIC_TASKS.values())
    fixed += [spec.description for spec in prompts.TASK_TYPES.values()]
    fixed += [p.format(fact="") for ps in _RUBRIC_VERBS.values() for p in ps] + [" The topic", " Task", " The"]
    protected = {i for text in fixed for i in tokenizer.encode(text, add_special_tokens=False)}
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    out = []
    for i, token in enumerate(vocab):
        if i in protected or token is None:
            continue
        text = tokenizer.convert_tokens_to_string([token])
        if _SWAPPABLE.match(text):
            out.append(i)
    return out


def swap_names(example: Example, names: Sequence[int], name_set: set[int], rng: random.Random) -> Example:
    """`example` with each distinct name token replaced by a distinct random one, everywhere it occurs."""
    present = sorted({t for t in example.input_ids if t in name_set})
    mapping = dict(zip(present, rng.sample(list(names), min(len(present), len(names))), strict=False))
    return Example(example.role, [mapping.get(t, t) for t in example.input_ids], list(example.completion_mask))


def sft_passes(examples: list[Example], tokenizer, cfg: WarmStartConfig) -> list[Example]:
    """`cfg.epochs` passes over the shuffled examples (each repeated `cfg.role_repeats` times for its role; a
    fractional last pass takes a prefix), each example's names swapped with probability `cfg.name_swap_share`
    by a fresh draw in every pass, for names of the SWAP_POOL most frequent ones (so every name the model learns
    to write is one it has read often)."""
    epochs, seed = cfg.epochs, cfg.seed
    name_set = set(swappable_names(tokenizer))
    counts: dict[int, int] = {}
    for e in examples:
        for t in e.input_ids:
            if t in name_set:
                counts[t] = counts.get(t, 0) + 1
    names = sorted(counts, key=lambda t: (-counts[t], t))[:SWAP_POOL]
    examples = [e for e in examples for _ in range(cfg.role_repeats.get(e.role, 1))]
    total = max(1, round(epochs * len(examples)))
    out: list[Example] = []
    k = 0
    while len(out) < total:
        rng = random.Random(f"{seed}/pass/{k}")
        order = list(range(len(examples)))
        rng.shuffle(order)
        for i in order[:total - len(out)]:
            e = examples[i]
            out.append(swap_names(e, names, name_set, rng) if rng.random() < cfg.name_swap_share else e)
        k += 1
    return out


# -- putting it together ---------------------------------------------------------------------------------


def teacher_params(cfg: WarmStartConfig, corpus_path: str | Path, index_dir: str | Path, dialect: str) -> Params:
    """The run parameters the teacher's rollouts and Judge use: the warm start's protocol shape, generous
    response budgets (each turn is held to `max_new_tokens_per_turn`), and its own exact (faiss Flat) index in `index_dir`."""
    index_dir = Path(index_dir)
    return validate_params({
        "run": {"name": index_dir.name, "runs_dir": str(index_dir.parent), "data_dir": str(Path(corpus_path).parent)},
        "model": {"base": "tiny", "dialect": dialect, "max_model_len": 8192},
        "judge": {"gate_max_tokens": GATE_MAX_TOKENS, "rubric_max_tokens": RUBRIC_MAX_TOKENS,
                  "grading_max_tokens": REASONED_GRADING_MAX_TOKENS if cfg.grade_reasoning else GRADING_MAX_TOKENS},
        # faiss Flat: exact search, so the teacher's results (and the warmed weights) are the same on every
        # build; an HNSW graph may differ between two builds of the same corpus.
        "retrieval": {"corpus": str(Path(corpus_path).resolve()), "embedder": cfg.embedder, "embed_batch_size": 16,
                      "backend": "faiss", "faiss_factory": "Flat",
                      "max_result_tokens": cfg.max_result_tokens, "top_k": cfg.top_k},
        "selfplay": {"document_max_tokens": cfg.document_max_tokens, "seed": cfg.seed},
        "challenger": {"max_new_tokens_per_turn": cfg.max_new_tokens_per_turn, "max_response_tokens": 4096,
                       "max_prompt_tokens": 4096},
        "solver": {"max_searches": cfg.solver_max_searches, "max_turns": cfg.solver_max_searches + 1,
                   "max_new_tokens_per_turn": cfg.max_new_tokens_per_turn, "max_response_tokens": 4096,
                   "max_prompt_tokens": 4096},
        "engine": {"backend": "hf", "device": "cpu"},
    }, source="<teacher>")


def _trajectory_examples(trajs: list[Trajectory], dialect: Dialect, role: str, ending: str) -> list[Example]:
    """Training examples of finished rollouts: the whole token stream with the assistant tokens as loss mask
    (each turn's context is exactly its prefix), or one example per turn for dialects that re-render the
    context without earlier thinking (Qwen3)."""
    out = []
    for t in trajs:
        if t.finish != ending:
            continue
        if dialect.strips_earlier_thinking:
            for (a, b), context in zip(t.turn_spans, t.turn_prompt_ids, strict=True):
                out.append(Example(role, list(context) + t.completion_ids[a:b],
                                   [0] * len(context) + [1] * (b - a)))
        else:
            out.append(Example(role, t.prompt_ids + t.completion_ids, [0] * len(t.prompt_ids) + t.env_mask))
    return out


def dialect_examples(tokenizer, dialect_name: str, documents: list[Passage], retriever: Retriever,
                     params: Params, cfg: WarmStartConfig, stats: TeacherStats) -> list[Example]:
    """Every role's examples for one dialect over `documents` (Challenger, gates, rubrics, Solver, grades)."""
    dialect = get_dialect(dialect_name)
    seed, sp = cfg.seed, params.selfplay
    names = Names(tokenizer, cfg.fact_max_tokens)
    engine = TeacherEngine(tokenizer)
    judge_teacher = JudgeTeacher(names, cfg.grade_reasoning)
    rng = random.Random(f"{seed}/judge/{dialect_name}")
    examples: list[Example] = []

    # Challenger rollouts through the real loop. Documents too poor in single-token facts for three rubrics
    # are left out (the Judge teacher could not write rubrics for them).
    prompts = make_challenger_prompts(documents, sp.task_types, sp.search_turn_strata, seed=seed,
                                      tokenizer=tokenizer, document_max_tokens=sp.document_max_tokens)
    prompts = [p for p in prompts if len(names.facts(p.document.split("\n", 1)[-1])) >= 3]
    by_id = {p.id: p for p in prompts}
    trajs = challenger_trajectories(prompts, dialect, tokenizer)
    challenger = ChallengerTeacher(names, dialect, by_id, {d.id: d for d in documents}, seed)
    limits = challenger_limits(params)
    engine.script(trajs, challenger.write, limits)
    run_rollouts(trajs, engine, retriever, dialect, limits)
    examples += _trajectory_examples(trajs, dialect, "challenger", "task")
    done = [t for t in trajs if t.task]

    # Gates: each task against its own source, and some against another document (source relevance 0).
    judge = make_judge(params, lambda _model: engine)   # the run's Judge: same prompts, thinking and seeding
    pairs = [(t.task, by_id[t.meta["prompt_id"]].document) for t in done]
    for task, _doc in list(pairs):
        if rng.random() < SOURCE_MISMATCH_SHARE:
            other = prompts[rng.randrange(len(prompts))].document
            pairs.append((task, other))
    gate_replies, passed = [], []
    for i, (task, doc) in enumerate(pairs):
        verdicts = []
        for gate in (g for g in params.judge.gates if g != ANSWERABILITY):   # the prompt gates
            verdict, reply = judge_teacher.gate(gate, task, doc)
            stats.count(f"gate {gate}", verdict)
            gate_replies.append(reply)
            verdicts.append(verdict)
        if i < len(done) and all(verdicts):
            passed.append(done[i])
    engine.queue("gates", gate_replies)
    judge.gates([p[0] for p in pairs], [p[1] for p in pairs])

    # Rubrics for every task that passed, from its source document (the paper's rubric context).
    rubric_sets, rubric_replies = [], []
    for t in passed:
        texts, reply = judge_teacher.rubrics(t.task, by_id[t.meta["prompt_id"]].document,
                                             random.Random(f"{seed}/rubrics/{t.id}"))
        rubric_sets.append(texts)
        rubric_replies.append(reply)
    engine.queue("rubrics", rubric_replies)
    judge.rubrics([t.meta["task_type"] for t in passed], [t.task for t in passed],
                  [[by_id[t.meta["prompt_id"]].document] for t in passed])

    # Solver rollouts on the tasks with rubrics.
    solvers = [new_trajectory(f"{t.id}/s{j}", "solver", solver_messages(t.task, dialect, params.solver.max_searches,
                                                                 params.solver.prompt),
                              tokenizer, max_searches=params.solver.max_searches,
                              meta={"challenger_id": t.id, "task": t.task})
               for t in passed for j in range(SOLVER_ROLLOUTS)]
    solver = SolverTeacher(names, dialect, seed, cfg.solver_guesses, cfg.solver_answer_facts)
    limits = solver_limits(params)
    engine.script(solvers, solver.write, limits)
    run_rollouts(solvers, engine, retriever, dialect, limits)
    examples += _trajectory_examples(solvers, dialect, "solver", "answer")

    # Grades: every answer against every rubric of its task, and answers made to hold a rubric's fact
    # (the Solver's own answers mostly miss the source's facts; the grader must see both verdicts).
    rubrics_of = {t.id: r for t, r in zip(passed, rubric_sets, strict=True)}
    triples, contrasts = [], []
    for s in solvers:
        if s.answer:
            triples += [(s.meta["task"], s.answer, r) for r in rubrics_of[s.meta["challenger_id"]]]
    for t in passed:
        subject = (names.names(t.task) or ["The topic"])[0]
        rubrics = rubrics_of[t.id]
        for k, r in enumerate(rubrics[:GOOD_ANSWERS]):
            held = [rubric_fact(x) for x in rubrics if x != r][:k % 2] + [rubric_fact(r)]
            answer = f"{subject} is linked to {_join(held)}."
            triples.append((t.task, answer, r))
            if cfg.contrast_grades:   # the same answer against the task's other rubrics: kept whatever the verdict
                contrasts += [(t.task, answer, x) for x in rubrics if x != r]
    if cfg.sentence_grades:   # answers made of the source's own sentences: stated, removed or swapped facts
        contrasts += sentence_grades(passed, by_id, documents, judge_teacher, params.judge.grading_max_tokens, rng,
                                     cfg.seed)
    grade_replies, kept = [], []
    for i, triple in enumerate(triples + contrasts):
        verdict, reply = judge_teacher.grade(triple[1], triple[2])
        if i < len(triples) and verdict == 0 and rng.random() > NEGATIVE_GRADES_KEPT:
            continue
        stats.count("grade", verdict)
        grade_replies.append(reply)
        kept.append(triple)
    engine.queue("grading", grade_replies)
    judge.grade([x[0] for x in kept], [x[1] for x in kept], [x[2] for x in kept])
    # Gate replies are the simplest to learn and their prompts the longest: keep a share of them.
    examples += [e for e in engine.judge_examples if e.role != "gates" or rng.random() < GATE_EXAMPLES_KEPT]
    return examples


def sentence_grades(passed: list[Trajectory], prompts_by_id: dict[str, ChallengerPrompt],
                    documents: Sequence[Passage], judge_teacher: JudgeTeacher, max_tokens: int, rng: random.Random,
                    seed: int) -> list[tuple[str, str, str]]:
    """(task, answer, rubric) grades on answers made of the task's source sentences (`model.warm_start.
    sentence_grades`): a sentence stating one of the source's facts beside another sentence (in both orders: met),
    the other sentence alone (the fact's sentence removed: not met) and the fact swapped for another document's
    fact of the same kind (not met); the rubric in one of SENTENCE_RUBRICS' wordings. Answers read like the
    Solver's prose, not the teacher's lists, and met and not met come equally often. A grade whose reply would
    not fit `max_tokens` is left out."""
    sources = {prompts_by_id[t.meta["prompt_id"]].document_id for t in passed}
    pairs = {p.passage_id: p for p in fact_pairs([d for d in documents if d.id in sources], len(sources), seed)}
    out = []
    for t in passed:
        pair = pairs.get(prompts_by_id[t.meta["prompt_id"]].document_id)
        if pair is None:
            continue
        rubric = rng.choice(SENTENCE_RUBRICS).format(fact=pair.fact)
        for _kind, answer, _met in fact_responses(pair):
            reply = judge_teacher.grade(answer, rubric)[1]
            if len(judge_teacher.tokenizer.encode(reply, add_special_tokens=False)) <= max_tokens:
                out.append((t.task, answer, rubric))
    return out


def teacher_examples(tokenizer, corpus_path: str | Path, cfg: WarmStartConfig, index_dir: str | Path
                     ) -> tuple[list[Example], TeacherStats]:
    """All SFT examples for the warm start: `cfg.documents` documents from the teacher's part of the corpus
    (`retrieval.corpus.teacher_documents`), every role, every dialect in `cfg.dialects`. Deterministic for a seed."""
    stats = TeacherStats()
    documents = teacher_documents(read_corpus(corpus_path).passages, cfg)
    if len(documents) < 4:
        raise TeacherError(f"{corpus_path}: only {len(documents)} documents outside the held-out share; the "
                           "teacher needs at least 4")
    stats.documents = len(documents)
    examples: list[Example] = []
    for dialect_name in cfg.dialects:
        params = teacher_params(cfg, corpus_path, index_dir, dialect_name)
        retriever = build_or_open_index(params, progress=False)
        examples += dialect_examples(tokenizer, dialect_name, documents, retriever, params, cfg, stats)
    for example in examples:
        stats.add(example)
    return examples, stats


def protocol_fingerprint() -> str:
    """A hash of everything the warm-started model learns the protocol from besides the corpus: this module (its
    version and source) and the fact extraction it writes rubrics and grades with (`protocol.facts`), the prompt
    templates, task types and dialects' search syntax (`prompts.protocol_fingerprint`). A change rebuilds the
    model."""
    digest = hashlib.sha256(f"teacher-v{TEACHER_VERSION}".encode())
    digest.update(Path(__file__).read_bytes())  # any change to what the teacher writes rebuilds the model
    digest.update(Path(facts.__file__).read_bytes())
    return prompts.protocol_fingerprint(digest)


#: Renderings of each prompt per protocol text sample (so their fixed phrases become single tokens).
PROTOCOL_TEXT_SAMPLES = 50


def protocol_texts(passages: Sequence[str], seed: int = 0) -> list[str]:
    """Protocol text for the warm-started model's tokenizer: every prompt rendered through the library's
    prompt functions for every dialect over sample documents (wiki-18 `contents` strings), and the
    teacher's reply formats, so the fixed phrases of the contexts the model reads become few tokens."""
    rng = random.Random(f"{seed}/protocol-texts")
    documents = [Passage.from_contents(str(i), c) for i, c in enumerate(passages[:2000])]
    task_types = list(prompts.TASK_TYPES)
    texts: list[str] = []
    for k in range(PROTOCOL_TEXT_SAMPLES):
        doc, other = rng.choice(documents), rng.choice(documents)
        dialect = list(DIALECTS.values())[k % len(DIALECTS)]
        task_type = task_types[k % len(task_types)]
        names = [w for w in re.findall(r"(?<=\s)[A-Z][a-z]+", other.text)[:2]] + [doc.title.split()[0]]
        task = _TASKS[task_type][k % len(_TASKS[task_type])].format(names=_join(names))
        texts += [
            prompts.challenger_prompt(doc.document, task_type, 1 + k % 3, dialect.search_example),
            prompts.challenger_after_search(1 + k % 2), prompts.challenger_finish(),
            prompts.challenger_malformed(k % 3), prompts.solver_malformed(k % 3, dialect.search_example),
            prompts.solver_prompt(task, 1 + k % 3, dialect.search_example, dialect.results_description),
            prompts.rubric_prompt(task_type, task, [doc.document]),
            prompts.grader_prompt(task, other.text[:300], f"Identifies {names[-1]}.", native_thinking=k % 2 == 1),
        ] + [prompts.gate_prompt(g, task, doc.document) for g in prompts.GATES]
        texts.append("".join(f"<think>{t}</think>\n" for t in THINK.values()))
        texts.append(f"{dialect.format_search(' ' + names[-1])}<answer> {names[0]} is linked to {names[-1]}.</answer>")
        texts.append(f'<rubrics>\n<rubric priority="critical">Mentions {names[0]}.</rubric>\n<rubric priority='
                     f'"important">Mentions 1990.</rubric>\n<rubric priority="bonus">Mentions '
                     f'{names[-1]}.</rubric>\n</rubrics>')
    return texts
