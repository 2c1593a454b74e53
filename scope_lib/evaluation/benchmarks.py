"""The paper's 15 evaluation benchmarks (§4.1): where each comes from, how its native files are read, how the
Solver is prompted, and which scorers apply. `BENCHMARKS[name]` is the registry.

Sources are each benchmark's own published files (HF dataset id with a pinned revision where one is known, or a
GitHub file at a pinned commit). `fetch_benchmark` downloads them to <data dir>/benchmarks/<name>/ and records
what it got (the resolved revision and each file's sha256) in SOURCE.json; `evaluation.data_files` points a
benchmark at local files instead (gated or offline data). Loaders read the native formats (JSONL split on "\\n"
only — arena-hard's answer files hold U+2028 inside strings —, JSON lists, parquet) and report every malformed
record with its file and line instead of stopping.

Subsampling (§4.1: benchmarks above 1,000 items are cut to 1,000, following DR Tulu) is seeded, and the chosen
ids are written to a manifest that every later checkpoint reuses, so all checkpoints see the same items.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from scope_lib.config import BENCHMARK_NAMES, Params
from scope_lib.evaluation import scorers as S
from scope_lib.runs import atomic_write_json, sha256_file
from scope_lib.selfplay.rollout import solver_messages

log = logging.getLogger(__name__)

Kind = Literal["short_form", "open_ended"]
PromptKind = Literal["solver", "preamble", "raw"]


class BenchmarkDataError(ValueError):
    """A benchmark's data cannot be found, downloaded or read; the message says what to do."""


