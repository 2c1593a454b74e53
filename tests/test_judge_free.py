"""The learning check's judge-free measures (scope_lib/evaluation/judge_free.py): every rule on answers whose values
are counted by hand here, without a model or a tokenizer."""

from __future__ import annotations

import pytest

from scope_lib.evaluation.judge_free import (
    MEASURES,
    answer_tokens,
    fact_recall,
    key_facts,
    length_range,
    name_precision,
    rubric_met,
    task_measures,
)
from scope_lib.protocol.names import names_in

SOURCE = ('"Eiffel Tower"\nThe Eiffel Tower was built by Gustave Eiffel for the Exposition Universelle of 1889 in '
          "Paris. It is 330 metres tall.")


def test_answer_length_is_whitespace_tokens():
    assert answer_tokens("It is about Paris.") == 4
    assert answer_tokens("  two\nlines ") == 2
    assert answer_tokens("") == 0 and answer_tokens(None) == 0


def test_names_are_capitalised_runs_that_do_not_start_a_sentence():
    assert names_in("It was built by Gustave Eiffel for the Exposition.") == ["Gustave Eiffel", "Exposition"]
    # a run that starts a sentence loses its first word; leading function words go; repeats (any case) count once
    assert names_in("Gustave Eiffel built it. In 1889 The Exposition opened in Paris; Paris's fair.") == \
        ["Eiffel", "Exposition", "Paris"]
    assert names_in("The sources discuss it.") == [] and names_in("Yes. He met Al.") == []   # "Al": too short
    assert names_in("Items:\nBerlin and Rome") == ["Rome"]                           # a line starts a sentence


def test_a_rubrics_key_facts_are_its_names_and_numbers():
    assert key_facts("Mentions Juno Awards of 1983.") == ["Juno Awards", "1983"]
    assert key_facts("Identifies Gustave Eiffel by name.") == ["Gustave Eiffel"]       # the verb is not a name
    assert key_facts("States that it is 330 metres tall, 3 times 7.5 more.") == ["330", "7.5"]   # one digit: no
    assert key_facts("Explains why the tower was built.") == []
    assert rubric_met("Built for the 1889 Juno awards.", "Mentions Juno Awards of 1983.") is False  # every fact
    assert rubric_met("The Juno Awards of 1983 were held.", "Mentions Juno Awards of 1983.") is True
    assert rubric_met("Anything.", "Explains why.") is None


def test_fact_recall_counts_the_rubrics_with_a_key_fact():
    rubrics = ["Identifies Gustave Eiffel by name.", "Mentions 1889.", "States the height of 330 metres.",
               "Explains why the tower was built."]             # three with a key fact, one without
    assert fact_recall("Gustave Eiffel built it in 1889.", rubrics) == pytest.approx(2 / 3)
    assert fact_recall("It was Eiffel, in 1889.", rubrics) == pytest.approx(1 / 3)   # "Gustave Eiffel" whole
    assert fact_recall(None, rubrics) == 0.0                                        # no answer: nothing met
    assert fact_recall("Gustave Eiffel.", ["Explains why."]) is None


def test_name_precision_is_the_share_of_names_the_source_mentions():
    assert name_precision("It was built by Gustave Eiffel for Paris.", SOURCE) == 1.0
    assert name_precision("It was built by Gustave Eiffel with Berlin and Rome.", SOURCE) == pytest.approx(1 / 3)
    assert name_precision("It was built in 1889.", SOURCE) is None                  # names nothing
    assert name_precision(None, SOURCE) is None and name_precision("By Gustave Eiffel.", None) is None


def test_m0s_length_range_is_its_5th_to_95th_percentile():
    answers = [" ".join(["w"] * n) for n in range(1, 22)] + [None]                  # 1..21 tokens, one unanswered
    assert length_range(answers) == (pytest.approx(2.0), pytest.approx(20.0))
    assert length_range([None, None]) is None


def test_a_tasks_measures_average_its_rollouts():
    rubrics = ["Identifies Gustave Eiffel by name.", "Mentions 1889."]
    answers = ["It was Gustave Eiffel in 1889.",                      # 6 tokens, 1 name, recall 1, precision 1
               "It was built by Berlin and Gustave Eiffel.",          # 8 tokens, 2 names, recall 1/2, precision 1/2
               None]                                                  # no answer: 0 tokens, 0 names, recall 0
    m = task_measures(answers, [1.0, 0.5, 0.0], rubrics, SOURCE, (5.0, 7.0))
    assert set(m) == set(MEASURES)
    assert m["answered"] == pytest.approx(2 / 3)
    assert m["answer_tokens"] == pytest.approx((6 + 8 + 0) / 3)
    assert m["names"] == pytest.approx((1 + 2 + 0) / 3)
    assert m["fact_recall"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["name_precision"] == pytest.approx((1 + 0.5) / 2)             # over the answers that name something
    assert m["score_in_m0_lengths"] == 1.0                                 # only the 6-token answer is in [5, 7]
    none = task_measures([None], [0.0], rubrics, SOURCE, None)
    assert none["name_precision"] is None and none["score_in_m0_lengths"] is None and none["answered"] == 0.0
