"""Search Self-Play's answer set 𝒟: the ground truths its Proposer writes questions for (App. A.4), never from an
evaluation set.

The paper samples 50,000 answers from the training sets of NQ and HotpotQA (and ARPO's). Two sources here:

- **The corpus** (data-free, the default): `corpus_answers(documents, n, seed)` takes answers from the documents
  the index holds, by this rule, per document:
    - its title, without a trailing "(…)" qualifier ("George Smith (historian)" gives "George Smith"), when it has
      1 to 6 words ("title");
    - names of two or three capitalised words inside its complete sentences (`facts.facts_of`: not starting a
      sentence, without a leading function word, not the title; "name"), unless a longer name was cut short there
      (a capitalised word follows or, one of `facts.NOT_NAMES` aside, precedes: "United States Exploring" of
      "United States Exploring Expedition", "Melinda Gates Foundation" of "Bill & Melinda Gates Foundation");
      single words are left out: they are too often adjectives or parts of longer names ("Roman", "English");
    - full dates, "12 August 1873" or "August 12, 1873" ("date");
    - years 1500-2049 standing alone (`facts.YEAR`; "year");
    - other whole numbers of two or more digits, thousands separators allowed ("1,200"), outside dates ("number").
  Documents are taken in a seeded order, one answer from each in turn (a seeded pick among its candidates), then a
  second from each, and so on until `n`; an answer whose normalised text was taken before is skipped.
- **A file** (`read_answer_file`): one answer per line, or JSONL records with "answer" (a string) or "answers" /
  "golden_answers" (a list; its first item is the answer) and, optionally, "question".

The evaluation guard (`check_not_evaluation`; `read_answer_file` applies it): a file is refused when it lies in an
evaluation folder (<data dir>/benchmarks/, where `scope eval` keeps the benchmarks, and <data dir>/qa/, the QA
benchmarks' samples: `evaluation_folders`) or is one of the given evaluation files; when one of its records carries
a question of the given evaluation questions; or when more than `max_shared` (default half) of its distinct answers
are evaluation gold answers: a training set shares a few common answers (countries, years) with any test set, a
copy of a test set shares nearly all. The shared answers themselves are then dropped from what is returned, so
no evaluation gold answer is ever a training target.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from scope_lib.protocol.facts import NOT_NAMES, YEAR, Document, facts_of, sentences
from scope_lib.protocol.verification import normalize_answer

__all__ = [
    "ANSWER_KINDS", "EVALUATION_FOLDERS", "MAX_SHARED_ANSWERS", "Answer", "AnswerSetError", "answer_candidates",
    "corpus_answers", "answers_from_lines", "evaluation_folders", "check_not_evaluation", "read_answer_file",
    "sample_answers",
]

#: What the corpus rule takes from a document, in the order it lists candidates.
ANSWER_KINDS: tuple[str, ...] = ("title", "name", "date", "year", "number")
#: Folders under the data directory that hold evaluation data.
EVALUATION_FOLDERS: tuple[str, ...] = ("benchmarks", "qa")
#: The largest share of an answer file's distinct answers that may be evaluation gold answers.
MAX_SHARED_ANSWERS = 0.5
#: The most words of a title taken as an answer.
MAX_TITLE_WORDS = 6

_MONTH = (r"(?:January|February|March|April|May|June|July|August|September|October|November|December)")
_DATE = re.compile(rf"(?<![\w])(?:\d{{1,2}} {_MONTH} (?:1[5-9]\d\d|20[0-4]\d)|{_MONTH} \d{{1,2}}, (?:1[5-9]\d\d|20[0-4]\d))"
                   rf"(?![\w])")
_NUMBER = re.compile(r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d{2,})(?![\w]|[.,]\d)")
_QUALIFIER = re.compile(r"\s*\([^()]*\)\s*$")


class AnswerSetError(ValueError):
    """An answer file that cannot be used: unreadable, malformed (file:line), or an evaluation set."""


@dataclass(frozen=True)
class Answer:
    """One ground truth a* for the Proposer: its text, its kind (ANSWER_KINDS, or "file") and where it came from
    (a document id, or file:line)."""

    text: str
    kind: str
    source: str


# -- from the corpus -------------------------------------------------------------------------------------------------


def answer_candidates(document: Document, kinds: Sequence[str] = ANSWER_KINDS) -> list[Answer]:
    """The answers the corpus rule (module docstring) takes from one document, kinds in ANSWER_KINDS order, each
    text once."""
    unknown = [k for k in kinds if k not in ANSWER_KINDS]
    if unknown:
        raise ValueError(f"unknown answer kinds {unknown}; choose from {', '.join(ANSWER_KINDS)}")
    found: list[Answer] = []
    title = _QUALIFIER.sub("", document.title or "").strip().strip('"')
    if "title" in kinds and 1 <= len(title.split()) <= MAX_TITLE_WORDS:
        found.append(Answer(title, "title", document.id))
    parts = sentences(document.text)
    body = " ".join(parts)
    if "name" in kinds:
        found += [Answer(f, "name", document.id) for s in parts for kind, f in facts_of(s, document.title)
                  if kind == "name" and len(f.split()) >= 2 and not _cut_short(s, f)]
    dates = [m.group(0) for m in _DATE.finditer(body)]
    if "date" in kinds:
        found += [Answer(d, "date", document.id) for d in dates]
    if "year" in kinds:
        found += [Answer(m.group(1), "year", document.id) for m in YEAR.finditer(body)]
    if "number" in kinds:
        undated = _DATE.sub(" ", body)
        found += [Answer(m.group(0), "number", document.id) for m in _NUMBER.finditer(undated)
                  if not YEAR.fullmatch(m.group(0))]
    unique: dict[str, Answer] = {}
    for a in found:
        unique.setdefault(a.text, a)
    return list(unique.values())


def _cut_short(sentence: str, name: str) -> bool:
    """Whether `name` is part of a longer name in `sentence`: a capitalised word (or "No. 10") follows it, or a
    capitalised word that is not one of NOT_NAMES (or "&") comes before it."""
    if re.search(rf"(?<!\w){re.escape(name)}(?:\s+[A-Z]|\.\s*\d)", sentence):
        return True
    before = re.findall(rf"([\w&'’-]+)\s+{re.escape(name)}(?!\w)", sentence)
    return any(w == "&" or (w[:1].isupper() and w not in NOT_NAMES) for w in before)


def corpus_answers(documents: Sequence[Document], n: int, seed: int | str = 0,
                   kinds: Sequence[str] = ANSWER_KINDS) -> list[Answer]:
    """Up to `n` distinct answers from the corpus (the module docstring's rule and order); fewer when the documents
    hold fewer. Seeded: the same documents, `n` and seed give the same answers."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a whole number >= 0, got {n!r}")
    order = list(range(len(documents)))
    random.Random(f"{seed}/ssp/answers").shuffle(order)
    queues: list[list[Answer]] = []
    for i in order:
        candidates = answer_candidates(documents[i], kinds)
        random.Random(f"{seed}/ssp/answers/{documents[i].id}").shuffle(candidates)
        if candidates:
            queues.append(candidates)
    taken: dict[str, Answer] = {}
    depth = 0
    while len(taken) < n and any(depth < len(q) for q in queues):
        for queue in queues:
            if depth < len(queue) and len(taken) < n:
                key = normalize_answer(queue[depth].text)
                if key and key not in taken:
                    taken[key] = queue[depth]
        depth += 1
    return list(taken.values())


