"""Rewards of SCOPE (paper §2–3, Appendix F): pure functions of numbers and turn texts.

    g     = rubric_score(verdicts, weights)                         eq. 1
    A_i   = group_advantages(rewards)                               eq. 2
    R_C   = challenger_reward(r_fmt, QG, g_bar)                     eq. 4 (+ F.1: r_fmt = 0 => R_C = 0)
    f_diff= difficulty_reward(g_bar, tau)                           eq. 5
    R_S   = solver_reward(g, |a|, r_fmt, n_search)                  eq. 6
    L(a)  = length_penalty(|a|) or LengthPenalty(...)(|a|)          eq. 7
    r_search = search_reward(n_search)                              F.2
    r_fmt = challenger_format(...).total / solver_format(...).total F.1 / F.2

Keyword defaults are the paper's (Table 9). Searches are counted by the caller in the model's own dialect
(`scope_lib.protocol.dialects`), so the format functions take counts, not search regexes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scope_lib.protocol.parsing import has_think

__all__ = [
    "FormatScore", "LengthPenalty", "PAPER_LENGTH_PENALTY", "DIFFICULTY_SHAPES", "rubric_score", "difficulty_reward",
    "length_penalty", "search_reward", "challenger_reward", "NO_RUBRICS_REWARDS", "solver_reward", "challenger_format",
    "solver_format", "group_advantages",
]


def _check_finite(name: str, value: float) -> float:
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _check_unit(name: str, value: float) -> float:
    value = _check_finite(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return value


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{name} must be a non-negative whole number, got {value!r}")
    return int(value)


# -- eq. 1 -------------------------------------------------------------------------------------------


def rubric_score(verdicts: Sequence[int | bool | None], weights: Sequence[float] | None = None) -> float:
    """g(o, 𝒢) = Σ w_k b_k / Σ w_k (eq. 1) over binary verdicts b_k.

    A verdict of None (the grader's reply never parsed) counts as 0. No verdicts, or weights that sum to 0,
    give 0.0. `weights` None means uniform (w_k = 1, the paper's §4.1 setting).
    """
    verdicts = list(verdicts)
    if not verdicts:
        return 0.0
    for v in verdicts:
        if v is not None and v not in (0, 1):
            raise ValueError(f"verdicts must be 0, 1 or None, got {v!r}")
    if weights is None:
        weights = [1.0] * len(verdicts)
    weights = [_check_finite("rubric weight", w) for w in weights]
    if len(weights) != len(verdicts):
        raise ValueError(f"{len(weights)} weights for {len(verdicts)} verdicts")
    if any(w < 0 for w in weights):
        raise ValueError(f"rubric weights must be >= 0 (eq. 1), got {weights}")
    total = sum(weights)
    if total == 0:
        return 0.0
    met = sum(w for w, v in zip(weights, verdicts, strict=True) if v == 1)
    return min(1.0, met / total)


# -- eq. 2 -------------------------------------------------------------------------------------------


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """A_i = (R_i − mean R) / (std R + eps) within one GRPO group (eq. 2), population std.

    A group whose rewards are all equal gets zero advantages.
    """
    values = [_check_finite("reward", r) for r in rewards]
    if not values:
        return []
    if min(values) == max(values):
        return [0.0] * len(values)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((r - mean) ** 2 for r in values) / len(values))
    return [(r - mean) / (std + eps) for r in values]


# -- eq. 5 -------------------------------------------------------------------------------------------


#: Challenger reward shapes f_diff (`challenger.reward_shape`): the paper's tent (eq. 5) and three from related
#: self-play methods (reference/related-methods.md).
DIFFICULTY_SHAPES: tuple[str, ...] = ("tent", "rzero", "spice", "ssp")


def difficulty_reward(mean_score: float, target: float = 0.5, shape: str = "tent") -> float:
    """f_diff(ḡ; τ) of eq. 4.

    - "tent" (eq. 5, the paper): max(0, 1 − |ḡ − τ| / min(τ, 1 − τ)); 1 at ḡ = τ, 0 at ḡ = 0 and ḡ = 1.
    - "rzero" (R-Zero): 1 − 2|ḡ − ½|, whatever τ (the same as the tent at τ = ½).
    - "spice" (SPICE): exp(−(ḡ(1 − ḡ) − ¼)² / (2 · 0.01)), a Gaussian on the variance of a Bernoulli(ḡ).
    - "ssp" (Search Self-Play): 1 − ḡ, harder is always better.
    """
    g = _check_finite("mean_score", mean_score)
    tau = _check_finite("target", target)
    if not 0.0 < tau < 1.0:
        raise ValueError(f"target tau must lie strictly between 0 and 1 (eq. 5), got {tau}")
    if shape == "tent":
        return max(0.0, 1.0 - abs(g - tau) / min(tau, 1.0 - tau))
    if shape == "rzero":
        return max(0.0, 1.0 - 2.0 * abs(g - 0.5))
    if shape == "spice":
        return math.exp(-((g * (1.0 - g) - 0.25) ** 2) / (2 * 0.01))
    if shape == "ssp":
        return min(1.0, max(0.0, 1.0 - g))
    raise ValueError(f"unknown difficulty reward shape {shape!r}; choose one of {', '.join(DIFFICULTY_SHAPES)}")


# -- eq. 7 -------------------------------------------------------------------------------------------


def length_penalty(n_tokens: int, soft: int = 1024, hard: int = 2048, floor: float = 0.05) -> float:
    """L(a) of eq. 7: 1 up to `soft` tokens, `floor` from `hard` on, a half-cosine between them."""
    n = _check_count("n_tokens", n_tokens)
    if not 0 <= soft < hard:
        raise ValueError(f"length limits must satisfy 0 <= soft < hard, got soft={soft}, hard={hard}")
    floor = _check_unit("floor", floor)
    if n <= soft:
        return 1.0
    if n >= hard:
        return floor
    phase = math.pi * (n - soft) / (hard - soft)
    return floor + (1.0 - floor) / 2.0 * (1.0 + math.cos(phase))


@dataclass(frozen=True)
class LengthPenalty:
    """eq. 7 with its limits bound (ℓ_soft, ℓ_hard, ℓ_min; Table 9): ``LengthPenalty()(n_tokens)``."""

    soft: int = 1024
    hard: int = 2048
    floor: float = 0.05

    def __post_init__(self) -> None:
        length_penalty(0, self.soft, self.hard, self.floor)  # validates the limits

    def __call__(self, n_tokens: int) -> float:
        return length_penalty(n_tokens, self.soft, self.hard, self.floor)


#: The paper's length penalty (Table 9), the default of `solver_reward`.
PAPER_LENGTH_PENALTY = LengthPenalty()


# -- F.2 search reward ----------------------------------------------------------------------------------


def search_reward(n_valid_searches: int, saturation: int = 3) -> float:
    """r_search = min(n / saturation, 1) over valid searches in ALL assistant turns (F.2)."""
    n = _check_count("n_valid_searches", n_valid_searches)
    if _check_count("saturation", saturation) < 1:
        raise ValueError(f"saturation must be >= 1, got {saturation}")
    return min(n / saturation, 1.0)


# -- format scores (F.1, F.2) -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatScore:
    """r_fmt's three components, each in [0, 1]; `total` is their mean (F.1, F.2).

    `final` is the structure component for the Challenger (a task was written) and the answer component
    for the Solver (an answer was given); `structure` and `answer` read it under either name.
    """

    think: float
    tool: float
    final: float

    @property
    def structure(self) -> float:
        return self.final

    @property
    def answer(self) -> float:
        return self.final

    @property
    def total(self) -> float:
        return (self.think + self.tool + self.final) / 3.0


def _think_share(assistant_turns: Sequence[str], starts_in_think: bool = False) -> float:
    turns = list(assistant_turns)
    return sum(1 for t in turns if has_think(t, starts_in_think=starts_in_think)) / len(turns) if turns else 0.0


def _nonempty(text: str | None) -> bool:
    return isinstance(text, str) and bool(text.strip())


def challenger_format(assistant_turns: Sequence[str], expected_searches: int, n_valid_searches: int,
                      n_malformed_searches: int, task: str | None, *,
                      subtract_malformed: bool = False, starts_in_think: bool = False) -> FormatScore:
    """r_fmt(o^C) (F.1) from the decoded assistant turns.

    - think: share of assistant turns holding a complete ``<think>…</think>`` block (a lone ``</think>``
      counts only when the chat template opened the block: ``starts_in_think=True``).
    - tool: valid searches / expected searches N, clamped to [0, 1] (N = 0 expects nothing: 1). As in the
      paper, a malformed search earns nothing and costs nothing here (it already wastes a turn, and the
      rollout may run out of turns before the task). ``subtract_malformed=True`` is the authors' code:
      (valid − malformed) / N.
    - structure: 1 if `task` — the task extracted from the FINAL assistant turn — is non-empty.
    With no assistant turns every component is 0.
    """
    n_expected = _check_count("expected_searches", expected_searches)
    valid = _check_count("n_valid_searches", n_valid_searches)
    malformed = _check_count("n_malformed_searches", n_malformed_searches)
    turns = list(assistant_turns)
    if not turns:
        return FormatScore(0.0, 0.0, 0.0)
    counted = valid - malformed if subtract_malformed else valid
    tool = 1.0 if n_expected == 0 else min(1.0, max(0.0, counted / n_expected))
    return FormatScore(_think_share(turns, starts_in_think), tool, 1.0 if _nonempty(task) else 0.0)


def solver_format(assistant_turns: Sequence[str], n_valid_searches_nonfinal: int,
                  answer: str | None, *, starts_in_think: bool = False) -> FormatScore:
    """r_fmt(o^S) (F.2) from the decoded assistant turns.

    - think: share of assistant turns holding a complete ``<think>…</think>`` block (a lone ``</think>``
      counts only when the chat template opened the block: ``starts_in_think=True``).
    - tool: min(valid searches in the non-final turns / (turns − 1), 1). A single-turn rollout has no
      non-final turn; it scores 0 (the Solver is trained to retrieve, and F.2's ratio is undefined there).
    - answer: 1 if a non-empty answer was extracted.
    """
    valid = _check_count("n_valid_searches_nonfinal", n_valid_searches_nonfinal)
    turns = list(assistant_turns)
    if not turns:
        return FormatScore(0.0, 0.0, 0.0)
    tool = min(1.0, valid / (len(turns) - 1)) if len(turns) > 1 else 0.0
    return FormatScore(_think_share(turns, starts_in_think), tool, 1.0 if _nonempty(answer) else 0.0)


def _format_total(format_score: float | FormatScore) -> float:
    value = format_score.total if isinstance(format_score, FormatScore) else format_score
    return _check_unit("format_score", value)


# -- eq. 4 -------------------------------------------------------------------------------------------


#: R_C of a task whose rubrics never parsed (`challenger.no_rubrics_reward`): the format term of eq. 4 (the paper
#: is silent; eq. 4 as written) or 0 (the authors' code).
NO_RUBRICS_REWARDS: tuple[str, ...] = ("format", "zero")


def challenger_reward(format_score: float | FormatScore, gates_passed: bool, mean_solver_score: float | None,
                      *, format_weight: float = 0.5, difficulty_weight: float = 1.0,
                      target: float = 0.5, shape: str = "tent", rubrics_parsed: bool = True,
                      no_rubrics_reward: str = "format") -> float:
    """R_C = λ_fmt·r_fmt + λ_diff·1[QG]·f_diff(ḡ; τ) (eq. 4).

    A rollout with r_fmt = 0 gets 0 (F.1). A failed gate, or no valid Solver rollouts to average
    (`mean_solver_score` None), leaves the format term only. `shape` picks f_diff (`difficulty_reward`).
    A task that passed the gates but whose rubric reply never parsed (`rubrics_parsed=False`) has no ḡ: it keeps
    the format term (`no_rubrics_reward="format"`, eq. 4 as written) or gets 0 (`"zero"`, the authors' code).
    """
    if no_rubrics_reward not in NO_RUBRICS_REWARDS:
        raise ValueError(f"unknown no_rubrics_reward {no_rubrics_reward!r}; choose one of "
                         f"{', '.join(NO_RUBRICS_REWARDS)}")
    fmt = _format_total(format_score)
    if fmt == 0.0:
        return 0.0
    if gates_passed and not rubrics_parsed and no_rubrics_reward == "zero":
        return 0.0
    difficulty = 0.0
    if gates_passed and mean_solver_score is not None:
        difficulty = difficulty_reward(mean_solver_score, target, shape)
    return format_weight * fmt + difficulty_weight * difficulty


# -- eq. 6 -------------------------------------------------------------------------------------------


def solver_reward(rubric: float, n_answer_tokens: int, format_score: float | FormatScore,
                  n_valid_searches: int, *, accuracy_weight: float = 1.0, format_weight: float = 0.5,
                  search_weight: float = 0.1, length: LengthPenalty | None = PAPER_LENGTH_PENALTY,
                  search_saturation: int = 3) -> float:
    """R_S = λ_acc·L(a)·g + λ_fmt·r_fmt + λ_search·r_search (eq. 6).

    `rubric` is g ∈ [0, 1] (eq. 1); `n_answer_tokens` is |a| in policy tokens; `n_valid_searches` counts
    every assistant turn (F.2). `length=None` is the No-LP ablation (L = 1).
    """
    g = _check_unit("rubric", rubric)
    fmt = _format_total(format_score)
    multiplier = 1.0 if length is None else length(n_answer_tokens)
    if length is None:
        _check_count("n_answer_tokens", n_answer_tokens)
    return (accuracy_weight * multiplier * g + format_weight * fmt
            + search_weight * search_reward(n_valid_searches, search_saturation))
