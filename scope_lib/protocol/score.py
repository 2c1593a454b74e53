"""SCORE (Zhu et al., HKUST / ByteDance / UCL, arXiv 2606.04507): the Evaluator's format, the two rewards, the
EMA baseline, the search-count verifier and the meta-harness.

One shared actor plays two roles. The Solver writes a research report with search (App. H, Listing 5); the
Evaluator picks k weighted dimensions from a pool under the meta-harness's constraints, may verify claims by
search, and scores all K reports of a query in one call (Listing 4). A fixed meta-harness model rewrites the
evaluation constraints every 5 steps (Listing 3, Algorithm 1 lines 35-39).

    harness = DEFAULT_HARNESS                                      # M_0 (Algorithm 1 line 4); our choice, see below
    evaluator_prompt(query, reports, harness, search_example, results_description)
    parsed = parse_evaluation(evaluator_reply, harness, K)          # EvaluationParse: rubric, K reports' scores
    required = required_searches(harness)                           # the verifier's depth (Algorithm 1 line 23)
    solver_rewards(parsed, report_valid, n_evaluator_searches, required)   # §3.5: a(r)·(1 + Σ_j w_j s_j), or 0
    c_i = pairwise_consistency([extract_conclusion(r) for r in reports])   # App. E: mean pairwise TF-IDF cosine
    r_eval = evaluator_reward([c_1, …, c_B])                        # Algorithm 2 line 8: the batch mean
    advantage, baseline = ema_step(r_eval, baseline)                # §3.5: A = R − b_{t−1}; b_t = β b_{t−1} + (1−β) R
    if harness_refresh_due(t): harness = parse_harness(meta_reply, harness).harness   # every 5 steps

Where the paper is silent, the choices made here (docs/methods.md, "SCORE"):

- a(r), "a report-level validity or accuracy score": 1 when the Solver's reply holds a complete, non-empty
  ``<answer>`` outside thinking (Listing 5, rule 8), else 0.
- The score scale: integers 0-10, as in Figure 6's case study (values 2-8) and DeepResearchEval's scale;
  s_j = value / 10, so with weights summing to 1 a valid report's reward lies in [1, 2].
- The weights: Listing 4 gives the required dimension no weight and each additional one a weight in
  [weight_min, weight_max]; the required dimension(s) share what is left, 1 − Σ additional weights, equally, so
  the weights sum to 1. A rubric whose additional weights leave nothing is invalid.
- The verifier: a query's K report rewards are set to 0 (Algorithm 1 line 23) when the Evaluator made fewer
  searches than the harness's ``min_number_of_tool_call`` (or a fixed floor τ_s), and also when its reply gave no
  valid rubric (Figure 2: "a reward verifier filters out invalid rewards"). K equal rewards give GRPO no signal.
- The conclusion of a report (Algorithm 2 line 5 names no rule): its "Conclusion" (or "Summary", "Key findings",
  "Bottom line", "Verdict", "Final answer", "Takeaways") section, else its last paragraph, with a trailing
  "Sources"/"References" section and bracketed citation marks removed (`extract_conclusion`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from scope_lib.protocol.parsing import extract_answer, last_json_object, strip_think
from scope_lib.protocol.prompts import render_template

__all__ = [
    "DIMENSION_POOL", "SCORE_MAX", "EMA_BETA", "HARNESS_PERIOD", "Harness", "DEFAULT_HARNESS",
    "RUBRIC_INVALID_REASONS", "SCORE_PROBLEMS", "HARNESS_INVALID_REASONS", "Rubric", "RubricParse", "ReportScores",
    "EvaluationParse", "dimension_name", "parse_rubric", "parse_evaluation", "report_valid", "solver_reward",
    "required_searches", "search_verified", "solver_rewards", "extract_conclusion", "pairwise_consistency",
    "evaluator_reward", "ema_step", "ema_advantages", "harness_refresh_due", "harness_set_at", "HarnessParse",
    "parse_harness", "harness_json", "solver_prompt", "rubric_prompt", "evaluator_prompt", "meta_harness_prompt",
]

#: The default dimension pool 𝒟 (Algorithm 1's input; the paper publishes no list). Written from the dimensions the
#: paper names: Figure 6's static rubric (factuality, insight, coherence, complexity) and adaptive ones
#: (citation_effectiveness, completeness, diversity, fairness), §3.1's axes of report quality (evidence coverage,
#: contradiction handling, uncertainty calibration) and DeepResearchBench's writing dimensions (App. H, Listing 2:
#: comprehensiveness, instruction following, readability).
DIMENSION_POOL: dict[str, str] = {
    "factuality": "claims are correct and supported by the evidence the report cites or that a search finds",
    "insight": "the analysis goes beyond listing facts to causes, mechanisms and consequences",
    "coherence": "the report is logically organised and its parts connect",
    "complexity": "the report handles the technical or conceptual depth the query needs",
    "citation_effectiveness": "key claims are grounded in cited, checkable sources that say what the report says",
    "completeness": "every part and condition of the query is addressed",
    "diversity": "competing viewpoints and perspectives are covered",
    "fairness": "viewpoints are presented in a balanced way, without unsupported bias",
    "evidence_coverage": "the report draws on the range of evidence that bears on the query",
    "contradiction_handling": "conflicting evidence is noticed and reconciled or explained",
    "uncertainty_calibration": "the report states what is uncertain or unknown and does not overclaim",
    "comprehensiveness": "breadth, depth and relevance of the information covered",
    "instruction_following": "the report answers exactly what the query asks, within its scope",
    "readability": "clear structure, fluent language, easy to follow",
}
#: The top of the Evaluator's 0-10 score scale (Figure 6: integer scores; s_j = value / SCORE_MAX).
SCORE_MAX = 10
#: The EMA baseline's decay β (§5.1, Table 2).
EMA_BETA = 0.7
#: The meta-harness's refresh period in training steps (§5.1, Table 2: every 5 steps).
HARNESS_PERIOD = 5


@dataclass(frozen=True)
class Harness:
    """The meta-harness's state ℳ_t (Listing 3's output format): the admissible rubric space and the Evaluator's
    process requirements. `pool` is the dimension pool as (name, description) pairs."""

    k: int                                   # dimensions per rubric, the required ones included
    must_include: tuple[str, ...]            # required dimensions (Listing 4: "the primary scoring dimension")
    weight_min: float                        # each additional dimension's weight lies in [weight_min, weight_max]
    weight_max: float
    require_search: bool = True
    require_gap_analysis: bool = True
    require_verification: bool = True
    citation_cross_check: bool = False
    min_number_of_tool_call: int = 1         # the Evaluator's fewest searches; fewer zero the rewards
    notes: str = ""
    pool: tuple[tuple[str, str], ...] = tuple(DIMENSION_POOL.items())

    @property
    def pool_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.pool)


#: ℳ_default (Algorithm 1 line 4). The paper gives no values: k = 4 as in Figure 6's rubrics; factuality required
#: (claims checked by search, the reason the Evaluator searches); weights in [0.1, 0.25] (with k = 4 the three
#: additional weights sum to 0.3-0.75, so the required dimension's share, 0.25-0.7, is never below another's); at
#: least one search.
DEFAULT_HARNESS = Harness(k=4, must_include=("factuality",), weight_min=0.1, weight_max=0.25)

#: Why the Evaluator's reply gives no usable rubric (`RubricParse.reason`), in the order checked.
RUBRIC_INVALID_REASONS: tuple[str, ...] = (
    "no_dimensions",               # no complete <dimensions> block outside thinking, or no <dim> in it
    "unknown_dimension",           # a dimension not in the harness's pool
    "duplicate_dimension",         # a dimension named twice
    "missing_required_dimension",  # a must_include dimension absent
    "wrong_dimension_count",       # not exactly k dimensions
    "missing_weight",              # an additional dimension without a weight
    "weight_not_a_number",         # a weight that does not read as a number
    "weight_out_of_range",         # an additional weight outside [weight_min, weight_max]
    "no_weight_left",              # the additional weights sum to 1 or more: nothing left for the required ones
)
#: What can be wrong with one report's scores (`ReportScores.problems`); each makes that score 0.
SCORE_PROBLEMS: tuple[str, ...] = (
    "report_missing",        # no <report id="k"> for the report: all its scores 0
    "score_missing",         # no <score dim="…"> for a rubric dimension
    "score_not_a_number",    # a value that does not read as a number
    "score_out_of_range",    # a value outside [0, SCORE_MAX]
    "rubric_invalid",        # the reply gave no valid rubric: every score of every report 0
)
#: Why a meta-harness reply is rejected (`HarnessParse.reason`); the previous harness stays in force.
HARNESS_INVALID_REASONS: tuple[str, ...] = (
    "no_json",                     # no JSON object outside thinking
    "not_a_number",                # k, a weight or min_number_of_tool_call is not a number
    "not_a_boolean",               # a process flag is not true/false
    "bad_pool",                    # dimension_pool not a list/object of names, an empty or duplicated name
    "unknown_required_dimension",  # a must_include dimension not in the pool
    "bad_k",                       # k below the required count, above the pool's size, or below 1
    "bad_weights",                 # weights outside [0, 1] or weight_min > weight_max
    "no_weight_left",              # (k − required)·weight_min ≥ 1: no rubric could leave a share for the required
    "bad_tool_calls",              # min_number_of_tool_call not a whole number ≥ 0
)


def dimension_name(text: Any) -> str:
    """A dimension's name as the pool spells it: lower case, spaces and hyphens as underscores
    ("Citation Effectiveness" → "citation_effectiveness")."""
    if not isinstance(text, str):
        return ""
    return re.sub(r"[\s\-]+", "_", text.strip().lower()).strip("_")


# -- the Evaluator's reply (App. H, Listing 4) ---------------------------------------------------------------------

_ATTR = re.compile(r"""([A-Za-z_][\w:.-]*)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'=<>`/]+))""")
_NUMBER = re.compile(r"\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?:/\s*10(?:\.0+)?)?\s*")


