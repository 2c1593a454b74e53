"""The quality gates' and the rubric writer's calibration probes (not in the paper; issue 51): the Judge's other two
stages answer controlled items whose right verdict is known before their verdicts count, as its per-rubric grader
does (`selfplay.grader_probe`), and are trusted by the same rule (`grader_probe.calibrate`: separation P(yes |
should) - P(yes | should not) at least `judge.calibration.min_separation`, invalid replies at most
`max_invalid_rate`).

    probes = probe_judge_stages(params, judge, passages)   # when a run opens and at the held-out build
    probes.gates["source_relevance"]["judge"].numbers()    # each gate as each method decides it
    probes.rubrics.trusted, probes.untrusted()

**The gate probe.** Probe tasks are built from corpus documents the warm start's teacher never read
(`grader_probe.unseen_by_teacher`), in a seeded order, each document cut to `selfplay.document_max_tokens` as the
Challenger and the gates see it, in the four task types' style from the templates below. Six kinds, with the right
verdict per gate (None: no right answer, left out of that gate's rates):

| kind       | the task is about                                     | entity identifiability | source relevance |
|------------|-------------------------------------------------------|------------------------|------------------|
| own_name   | a name of the document (its title, or a 2-4-word one) | yes                    | yes              |
| respelled  | the same name in capitals, or without its accents     | yes                    | yes              |
| other_name | a name of another document, no word of which this     | yes                    | no               |
|            | one holds                                             |                        |                  |
| generic    | nothing ("Summarise the key points of the document")  | no                     | no               |
| bare_name  | one word that begins or ends two or more names of     | no                     | not counted      |
|            | other documents (ambiguous: "George", "Kennedy")      |                        |                  |
| topic_only | the document's most frequent content word, no name    | no                     | not counted      |

Each document gives two kinds, the ones used least so far, until `judge.calibration.gate_items` tasks. The Judge
answers every configured prompt gate for every probe task in ONE batched call (`Judge.judge_gates`, with its
corrective retry); the word rules (`protocol.gate_rules`) cost nothing. Each gate is then calibrated three ways: as
the Judge alone decides it, as the rules alone do, and as `rules_then_judge` does (a task that fails any rule keeps
the rules' verdicts). The one `judge.gates_by` names is the gate's calibration (it decides trust); the others are
reported beside it, so a user sees what the rules add.

**The rubric-writer probe.** `judge.calibration.rubric_items` tasks about a name of a document (own_name, one per
document), and the rubrics the writer makes from that document, in ONE batched call as in training. Two items per
reply: `grounded` (right: yes) is yes when at least `rubric_fact_share` of its rubrics name a fact of the source
(a name, year or number of `protocol.facts` that the task does not already name); `foreign` (right: no) is yes when
any rubric names a fact of another probe document that neither the source nor the task names. A reply that does
not parse with `judge.min_rubrics`..`max_rubrics` rubrics (3-5) after the retry makes both items invalid.

**The answer-check probe.** Search Self-Play's LLM-as-a-judge (`Judge.answers_match`, SSP §3.2 and App. E: Correct or
Wrong for a question, a predicted answer and the ground truth) on `judge.calibration.answer_match_items` items in ONE
call. Per document, a ground truth: a fact of it (`protocol.facts.facts_of`'s names and years, or a number of at least
two digits; the kinds in turn over the documents), the question a cloze of its sentence that holds it ("Which name
fills the blank in this sentence: ...?"), and four predictions of known verdict:

| kind           | the predicted answer                                                         | right verdict |
|----------------|------------------------------------------------------------------------------|---------------|
| same           | the ground truth itself                                                      | Correct       |
| restated       | the same answer in a short sentence and another case ("It was LONDON.")      | Correct       |
| other_document | a fact of the same kind from another probe document, which this one never    | Wrong         |
|                | mentions                                                                     |               |
| same_document  | another fact of the same kind from the same document (the plausible wrong    | Wrong         |
|                | answer)                                                                      |               |

No wrong answer holds the ground truth or is held by it (App. E's criterion 4 would count it Correct). A reply that
never parses (after the retry) is invalid. A run probes the stages its method uses (`Method.judge_stages`: SCOPE the
grader, gates and rubric writer; SSP with `ssp.answer_check: judge` the answer check).
"""

