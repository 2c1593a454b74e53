"""scope_lib.protocol.ssp: Search Self-Play's rule filters (each reason), the Solver's rule check, the rewards
(eq. 6-7) against hand-computed values, RAG verification's noise passages, and the prompts."""

from __future__ import annotations

import pytest

from scope_lib.protocol import ssp
from scope_lib.protocol.dialects import DIALECTS
from scope_lib.protocol.parsing import extract_answer

QUESTION = ("What is the name of the castle in Devon designed by the architect who laid out the garden at "
            "Hestercombe House with Gertrude Jekyll?")

# -- the Proposer's question ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, question", [
    ("<think>plan</think><question> Who? </question>", "Who?"),
    ("<question>first</question> then <question>second</question>", "second"),
    ("<question>a <question>b</question>", "b"),                     # the nearest opener pairs
    ('<question id="1">Who?</question>', "Who?"),
    ("<question>  </question>", ""),
    ("<think><question>Who?</question></think> nothing", None),      # only inside thinking
    ("<question>Who?", None),                                        # never closed
    ("Who?", None),
    (None, None),
])
def test_extract_question(reply, question):
    assert ssp.extract_question(reply) == question


FILTERED = [
    ("no_question", None, "Castle Drogo", 3),
    ("empty", "", "Castle Drogo", 3),
    ("empty", "   ", "Castle Drogo", 3),
    ("tags_left", "Which castle <search>Lutyens castle</search> did Lutyens design in Devon?", "Castle Drogo", 3),
    ("tags_left", "Which castle did the architect design? <information>Doc 1</information>", "Castle Drogo", 3),
    ("no_search", QUESTION, "Castle Drogo", 0),
    ("too_short", "Temptations singer", "Otis Williams", 2),
    ("too_short", "Which Temptations singer?", "Otis Williams", 2),
    ("answer_in_question", "Which 20th-century building, castle drogo or another, did Lutyens design?",
     "Castle Drogo", 3),
    ("answer_in_question", "Which castle, the one near Drewsteignton, is the last built in England?",
     ["Castle Drogo", "Drewsteignton"], 3),
    ("answer_in_question", "In which year (1930, some say) was the last castle in England finished?", "1930", 2),
]


@pytest.mark.parametrize("reason, question, answer, searches", FILTERED)
def test_each_rule_filter_names_its_reason(reason, question, answer, searches):
    assert ssp.filter_question(question, answer, searches) == reason


def test_every_filter_reason_has_a_case():
    assert {reason for reason, *_ in FILTERED} == set(ssp.FILTER_REASONS)


def test_a_good_question_passes_every_filter():
    assert ssp.filter_question(QUESTION, "Castle Drogo", 3) is None
    assert ssp.filter_question(QUESTION, ["Castle Drogo", "Drogo Castle"], 1) is None


def test_the_answer_check_is_whole_words_in_any_case():
    assert ssp.filter_question("Which PARISIAN landmark was finished in 1889 for a fair?", "Paris", 1) is None
    assert ssp.filter_question("Which landmark of PARIS was finished in 1889 for a fair?", "Paris", 1) == \
        "answer_in_question"
    assert ssp.filter_question("Which landmark of Paris was finished in 1889 for a fair?", "The Paris!", 1) == \
        "answer_in_question"


def test_filters_run_in_the_documented_order():
    # too short AND holding the answer: the earlier rule names it
    assert ssp.filter_question("Otis Williams?", "Otis Williams", 1) == "too_short"
    # no search AND too short
    assert ssp.filter_question("Temptations singer", "Otis Williams", 0) == "no_search"
    assert ssp.filter_question("one two three four", "x", 1, min_words=4) is None
    with pytest.raises(ValueError, match="n_valid_searches"):
        ssp.filter_question(QUESTION, "x", -1)


# -- the Solver's answer and the rewards ---------------------------------------------------------------------------


@pytest.mark.parametrize("prediction, answer, correct", [
    ("Castle Drogo", "Castle Drogo", True),
    ("castle drogo.", "Castle Drogo", True),
    ("The Castle Drogo", "Castle Drogo", True),
    ("It is Castle Drogo in Devon", "Castle Drogo", True),             # containment, 6 words
    ("Drogo", "Castle Drogo", False),                                  # a part is not the answer
    ("Castle Drogos", "Castle Drogo", False),
    ("Hestercombe House", "Castle Drogo", False),
    ("x " * 10 + "Castle Drogo", "Castle Drogo", False),               # 12 words: over the containment cap
    ("Lindisfarne", ["Castle Drogo", "Lindisfarne Castle", "Lindisfarne"], True),   # aliases
    (None, "Castle Drogo", False),
    ("", "", False),
])
def test_answer_correct_by_rule(prediction, answer, correct):
    assert ssp.answer_correct(prediction, answer) is correct


def test_containment_can_be_switched_off():
    assert not ssp.answer_correct("It is Castle Drogo", "Castle Drogo", containment=False)
    assert ssp.answer_correct("castle  DROGO", "Castle Drogo", containment=False)