@dataclass
class Item:
    """One benchmark example in one schema for all: the conversation to answer (`messages`, native, without our
    search instructions) and the benchmark's reference payload (gold answers, rubrics, checklist, baseline
    answer, criteria, ...)."""

    id: str
    benchmark: str
    messages: list[dict[str, str]]
    reference: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        """The last user message: the question of a single-turn benchmark, the query of a conversation."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


@dataclass(frozen=True)
class Problem:
    """A record that could not be read: file, line (or record number) and why."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class LoadResult:
    items: list[Item]
    problems: list[Problem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Source:
    """Where a benchmark is published. kind "hf": a dataset repo (files, or a config/split read with `datasets`);
    kind "url": files at fixed URLs (`files` are full URLs). `revision` None = not pinned: the download records
    the revision it resolved."""

    kind: Literal["hf", "url"]
    location: str
    files: tuple[str, ...] = ()
    revision: str | None = None
    config: str | tuple[str, ...] | None = None
    split: str | None = None
    license: str = ""
    gated: bool = False

    def describe(self) -> str:
        if self.kind == "url":
            return ", ".join(self.files)
        pin = f"@{self.revision[:12]}" if self.revision else " (revision not pinned; recorded at download)"
        what = ", ".join(self.files) if self.files else f"config {self.config}, split {self.split}"
        return f"HF {self.location}{pin}: {what}"


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark: source, loader, Solver prompt, answer extraction and its two scorers."""

    name: str
    title: str
    column: str                      # column label in the paper's Table 2 / 3
    kind: Kind
    group: str                       # the paper's category (General QA, Deep Research, ...)
    source: Source
    local_files: tuple[str, ...]     # file names under <data dir>/benchmarks/<name>/ (the first is required)
    load: Callable[[list[Path], str], LoadResult]
    prompt_kind: PromptKind
    scorers: dict[str, S.Scorer]
    differences: str                 # how our protocol differs from the paper's (docs/evaluation.md)
    answer_source: Literal["answer_tag", "final_text"] = "answer_tag"
    official_judge: str = ""         # the benchmark's own judge model, for reference
    size: int | None = None          # items in the full source


# -- reading native files --------------------------------------------------------------------------------


def iter_records(path: Path) -> Iterator[tuple[int, dict[str, Any] | Problem]]:
    """(line or record number, record or Problem) for a JSONL, JSON (list, or {"data": list}) or parquet file.
    JSONL is split on "\\n" only, so U+2028 inside strings is kept; a last line without a newline is read."""
    name = str(path)
    suffixes = "".join(path.suffixes[-2:]).lower()
    if suffixes.endswith(".parquet"):
        import pandas as pd

        for i, row in enumerate(pd.read_parquet(path).to_dict(orient="records"), start=1):
            yield i, _plain(row)
        return
    if suffixes.endswith(".json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            yield 1, Problem(name, 1, f"not valid JSON: {exc}")
            return
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            yield 1, Problem(name, 1, f"expected a JSON list of records, got {type(data).__name__}")
            return
        for i, record in enumerate(data, start=1):
            yield i, record if isinstance(record, dict) else Problem(name, i, "record is not a JSON object")
        return
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh.read().split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                yield lineno, Problem(name, lineno, f"not valid JSON: {str(exc)[:120]}")
                continue
            yield lineno, record if isinstance(record, dict) else Problem(name, lineno, "not a JSON object")


def _plain(value: Any) -> Any:
    """numpy arrays and scalars from parquet rows -> plain lists and Python scalars."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _plain(value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _read(paths: list[Path], build: Callable[[dict[str, Any], int], Item | str | None]) -> LoadResult:
    """Read records from every file; `build(record, index)` returns an Item, a reason string (malformed), or
    None (a record of another benchmark, skipped silently). Duplicate ids are problems too."""
    result = LoadResult(items=[], files=[str(p) for p in paths])
    seen: set[str] = set()
    index = 0
    for path in paths:
        for lineno, record in iter_records(path):
            if isinstance(record, Problem):
                result.problems.append(record)
                continue
            try:
                built = build(record, index)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                built = f"unexpected record shape ({type(exc).__name__}: {exc})"
            if built is None:
                continue
            index += 1
            if isinstance(built, str):
                result.problems.append(Problem(str(path), lineno, built))
            elif built.id in seen:
                result.problems.append(Problem(str(path), lineno, f"duplicate id {built.id!r}"))
            else:
                seen.add(built.id)
                result.items.append(built)
    return result


def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- short-form QA ---------------------------------------------------------------------------------------


def _gold_answers(record: dict[str, Any]) -> list[str] | None:
    """Gold answers from any of the shapes the QA files use: FlashRAG `golden_answers`, Search-R1/verl
    `reward_model.ground_truth(.target)`, `answer` / `answers` / `possible_answers` (a list or a JSON list)."""
    for key in ("golden_answers", "answers", "possible_answers"):
        value = record.get(key)
        if isinstance(value, str) and value.startswith("["):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and value:
            return [str(v) for v in value]
    truth = (record.get("reward_model") or {}).get("ground_truth")
    if isinstance(truth, dict):
        truth = truth.get("target")
    if isinstance(truth, str):
        truth = [truth]
    if isinstance(truth, list) and truth:
        return [str(v) for v in truth]
    answer = record.get("answer") if record.get("answer") is not None else (record.get("extra_info") or {}).get("answer")
    if isinstance(answer, dict):  # TriviaQA's own schema
        answer = [answer.get("value"), *(answer.get("aliases") or [])]
    if isinstance(answer, str):
        answer = [answer]
    if isinstance(answer, list):
        answers = list(dict.fromkeys(str(a) for a in answer if a not in (None, "")))
        return answers or None
    return None


def qa_loader(name: str) -> Callable[[list[Path], str], LoadResult]:
    def build(record: dict[str, Any], index: int) -> Item | str | None:
        source = record.get("data_source") or record.get("source")
        if isinstance(source, str) and source in BENCHMARK_NAMES and source != name:
            return None  # Search-R1's merged test file holds all seven sets: a row of another one
        question = _text(record.get("question")) or _text((record.get("extra_info") or {}).get("question"))
        if question is None and isinstance(record.get("prompt"), list) and record["prompt"]:
            question = _text(record["prompt"][-1].get("content"))
        if question is None:
            return "no question"
        golds = _gold_answers(record)
        if not golds:
            return "no gold answers"
        raw_id = record.get("id") or (record.get("extra_info") or {}).get("index")
        item_id = str(raw_id) if raw_id not in (None, "") else f"{name}-{index}"
        return Item(item_id, name, _user(question), {"golden_answers": golds},
                    {"source": str(source or name)})

    return lambda paths, _name: _read(paths, build)


def qa_question(question: str) -> str:
    """Search-R1's test questions end with "?" (its merge script adds one): the same here."""
    question = question.strip()
    return question if question.endswith("?") else question + "?"


# -- open-ended ------------------------------------------------------------------------------------------


def _conversation(turns: Any) -> list[dict[str, str]] | str:
    if not isinstance(turns, list) or not turns:
        return "no conversation"
    messages = []
    for t in turns:
        if not isinstance(t, dict) or t.get("role") not in ("user", "assistant", "system") \
                or not isinstance(t.get("content"), str):
            return "a conversation turn lacks role/content"
        messages.append({"role": t["role"], "content": t["content"]})
    if messages[-1]["role"] != "user":
        return "the conversation does not end with a user turn"
    return messages


def load_healthbench(paths: list[Path], name: str) -> LoadResult:
    def build(record, index):
        messages = _conversation(record.get("prompt"))
        if isinstance(messages, str):
            return messages
        rubrics = record.get("rubrics")
        if not isinstance(rubrics, list) or not rubrics:
            return "no rubrics"
        clean = []
        for r in rubrics:
            if not isinstance(r, dict) or not _text(r.get("criterion")) \
                    or not isinstance(r.get("points"), (int, float)) or isinstance(r.get("points"), bool):
                return "a rubric lacks criterion/points"
            clean.append({"criterion": r["criterion"], "points": float(r["points"]), "tags": r.get("tags") or []})
        if not any(r["points"] > 0 for r in clean):
            return "no positive-point criterion (the score is undefined)"
        return Item(str(record.get("prompt_id") or f"healthbench-{index}"), name, messages, {"rubrics": clean},
                    {"example_tags": record.get("example_tags") or [], "canary": record.get("canary")})

    return _read(paths, build)


def load_wildbench(paths: list[Path], name: str) -> LoadResult:
    def build(record, index):
        messages = _conversation(record.get("conversation_input"))
        if isinstance(messages, str):
            return messages
        checklist = record.get("checklist")
        if not isinstance(checklist, list):
            return "no checklist"
        item_id = record.get("session_id") or record.get("id") or f"wildbench-{index}"
        return Item(str(item_id), name, messages, {"checklist": [str(c) for c in checklist],
                                                    "references": record.get("references") or {}},
                    {"primary_tag": record.get("primary_tag"), "secondary_tags": record.get("secondary_tags") or [],
                     "intent": record.get("intent")})

    return _read(paths, build)


def load_arena_hard(paths: list[Path], name: str) -> LoadResult:
    """question.jsonl (creative_writing rows kept) joined on uid with the baseline's model_answer file."""
    if len(paths) < 2:
        raise BenchmarkDataError("arena_hard_cw needs two files: the questions and the baseline model's answers "
                                 "(evaluation.data_files.arena_hard_cw: [question.jsonl, <baseline>.jsonl])")
    baseline: dict[str, tuple[str, str]] = {}
    problems: list[Problem] = []
    for lineno, record in iter_records(paths[1]):
        if isinstance(record, Problem):
            problems.append(record)
            continue
        answer = _arena_answer(record)
        if answer is None or not record.get("uid"):
            problems.append(Problem(str(paths[1]), lineno, "no uid or no assistant answer"))
            continue
        baseline[str(record["uid"])] = (answer, str(record.get("model") or "baseline"))

    def build(record, index):
        if record.get("category") not in (None, "creative_writing"):
            return None
        prompt, uid = _text(record.get("prompt")), record.get("uid")
        if prompt is None or not uid:
            return "no uid or prompt"
        if str(uid) not in baseline:
            return f"no baseline answer for uid {uid} in {paths[1]}"
        answer, model = baseline[str(uid)]
        return Item(str(uid), name, _user(prompt), {"baseline_answer": answer, "baseline_model": model},
                    {"subcategory": record.get("subcategory")})

    result = _read(paths[:1], build)
    result.problems = problems + result.problems
    result.files = [str(p) for p in paths]
    return result


def _arena_answer(record: dict[str, Any]) -> str | None:
    for message in reversed(record.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, dict):
                content = content.get("answer")
            return content if isinstance(content, str) else None
    return None


def load_researchqa(paths: list[Path], name: str) -> LoadResult:
    def build(record, index):
        query = _text(record.get("query"))
        rubric = record.get("rubric")
        if query is None:
            return "no query"
        if not isinstance(rubric, list) or not rubric or not all(
                isinstance(r, dict) and _text(r.get("rubric_item")) for r in rubric):
            return "no rubric items"
        return Item(str(record.get("id") or f"researchqa-{index}"), name, _user(query),
                    {"rubric": [{"rubric_item": r["rubric_item"], "type": r.get("type")} for r in rubric]},
                    {k: record.get(k) for k in ("general_domain", "subdomain", "field")})

    return _read(paths, build)


def load_drb(paths: list[Path], name: str) -> LoadResult:
    """query.jsonl, with criteria.jsonl and a reference-articles file joined on id when given."""
    extra: list[dict[int | str, dict]] = []
    problems: list[Problem] = []
    for path in paths[1:]:
        table: dict[int | str, dict] = {}
        for lineno, record in iter_records(path):
            if isinstance(record, Problem) or record.get("id") is None:
                problems.append(record if isinstance(record, Problem) else Problem(str(path), lineno, "no id"))
                continue
            table[str(record["id"])] = record
        extra.append(table)
    criteria = next((t for t in extra if any("criterions" in r for r in t.values())), {})
    articles = next((t for t in extra if any("article" in r for r in t.values())), {})

    def build(record, index):
        prompt = _text(record.get("prompt")) or _text(record.get("topic"))
        if prompt is None or record.get("id") is None:
            return "no id or prompt"
        key = str(record["id"])
        crit = criteria.get(key)
        if crit is not None and (not isinstance(crit.get("criterions"), dict)
                                 or not isinstance(crit.get("dimension_weight"), dict)):
            return f"criteria for id {key} lack criterions/dimension_weight"
        reference = (articles.get(key) or {}).get("article")
        return Item(key, name, _user(prompt), {
            "criteria": {"dimension_weight": crit["dimension_weight"], "criterions": crit["criterions"]} if crit else None,
            "reference_article": reference if isinstance(reference, str) and reference.strip() else None},
            {"language": record.get("language"), "topic": record.get("topic")})

    result = _read(paths[:1], build)
    result.problems = problems + result.problems
    result.files = [str(p) for p in paths]
    return result


def load_researchrubrics(paths: list[Path], name: str) -> LoadResult:
    def build(record, index):
        prompt, rubrics = _text(record.get("prompt")), record.get("rubrics")
        if prompt is None:
            return "no prompt"
        if not isinstance(rubrics, list) or not rubrics:
            return "no rubrics"
        clean = []
        for r in rubrics:
            if not isinstance(r, dict) or not _text(r.get("criterion")) or not isinstance(r.get("weight"), (int, float)):
                return "a rubric lacks criterion/weight"
            clean.append({"criterion": r["criterion"], "weight": float(r["weight"]), "axis": r.get("axis")})
        if not any(r["weight"] > 0 for r in clean):
            return "no positive weight (the score is undefined)"
        return Item(str(record.get("sample_id") or f"researchrubrics-{index}"), name, _user(prompt),
                    {"rubrics": clean}, {k: record.get(k) for k in ("domain", "conceptual_breadth")})

    return _read(paths, build)


def load_sqa(paths: list[Path], name: str) -> LoadResult:
    """AstaBench's rubrics file ({case_id, question, ingredients, ...}) or question-only rows
    ({example_id, problem}, as in DR Tulu's SQA files)."""
    def build(record, index):
        question = _text(record.get("question")) or _text(record.get("problem"))
        if question is None:
            return "no question"
        ingredients = record.get("ingredients")
        if ingredients is not None and (not isinstance(ingredients, list) or not all(
                isinstance(g, dict) and _text(g.get("criterion")) for g in ingredients)):
            return "ingredients lack a criterion"
        item_id = record.get("case_id") or record.get("example_id") or f"sqa-{index}"
        return Item(str(item_id), name, _user(question), {"ingredients": ingredients or None})

    return _read(paths, build)


def load_researchplangen(paths: list[Path], name: str) -> LoadResult:
    """Rows {Goal, Rubric, "Reference solution"} (one file per subset: ml, arxiv, pubmed; subsets combined,
    as the authors' code does). Ids are <subset>-<row>, the subset taken from the file name or a `subset`
    column."""
    items, problems, files = [], [], []
    for path in paths:
        subset = next((s for s in ("ml", "arxiv", "pubmed") if s in path.name.lower()), path.stem)

        def build(record, index, subset=subset):
            goal, rubric = _text(record.get("Goal")), record.get("Rubric")
            if goal is None:
                return "no Goal"
            if isinstance(rubric, str):
                rubric = [rubric]
            if not isinstance(rubric, list) or not any(_text(r) for r in rubric):
                return "no Rubric items"
            part = record.get("subset") or subset
            return Item(f"{part}-{index}", name, _user(S.render("rpg_question", goal=goal)),
                        {"goal": goal, "rubric": [r for r in rubric if _text(r)],
                         "reference_solution": record.get("Reference solution")}, {"subset": part})

        result = _read([path], build)
        items += result.items
        problems += result.problems
        files += result.files
    return LoadResult(items, problems, files)


# -- the registry ----------------------------------------------------------------------------------------

_QA_SOURCE = dict(kind="hf", location="RUC-NLPIR/FlashRAG_datasets", license="cc-by-sa-4.0 (FlashRAG_datasets card)")
_QA_DIFF = ("Paper: gpt-5-mini judges semantic equivalence (T 1.0). Here the same, with the SCOPE grader template "
            "(Figure 11) and the gold answers as one rubric; EM/F1/substring accuracy reported beside it.")


def _qa(name: str, title: str, column: str, group: str, config: str, split: str, size: int) -> BenchmarkSpec:
    return BenchmarkSpec(
        name=name, title=title, column=column, kind="short_form", group=group,
        source=Source(files=(f"{config}/{split}.jsonl",), **_QA_SOURCE),
        local_files=(f"{split}.jsonl",), load=qa_loader(name), prompt_kind="solver",
        scorers={"scope_paper": S.QAJudge(), "official": S.QAMetrics()}, differences=_QA_DIFF, size=size,
        official_judge="none (exact match)")


_ARENA_COMMIT = "196f6b826783b3da7310e361a805fa36f0be83f3"
_DRB_COMMIT = "214741e474a5347ea7f869ab79d27e7c8734ede7"
_GITHUB = "https://raw.githubusercontent.com"

BENCHMARKS: dict[str, BenchmarkSpec] = {spec.name: spec for spec in [
    _qa("nq", "Natural Questions", "NQ", "General QA", "nq", "test", 3610),
    _qa("triviaqa", "TriviaQA", "TriviaQA", "General QA", "triviaqa", "test", 11313),
    _qa("popqa", "PopQA", "PopQA", "General QA", "popqa", "test", 14267),
    _qa("hotpotqa", "HotpotQA", "HotpotQA", "Multi-hop QA", "hotpotqa", "dev", 7405),
    _qa("2wikimultihopqa", "2WikiMultiHopQA", "2Wiki", "Multi-hop QA", "2wikimultihopqa", "dev", 12576),
    _qa("musique", "MuSiQue", "MuSiQue", "Multi-hop QA", "musique", "dev", 2417),
    _qa("bamboogle", "Bamboogle", "Bamboogle", "Multi-hop QA", "bamboogle", "test", 125),
    BenchmarkSpec(
        name="drb", title="DeepResearch Bench (RACE)", column="DRB", kind="open_ended", group="Deep Research",
        source=Source("url", "Ayanami0730/deep_research_bench", files=(
            f"{_GITHUB}/Ayanami0730/deep_research_bench/{_DRB_COMMIT}/data/prompt_data/query.jsonl",
            f"{_GITHUB}/Ayanami0730/deep_research_bench/{_DRB_COMMIT}/data/criteria_data/criteria.jsonl",
            f"{_GITHUB}/Ayanami0730/deep_research_bench/{_DRB_COMMIT}/data/test_data/cleaned_data/reference.jsonl"),
            revision=_DRB_COMMIT, license="Apache-2.0"),
        local_files=("query.jsonl", "criteria.jsonl", "reference.jsonl"), load=load_drb, prompt_kind="solver",
        scorers={"scope_paper": S.DRBHolisticScorer(), "official": S.DRBRaceScorer()}, size=100,
        official_judge="gemini-2.5-pro", differences=(
            "Paper number = the authors' code: one holistic 1-5 rating of 5 dimensions (not RACE). official = RACE "
            "against the reference report (absolute without one); the LLM article-cleaning step is skipped. Half "
            "the tasks are Chinese.")),
    BenchmarkSpec(
        name="researchrubrics", title="ResearchRubrics", column="Rubrics", kind="open_ended", group="Deep Research",
        source=Source("hf", "ScaleAI/researchrubrics", files=("processed_data.jsonl",), license="MIT", gated=True),
        local_files=("processed_data.jsonl",), load=load_researchrubrics, prompt_kind="solver",
        scorers={"scope_paper": S.ResearchRubricsScorer("scope_paper"),
                 "official": S.ResearchRubricsScorer("official")}, size=101, official_judge="gemini-2.5-pro",
        differences="Gated dataset: accept its terms on HF or give a local file. scope_paper clips each item to "
                    "[0, 1]; official does not and hides the task from the judge."),
    BenchmarkSpec(
        name="researchqa", title="ResearchQA", column="ResQA", kind="open_ended", group="Scholarly QA",
        source=Source("hf", "realliyifei/ResearchQA", files=("test.json",),
                      revision="87cdd81df0c5ea96de293859233e8e64dac3d168", license="see the HF card"),
        local_files=("test.json",), load=load_researchqa, prompt_kind="solver",
        scorers={"scope_paper": S.ResearchQAScorer("scope_paper", None),
                 "official": S.ResearchQAScorer("official", 8)}, size=3750, official_judge="gpt-4.1-mini",
        differences="Both scorers number the rubric items and require every number once (the authors' code keeps "
                    "only lines equal to a label, so a misaligned reply silently shifts labels)."),
    BenchmarkSpec(
        name="sqa_cs_v2", title="ScholarQA-CS-V2", column="SQAv2", kind="open_ended", group="Scholarly QA",
        source=Source("hf", "allenai/asta-bench", files=("tasks/sqa/rubrics_v2_recomputed.json",),
                      license="see the HF card"),
        local_files=("rubrics_v2_recomputed.json",), load=load_sqa, prompt_kind="solver",
        scorers={"scope_paper": S.SQAQualityScorer(), "official": S.SQAIngredientScorer()}, size=100,
        official_judge="gpt-4o / gemini-2.5-flash",
        differences="Paper number = one holistic 1-5 rating. official here is only the ingredient-recall part of "
                    "AstaBench's score: the citation metrics need JSON answers with citations."),
    BenchmarkSpec(
        name="researchplangen", title="ResearchPlanGen", column="ResPlan", kind="open_ended", group="Planning",
        source=Source("hf", "facebook/research-plan-gen", config=("ml", "arxiv", "pubmed"), split="test",
                      license="see the HF card"),
        local_files=("ml.jsonl", "arxiv.jsonl", "pubmed.jsonl"), load=load_researchplangen, prompt_kind="solver",
        scorers={"scope_paper": S.ResearchPlanGenScorer("scope_paper"),
                 "official": S.ResearchPlanGenScorer("official")}, size=2645, official_judge="a jury of frontier models",
        differences="Subsets combined before subsampling (the authors' code). The official grader prompt is not "
                    "published; official = share of rubric items met with the bare goal as context."),
    BenchmarkSpec(
        name="healthbench", title="HealthBench", column="HealthB", kind="open_ended", group="User Assist.",
        source=Source("url", "openai/simple-evals", files=(
            "https://openaipublic.blob.core.windows.net/simple-evals/healthbench/2025-05-07-06-14-12_oss_eval.jsonl",),
            license="MIT"),
        local_files=("2025-05-07-06-14-12_oss_eval.jsonl",), load=load_healthbench, prompt_kind="preamble",
        scorers={"scope_paper": S.HealthBenchScorer("scope_paper"), "official": S.HealthBenchScorer("official")},
        size=5000, official_judge="gpt-4.1 (T 0.5)",
        differences="scope_paper clips each item to [0, 1] (the authors' code); official clips only the final "
                    "mean. The search instructions go on the first user turn; the judge sees the original "
                    "conversation."),
    BenchmarkSpec(
        name="wildbench", title="WildBench v2", column="WildB", kind="open_ended", group="User Assist.",
        source=Source("hf", "allenai/WildBench", config="v2", split="test", license="not stated (treat as restricted)"),
        local_files=("test.jsonl",), load=load_wildbench, prompt_kind="preamble",
        scorers={"scope_paper": S.WildBenchScorer("scope_paper"), "official": S.WildBenchScorer("official")},
        size=1024, official_judge="gpt-4o-2024-05-13 (T 0)",
        differences="scope_paper = (s - 1) / 9 (the authors' code); official = WB-Score (s - 5) / 5 and its "
                    "task-macro. Unparseable ratings follow the declared policy (the authors' code uses 1)."),
    BenchmarkSpec(
        name="arena_hard_cw", title="Arena-Hard v2 creative writing", column="AH-CW", kind="open_ended",
        group="Creative", source=Source("url", "lmarena/arena-hard-auto", files=(
            f"{_GITHUB}/lmarena/arena-hard-auto/{_ARENA_COMMIT}/data/arena-hard-v2.0/question.jsonl",
            f"{_GITHUB}/lmarena/arena-hard-auto/{_ARENA_COMMIT}/data/arena-hard-v2.0/model_answer/"
            "gemini-2.0-flash-001.jsonl"), revision=_ARENA_COMMIT, license="Apache-2.0"),
        local_files=("question.jsonl", "gemini-2.0-flash-001.jsonl"), load=load_arena_hard, prompt_kind="raw",
        answer_source="final_text",
        scorers={"scope_paper": S.ArenaHardScorer("scope_paper"), "official": S.ArenaHardScorer("official")},
        size=250, official_judge="gpt-4.1 (T 0), baseline gemini-2.0-flash-001",
        differences="Raw prompt without search instructions (as the authors' code); the reply is the final turn's "
                    "text outside <think> (the code grades only <answer> text, which a raw prompt never asks for). "
                    "official pools exploded verdicts and drops questions with an invalid game."),
]}

assert tuple(BENCHMARKS) == BENCHMARK_NAMES, "registry and config.BenchmarkName must list the same benchmarks"


# -- files, download -------------------------------------------------------------------------------------


def benchmark_dir(params: Params, name: str) -> Path:
    return params.data_dir / "benchmarks" / name


def benchmark_files(params: Params, name: str, *, download: bool = True) -> list[Path]:
    """The local files of a benchmark: `evaluation.data_files[name]` (a file, a list of files, or a folder holding
    the spec's file names), else <data dir>/benchmarks/<name>/, downloaded there when missing."""
    spec = BENCHMARKS[name]
    given = params.evaluation.data_files.get(name)
    if given is not None:
        entries = [given] if isinstance(given, str) else list(given)
        paths = [p if p.is_absolute() else params.data_dir / p
                 for p in (Path(os.path.expandvars(os.path.expanduser(str(e)))) for e in entries)]
        if len(paths) == 1 and paths[0].is_dir():
            paths = [paths[0] / f for f in spec.local_files if (paths[0] / f).exists()] or [paths[0] / spec.local_files[0]]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise BenchmarkDataError(f"evaluation.data_files.{name}: no such file: {', '.join(missing)}")
        return paths
    folder = benchmark_dir(params, name)
    present = [folder / f for f in spec.local_files if (folder / f).is_file()]
    if not present and download:
        fetch_benchmark(name, folder)
        present = [folder / f for f in spec.local_files if (folder / f).is_file()]
    if not present:
        raise BenchmarkDataError(f"{name}: no data under {folder} (expected {', '.join(spec.local_files)})")
    return present


def fetch_benchmark(name: str, folder: str | os.PathLike) -> Path:
    """Download a benchmark's source files into `folder` (resumable at file level) and write SOURCE.json with
    what was fetched: the revision (resolved when not pinned) and each file's sha256."""
    spec = BENCHMARKS[name]
    source, folder = spec.source, Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fetched: dict[str, str] = {}
    resolved = source.revision
    try:
        if source.kind == "url":
            for url, local in zip(source.files, spec.local_files, strict=False):
                _download_url(url, folder / local)
                fetched[local] = url
        elif source.files:
            from huggingface_hub import HfApi, hf_hub_download

            resolved = resolved or HfApi().dataset_info(source.location).sha
            for remote, local in zip(source.files, spec.local_files, strict=True):
                path = hf_hub_download(source.location, remote, repo_type="dataset", revision=resolved,
                                       local_dir=str(folder / ".hf"))
                Path(path).replace(folder / local)
                fetched[local] = f"hf://{source.location}@{resolved}/{remote}"
        else:
            from datasets import load_dataset
            from huggingface_hub import HfApi

            resolved = resolved or HfApi().dataset_info(source.location).sha
            configs = source.config if isinstance(source.config, tuple) else (source.config,)
            for config, local in zip(configs, spec.local_files, strict=False):
                rows = load_dataset(source.location, config, split=source.split, revision=resolved)
                _write_rows(folder / local, (dict(r) for r in rows))
                fetched[local] = f"hf://{source.location}@{resolved} config={config} split={source.split}"
    except BenchmarkDataError:
        raise
    except Exception as exc:  # network, auth (gated), missing package: one clear message
        gated = " It is gated: accept its terms on huggingface.co and set HF_TOKEN." if source.gated else ""
        raise BenchmarkDataError(
            f"{name}: could not download {source.describe()} ({type(exc).__name__}: {str(exc)[:200]}).{gated} "
            f"Put the files ({', '.join(spec.local_files)}) in {folder}, or set evaluation.data_files.{name} to "
            f"local files.") from None
    atomic_write_json(folder / "SOURCE.json", {
        "benchmark": name, "source": asdict(source), "revision": resolved, "fetched": time.time(),
        "files": {local: {"from": origin, "sha256": sha256_file(folder / local)} for local, origin in fetched.items()}})
    return folder


def _download_url(url: str, dest: Path) -> None:
    import httpx

    if dest.is_file():
        return
    tmp = dest.with_name(dest.name + ".part")
    with httpx.stream("GET", url, follow_redirects=True, timeout=60) as response:
        response.raise_for_status()
        with open(tmp, "wb") as fh:
            for chunk in response.iter_bytes():
                fh.write(chunk)
    tmp.replace(dest)


def _write_rows(dest: Path, rows) -> None:
    tmp = dest.with_name(dest.name + ".part")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(_plain(row), ensure_ascii=False, default=str) + "\n")
    tmp.replace(dest)


