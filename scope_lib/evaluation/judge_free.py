"""Judge-free measures of the learning check: what the answers say, read from their stored text without the grader
the Solver trained against (issue 47; docs/training.md, "The learning check").

    answer_tokens("It is about Paris.")                                    # 4: whitespace-separated tokens
    key_facts("Mentions Juno Awards of 1983.")                            # ['Juno Awards', '1983']
    fact_recall(answer, rubric_texts)                                      # met rubrics / rubrics with a key fact
    name_precision(answer, source_document)                                # names in the source / names
    task_measures(answers, scores, rubric_texts, source_document, lengths) # one held-out task, every measure

Every rule is lexical and needs no tokenizer and no model, so a stored evaluation is measured as it is and two
models' answers on the same scale:

- **answer length**: whitespace-separated tokens of the answer (a word with the punctuation stuck to it);
- **names**: `protocol.names.names_in`: runs of capitalised words, the first word of a sentence left out
  (capitalised by grammar, not because it names something), leading words of `protocol.facts.NOT_NAMES` ("The",
  "In", months, ...) dropped, a word of 3 letters or more; the rule gates read tasks with the same rule;
- **a rubric's key facts** (`key_facts`): its names and its numbers of two or more digits (years among them); the
  rubric is met lexically when the answer mentions every one (`protocol.facts.mentions`: a whole word or phrase, any
  case); a rubric without a key fact ("Explains the cause") is not counted;
- **name precision**: the share of the answer's names that the task's source document mentions.

A rollout without an answer counts as an empty answer (length 0, no name, no rubric met), as it scores 0 with the
grader; its name precision is undefined, as is that of an answer that names nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from scope_lib.protocol.facts import mentions
from scope_lib.protocol.names import names_in

#: The judge-free measures, in the order reports show them: each a per-task mean over the K rollouts.
MEASURES = ("answered", "answer_tokens", "names", "fact_recall", "name_precision", "score_in_m0_lengths")
#: What each measure is, for tables and reasons.
LABELS = {"answered": "answered rate", "answer_tokens": "answer length (tokens)", "names": "names per answer",
          "fact_recall": "rubric-fact recall", "name_precision": "name precision",
          "score_in_m0_lengths": "rubric score at M0's lengths"}
#: M0's length range: the 5th to the 95th percentile of its answers' lengths (a few outliers do not stretch it).
LENGTH_PERCENTILES = (5.0, 95.0)

_NUMBER = re.compile(r"(?<![\w.,-])\d+(?:[.,]\d+)*(?![\w])")


def answer_tokens(answer: str | None) -> int:
    """The answer's length: its whitespace-separated tokens (0 for no answer)."""
    return len(answer.split()) if answer else 0


def key_facts(rubric: str) -> list[str]:
    """The facts a rubric asks for, lexically: its names (`names_in`; its first word, the verb, is left out) and its
    numbers of two or more digits."""
    return names_in(rubric) + [n for n in _NUMBER.findall(rubric) if sum(c.isdigit() for c in n) >= 2]


def rubric_met(answer: str, rubric: str) -> bool | None:
    """Whether the answer mentions every key fact of the rubric (None: the rubric has none)."""
    facts = key_facts(rubric)
    return all(mentions(answer, f) for f in facts) if facts else None


def fact_recall(answer: str | None, rubrics: Sequence[str]) -> float | None:
    """The share of the rubrics with a key fact that the answer meets lexically (0 for no answer; None when no
    rubric has a key fact)."""
    met = [rubric_met(answer or "", r) for r in rubrics]
    counted = [m for m in met if m is not None]
    return sum(counted) / len(counted) if counted else None


def name_precision(answer: str | None, document: str | None) -> float | None:
    """The share of the answer's names that the source document mentions (None: no answer, no name, or no
    document)."""
    names = names_in(answer) if answer else []
    if not names or not document:
        return None
    return sum(mentions(document, n) for n in names) / len(names)


def length_range(answers: Sequence[str | None]) -> tuple[float, float] | None:
    """M0's length range: LENGTH_PERCENTILES of the lengths of its answers (None when it answered nothing)."""
    import numpy as np

    lengths = [answer_tokens(a) for a in answers if a is not None]
    if not lengths:
        return None
    lo, hi = np.percentile(lengths, LENGTH_PERCENTILES)
    return float(lo), float(hi)


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def task_measures(answers: Sequence[str | None], scores: Sequence[float], rubrics: Sequence[str],
                  document: str | None, lengths: tuple[float, float] | None) -> dict[str, float | None]:
    """Every measure of one held-out task: the mean over its rollouts of each rollout's value, over the rollouts
    where the value is defined (None when it is defined for none). `scores` are the rollouts' rubric scores g;
    `lengths` M0's length range (`length_range`), within which `score_in_m0_lengths` averages g over the answered
    rollouts."""
    def in_range(answer: str | None) -> bool:
        return answer is not None and lengths is not None and lengths[0] <= answer_tokens(answer) <= lengths[1]

    return {
        "answered": _mean([float(a is not None) for a in answers]),
        "answer_tokens": _mean([float(answer_tokens(a)) for a in answers]),
        "names": _mean([float(len(names_in(a))) if a else 0.0 for a in answers]),
        "fact_recall": _mean([fact_recall(a, rubrics) for a in answers]),
        "name_precision": _mean([name_precision(a, document) for a in answers]),
        "score_in_m0_lengths": _mean([g if in_range(a) else None for a, g in zip(answers, scores, strict=True)]),
    }
