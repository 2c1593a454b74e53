"""Search Self-Play (SSP; Lu et al., Alibaba Qwen, github Qwen-Applications/SSP): filters, RAG check and rewards.

One policy plays two roles. The Proposer is given a ground-truth answer a* and searches over several turns to
write a question whose answer it is, between <question> tags (§3.2, App. E). Rule filters drop bad questions before
anything else runs (§3.3); RAG verification then asks a no-search Solver to answer the question from the Proposer's
retrieved passages plus noise passages from other trajectories of the batch, and rejects the question unless it is
right (eq. 3, §4.4). The Solver is a Search-R1-style agent (<think>, a search, <answer>).

    question = extract_question(proposer_final_turn)
    reason = filter_question(question, answer, n_valid_searches)     # None, or one of FILTER_REASONS
    passages = rag_passages(batch_passages, i, seed=seed)            # own retrieved + 4 noise, shuffled
    rag_solver_prompt(question, passages)                            # the verification's prompt
    solved = [answer_correct(extract_answer(r), answer) for r in solver_replies]   # by rule, or:
    judge_prompt(question, prediction, answer)                       # the LLM judge's prompt: Correct or Wrong
    proposer_reward(solved, valid)                                   # eq. 7: 1 − mean success; 0 when invalid
    solver_reward(solved[j])                                         # eq. 6: 1[a = a*]

r(a, a*) is the paper's LLM-as-a-judge (§3.2, App. E: "Correct" or "Wrong", `judge_prompt`, read by
`parsing.parse_correct_wrong`) or `answer_correct`, a rule; `ssp.answer_check` chooses (the judge by default), and
the loop (`selfplay.methods.ssp.check_answers`) asks the Judge's grader model for a batch's verdicts in one call.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from scope_lib.protocol import verification as V
from scope_lib.protocol.parsing import strip_think
from scope_lib.protocol.prompts import format_documents, render_template
from scope_lib.protocol.rewards import difficulty_reward

__all__ = [
    "FILTER_REASONS", "MIN_QUESTION_WORDS", "NOISE_PASSAGES", "CONTAINMENT_MAX_WORDS", "extract_question",
    "filter_question", "answer_correct", "proposer_reward", "solver_reward", "rag_passages", "proposer_prompt",
    "solver_prompt", "rag_solver_prompt", "judge_prompt",
]

#: Why a Proposer's question is dropped by rule (§3.3's list, with the format check first), in the order checked.
FILTER_REASONS: tuple[str, ...] = (
    "no_question",          # no complete <question>…</question> outside thinking (the format check)
    "empty",                # (1) an empty question string
    "tags_left",            # protocol tags inside the question (<search>, <think>, <information>, …)
    "no_search",            # (2) no search tool invoked
    "too_short",            # (3) an excessively short question: fewer than MIN_QUESTION_WORDS words
    "answer_in_question",   # (4) the ground-truth answer inside the question, any case
)
#: The fewest words a question may have (the paper gives no number; "Temptations singer", its App. F example of a
#: hacked question, has 2).
MIN_QUESTION_WORDS = 5
#: Noise passages mixed into RAG verification (§4.4, Table 3: 4 was best).
NOISE_PASSAGES = 4
#: The most words (after normalisation) a prediction may have for containment to count (`answer_correct`).
CONTAINMENT_MAX_WORDS = 10

_QUESTION = re.compile(r"<question(?:\s[^<>]*)?>|</question\s*>")
_TAG = re.compile(r"</?[A-Za-z_][\w:-]*(?:\s[^<>]*)?/?>")


# -- the Proposer's question and the rule filters (§3.3) -------------------------------------------------------------


def extract_question(text: Any, *, starts_in_think: bool = False) -> str | None:
    """The last complete ``<question>…</question>`` outside thinking, stripped ("" when it is empty), or None when
    there is none. Each closer pairs with the nearest opener before it."""
    if not isinstance(text, str):
        return None
    visible = strip_think(text, starts_in_think=starts_in_think)
    found, open_end = None, None
    for m in _QUESTION.finditer(visible):
        if m.group().startswith("</"):
            if open_end is not None:
                found, open_end = visible[open_end:m.start()].strip(), None
        else:
            open_end = m.end()
    return found


def _contains_phrase(text: str, phrase: str) -> bool:
    """Whether normalised `phrase` occurs in normalised `text` as whole words."""
    needle = V.normalize_answer(phrase)
    return bool(needle) and f" {needle} " in f" {V.normalize_answer(text)} "


def filter_question(question: str | None, answer: str | Sequence[str], n_valid_searches: int, *,
                    min_words: int = MIN_QUESTION_WORDS) -> str | None:
    """The first rule a question breaks (one of FILTER_REASONS), or None when it passes (§3.3). `question` is
    `extract_question`'s result; `answer` the ground truth (or its aliases: any one inside the question drops it);
    `n_valid_searches` the valid searches the Proposer made, counted by the caller in its dialect. The answer test
    compares normalised texts as whole words (`verification.normalize_answer`: any case, punctuation and articles
    aside), so "Paris" is inside "Which city, PARIS or Rome?" but not inside "Parisian"."""
    if isinstance(n_valid_searches, bool) or not isinstance(n_valid_searches, int) or n_valid_searches < 0:
        raise ValueError(f"n_valid_searches must be a whole number >= 0, got {n_valid_searches!r}")
    if question is None:
        return "no_question"
    if not question.strip():
        return "empty"
    if _TAG.search(question):
        return "tags_left"
    if n_valid_searches == 0:
        return "no_search"
    if len(question.split()) < min_words:
        return "too_short"
    answers = [answer] if isinstance(answer, str) else list(answer)
    if any(_contains_phrase(question, a) for a in answers):
        return "answer_in_question"
    return None


# -- the Solver's answer and the rewards (App. A.2) -----------------------------------------------------------------


def answer_correct(prediction: Any, answer: str | Sequence[str], *, containment: bool = True,
                   max_words: int = CONTAINMENT_MAX_WORDS) -> bool:
    """r(a, a*) by rule: the normalised prediction equals a normalised ground truth (or one of its aliases), or,
    with `containment`, holds it as whole words and has at most `max_words` words: the paper's judge counts "a model
    answer that includes the correct answer" as correct (App. E, criterion 5); the word cap keeps a list of
    guesses from collecting it. No prediction (None) is wrong."""
    pred = V.normalize_answer(V.strip_latex(prediction)) if isinstance(prediction, str) else ""
    if not pred:
        return False
    answers = [answer] if isinstance(answer, str) else list(answer)
    for gold in answers:
        ref = V.normalize_answer(V.strip_latex(gold))
        if not ref:
            continue
        if pred == ref:
            return True
        if containment and len(pred.split()) <= max_words and f" {ref} " in f" {pred} ":
            return True
    return False


def solver_reward(correct: bool) -> float:
    """r_solve = 1[a = a*] (eq. 6)."""
    return 1.0 if correct else 0.0


def proposer_reward(solved: Sequence[bool], valid: bool) -> float:
    """r_propose = 1 − (1/n) Σ_j r_solve^j (eq. 7; `rewards.difficulty_reward`, shape "ssp") over the Solver's n
    attempts; 0 for a question the filters or the RAG check rejected (a −0.1 penalty made the paper's training
    collapse). A valid question needs at least one attempt."""
    if not valid:
        return 0.0
    outcomes = [bool(s) for s in solved]
    if not outcomes:
        raise ValueError("a valid SSP question needs the Solver's n attempts for its reward (eq. 7); got none")
    return difficulty_reward(sum(outcomes) / len(outcomes), shape="ssp")


# -- RAG verification (§3.3, §4.4) ----------------------------------------------------------------------------------


def _key(passage: str) -> str:
    return " ".join(passage.split())


def rag_passages(batch_passages: Sequence[Sequence[str]], index: int, *, n_noise: int = NOISE_PASSAGES,
                 seed: int | str = 0) -> list[str]:
    """The RAG verification's documents for trajectory `index` of a batch: the passages its Proposer retrieved (each
    once) plus `n_noise` noise passages drawn from the OTHER trajectories' passages, never one this trajectory
    retrieved itself (compared with whitespace collapsed), then shuffled. Fewer noise passages when the batch has
    fewer to give. `batch_passages[i]` is the retrieved passages' texts of trajectory i, in order. Seeded by `seed`
    and `index`: the same call gives the same list."""
    if not 0 <= index < len(batch_passages):
        raise ValueError(f"trajectory {index} is not in a batch of {len(batch_passages)}")
    if isinstance(n_noise, bool) or not isinstance(n_noise, int) or n_noise < 0:
        raise ValueError(f"n_noise must be a whole number >= 0, got {n_noise!r}")
    own: dict[str, str] = {}
    for passage in batch_passages[index]:
        own.setdefault(_key(passage), passage)
    others: dict[str, str] = {}
    for j, passages in enumerate(batch_passages):
        if j == index:
            continue
        for passage in passages:
            if _key(passage) not in own:
                others.setdefault(_key(passage), passage)
    rng = random.Random(f"{seed}/ssp/rag/{index}")
    noise = rng.sample(list(others.values()), min(n_noise, len(others)))
    documents = list(own.values()) + noise
    rng.shuffle(documents)
    return documents


# -- prompts (App. E) ---------------------------------------------------------------------------------------------


def proposer_prompt(answer: str, num_searches: int, search_example: str, results_description: str) -> str:
    """The Proposer's prompt: the answer, the backward search chain of `num_searches` links (the paper's n), the
    dialect's search syntax, the rules, and the <question> tags."""
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError("the SSP Proposer needs a non-empty answer")
    if isinstance(num_searches, bool) or not isinstance(num_searches, int) or num_searches < 1:
        raise ValueError(f"num_searches must be a whole number >= 1, got {num_searches!r}")
    return render_template("ssp_proposer", answer=answer.strip(), num_searches=num_searches,
                           search_example=search_example, results_description=results_description)