def load_benchmark(params: Params, name: str) -> LoadResult:
    """Every item of a benchmark from its local (or downloaded) files; malformed records are logged with file
    and line and returned in `problems`."""
    if name not in BENCHMARKS:
        raise BenchmarkDataError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    result = BENCHMARKS[name].load(benchmark_files(params, name), name)
    if result.problems:
        log.warning("%s: %d malformed record(s) skipped, e.g. %s", name, len(result.problems), result.problems[0])
    if not result.items:
        raise BenchmarkDataError(f"{name}: no usable items in {', '.join(result.files)}"
                                 + (f" (first problem: {result.problems[0]})" if result.problems else ""))
    return result


# -- subsampling and the manifest ------------------------------------------------------------------------


def subsample(ids: list[str], n: int, seed: int, method: str = "scope_sorted") -> list[str]:
    """At most n ids, seeded. scope_sorted: Random(seed).sample of positions, sorted back into source order (the
    authors' code); drtulu_shuffle_head: random.seed(seed), shuffle, first n (DR Tulu); simple_evals:
    Random(0).sample (seed ignored, as simple-evals). Sets of n or fewer are kept whole, in source order."""
    if len(ids) <= n:
        return list(ids)
    if method == "scope_sorted":
        return [ids[i] for i in sorted(random.Random(seed).sample(range(len(ids)), n))]
    if method == "drtulu_shuffle_head":
        shuffled = list(ids)
        random.Random(seed).shuffle(shuffled)
        return shuffled[:n]
    if method == "simple_evals":
        return random.Random(0).sample(list(ids), n)
    raise ValueError(f"unknown sample method {method!r}; choose scope_sorted, drtulu_shuffle_head or simple_evals")