def _attributes(raw: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for m in _ATTR.finditer(raw or ""):
        value = next((v for v in m.groups()[1:] if v is not None), "")
        found.setdefault(m.group(1).lower(), value)
    return found


def _blocks(text: str, name: str) -> list[str]:
    """The contents of complete ``<name …>…</name>`` elements, in order (the nearest opener pairs)."""
    tags = re.compile(rf"<{name}(?:\s[^<>]*)?>|</{name}\s*>", re.IGNORECASE)
    out, open_end = [], None
    for m in tags.finditer(text):
        if m.group().startswith("</"):
            if open_end is not None:
                out.append(text[open_end:m.start()])
                open_end = None
        else:
            open_end = m.end()
    return out


def _number(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    m = _NUMBER.fullmatch(value)
    if not m:
        return None
    number = float(m.group(1))
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class Rubric:
    """Γ_q = (H_q, w_q): the selected dimensions and their weights (summing to 1), in the reply's order."""

    dimensions: tuple[str, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class RubricParse:
    rubric: Rubric | None
    reason: str | None = None       # one of RUBRIC_INVALID_REASONS when rubric is None
    detail: str = ""

    @property
    def valid(self) -> bool:
        return self.rubric is not None


def parse_rubric(text: Any, harness: Harness = DEFAULT_HARNESS, *, starts_in_think: bool = False) -> RubricParse:
    """The rubric in the LAST complete ``<dimensions>`` block outside thinking: ``<dim name="…"/>`` for a required
    dimension (no weight), ``<dim name="…" weight="…"/>`` for an additional one. Names are read with
    `dimension_name`. A weight written on a required dimension is ignored: the required dimensions share
    1 − Σ additional weights equally (the paper gives them none; module docstring). Never raises."""
    if not isinstance(text, str):
        return RubricParse(None, "no_dimensions")
    blocks = _blocks(strip_think(text, starts_in_think=starts_in_think), "dimensions")
    dims = [_attributes(m.group(1)) for m in re.finditer(r"<dim\b([^<>]*)>", blocks[-1], re.IGNORECASE)] \
        if blocks else []
    if not dims:
        return RubricParse(None, "no_dimensions")
    names = [dimension_name(d.get("name", "")) for d in dims]
    pool = set(harness.pool_names)
    unknown = [n for n in names if n not in pool]
    if unknown:
        return RubricParse(None, "unknown_dimension", unknown[0])
    repeated = [n for i, n in enumerate(names) if n in names[:i]]
    if repeated:
        return RubricParse(None, "duplicate_dimension", repeated[0])
    missing = [n for n in harness.must_include if n not in names]
    if missing:
        return RubricParse(None, "missing_required_dimension", missing[0])
    if len(names) != harness.k:
        return RubricParse(None, "wrong_dimension_count", f"{len(names)} != k = {harness.k}")
    extra: dict[str, float] = {}
    for name, attrs in zip(names, dims, strict=True):
        if name in harness.must_include:
            continue
        if "weight" not in attrs:
            return RubricParse(None, "missing_weight", name)
        weight = _number(attrs["weight"])
        if weight is None:
            return RubricParse(None, "weight_not_a_number", f"{name}: {attrs['weight']!r}")
        if not harness.weight_min - 1e-9 <= weight <= harness.weight_max + 1e-9:
            return RubricParse(None, "weight_out_of_range",
                               f"{name}: {weight} not in [{harness.weight_min}, {harness.weight_max}]")
        extra[name] = weight
    if not harness.must_include:  # no required dimension: the weights are normalised to sum 1
        total = sum(extra.values())
        if total <= 0:
            return RubricParse(None, "no_weight_left", "every weight is 0")
        return RubricParse(Rubric(tuple(names), tuple(extra[n] / total for n in names)))
    left = 1.0 - sum(extra.values())
    if left <= 1e-9:
        return RubricParse(None, "no_weight_left", f"additional weights sum to {1.0 - left:g}")
    share = left / len(harness.must_include)
    return RubricParse(Rubric(tuple(names), tuple(extra.get(n, share) for n in names)))


@dataclass(frozen=True)
class ReportScores:
    """One report's scores on the rubric's dimensions, raw on 0..SCORE_MAX (0 where a problem was found), and the
    problems (SCORE_PROBLEMS), one per score affected ("report_missing" and "rubric_invalid" once)."""

    report: int                      # 1..K, the id the prompt gave it
    scores: tuple[float, ...]
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvaluationParse:
    """The Evaluator's one reply for the K reports of a query."""

    rubric: RubricParse
    reports: tuple[ReportScores, ...]            # always K, in report order

    @property
    def valid(self) -> bool:
        return self.rubric.valid

    def problem_counts(self) -> dict[str, int]:
        """Every problem counted over the reply: the rubric's reason (once) and each report's score problems."""
        counts: dict[str, int] = {}
        if self.rubric.reason:
            counts[self.rubric.reason] = 1
        for report in self.reports:
            for problem in report.problems:
                counts[problem] = counts.get(problem, 0) + 1
        return counts


def parse_evaluation(text: Any, harness: Harness, n_reports: int, *, rubric: Rubric | None = None,
                     starts_in_think: bool = False) -> EvaluationParse:
    """The Evaluator's reply to `evaluator_prompt` for `n_reports` reports: the rubric (`parse_rubric`, or the
    given `rubric` when it was chosen before the reports: then the reply's <dimensions> are not read) and, per
    report, ``<report id="k">`` … ``<score dim="…" value="…"/>`` (the id's digits name the report: "2", "report_2";
    the last block for an id decides). Every problem scores 0 and is counted; never raises on the reply."""
    if isinstance(n_reports, bool) or not isinstance(n_reports, int) or n_reports < 1:
        raise ValueError(f"n_reports must be a whole number >= 1, got {n_reports!r}")
    parsed = RubricParse(rubric) if rubric is not None else parse_rubric(text, harness,
                                                                          starts_in_think=starts_in_think)
    if not parsed.valid:
        return EvaluationParse(parsed, tuple(ReportScores(k, (), ("rubric_invalid",))
                                             for k in range(1, n_reports + 1)))
    dims = parsed.rubric.dimensions
    visible = strip_think(text, starts_in_think=starts_in_think) if isinstance(text, str) else ""
    evaluations = _blocks(visible, "report_evaluations")
    scope = evaluations[-1] if evaluations else visible
    by_id: dict[int, str] = {}
    for m in re.finditer(r"<report(\s[^<>]*)?>(.*?)</report\s*>", scope, re.IGNORECASE | re.DOTALL):
        digits = re.search(r"\d+", _attributes(m.group(1) or "").get("id", ""))
        if digits:
            by_id[int(digits.group())] = m.group(2)
    reports = []
    for k in range(1, n_reports + 1):
        if k not in by_id:
            reports.append(ReportScores(k, (0.0,) * len(dims), ("report_missing",)))
            continue
        given: dict[str, str | None] = {}
        for m in re.finditer(r"<score\b([^<>]*)>", by_id[k], re.IGNORECASE):
            attrs = _attributes(m.group(1))
            given[dimension_name(attrs.get("dim", attrs.get("name", "")))] = attrs.get("value")
        scores, problems = [], []
        for dim in dims:
            if dim not in given:
                scores.append(0.0)
                problems.append("score_missing")
                continue
            value = _number(given[dim])
            if value is None:
                scores.append(0.0)
                problems.append("score_not_a_number")
            elif not 0 <= value <= SCORE_MAX:
                scores.append(0.0)
                problems.append("score_out_of_range")
            else:
                scores.append(value)
        reports.append(ReportScores(k, tuple(scores), tuple(problems)))
    return EvaluationParse(parsed, tuple(reports))


# -- the Solver's reward (§3.5) and the search-count verifier (Algorithm 1 line 23) -------------------------------


def report_valid(reply: Any, *, starts_in_think: bool = False) -> bool:
    """a(r) as a flag: the Solver's reply holds a complete, non-empty <answer> outside thinking (Listing 5)."""
    return extract_answer(reply, starts_in_think=starts_in_think) is not None


def solver_reward(valid: bool, scores: Sequence[float], weights: Sequence[float], *,
                  score_max: float = SCORE_MAX) -> float:
    """R_s(r) = a(r)·(1 + Σ_j w_j s_j) (§3.5), a(r) = 1[valid], s_j = score_j / score_max ∈ [0, 1]."""
    if len(scores) != len(weights):
        raise ValueError(f"{len(scores)} scores for {len(weights)} weights")
    if not valid:
        return 0.0
    return 1.0 + sum(w * s / score_max for w, s in zip(weights, scores, strict=True))


def required_searches(harness: Harness, floor: int = 0) -> int:
    """The verifier's depth: the harness's min_number_of_tool_call, at least a fixed floor τ_s (Algorithm 1)."""
    return max(int(floor), harness.min_number_of_tool_call)


def search_verified(n_searches: int, required: int) -> bool:
    """Whether the Evaluator searched enough: n_searches ≥ required (Algorithm 1 line 23: below τ_s, s ← 0)."""
    if isinstance(n_searches, bool) or not isinstance(n_searches, int) or n_searches < 0:
        raise ValueError(f"n_searches must be a whole number >= 0, got {n_searches!r}")
    return n_searches >= required


def solver_rewards(evaluation: EvaluationParse, valid: Sequence[bool], n_searches: int,
                   required: int) -> list[float]:
    """The K reports' rewards R_s from one Evaluator reply: `solver_reward` per report, all 0 when the Evaluator
    searched fewer than `required` times or its reply gave no valid rubric (the verifier)."""
    if len(valid) != len(evaluation.reports):
        raise ValueError(f"{len(valid)} validity flags for {len(evaluation.reports)} evaluated reports")
    if not evaluation.valid or not search_verified(n_searches, required):
        return [0.0] * len(valid)
    weights = evaluation.rubric.rubric.weights
    return [solver_reward(v, r.scores, weights) for v, r in zip(valid, evaluation.reports, strict=True)]


# -- the Evaluator's consistency reward (§3.5, App. E Algorithm 2) ------------------------------------------------

_HEADING = re.compile(r"^\s*(?:#{1,6}\s*(.+?)\s*#*|\*\*(.+?)\*\*:?|__(.+?)__:?|([A-Z][\w ]{0,40}):)\s*$")
_CONCLUSION_WORDS = re.compile(r"\b(conclusions?|summary|key findings|bottom line|verdict|final answer|takeaways?)\b",
                               re.IGNORECASE)
_SOURCES_WORDS = re.compile(r"^(sources|references|bibliography|citations|works cited)\b", re.IGNORECASE)
_CITATION_MARK = re.compile(r"\[\s*\d+(?:\s*[,\-–]\s*\d+)*\s*\]")


def _heading(line: str) -> str | None:
    m = _HEADING.match(line)
    if not m:
        return None
    return next(g for g in m.groups() if g is not None).strip().strip("*_:").strip()


def extract_conclusion(reply: Any, *, starts_in_think: bool = False) -> str:
    """A report's conclusion c (Algorithm 2 line 5; the paper names no rule): from the report (the <answer>
    content), a trailing Sources/References section dropped, the body of the LAST section whose heading (a
    markdown "#" heading, a bold line or a short "Title:" line) names a conclusion, summary, key findings, bottom
    line, verdict, final answer or takeaways; without one (or when it is empty), the last paragraph that is not a
    heading. Bracketed citation marks ("[1]",
    "[2, 3]") are removed and whitespace collapsed. "" for a reply with no report."""
    report = extract_answer(reply, starts_in_think=starts_in_think)
    if report is None:
        return ""
    lines = report.splitlines()
    for i, line in enumerate(lines):  # a trailing sources section, and anything after it
        title = _heading(line)
        if title is not None and _SOURCES_WORDS.match(title) and i > 0:
            lines = lines[:i]
            break
    start = None
    for i, line in enumerate(lines):
        title = _heading(line)
        if title is not None and _CONCLUSION_WORDS.search(title):
            start = i + 1
    if start is not None:
        end = next((j for j in range(start, len(lines)) if _heading(lines[j]) is not None), len(lines))
        body = "\n".join(lines[start:end])
    if start is None or not body.strip():  # no conclusion section, or an empty one
        text = "\n".join("" if _heading(line) is not None else line for line in lines)
        paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
        body = paragraphs[-1] if paragraphs else ""
    return " ".join(_CITATION_MARK.sub(" ", body).split())


def pairwise_consistency(conclusions: Sequence[str]) -> float:
    """C(Γ_q) = (1/M) Σ_{i<j} cos(tfidf(c_i), tfidf(c_j)), M = K(K−1)/2 (App. F.1 and App. E: "the mean pairwise
    TF-IDF cosine similarity over extracted rollout conclusions"). scikit-learn's TfidfVectorizer at its defaults
    (lower case, words of two or more letters or digits, smoothed idf, l2 rows), fitted on the K conclusions of
    the query. An empty conclusion (or one with no word) has similarity 0 to every other; all empty give 0."""
    texts = [c if isinstance(c, str) else "" for c in conclusions]
    if len(texts) < 2:
        raise ValueError(f"consistency needs K >= 2 conclusions, got {len(texts)}")
    # A heavy import (scipy), only when a consistency is computed.
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics.pairwise import cosine_similarity

    try:
        matrix = TfidfVectorizer().fit_transform(texts)
    except ValueError:  # "empty vocabulary": no conclusion has a word
        return 0.0
    similarity = cosine_similarity(matrix)
    k = len(texts)
    pairs = [float(similarity[i, j]) for i in range(k) for j in range(i + 1, k)]
    return sum(pairs) / len(pairs)


def evaluator_reward(consistencies: Sequence[float]) -> float:
    """R_eval = (1/B) Σ_i C_i over the step's B queries (Algorithm 2 line 8); one query: its C."""
    values = list(consistencies)
    if not values:
        raise ValueError("the evaluator's reward needs at least one query's consistency")
    return sum(values) / len(values)


# -- REINFORCE with an EMA baseline (§3.5, Algorithm 2 lines 10-11) ------------------------------------------------


def ema_step(reward: float, baseline: float, beta: float = EMA_BETA) -> tuple[float, float]:
    """(A, b_t) for one reward: A = R − b_{t−1}, then b_t = β b_{t−1} + (1 − β) R (§3.5, Algorithm 2 lines
    10-11; §4 writes R − b_t, the algorithm centres by the previous baseline, which this follows)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta!r}")
    return reward - baseline, beta * baseline + (1.0 - beta) * reward


def ema_advantages(rewards: Sequence[float], beta: float = EMA_BETA,
                   baseline: float = 0.0) -> tuple[list[float], float]:
    """The advantages of a sequence of Evaluator rewards, one per step, from baseline b_0 (Algorithm 1 line 5:
    b_0 = 0), and the last baseline (to resume from)."""
    advantages = []
    for reward in rewards:
        advantage, baseline = ema_step(float(reward), baseline, beta)
        advantages.append(advantage)
    return advantages, baseline


# -- the meta-harness (§3.3, Algorithm 1 lines 35-39, App. H Listing 3) --------------------------------------------


def harness_refresh_due(step: int, period: int = HARNESS_PERIOD) -> bool:
    """Whether the meta-harness runs after training step `step` (1, 2, …): t mod M = 0 (Algorithm 1 line 35)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a whole number >= 1, got {step!r}")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be a whole number >= 1, got {period!r}")
    return step % period == 0


def harness_set_at(step: int, period: int = HARNESS_PERIOD) -> int:
    """The step whose refresh set the harness in force during `step` (0: ℳ_default). Step t uses ℳ_{t−1}, and
    ℳ changes only after a step t with t mod M = 0: with M = 5, steps 1-5 use ℳ_0, steps 6-10 the harness set
    after step 5."""
    harness_refresh_due(step, period)  # validates
    return (step - 1) // period * period


@dataclass(frozen=True)
class HarnessParse:
    harness: Harness               # the new harness, or the previous one when the reply was rejected
    reason: str | None = None      # one of HARNESS_INVALID_REASONS
    detail: str = ""

    @property
    def valid(self) -> bool:
        return self.reason is None


class _Rejected(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _real(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Rejected("not_a_number", f"{key}: {value!r}")
    return float(value)


def _pool(value: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(value, Mapping):
        items = [(k, v) for k, v in value.items()]
    elif isinstance(value, list):
        items = []
        for item in value:
            if isinstance(item, str):
                items.append((item, None))
            elif isinstance(item, Mapping):
                items.append((item.get("name"), item.get("description")))
            else:
                raise _Rejected("bad_pool", f"{item!r}")
    else:
        raise _Rejected("bad_pool", f"{value!r}")
    pool: list[tuple[str, str]] = []
    for name, description in items:
        key = dimension_name(name)
        if not key or key in dict(pool):
            raise _Rejected("bad_pool", f"empty or repeated name {name!r}")
        pool.append((key, description if isinstance(description, str) and description.strip()
                     else DIMENSION_POOL.get(key, key.replace("_", " "))))
    return tuple(pool)


def parse_harness(text: Any, previous: Harness = DEFAULT_HARNESS, *, starts_in_think: bool = False) -> HarnessParse:
    """The meta-harness's reply (Listing 3): the last JSON object outside thinking with `dimension_constraints`
    (k, must_include, weight_min, weight_max), `process_constraints` (require_search, require_gap_analysis,
    require_verification, citation_cross_check, min_number_of_tool_call), `notes` and optionally `dimension_pool`
    (names, or {name, description} objects, or name → description). A key left out keeps the previous value; any
    invalid value rejects the whole reply (the previous harness stays, with the reason). Never raises."""
    obj = last_json_object(strip_think(text, starts_in_think=starts_in_think)) if isinstance(text, str) else None
    if obj is None:
        return HarnessParse(previous, "no_json")
    try:
        dims = obj.get("dimension_constraints") or {}
        process = obj.get("process_constraints") or {}
        if not isinstance(dims, Mapping) or not isinstance(process, Mapping):
            raise _Rejected("no_json", "dimension_constraints and process_constraints must be objects")
        values: dict[str, Any] = {}
        if "dimension_pool" in obj:
            values["pool"] = _pool(obj["dimension_pool"])
        if "k" in dims:
            k = _real(dims["k"], "k")
            if k != int(k):
                raise _Rejected("bad_k", f"k = {k:g}")
            values["k"] = int(k)
        if "must_include" in dims:
            required = dims["must_include"]
            required = [required] if isinstance(required, str) else required
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise _Rejected("unknown_required_dimension", f"{dims['must_include']!r}")
            values["must_include"] = tuple(dict.fromkeys(dimension_name(r) for r in required))
        for key in ("weight_min", "weight_max"):
            if key in dims:
                values[key] = _real(dims[key], key)
        for key in ("require_search", "require_gap_analysis", "require_verification", "citation_cross_check"):
            if key in process:
                if not isinstance(process[key], bool):
                    raise _Rejected("not_a_boolean", f"{key}: {process[key]!r}")
                values[key] = process[key]
        if "min_number_of_tool_call" in process:
            n = _real(process["min_number_of_tool_call"], "min_number_of_tool_call")
            if n != int(n) or n < 0:
                raise _Rejected("bad_tool_calls", f"min_number_of_tool_call = {n:g}")
            values["min_number_of_tool_call"] = int(n)
        if "notes" in obj:
            values["notes"] = obj["notes"] if isinstance(obj["notes"], str) else json.dumps(obj["notes"])
        harness = replace(previous, **values)
        missing = [r for r in harness.must_include if r not in harness.pool_names]
        if missing:
            raise _Rejected("unknown_required_dimension", missing[0])
        if not max(1, len(harness.must_include)) <= harness.k <= len(harness.pool):
            raise _Rejected("bad_k", f"k = {harness.k} with {len(harness.must_include)} required and a pool of "
                                     f"{len(harness.pool)}")
        if not 0.0 <= harness.weight_min <= harness.weight_max <= 1.0:
            raise _Rejected("bad_weights", f"[{harness.weight_min}, {harness.weight_max}]")
        if harness.must_include and (harness.k - len(harness.must_include)) * harness.weight_min >= 1.0:
            raise _Rejected("no_weight_left", f"{harness.k - len(harness.must_include)} × {harness.weight_min}")
    except _Rejected as rejected:
        return HarnessParse(previous, rejected.reason, rejected.detail)
    return HarnessParse(harness)


def harness_json(harness: Harness) -> str:
    """The harness in Listing 3's output format (plus the pool's names), for the meta-harness's prompt and the
    run's records."""
    data = asdict(harness)
    return json.dumps({
        "dimension_constraints": {"k": data["k"], "must_include": list(data["must_include"]),
                                  "weight_min": data["weight_min"], "weight_max": data["weight_max"]},
        "process_constraints": {key: data[key] for key in ("require_search", "require_gap_analysis",
                                                           "require_verification", "citation_cross_check",
                                                           "min_number_of_tool_call")},
        "notes": data["notes"],
        "dimension_pool": list(harness.pool_names),
    }, indent=2)


# -- prompts (App. H, Listings 3-5) -----------------------------------------------------------------------------


def _pool_text(harness: Harness) -> str:
    return "\n".join(f"- {name}: {description}" for name, description in harness.pool)


def _rubric_text(rubric: Rubric) -> str:
    return "\n".join(f"- {d} (weight {w:.2f}): {DIMENSION_POOL.get(d, d.replace('_', ' '))}"
                     for d, w in zip(rubric.dimensions, rubric.weights, strict=True))


def _dimension_rules(harness: Harness) -> str:
    if not harness.must_include:
        return (f"Select exactly {harness.k} dimension(s) from the pool below and give each a weight within "
                f"[{harness.weight_min:g}, {harness.weight_max:g}]; the weights are scaled to a total of 1.")
    required = ", ".join(harness.must_include)
    extra = harness.k - len(harness.must_include)
    return (f"{required} is always required as the primary scoring dimension; write it without a weight. Select "
            f"exactly {extra} additional dimension(s) from the pool below and give each a weight within "
            f"[{harness.weight_min:g}, {harness.weight_max:g}]; the required dimension(s) take the rest of a "
            f"total weight of 1.")


def _process_rules(harness: Harness) -> str:
    rules = []
    if harness.require_search or harness.min_number_of_tool_call:
        rules.append(f"Search at least {harness.min_number_of_tool_call} time(s) before you write your final "
                     f"result; an evaluation with fewer searches is discarded.")
    if harness.require_verification:
        rules.append("Verify the key claims of each report with the search tool.")
    if harness.citation_cross_check:
        rules.append("Check that each report's cited sources say what the report claims they say.")
    if harness.require_gap_analysis:
        rules.append("Research the query yourself and name the important points each report misses.")
    if harness.notes.strip():
        rules.append(harness.notes.strip())
    return "\n".join(f"- {r}" for r in rules) or "- (none)"


def _reports_text(reports: Sequence[str]) -> str:
    return "\n\n".join(f'<report id="{k}">\n{(r or "").strip()}\n</report>' for k, r in enumerate(reports, 1))


def solver_prompt(query: str, max_search_turns: int, search_example: str, results_description: str, *,
                  rubric: Rubric | None = None) -> str:
    """The Solver's prompt (Listing 5): research the query by searching, then the report inside <answer>. With
    `rubric` (when the Evaluator chose it before the reports, Algorithm 1 line 16), the dimensions it will be
    scored on are listed."""
    if isinstance(max_search_turns, bool) or not isinstance(max_search_turns, int) or max_search_turns < 0:
        raise ValueError(f"max_search_turns must be a whole number >= 0, got {max_search_turns!r}")
    block = (f"\n\nYour report will be scored on these dimensions, with these weights:\n{_rubric_text(rubric)}"
             if rubric is not None else "")
    return render_template("score_solver", query=query, max_search_turns=max_search_turns,
                           search_example=search_example, results_description=results_description,
                           rubric_block=block)


def rubric_prompt(query: str, harness: Harness = DEFAULT_HARNESS) -> str:
    """The Evaluator's rubric choice before any report is written (Algorithm 1 lines 12-13): the query, the
    harness's dimension rules and pool, and the <dimensions> block alone (`parse_rubric` reads it)."""
    return render_template("score_rubric", query=query, dimension_rules=_dimension_rules(harness),
                           dimension_pool=_pool_text(harness))


def evaluator_prompt(query: str, reports: Sequence[str], harness: Harness, search_example: str,
                     results_description: str, max_search_turns: int, *, rubric: Rubric | None = None) -> str:
    """The Evaluator's one call for the K reports of a query (Listing 4): choose the rubric (or use `rubric`,
    chosen before the reports), search to verify claims and find gaps under the harness's process constraints,
    and score every report on every dimension from 0 to 10 in the XML `parse_evaluation` reads."""
    if isinstance(reports, str) or not reports:
        raise ValueError("reports must be a non-empty list of report texts")
    if isinstance(max_search_turns, bool) or not isinstance(max_search_turns, int) or max_search_turns < 0:
        raise ValueError(f"max_search_turns must be a whole number >= 0, got {max_search_turns!r}")
    if rubric is None:
        dimension_stage = f"{_dimension_rules(harness)}\n\nThe dimension pool:\n{_pool_text(harness)}"
    else:
        dimension_stage = ("The dimensions are already chosen; copy them into <dimensions> as written:\n"
                           f"{_rubric_text(rubric)}")
    return render_template("score_evaluator", query=query, n_reports=len(reports), reports=_reports_text(reports),
                           dimension_stage=dimension_stage, process_rules=_process_rules(harness),
                           score_max=SCORE_MAX, search_example=search_example,
                           results_description=results_description, max_search_turns=max_search_turns)


def meta_harness_prompt(statistics: Mapping[str, Any], harness: Harness) -> str:
    """The meta-harness's prompt (Listing 3): the recent training statistics (a JSON object the loop assembles,
    e.g. the Solver's mean reward and per-dimension scores, the Evaluator's consistency reward, its searches, the
    share of zeroed rewards), the harness in force, and Listing 3's output format."""
    if not isinstance(statistics, Mapping):
        raise ValueError(f"statistics must be a mapping, got {type(statistics).__name__}")
    return render_template("score_meta_harness", statistics=json.dumps(dict(statistics), indent=2, sort_keys=True,
                                                                       default=str),
                           current_harness=harness_json(harness), dimension_pool=_pool_text(harness))