# -- from a file, with the evaluation guard -------------------------------------------------------------------------


def answers_from_lines(lines: Iterable[str], source: str = "<answers>") -> list[tuple[Answer, str | None]]:
    """(answer, question or None) per non-blank line: JSONL when the first non-blank line starts with "{", else one
    answer per line. A malformed record is an AnswerSetError naming source:line."""
    records: list[tuple[Answer, str | None]] = []
    jsonl: bool | None = None
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        if jsonl is None:
            jsonl = text.startswith("{")
        where = f"{source}:{number}"
        if not jsonl:
            records.append((Answer(text, "file", where), None))
            continue
        answer, question = _record(text, where)
        records.append((Answer(answer, "file", where), question))
    return records


def _record(text: str, where: str) -> tuple[str, str | None]:
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise AnswerSetError(f"{where}: not a JSON record ({exc.msg}); write one JSON object per line, or one "
                             "plain answer per line") from None
    if not isinstance(record, dict):
        raise AnswerSetError(f"{where}: a JSON {type(record).__name__}, not an object")
    answer = record.get("answer")
    if answer is None:
        listed = record.get("answers") or record.get("golden_answers")
        answer = listed[0] if isinstance(listed, list) and listed else None
    if not isinstance(answer, str | int | float) or isinstance(answer, bool) or not str(answer).strip():
        raise AnswerSetError(f'{where}: no answer: give "answer" (a string) or "answers" / "golden_answers" '
                             "(a non-empty list)")
    question = record.get("question")
    return str(answer).strip(), question if isinstance(question, str) else None