def ids_sha256(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


def manifest_path(params: Params, name: str) -> Path:
    return params.run_dir / "eval" / "manifests" / f"{name}.json"


def select_items(params: Params, name: str) -> tuple[list[Item], dict[str, Any]]:
    """The evaluated items of a benchmark and their manifest. The first call draws the sample and writes
    runs/<name>/eval/manifests/<benchmark>.json; later calls (other checkpoints, re-scoring, replay) reuse it.
    A manifest drawn with other sampling settings is an error, not a silent redraw."""
    e = params.evaluation
    loaded = load_benchmark(params, name)
    by_id = {item.id: item for item in loaded.items}
    path = manifest_path(params, name)
    wanted = {"max_examples": e.max_examples, "method": e.sample_method, "seed": e.sample_seed}
    if path.is_file():
        manifest = json.loads(path.read_text())
        drawn = {k: manifest.get(k) for k in wanted}
        if drawn != wanted:
            raise BenchmarkDataError(f"{path} was drawn with {drawn}, the params ask for {wanted}; every checkpoint "
                                     "of a run must see the same items. Delete the manifest to draw a new sample "
                                     "(earlier results then no longer compare), or use another run name.")
        missing = [i for i in manifest["ids"] if i not in by_id]
        if missing:
            raise BenchmarkDataError(f"{path} lists {len(missing)} id(s) absent from {', '.join(loaded.files)} "
                                     f"(e.g. {missing[:3]}); the source changed since the sample was drawn")
        return [by_id[i] for i in manifest["ids"]], manifest
    chosen = subsample([item.id for item in loaded.items], e.max_examples, e.sample_seed, e.sample_method)
    files = {str(p): sha256_file(p) for p in loaded.files}
    source_record = benchmark_dir(params, name) / "SOURCE.json"
    manifest = {"benchmark": name, **wanted, "n_total": len(loaded.items), "n_selected": len(chosen),
                "ids": chosen, "ids_sha256": ids_sha256(chosen), "files": files,
                "source": BENCHMARKS[name].source.describe(),
                "download": json.loads(source_record.read_text()) if source_record.is_file() else None,
                "malformed_records": [str(p) for p in loaded.problems], "created": time.time()}
    atomic_write_json(path, manifest)
    return [by_id[i] for i in chosen], manifest


# -- Solver prompts --------------------------------------------------------------------------------------


def solver_conversation(spec: BenchmarkSpec, item: Item, dialect, max_searches: int,
                        variant: str = "paper") -> list[dict[str, str]]:
    """What the Solver is given: the Solver prompt around the question (single-turn benchmarks; `variant` is the
    Solver prompt the checkpoint was trained with, `solver.prompt`), the native conversation with the search
    instructions on its first user turn (multi-turn benchmarks), or the raw prompt (Arena-Hard creative writing,
    as the authors' code)."""
    if spec.prompt_kind == "raw":
        return [dict(m) for m in item.messages]
    if spec.prompt_kind == "solver":
        question = qa_question(item.question) if spec.kind == "short_form" else item.question
        return solver_messages(question, dialect, max_searches, variant)
    preamble = S.render("solver_preamble", search_example=dialect.search_example,
                        results_description=dialect.results_description, max_search_turns=max_searches)
    messages = [dict(m) for m in item.messages]
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[first]["content"] = preamble + "\n\n" + messages[first]["content"]
    return messages