from __future__ import annotations

import logging
import random
import re
import unicodedata
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scope_lib.config import PAPER_TASK_TYPES, JudgeCalibrationConfig, Params
from scope_lib.protocol import prompts
from scope_lib.protocol.facts import NOT_NAMES, facts_of, is_year, mentions, sentences
from scope_lib.protocol.gate_rules import RULE_GATES, fold, mentions_folded, rule_verdicts
from scope_lib.runs import read_json
from scope_lib.selfplay.grader_probe import Calibration, ProbeItem, calibrate, unseen_by_teacher
from scope_lib.selfplay.judge import (
    ANSWER_MATCH,
    ANSWERABILITY,
    Judge,
    JudgeStats,
    combine_gates,
    judge_models,
)
from scope_lib.selfplay.rollout import truncate_tokens

log = logging.getLogger(__name__)

#: The right verdict of each probe kind, per gate (None: no right answer; the item is left out of that gate's rates).
GATE_SHOULD: dict[str, dict[str, bool | None]] = {
    "own_name": {"entity_identifiability": True, "source_relevance": True},
    "respelled": {"entity_identifiability": True, "source_relevance": True},
    "other_name": {"entity_identifiability": True, "source_relevance": False},
    "generic": {"entity_identifiability": False, "source_relevance": False},
    "bare_name": {"entity_identifiability": False, "source_relevance": None},
    "topic_only": {"entity_identifiability": False, "source_relevance": None},
}
KINDS: tuple[str, ...] = tuple(GATE_SHOULD)
#: How a gate can be decided (`judge.gates_by`).
GATE_METHODS: tuple[str, ...] = ("judge", "rules", "rules_then_judge")
#: Probe tasks each document gives the gate probe.
KINDS_PER_DOCUMENT = 2

