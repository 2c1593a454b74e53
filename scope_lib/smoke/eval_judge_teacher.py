"""Teacher traces for the evaluation judges: an option of the warm start (`model.warm_start.eval_judges`, off by
default; CPU demos only, not in the paper). When M0 is also the benchmark judge (`evaluation.judge_backend: local`,
as in params/smollm.yaml), the warm start can teach it the two judge prompts the CPU evaluation leans on:

- the short-form QA judge: SCOPE's strict grader (Figure 11) with the semantic-equivalence rubric
  (`scorers.QAJudge`), for a short answer to a question about a corpus document;
- the criterion grader (`criterion_grader`: HealthBench, ResearchPlanGen, ResearchRubrics' scope_paper scorer),
  for a teacher answer against one "Mentions X." criterion.

The replies decide by copying facts, in the style of the self-Judge's reasoned grades (`JudgeTeacher.grade` with
`model.warm_start.grade_reasoning`): first what the answer names, each "X (named)", then the reference answers (or
the criterion's fact), "(named)" when the answer holds it and ", not named" when it does not, then the verdict.
Whether a fact is held becomes a copy of what followed its last mention, which a pretrained model makes by
induction. Every prompt is the one `scope eval` sends (the scorers build it), chat-templated as the local judge
encodes it; every reply ends with the end-of-turn token, since the evaluation judge samples without stop strings.
Both verdicts come equally often.

The judges' calibration probes (`scope_lib.evaluation.judge_probes`) use other wording ("Identifies X by name.",
another question's gold answer), so passing them is not learning them by heart.

    traces = eval_judge_traces(tokenizer, documents, params.model.warm_start)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scope_lib.config import WarmStartConfig
from scope_lib.evaluation import scorers as S
from scope_lib.evaluation.benchmarks import Item
from scope_lib.protocol import prompts
from scope_lib.protocol.facts import Names, fact_pairs, fact_responses, mentions
from scope_lib.retrieval.corpus import Passage
from scope_lib.smoke.teacher import (
    SENTENCE_RUBRICS,
    Example,
    TeacherError,
    listed_facts,
    title_words,
)

#: The two evaluation judge roles the option teaches (keys of `model.warm_start.role_repeats`).
ROLES = ("qa_judge", "criterion_grader")
#: Every reply fits this many tokens of M0's tokenizer: the evaluation judges' `max_tokens` must be at least this.
EVAL_JUDGE_MAX_TOKENS = 64
#: Facts of the answer listed before the verdict (the held one among them).
LISTED_FACTS = 3
#: Examples per document and role: half say yes, half no.
PER_DOCUMENT = 4

_QUESTIONS = ("what is {subject} known for", "who or what is linked to {subject}",
              "what name or year goes with {subject}")
_CONVERSATIONS = ("Summarise in a short paragraph what is known about {subject}.",
                  "Explain in one paragraph what {subject} is linked to.")


@dataclass
class JudgeTrace:
    """One evaluation-judge example: its role, the judge prompt (chat messages, as the scorer builds them), the
    teacher's reply, the verdict in it, and the SFT example (prompt tokens masked, reply and end-of-turn trained)."""

    role: str
    messages: list[dict[str, str]]
    reply: str
    verdict: int
    example: Example


def _join(parts: Sequence[str]) -> str:
    parts = list(parts)
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _listed(names: Names, answer: str, held: Sequence[str]) -> str:
    """What the answer names, each "(named)": at most LISTED_FACTS, the held facts among them."""
    facts = names.facts(f"and {answer}")  # a bare answer ("Morris") starts the text, where Names skips a word
    for h in held:   # a held fact as the criterion spells it, however long (`teacher.listed_facts`)
        facts = listed_facts(facts, answer, h)
    keep = [f for f in facts if any(f.lower() == h.lower() for h in held)]
    facts = [f for f in facts if f not in keep][:max(0, LISTED_FACTS - len(keep))] + keep
    facts = sorted(facts, key=lambda f: answer.lower().find(f.lower()))
    return _join([f"{f} (named)" for f in facts]) if facts else "no name or year"


def _marked(fact: str, held: bool) -> str:
    return f"{fact} (named)" if held else f"{fact}, not named"


def qa_reply(names: Names, answer: str, golds: Sequence[str]) -> tuple[int, str]:
    """The short-form judge's verdict (1 when the answer names one of the gold answers) and its reasoned reply."""
    held = [g for g in golds if mentions(answer, g)]
    verdict = int(bool(held))
    references = (f"The reference answer is {_marked(golds[0], bool(held))}" if len(golds) == 1 else
                  "The reference answers are " + " or ".join(_marked(g, g in held) for g in golds))
    return verdict, (f"<think>The response names {_listed(names, answer, held)}. {references}.</think>\n"
                     f"<score>{verdict}</score>")


def criterion_reply(names: Names, answer: str, fact: str) -> tuple[int, str]:
    """The criterion grader's verdict (met when the reply names the criterion's fact) and its JSON reply, the
    reasoning in the explanation before the verdict."""
    held = mentions(answer, fact)
    explanation = (f"The reply names {_listed(names, answer, [fact] if held else [])}. The criterion asks for "
                   f"{_marked(fact, held)}.")
    return int(held), '{"explanation": "' + explanation + '", "criteria_met": ' + ("true" if held else "false") + "}"