def test_the_solver_reward_reads_the_answer_tag():
    reply = "<think>Lutyens designed it.</think><answer> Castle Drogo </answer>"
    assert ssp.solver_reward(ssp.answer_correct(extract_answer(reply), "Castle Drogo")) == 1.0
    assert ssp.solver_reward(ssp.answer_correct(extract_answer("Castle Drogo"), "Castle Drogo")) == 0.0


@pytest.mark.parametrize("solved, reward", [
    ([1, 0, 0, 0, 1], 0.6),        # 1 − 2/5
    ([1, 1, 1, 1, 1], 0.0),
    ([0, 0, 0, 0, 0], 1.0),
    ([1, 0, 0, 0], 0.75),          # 1 − 1/4
])
def test_proposer_reward_is_one_minus_the_success_rate(solved, reward):
    assert ssp.proposer_reward([bool(s) for s in solved], valid=True) == pytest.approx(reward)


def test_an_invalid_question_earns_the_proposer_nothing():
    assert ssp.proposer_reward([], valid=False) == 0.0
    assert ssp.proposer_reward([False, False], valid=False) == 0.0
    with pytest.raises(ValueError, match="n attempts"):
        ssp.proposer_reward([], valid=True)


# -- RAG verification -------------------------------------------------------------------------------------------------

BATCH = [
    ["own 1", "own 2", "shared passage"],
    ["other 1a", "other 1b", "shared  passage"],     # the same passage, retrieved by trajectory 0 too
    ["other 2a", "other 2b", "other 2c"],
    ["other 3a", "own 1"],
]


@pytest.mark.parametrize("seed", range(20))
def test_rag_passages_are_own_plus_four_noise_never_the_trajectorys_own(seed):
    docs = ssp.rag_passages(BATCH, 0, seed=seed)
    own = {"own 1", "own 2", "shared passage"}
    assert own <= set(docs) and len(docs) == 3 + 4 and len(set(docs)) == len(docs)
    noise = [d for d in docs if d not in own]
    assert len(noise) == 4
    assert all(n.startswith("other") for n in noise)    # never "shared  passage", never trajectory 0's "own 1"
    assert docs == ssp.rag_passages(BATCH, 0, seed=seed)


def test_rag_passages_are_shuffled_by_the_seed():
    orders = {tuple(ssp.rag_passages(BATCH, 0, seed=s)) for s in range(20)}
    assert len(orders) > 5
    assert any(set(order[:3]) != {"own 1", "own 2", "shared passage"} for order in orders)   # own not always first


def test_rag_passages_take_what_the_batch_has():
    docs = ssp.rag_passages([["a", "a", "b"], ["b", "c"]], 0, seed=0)
    assert sorted(docs) == ["a", "b", "c"]                # own once each, one noise passage available
    assert sorted(ssp.rag_passages([["a"], ["b"]], 0, n_noise=0)) == ["a"]
    assert ssp.rag_passages([["a"]], 0) == ["a"]
    with pytest.raises(ValueError, match="not in a batch"):
        ssp.rag_passages([["a"]], 1)
    with pytest.raises(ValueError, match="n_noise"):
        ssp.rag_passages([["a"]], 0, n_noise=-1)


# -- prompts (App. E) ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", list(DIALECTS.values()), ids=list(DIALECTS))
def test_proposer_and_solver_prompts_use_the_dialect(dialect):
    proposer = ssp.proposer_prompt(" Castle Drogo ", 3, dialect.search_example, dialect.results_description)
    assert "Answer: Castle Drogo\n" in proposer and "3 search(es)" in proposer and "3 link(s)" in proposer
    assert dialect.search_example in proposer and dialect.results_description in proposer
    assert "<question>" in proposer and "</question>" in proposer and "$" not in proposer
    solver = ssp.solver_prompt(QUESTION, 10, dialect.search_example, dialect.results_description)
    assert solver.endswith(f"Question: {QUESTION}") and "up to 10 times" in solver
    assert dialect.search_example in solver and "<answer>" in solver and "$" not in solver.replace(
        dialect.search_example, "")


def test_rag_solver_prompt_has_the_documents_and_no_search():
    text = ssp.rag_solver_prompt(QUESTION, ["Castle Drogo is in Devon.", "Noise."])
    assert "Document 1:\nCastle Drogo is in Devon." in text and "Document 2:\nNoise." in text
    assert text.endswith(f"Question: {QUESTION}") and "cannot search" in text and "<search>" not in text
    with pytest.raises(ValueError, match="list of texts"):
        ssp.rag_solver_prompt(QUESTION, "one text")


def test_prompts_refuse_bad_values():
    with pytest.raises(ValueError, match="answer"):
        ssp.proposer_prompt(" ", 3, "<search>q</search>", "x")
    with pytest.raises(ValueError, match="num_searches"):
        ssp.proposer_prompt("Paris", 0, "<search>q</search>", "x")
    with pytest.raises(ValueError, match="max_search_turns"):
        ssp.solver_prompt("Q?", -1, "<search>q</search>", "x")