def evaluation_folders(data_dir: str | Path, extra: Iterable[str | Path] = ()) -> list[Path]:
    """Where evaluation data lives: the data directory's EVALUATION_FOLDERS and any `extra` files or folders (the
    run's `evaluation.data_files`)."""
    return [Path(data_dir) / f for f in EVALUATION_FOLDERS] + [Path(p) for p in extra]


def _inside(path: Path, place: Path) -> bool:
    return path == place or place in path.parents


def check_not_evaluation(path: str | Path, records: Sequence[tuple[Answer, str | None]], *,
                         evaluation_paths: Iterable[str | Path] = (), evaluation_questions: Iterable[str] = (),
                         evaluation_answers: Iterable[str] = (), max_shared: float = MAX_SHARED_ANSWERS) -> None:
    """Raise AnswerSetError when the answer file at `path` (read into `records`) is, or overlaps, an evaluation set:
    it lies in one of `evaluation_paths` (symbolic links resolved), a record's question is an evaluation question
    (normalised), or more than `max_shared` of its distinct answers are evaluation gold answers."""
    resolved = Path(path).resolve()
    for place in evaluation_paths:
        if _inside(resolved, Path(place).resolve()):
            raise AnswerSetError(f"{path}: the answer file lies in {place}, which holds evaluation data; SSP's "
                                 "answers must never come from an evaluation set (use training data or the corpus)")
    questions = {normalize_answer(q) for q in evaluation_questions} - {""}
    for answer, question in records:
        if question is not None and normalize_answer(question) in questions:
            raise AnswerSetError(f"{answer.source}: this record's question is an evaluation question; the file "
                                 "overlaps an evaluation set")
    golds = {normalize_answer(a) for a in evaluation_answers} - {""}
    distinct = {normalize_answer(a.text) for a, _ in records} - {""}
    shared = len(distinct & golds) / len(distinct) if distinct else 0.0
    if shared > max_shared:
        raise AnswerSetError(f"{path}: {shared:.0%} of its distinct answers are evaluation gold answers (more than "
                             f"{max_shared:.0%}): it looks like an evaluation set")


def read_answer_file(path: str | Path, *, evaluation_paths: Iterable[str | Path] = (),
                     evaluation_questions: Iterable[str] = (), evaluation_answers: Iterable[str] = (),
                     max_shared: float = MAX_SHARED_ANSWERS) -> list[Answer]:
    """The distinct answers of an answer file (`answers_from_lines`), after `check_not_evaluation`, without those
    that are evaluation gold answers; in file order, the first of each normalised text kept."""
    evaluation_answers = list(evaluation_answers)
    try:
        with open(path, encoding="utf-8") as fh:
            records = answers_from_lines(fh, str(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise AnswerSetError(f"{path}: cannot read the answer file ({exc})") from None
    if not records:
        raise AnswerSetError(f"{path}: the answer file holds no answers")
    check_not_evaluation(path, records, evaluation_paths=evaluation_paths,
                         evaluation_questions=evaluation_questions, evaluation_answers=evaluation_answers,
                         max_shared=max_shared)
    golds = {normalize_answer(a) for a in evaluation_answers}
    kept: dict[str, Answer] = {}
    for answer, _question in records:
        key = normalize_answer(answer.text)
        if key and key not in golds:
            kept.setdefault(key, answer)
    return list(kept.values())


def sample_answers(answers: Sequence[Answer], n: int, seed: int | str = 0) -> list[Answer]:
    """`n` answers drawn without replacement in a seeded order (all of them, shuffled, when there are fewer)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a whole number >= 0, got {n!r}")
    rng = random.Random(f"{seed}/ssp/sample")
    return rng.sample(list(answers), min(n, len(answers)))