#: Probe task templates in the four task types' style (§4.1, App. H): about a name ...
NAMED_TASKS: dict[str, str] = {
    "long_form_qa": "Explain what {name} is best known for and how that reputation came about, in connected prose.",
    "summarisation": "Summarise the main facts about {name} as a short brief of about 200 words.",
    "planning": "Plan a three-step study of {name}, with a timeline and one milestone for each step.",
    "writing": "Write a structured article on {name}, with an introduction, a body and a conclusion.",
}
#: ... about the document's topic, naming no entity ...
TOPIC_TASKS: dict[str, str] = {
    "long_form_qa": "Explain how {topic} works in general and why it matters, in connected prose.",
    "summarisation": "Summarise what is generally known on the topic of {topic}, as a short brief.",
    "planning": "Plan a three-step introduction to the topic of {topic}, with a timeline for each step.",
    "writing": "Write a structured essay on the topic of {topic}, with an introduction, a body and a conclusion.",
}
#: ... and naming nothing at all (a task that would fit any document).
GENERIC_TASKS: dict[str, str] = {
    "long_form_qa": "Explain why the subject of the document matters, in connected prose.",
    "summarisation": "Summarise the key points of the document in one paragraph.",
    "planning": "Plan a three-step study of the subject, with a timeline and one milestone for each step.",
    "writing": "Write a structured essay on the subject, with an introduction, a body and a conclusion.",
}
#: Frequent long words that name no topic (a topic word is a content word of at least 6 letters).
NOT_TOPICS = frozenset({
    "according", "across", "against", "almost", "already", "although", "always", "amongst", "another", "around",
    "became", "because", "become", "before", "behind", "between", "beyond", "called", "despite", "during", "either",
    "except", "following", "further", "herself", "himself", "however", "including", "itself", "number", "people",
    "perhaps", "rather", "second", "several", "should", "themselves", "thereafter", "through", "throughout",
    "toward", "towards", "whether", "within", "without",
})
#: Endings of words that describe rather than name a topic.
NOT_TOPIC_ENDINGS = ("ly", "ed", "ous", "ful", "able", "ible")
_CLEAN_NAME = re.compile(r"[^\W\d_][\w'’-]*(?: [^\W\d_][\w'’-]*){1,3}")
_WORD = re.compile(r"[^\W\d_][\w'’-]*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_NUMBER = re.compile(r"(?<![\w.,])\d[\d,.]*\d(?![\w])")
#: The right verdict of each answer-check probe kind (yes = Correct).
ANSWER_SHOULD: dict[str, bool] = {"same": True, "restated": True, "other_document": False, "same_document": False}
#: The kinds of fact an answer-check probe's ground truth is, preferred in turn over the documents.
FACT_KINDS: tuple[str, ...] = ("name", "year", "number")
#: What stands for the ground truth in the probe question's sentence.
BLANK = "____"


class UntrustedJudge(RuntimeError):
    """A Judge stage failed its calibration probe and the params do not accept it (`scope train` exits 4)."""


# -- probe documents and tasks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeDocument:
    """A corpus document as the gates see it (cut to `selfplay.document_max_tokens`), and its names of 2-4
    capitalised words, the title first when it is one."""

    passage_id: str
    title: str
    document: str
    names: tuple[str, ...]

    @property
    def name(self) -> str | None:
        return self.names[0] if self.names else None


@dataclass(frozen=True)
class ProbeTask:
    """One probe task: its kind (GATE_SHOULD), task type, text, the document it is judged against, and the name it is
    about ("" for the kinds that name nothing)."""

    key: str
    kind: str
    task_type: str
    task: str
    passage_id: str
    document: str
    name: str = ""


def _clean_name(name: str) -> bool:
    words = name.split()
    return (_CLEAN_NAME.fullmatch(name) is not None and all(w[0].isupper() for w in words)
            and words[0] not in NOT_NAMES and len(name) >= 4)


def document_names(title: str, document: str) -> tuple[str, ...]:
    """Names of 2-4 capitalised words the document holds: its title when it is one, then the names of its sentences
    (`protocol.facts.facts_of`), in order, without repeats."""
    found = [title] if _clean_name(title) else []
    for sentence in _SENTENCE_END.split(document):
        for kind, fact in facts_of(sentence):
            if kind == "name" and _clean_name(fact) and fact not in found and mentions(document, fact):
                found.append(fact)
    return tuple(found)


def probe_documents(passages: Sequence[Any], tokenizer=None, max_tokens: int | None = None) -> list[ProbeDocument]:
    """`passages` as the gates see them: each `document` cut to `max_tokens` tokens of `tokenizer` (as
    `rollout.make_challenger_prompts` cuts it), with its names."""
    out = []
    for p in passages:
        document = p.document
        if tokenizer is not None and max_tokens:
            document = truncate_tokens(document, tokenizer, max_tokens)
        out.append(ProbeDocument(p.id, p.title, document, document_names(p.title, document)))
    return out


def respell(name: str) -> str:
    """The name in another spelling: without its accents where it has some, else in capitals."""
    plain = "".join(c for c in unicodedata.normalize("NFKD", name) if not unicodedata.combining(c))
    return plain if plain != name else name.upper()


def name_ends(docs: Sequence[ProbeDocument]) -> dict[str, set[str]]:
    """For each first or last word of a name of the probe documents, the different names it begins or ends."""
    ends: dict[str, set[str]] = {}
    for d in docs:
        for name in d.names:
            words = name.split()
            for w in (words[0], words[-1]):
                ends.setdefault(w, set()).add(name)
    return ends


def bare_name(doc: ProbeDocument, ends: dict[str, set[str]]) -> str | None:
    """The first (else the last) word of one of the document's names that begins or ends at least two names it does
    not hold (`name_ends`: over every probe document): a bare name that on its own fits several things ("George",
    "Kennedy"), as "Michael Brown" does in the gate prompt's example."""
    for name in doc.names:
        words = name.split()
        for w in (words[0], words[-1]):
            elsewhere = {n for n in ends.get(w, ()) if not mentions(doc.document, n)}
            if w.isalpha() and len(w) >= 4 and w not in NOT_NAMES and len(elsewhere) >= 2:
                return w
    return None


def topic_word(doc: ProbeDocument) -> str | None:
    """The document's most frequent lower-case content word of at least 6 letters, used at least twice, that is no
    word of its title or names (ties: the first): what the document is about, naming none of its entities. Words
    with an adverb's or adjective's ending are left out ("mostly", "famous", "notable")."""
    named = {fold(w) for name in (doc.title, *doc.names) for w in _WORD.findall(name)}
    words = [w for w in _WORD.findall(doc.document.split("\n", 1)[-1])
             if w.islower() and w.isalpha() and len(w) >= 6 and w not in NOT_TOPICS and fold(w) not in named
             and not w.endswith(NOT_TOPIC_ENDINGS)]
    top = Counter(words).most_common(1)
    return top[0][0] if top and top[0][1] >= 2 else None


def other_name(doc: ProbeDocument, others: Sequence[ProbeDocument], rng: random.Random) -> str | None:
    """The name of another document of which no word occurs in this document (any case, any accents)."""
    candidates = sorted({o.name for o in others if o.passage_id != doc.passage_id and o.name
                         and not any(mentions_folded(doc.document, w) for w in o.name.split())})
    return rng.choice(candidates) if candidates else None


def document_tasks(doc: ProbeDocument, pool: Sequence[ProbeDocument], ends: dict[str, set[str]], rng: random.Random,
                   task_type: str) -> dict[str, ProbeTask]:
    """Every probe kind this document can give, each a task of `task_type`."""
    texts: dict[str, tuple[str, str]] = {"generic": (GENERIC_TASKS[task_type], "")}
    if doc.name:
        texts["own_name"] = (NAMED_TASKS[task_type].format(name=doc.name), doc.name)
        texts["respelled"] = (NAMED_TASKS[task_type].format(name=respell(doc.name)), respell(doc.name))
    named = {"other_name": other_name(doc, pool, rng), "bare_name": bare_name(doc, ends)}
    for kind, name in named.items():
        if name:
            texts[kind] = (NAMED_TASKS[task_type].format(name=name), name)
    topic = topic_word(doc)
    if topic:
        texts["topic_only"] = (TOPIC_TASKS[task_type].format(topic=topic), "")
    return {kind: ProbeTask(f"{doc.passage_id}/{kind}", kind, task_type, text, doc.passage_id, doc.document, name)
            for kind, (text, name) in texts.items()}


def gate_probe_tasks(docs: Sequence[ProbeDocument], n: int, seed: int = 0) -> list[ProbeTask]:
    """`n` gate probe tasks from `docs` in order: from each document the KINDS_PER_DOCUMENT kinds used least so far
    (ties in a rotating order), task types in turn."""
    ends = name_ends(docs)
    rng = random.Random(f"{seed}/gate_probe")
    used: Counter = Counter()
    tasks: list[ProbeTask] = []
    for j, doc in enumerate(docs):
        if len(tasks) >= n:
            break
        task_type = PAPER_TASK_TYPES[j % len(PAPER_TASK_TYPES)]
        built = document_tasks(doc, docs, ends, rng, task_type)
        order = sorted(built, key=lambda k: (used[k], (KINDS.index(k) - j) % len(KINDS)))
        for kind in order[:KINDS_PER_DOCUMENT]:
            tasks.append(built[kind])
            used[kind] += 1
    return tasks[:n]


def rubric_probe_tasks(docs: Sequence[ProbeDocument], n: int) -> list[ProbeTask]:
    """`n` tasks about a name of a document (own_name), one per document that has a name and a fact the task does
    not already name, task types in turn."""
    tasks: list[ProbeTask] = []
    for doc in docs:
        if len(tasks) >= n:
            break
        if not doc.name:
            continue
        task_type = PAPER_TASK_TYPES[len(tasks) % len(PAPER_TASK_TYPES)]
        task = NAMED_TASKS[task_type].format(name=doc.name)
        if source_facts(doc.document, task):
            tasks.append(ProbeTask(f"{doc.passage_id}/rubrics", "own_name", task_type, task, doc.passage_id,
                                   doc.document, doc.name))
    return tasks


# -- the facts a rubric can name -------------------------------------------------------------------------------


def document_facts(text: str) -> list[str]:
    """The names, years and numbers of at least two digits of a text (`protocol.facts.facts_of` per sentence), in
    order, without repeats."""
    found: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        for fact in [f for _, f in facts_of(sentence)] + _NUMBER.findall(sentence):
            if fact not in found:
                found.append(fact)
    return found


def source_facts(document: str, task: str) -> list[str]:
    """The facts of the source a rubric can add: those the task does not already name."""
    return [f for f in document_facts(document) if not mentions(task, f)]


def names_a_fact(text: str, facts: Sequence[str]) -> bool:
    return any(mentions(text, f) for f in facts)


# -- the answer check's items ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerProbe:
    """One answer-check probe item: its kind (ANSWER_SHOULD), the question, the predicted answer and the ground
    truth the judge compares it with."""

    key: str
    kind: str
    question: str
    prediction: str
    reference: str


def answer_facts(doc: ProbeDocument) -> list[tuple[str, str, str]]:
    """(kind, fact, sentence) of the document's complete sentences (`protocol.facts.sentences`), in order, each fact
    once: names and years (`facts_of`), and numbers of at least two digits that are no year."""
    found: list[tuple[str, str, str]] = []
    for sentence in sentences(doc.document.split("\n", 1)[-1]):
        numbers = [("number", n) for n in _NUMBER.findall(sentence) if not is_year(n)]
        for kind, fact in facts_of(sentence) + numbers:
            if all(fact != f for _, f, _ in found):
                found.append((kind, fact, sentence))
    return found


def overlaps(a: str, b: str) -> bool:
    """Whether one fact holds the other (an answer holding the ground truth counts as Correct: App. E)."""
    return mentions(a, b) or mentions(b, a)


def cloze(sentence: str, fact: str) -> str:
    """The sentence with every occurrence of the fact (any case) blanked out."""
    return re.sub(rf"(?<![\w]){re.escape(fact)}(?![\w])", BLANK, sentence, flags=re.IGNORECASE)


def document_answer_probes(doc: ProbeDocument, facts: dict[str, list[tuple[str, str, str]]], rng: random.Random,
                           prefer: str) -> list[AnswerProbe]:
    """The four answer-check items of one document (module docstring), on its first fact of kind `prefer` (else of
    the kinds after it in FACT_KINDS' order) that has a wrong answer of its kind from this document and from another
    (`facts`: every probe document's `answer_facts`, by passage id); [] when none has."""
    own = facts[doc.passage_id]
    order = FACT_KINDS[FACT_KINDS.index(prefer):] + FACT_KINDS[:FACT_KINDS.index(prefer)]
    for kind, truth, sentence in sorted(own, key=lambda f: order.index(f[0])):
        same = [f for k, f, _ in own if k == kind and not overlaps(f, truth)]
        other = same and sorted({f for pid, found in facts.items() if pid != doc.passage_id for k, f, _ in found
                                 if k == kind and not overlaps(f, truth) and not mentions(doc.document, f)})
        if not other:
            continue
        question = f"Which {kind} fills the blank in this sentence: \"{cloze(sentence, truth)}\"?"
        predictions = {"same": truth, "restated": f"It was {truth.upper()}.", "other_document": rng.choice(other),
                       "same_document": same[0]}
        return [AnswerProbe(f"{doc.passage_id}/{k}", k, question, predictions[k], truth) for k in ANSWER_SHOULD]
    return []


def answer_probe_items(docs: Sequence[ProbeDocument], n: int, seed: int = 0) -> list[AnswerProbe]:
    """`n` answer-check items from `docs` in order, four per document that gives them (`document_answer_probes`),
    the ground truth's kind preferred in turn (FACT_KINDS)."""
    facts = {d.passage_id: answer_facts(d) for d in docs}
    rng = random.Random(f"{seed}/answer_probe")
    items: list[AnswerProbe] = []
    for doc in docs:
        if len(items) >= n:
            break
        prefer = FACT_KINDS[len(items) // len(ANSWER_SHOULD) % len(FACT_KINDS)]
        items += document_answer_probes(doc, facts, rng, prefer)
    return items[:n]


# -- the probes ------------------------------------------------------------------------------------------------


@dataclass
class StageProbes:
    """The gate probe and the rubric-writer probe of one Judge: per gate, a calibration per method (GATE_METHODS;
    `gates_by` names the one that decides trust), and the rubric writer's."""

    gates_by: str
    gates: dict[str, dict[str, Calibration]] = field(default_factory=dict)
    rubrics: Calibration | None = None
    answer_match: Calibration | None = None

    def configured(self) -> list[Calibration]:
        """The calibrations that decide trust: each gate as `gates_by` decides it, the rubric writer and the answer
        check (those probed)."""
        found = [by_method[self.gates_by] for by_method in self.gates.values()]
        return found + [c for c in (self.rubrics, self.answer_match) if c is not None]

    def untrusted(self) -> list[Calibration]:
        return [c for c in self.configured() if not c.trusted]

    def rows(self) -> list[dict[str, Any]]:
        """One row per calibration, the deciding ones first within each gate (notebook 02, the index page)."""
        rows = []
        for gate, by_method in self.gates.items():
            for method in sorted(by_method, key=lambda m: m != self.gates_by):
                rows.append(calibration_row(by_method[method], f"gate: {gate}", method, method == self.gates_by))
        if self.rubrics is not None:
            rows.append(calibration_row(self.rubrics, "rubric writer", "judge", True))
        if self.answer_match is not None:
            rows.append(calibration_row(self.answer_match, "answer check (Correct/Wrong)", "judge", True))
        return rows

    def to_record(self) -> dict[str, Any]:
        """The record a manifest stores; `answer_match` only where it was probed (SCOPE's record as before it)."""
        record = {"gates_by": self.gates_by,
                  "gates": {g: {m: c.to_record() for m, c in by.items()} for g, by in self.gates.items()},
                  "rubrics": None if self.rubrics is None else self.rubrics.to_record()}
        if self.answer_match is not None:
            record["answer_match"] = self.answer_match.to_record()
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StageProbes:
        gates = {g: {m: Calibration.from_record(c) for m, c in by.items()} for g, by in record["gates"].items()}
        rubrics, answers = record.get("rubrics"), record.get("answer_match")
        return cls(record["gates_by"], gates, None if rubrics is None else Calibration.from_record(rubrics),
                   None if answers is None else Calibration.from_record(answers))


def calibration_row(c: Calibration, stage: str, decided_by: str, decides: bool) -> dict[str, Any]:
    """One probe's numbers as a table row."""
    return {"stage": stage, "decided by": decided_by, "decides trust": decides, "probes": c.n_items,
            "sensitivity": c.sensitivity, "specificity": c.specificity, "separation": c.separation,
            "invalid": c.invalid_rate, "trusted": c.trusted, "reasons": "; ".join(c.reasons)}


def prompt_gates(judge: Judge) -> list[str]:
    """The configured gates a prompt decides (the answerability check needs rubrics: it is not probed here)."""
    return [g for g in judge.cfg.gates if g != ANSWERABILITY and g in RULE_GATES]


def _isolated_stats(judge: Judge, stage: str, call):
    """Run `call()` on the Judge with fresh statistics (the run's are left as they were); (result, usage)."""
    saved, judge.stats = judge.stats, JudgeStats()
    try:
        result = call()
        s = judge.stats.stage(stage)
        usage = {"prompts": s.prompts, "engine_calls": s.calls, "retried": s.retried, "seconds": round(s.seconds, 3)}
    finally:
        judge.stats = saved
    return result, usage


def probe_gates(judge: Judge, tasks: Sequence[ProbeTask], cfg: JudgeCalibrationConfig, *, model: str
                ) -> dict[str, dict[str, Calibration]]:
    """Every prompt gate on every probe task in ONE batched Judge call, calibrated per gate as each method decides
    it (GATE_METHODS)."""
    gates = prompt_gates(judge)
    if not gates or not tasks:
        return {}
    judged, usage = _isolated_stats(judge, "gates", lambda: judge.judge_gates([t.task for t in tasks],
                                                                              [t.document for t in tasks]))
    ruled = [rule_verdicts(t.task, t.document, gates) for t in tasks]
    out: dict[str, dict[str, Calibration]] = {}
    for gate in gates:
        out[gate] = {}
        for method in GATE_METHODS:
            items = []
            for t, rules, outcome in zip(tasks, ruled, judged, strict=True):
                verdict = combine_gates(method, rules, outcome.verdicts)[gate]
                items.append(ProbeItem(t.key, t.kind, GATE_SHOULD[t.kind][gate],
                                       yes=None if verdict is None else verdict == 1, invalid=verdict is None))
            title = f"{gate.replace('_', ' ')} gate ({method})"
            out[gate][method] = calibrate(title, gate, _method_model(method, model), _method_prompt(method, gate),
                                          items, cfg, usage if method != "rules" else {})
    return out


def _method_model(method: str, model: str) -> str:
    return {"judge": model, "rules": "rules", "rules_then_judge": f"rules + {model}"}[method]


def _method_prompt(method: str, gate: str) -> str:
    prompt = prompts.template_version(prompts.GATES[gate])
    return {"judge": prompt, "rules": "protocol.gate_rules", "rules_then_judge": f"protocol.gate_rules + {prompt}"}[
        method]


def probe_rubric_writer(judge: Judge, tasks: Sequence[ProbeTask], cfg: JudgeCalibrationConfig, *, model: str
                        ) -> Calibration:
    """The rubric writer on `tasks` (one per document) in ONE batched call, as in training: a `grounded` and a
    `foreign` item per reply (module docstring)."""
    replies, usage = _isolated_stats(judge, "rubrics", lambda: judge.rubrics(
        [t.task_type for t in tasks], [t.task for t in tasks], [[t.document] for t in tasks]))
    facts = {t.passage_id: document_facts(t.document) for t in tasks}
    items = []
    for t, rubrics in zip(tasks, replies, strict=True):
        own = source_facts(t.document, t.task)
        foreign = [f for pid, found in facts.items() if pid != t.passage_id for f in found
                   if not mentions(t.document, f) and not mentions(t.task, f)]
        text = "\n".join(r.text for r in rubrics or [])
        grounded = bool(rubrics) and sum(names_a_fact(r.text, own) for r in rubrics) >= cfg.rubric_fact_share * len(
            rubrics)
        items.append(ProbeItem(f"{t.key}/grounded", "grounded", True, yes=None if rubrics is None else grounded,
                               invalid=rubrics is None, reply=text))
        items.append(ProbeItem(f"{t.key}/foreign", "foreign", False, yes=None if rubrics is None
                               else names_a_fact(text, foreign), invalid=rubrics is None, reply=text))
    template = f"{prompts.template_version('rubric_writer')} ({judge.cfg.rubric_prompt})"
    result = calibrate("rubric writer", "rubrics", model, template, items, cfg, usage)
    if not tasks:
        result.reasons.insert(0, "no probe task could be built from the corpus (no document with a name and a fact)")
    return result


def probe_answer_check(judge: Judge, items: Sequence[AnswerProbe], cfg: JudgeCalibrationConfig, *, model: str
                       ) -> Calibration:
    """Search Self-Play's answer check (`Judge.answers_match`) on `items` in ONE call, as the method checks a batch:
    Correct is the probe's yes (module docstring). Each item's `reply` holds the predicted answer it judged."""
    verdicts, usage = _isolated_stats(judge, ANSWER_MATCH, lambda: judge.answers_match(
        [i.question for i in items], [i.prediction for i in items], [i.reference for i in items]))
    probes = [ProbeItem(i.key, i.kind, ANSWER_SHOULD[i.kind], yes=None if v is None else v == 1, invalid=v is None,
                        reply=i.prediction) for i, v in zip(items, verdicts, strict=True)]
    result = calibrate("answer check", ANSWER_MATCH, model, prompts.template_version("ssp_judge"), probes, cfg, usage)
    if not items:
        result.reasons.insert(0, "no probe item could be built from the corpus (no document with two facts of a kind)")
    return result


#: The stages `probe_judge_stages` probes unless told: SCOPE's (the learning check's held-out set is SCOPE's tasks).
SCOPE_STAGE_PROBES = frozenset({"gates", "rubrics"})


def probe_judge_stages(params: Params, judge: Judge, passages: Sequence[Any],
                       stages: Collection[str] = SCOPE_STAGE_PROBES) -> StageProbes:
    """The run's probes of the Judge `stages` its method uses (`Method.judge_stages`: of them `gates`, `rubrics` and
    `answer_match` are probed here, the grader by `grader_probe.probe_self_judge`), with `judge.calibration`'s item
    counts: on the corpus less the teacher's documents (`grader_probe.unseen_by_teacher`), in an order seeded by the
    document permutation's seed. A run takes them when it opens (`selfplay.loop.open_run`), the learning check (its
    held-out set is SCOPE's gates' and rubric writer's) once per held-out set."""
    cfg = params.judge.calibration
    unseen = unseen_by_teacher(params, passages)
    order = list(range(len(unseen)))
    random.Random(f"{params.selfplay.seed}/stage_probes").shuffle(order)
    sizes = {"gates": cfg.gate_items, "rubrics": cfg.rubric_items, ANSWER_MATCH: cfg.answer_match_items}
    pool = [unseen[i] for i in order[:max(200, 8 * max([sizes[s] for s in stages if s in sizes], default=0))]]
    docs = probe_documents(pool, judge.gate_engine.tokenizer, params.selfplay.document_max_tokens)
    models = judge_models(params)
    gates = probe_gates(judge, gate_probe_tasks(docs, cfg.gate_items, params.selfplay.seed), cfg,
                        model=models["gates"]) if "gates" in stages else {}
    rubrics = probe_rubric_writer(judge, rubric_probe_tasks(docs, cfg.rubric_items), cfg,
                                  model=models["rubrics"]) if "rubrics" in stages else None
    answers = probe_answer_check(judge, answer_probe_items(docs, cfg.answer_match_items, params.selfplay.seed), cfg,
                                 model=models["grading"]) if ANSWER_MATCH in stages else None
    probes = StageProbes(params.judge.gates_by, gates, rubrics, answers)
    for c in probes.configured():
        log.info("%s calibration: %s -> %s", c.judge, c.numbers(),
                 "trusted" if c.trusted else "UNTRUSTED: " + "; ".join(c.reasons))
    return probes


# -- what a run does with them ---------------------------------------------------------------------------------


#: The key of the stage probes in runs/<name>/manifest.json (the grader's is `judge_calibration`).
MANIFEST_KEY = "judge_stage_calibration"


def stored_stage_probes(run_dir: str | Path) -> StageProbes | None:
    """The stage probes a run stored when it opened (None: no manifest yet, or the probes were off)."""
    path = Path(run_dir) / "manifest.json"
    if not path.is_file():
        return None
    record = read_json(path, "it is rewritten when the run opens").get(MANIFEST_KEY)
    return None if record is None else StageProbes.from_record(record)


def refusal(untrusted: Sequence[Calibration], cfg: JudgeCalibrationConfig) -> str | None:
    """The line `scope train` stops with when a Judge stage failed its probe and the params do not accept it (None:
    nothing failed, or accepted)."""
    if not untrusted or cfg.accept_untrusted:
        return None
    failed = "; ".join(f"{c.judge} ({c.model}): {', '.join(c.reasons)}" for c in untrusted)
    roles = {c.role == ANSWER_MATCH for c in untrusted}
    tries = ["judge.gates_by: rules_then_judge for untrusted gates"] * (False in roles) + [
        "ssp.answer_check: rule for an untrusted answer check"] * (True in roles)
    return (f"the Judge failed its calibration probe: {failed}. Its verdicts decide the run's task pool and rewards "
            f"by chance (docs/protocol.md, 'Judge calibration'). Try {', or '.join(tries)}, or train anyway with "
            "--accept-untrusted-judge (params: judge.calibration.accept_untrusted)")