def solver_prompt(question: str, max_search_turns: int, search_example: str, results_description: str) -> str:
    """The Solver's prompt (Search-R1's, App. E): think, search in the dialect's syntax, answer in <answer>."""
    if isinstance(max_search_turns, bool) or not isinstance(max_search_turns, int) or max_search_turns < 0:
        raise ValueError(f"max_search_turns must be a whole number >= 0, got {max_search_turns!r}")
    return render_template("ssp_solver", question=question, max_search_turns=max_search_turns,
                           search_example=search_example, results_description=results_description)


def rag_solver_prompt(question: str, passages: Sequence[str]) -> str:
    """The RAG verification's prompt: the question and the passages (`rag_passages`), no search, a short answer."""
    if isinstance(passages, str):
        raise ValueError("passages must be a list of texts, not one text")
    return render_template("ssp_rag_solver", question=question, documents=format_documents(list(passages)))


def judge_prompt(question: str, prediction: str, reference: str) -> str:
    """The LLM judge's prompt for r(a, a*) (§3.2, App. E): the question, the ground-truth answer a* and the predicted
    answer a; equal in meaning (a prediction that holds a* and nothing conflicting counts), replied with only Correct
    or Wrong (`parsing.parse_correct_wrong`)."""
    for name, value in (("question", question), ("prediction", prediction), ("reference", reference)):
        if not isinstance(value, str):
            raise ValueError(f"the SSP judge's {name} must be a string, got {type(value).__name__}")
    return render_template("ssp_judge", question=question.strip(), prediction=prediction.strip(),
                           reference=reference.strip())