def _example(tokenizer, role: str, messages: list[dict[str, str]], reply: str) -> Example:
    """The prompt as `LocalEngineBackend` encodes it, then the reply and the end-of-turn token (trained)."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    completion = tokenizer.encode(reply, add_special_tokens=False)
    if len(completion) > EVAL_JUDGE_MAX_TOKENS:
        raise TeacherError(f"{role} reply of {len(completion)} tokens exceeds {EVAL_JUDGE_MAX_TOKENS}: {reply!r}")
    if tokenizer.eos_token_id is not None:
        completion.append(tokenizer.eos_token_id)
    return Example(role, prompt + completion, [0] * len(prompt) + [1] * len(completion))


def eval_judge_traces(tokenizer, documents: Sequence[Passage], cfg: WarmStartConfig) -> list[JudgeTrace]:
    """PER_DOCUMENT short-form-judge and criterion-grader traces per document with at least four facts (names and
    years of `cfg.fact_max_tokens` tokens, `protocol.facts.Names`), half of each role saying yes. Deterministic for
    `cfg.seed`. A reply that would not fit EVAL_JUDGE_MAX_TOKENS is skipped."""
    names = Names(tokenizer, cfg.fact_max_tokens)
    by_document = [(d, names.facts(d.text, exclude=title_words(d.title))) for d in documents]
    by_document = [(d, f) for d, f in by_document if len(f) >= 4]
    traces: list[JudgeTrace] = []
    qa = S.QAJudge()
    for k, (doc, facts) in enumerate(by_document):
        rng = random.Random(f"{cfg.seed}/eval-judges/{doc.id}")
        subject = doc.title
        others = [f for _, fs in by_document[k + 1:] + by_document[:k] for f in fs if not mentions(doc.text, f)]
        if not others:
            continue
        other = rng.choice(others)
        # the short-form judge: one or two gold answers; short answers that name one of them or not
        golds = facts[:1 + rng.randrange(2)]
        question = rng.choice(_QUESTIONS).format(subject=subject)
        item = Item(f"teacher-{doc.id}", "teacher", [{"role": "user", "content": question}],
                    {"golden_answers": list(golds)})
        gold, wrong = rng.choice(golds), facts[2]
        for answer in (gold, f"It is {gold}.", wrong, f"It is {other}."):
            _add(traces, tokenizer, "qa_judge", qa.units(item, answer)[0].messages,
                 *qa_reply(names, answer, golds))
        # the criterion grader: "Mentions X." against teacher answers naming X (and one more fact) or not
        conversation = f"user: {rng.choice(_CONVERSATIONS).format(subject=subject)}"
        fact, rest = facts[0], facts[1:]
        points = rng.choice([1, 2, 3, 5])
        criterion = f"Mentions {fact}."
        for held in ([fact], [rest[0], fact], [rest[1]], [rest[0], rest[2]]):
            answer = f"{subject} is linked to {_join(held)}."
            unit = S.criterion_unit("c0", conversation, answer, criterion, points)
            _add(traces, tokenizer, "criterion_grader", unit.messages, *criterion_reply(names, answer, fact))
    if cfg.sentence_grades:
        traces += criterion_sentence_traces(tokenizer, names, documents, cfg.seed)
    return traces


def criterion_sentence_traces(tokenizer, names: Names, documents: Sequence[Passage], seed: int) -> list[JudgeTrace]:
    """Criterion-grader traces on answers made of a document's own sentences, as `teacher.sentence_grades` writes
    them for the self-Judge (`model.warm_start.sentence_grades`): the fact stated (two orders), its sentence
    removed, the fact swapped; the criterion in one of `teacher.SENTENCE_RUBRICS`' wordings."""
    traces: list[JudgeTrace] = []
    for pair in fact_pairs(documents, len(documents), seed):
        rng = random.Random(f"{seed}/eval-judges/sentences/{pair.passage_id}")
        conversation = f"user: {rng.choice(_CONVERSATIONS).format(subject=pair.subject)}"
        criterion, points = rng.choice(SENTENCE_RUBRICS).format(fact=pair.fact), rng.choice([1, 2, 3, 5])
        for _kind, answer, _met in fact_responses(pair):
            unit = S.criterion_unit("c0", conversation, answer, criterion, points)
            _add(traces, tokenizer, "criterion_grader", unit.messages, *criterion_reply(names, answer, pair.fact))
    return traces


def _add(traces: list[JudgeTrace], tokenizer, role: str, messages: list[dict[str, str]], verdict: int,
         reply: str) -> None:
    try:
        example = _example(tokenizer, role, messages, reply)
    except TeacherError:
        return
    traces.append(JudgeTrace(role, messages, reply, verdict, example))


def fingerprint() -> str:
    """A hash of what these traces are made of (this module, the grader and the two evaluation templates), part of
    the warm-started model's cache key when the option is on."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(prompts.load_template("grader").template.encode())
    for name in ("semantic_equivalence_rubric", "criterion_grader"):
        digest.update(S.template_version(name).encode())
    return digest.hexdigest()
