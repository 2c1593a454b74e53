"""scope_lib.protocol.answer_set: Search Self-Play's answer set from the corpus (the documented rule, seeded,
de-duplicated), from a file, and the guard that refuses evaluation data."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from scope_lib.protocol import answer_set as A


@dataclass(frozen=True)
class Doc:
    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        return f'"{self.title}"\n{self.text}'


# sentences() drops the passage's first piece (a 100-word passage starts mid-sentence) and any unfinished last one
DROGO = Doc("7", "Castle Drogo (house)",
            "walls of granite. Castle Drogo was built for Julius Drewe between 1911 and 1930 in Devon. "
            "The architect Edwin Lutyens designed it on 12 August 1911 for 60,000 pounds. "
            "It has 1,200 rooms, 25 towers and a garden by the United States Exploring Expedition team. Its last")
JEKYLL = Doc("8", "Gertrude Jekyll",
             "a garden designer. She was born on November 29, 1843 in London and met Edwin Lutyens in 1889. "
             "Her garden at Hestercombe House was laid out with 40 beds. Her next")


def test_the_corpus_rule_on_a_hand_read_document():
    found = [(a.kind, a.text) for a in A.answer_candidates(DROGO)]
    assert found == [
        ("title", "Castle Drogo"),                  # the "(house)" qualifier dropped
        ("name", "Julius Drewe"), ("name", "Edwin Lutyens"),   # "Devon": one word; "United States Exploring": cut
        ("date", "12 August 1911"),
        ("year", "1911"), ("year", "1930"),
        ("number", "60,000"), ("number", "1,200"), ("number", "25"),   # "12" is the date's; years are years
    ]
    assert all(a.source == "7" for a in A.answer_candidates(DROGO))


def test_kinds_choose_what_is_taken():
    assert [a.text for a in A.answer_candidates(JEKYLL, kinds=("date", "year"))] == \
        ["November 29, 1843", "1843", "1889"]
    assert [a.text for a in A.answer_candidates(JEKYLL, kinds=("name",))] == ["Edwin Lutyens", "Hestercombe House"]
    with pytest.raises(ValueError, match="unknown answer kinds"):
        A.answer_candidates(JEKYLL, kinds=("person",))


def test_corpus_answers_take_one_per_document_in_turn_then_more():
    two = A.corpus_answers([DROGO, JEKYLL], 2, seed=0)
    assert sorted(a.source for a in two) == ["7", "8"]
    everything = A.corpus_answers([DROGO, JEKYLL], 100, seed=0)
    texts = [a.text for a in everything]
    assert len(texts) == len(set(texts))
    assert texts.count("Edwin Lutyens") == 1                      # in both documents, taken once
    expected = {a.text for a in A.answer_candidates(DROGO)} | {a.text for a in A.answer_candidates(JEKYLL)}
    assert set(texts) == expected and len(texts) == 9 + 7 - 1


def test_corpus_answers_are_seeded():
    one = A.corpus_answers([DROGO, JEKYLL], 5, seed=1)
    assert one == A.corpus_answers([DROGO, JEKYLL], 5, seed=1)
    assert len({tuple(a.text for a in A.corpus_answers([DROGO, JEKYLL], 5, seed=s)) for s in range(6)}) > 1
    assert A.corpus_answers([DROGO], 0) == []
    with pytest.raises(ValueError, match="n must be"):
        A.corpus_answers([DROGO], -1)


def test_corpus_answers_on_the_real_sample(wiki_sample):
    from scope_lib.protocol.verification import normalize_answer
    from scope_lib.retrieval.corpus import read_corpus

    passages = read_corpus(wiki_sample).passages
    by_id = {p.id: p for p in passages}
    answers = A.corpus_answers(passages, 300, seed=0)
    assert len(answers) == 300 and answers == A.corpus_answers(passages, 300, seed=0)
    assert len({normalize_answer(a.text) for a in answers}) == 300
    assert {a.kind for a in answers} == set(A.ANSWER_KINDS)
    assert len({a.source for a in answers}) >= 250                 # spread over documents, about one each
    for a in answers:                                               # every answer is read from its document
        assert a.text in by_id[a.source].contents, a


def test_normalised_duplicates_are_dropped():
    twin = Doc("9", "castle drogo", "x. The garden was planted for Julius Drewe in the year 1911 by hand. y")
    texts = [a.text for a in A.corpus_answers([DROGO, twin], 100, seed=0)]
    assert sum(t.lower() == "castle drogo" for t in texts) == 1 and texts.count("1911") == 1


# -- the answer file ---------------------------------------------------------------------------------------------------


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_plain_file_one_answer_per_line(tmp_path):
    path = _write(tmp_path / "answers.txt", ["Castle Drogo", "", "  castle drogo. ", "1911", "Otis Williams"])
    answers = A.read_answer_file(path)
    assert [a.text for a in answers] == ["Castle Drogo", "1911", "Otis Williams"]
    assert answers[0].source == f"{path}:1" and answers[1].source == f"{path}:4" and answers[0].kind == "file"


def test_a_jsonl_file(tmp_path):
    path = _write(tmp_path / "answers.jsonl", [
        json.dumps({"answer": "Castle Drogo", "question": "Which castle?"}),
        json.dumps({"answers": ["Otis Williams", "Otis Miles"]}),
        json.dumps({"golden_answers": ["1911"]}),
        json.dumps({"answer": 42}),
    ])
    assert [a.text for a in A.read_answer_file(path)] == ["Castle Drogo", "Otis Williams", "1911", "42"]


@pytest.mark.parametrize("lines, message", [
    (['{"answer": "x"}', "{not json"], ":2: not a JSON record"),
    (['{"answer": "x"}', '["x"]'], ":2: a JSON list"),
    (['{"answer": "x"}', '{"answers": []}'], ":2: no answer"),
    (['{"question": "Q?"}'], ":1: no answer"),
    (["", "  "], "holds no answers"),
])
def test_malformed_answer_files_name_file_and_line(tmp_path, lines, message):
    path = _write(tmp_path / "answers.jsonl", lines)
    with pytest.raises(A.AnswerSetError, match=message):
        A.read_answer_file(path)


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(A.AnswerSetError, match="cannot read the answer file"):
        A.read_answer_file(tmp_path / "nope.txt")


# -- the evaluation guard ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", A.EVALUATION_FOLDERS)
def test_files_in_the_evaluation_folders_are_refused(tmp_path, folder):
    path = _write(tmp_path / "data" / folder / "nq" / "answers.txt", ["Castle Drogo"])
    with pytest.raises(A.AnswerSetError, match="holds evaluation data"):
        A.read_answer_file(path, evaluation_paths=A.evaluation_folders(tmp_path / "data"))


def test_a_link_into_an_evaluation_folder_or_a_named_evaluation_file_is_refused(tmp_path):
    real = _write(tmp_path / "data" / "benchmarks" / "test.jsonl", ['{"answer": "x"}'])
    link = tmp_path / "elsewhere.jsonl"
    link.symlink_to(real)
    with pytest.raises(A.AnswerSetError, match="holds evaluation data"):
        A.read_answer_file(link, evaluation_paths=A.evaluation_folders(tmp_path / "data"))
    named = _write(tmp_path / "my_eval.txt", ["x"])
    with pytest.raises(A.AnswerSetError, match="holds evaluation data"):
        A.read_answer_file(named, evaluation_paths=A.evaluation_folders(tmp_path / "data", extra=[named]))
    fine = _write(tmp_path / "train" / "answers.txt", ["x"])
    assert [a.text for a in A.read_answer_file(fine, evaluation_paths=A.evaluation_folders(tmp_path / "data"))] \
        == ["x"]


def test_a_record_with_an_evaluation_question_is_refused(tmp_path):
    path = _write(tmp_path / "answers.jsonl", [json.dumps({"answer": "a", "question": "Who?"}),
                                               json.dumps({"answer": "b", "question": "Who wrote Hamlet?"})])
    with pytest.raises(A.AnswerSetError, match=r"answers.jsonl:2: .*evaluation question"):
        A.read_answer_file(path, evaluation_questions=["who wrote hamlet"])


def test_mostly_evaluation_answers_are_refused_and_shared_ones_dropped(tmp_path):
    path = _write(tmp_path / "answers.txt", ["Paris", "1990", "Castle Drogo", "Otis Williams"])
    # 2 of 4 distinct answers are evaluation gold answers: 50%, not more than half -> kept, the two dropped
    kept = A.read_answer_file(path, evaluation_answers=["the paris", "1990", "London"])
    assert [a.text for a in kept] == ["Castle Drogo", "Otis Williams"]
    # 3 of 4: 75% -> an evaluation set
    with pytest.raises(A.AnswerSetError, match="75% of its distinct answers"):
        A.read_answer_file(path, evaluation_answers=["Paris", "1990", "Otis Williams"])
    with pytest.raises(A.AnswerSetError, match="50% of its distinct answers"):
        A.read_answer_file(path, evaluation_answers=["Paris", "1990"], max_shared=0.25)


def test_a_copy_of_the_nq_sample_is_refused_wherever_it_lies(shared_data, tmp_path):
    nq = shared_data / "qa" / "nq.jsonl"
    with pytest.raises(A.AnswerSetError, match="holds evaluation data"):
        A.read_answer_file(nq, evaluation_paths=A.evaluation_folders(shared_data))
    records = [json.loads(line) for line in nq.read_text(encoding="utf-8").splitlines() if line.strip()]
    copy = _write(tmp_path / "train_answers.jsonl", [json.dumps(r) for r in records])
    with pytest.raises(A.AnswerSetError, match="evaluation question"):
        A.read_answer_file(copy, evaluation_questions=[r["question"] for r in records])
    answers_only = _write(tmp_path / "answers.txt", [r["golden_answers"][0] for r in records])
    with pytest.raises(A.AnswerSetError, match="look"):
        A.read_answer_file(answers_only, evaluation_answers=[g for r in records for g in r["golden_answers"]])


def test_sample_answers_is_seeded_without_replacement():
    pool = [A.Answer(str(i), "file", f"f:{i}") for i in range(10)]
    draw = A.sample_answers(pool, 4, seed=2)
    assert len(draw) == 4 and len(set(draw)) == 4 and draw == A.sample_answers(pool, 4, seed=2)
    assert sorted(a.text for a in A.sample_answers(pool, 50)) == sorted(a.text for a in pool)
