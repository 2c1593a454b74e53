"""scope_lib.evaluation.benchmarks: native-format loaders on the real samples in ../shared/data and on fixtures written in
each benchmark's schema (tests/fixtures/benchmarks), malformed records reported with file and line, seeded
subsampling with a manifest every checkpoint reuses, and the Solver prompt of each benchmark kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scope_lib.config import load_params
from scope_lib.evaluation.benchmarks import (
    BENCHMARKS,
    BenchmarkDataError,
    benchmark_files,
    fetch_benchmark,
    load_benchmark,
    select_items,
    solver_conversation,
    subsample,
)
from scope_lib.protocol.dialects import get_dialect

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"


def params_for(data_dir: Path, files: dict, tmp_path: Path | None = None, **over):
    overrides = {"run.data_dir": str(data_dir), "evaluation.data_files": files, **over}
    if tmp_path is not None:
        overrides["run.runs_dir"] = str(tmp_path)
    return load_params(None, overrides)


# -- real samples -------------------------------------------------------------------------------------------


def test_qa_samples_in_both_schemas(shared_data):
    p = params_for(shared_data, {"nq": "qa/nq.jsonl", "triviaqa": "qa/triviaqa.jsonl",
                                 "hotpotqa": "qa/nq_flashrag_format.jsonl"})
    nq = load_benchmark(p, "nq")
    assert len(nq.items) == 100 and not nq.problems
    assert sum(len(i.reference["golden_answers"]) > 1 for i in nq.items) == 43     # multi-answer rows kept
    trivia = load_benchmark(p, "triviaqa")
    assert len(trivia.items) == 20 and sum(len(i.reference["golden_answers"]) for i in trivia.items) == 224
    assert trivia.items[9].reference["golden_answers"][:2] == ["11", "eleven"]
    flashrag = load_benchmark(p, "hotpotqa")      # FlashRAG's own file: 17 rows, no trailing newline
    assert [i.id for i in flashrag.items][:2] == ["test_0", "test_1"] and len(flashrag.items) == 17


def test_open_ended_samples(shared_data):
    p = params_for(shared_data, {
        "healthbench": "openended/healthbench_sample.jsonl",
        "arena_hard_cw": ["openended/arena_hard_v2_creative.jsonl", "openended/arena_hard_v2_o3mini_answers.jsonl"],
        "drb": ["openended/drb_queries.jsonl", "openended/drb_criteria.jsonl", "openended/drb_articles_claude37.jsonl"],
        "sqa_cs_v2": "openended/sqa_cs_v2_questions.jsonl"})
    hb = load_benchmark(p, "healthbench").items
    assert len(hb) == 8 and sum(len(i.reference["rubrics"]) for i in hb) == 58
    assert sum(r["points"] < 0 for i in hb for r in i.reference["rubrics"]) == 17
    assert [len(i.messages) for i in hb] == [3, 1, 1, 1, 5, 1, 1, 7] and all(i.meta["canary"] for i in hb)
    arena = load_benchmark(p, "arena_hard_cw").items
    assert len(arena) == 60 and all(i.reference["baseline_answer"] for i in arena)
    assert arena[0].reference["baseline_model"] == "o3-mini-2025-01-31"
    drb = load_benchmark(p, "drb").items
    assert [i.id for i in drb] == ["24", "52", "70", "77"] and drb[0].meta["language"] == "zh"
    crit = drb[1].reference["criteria"]
    assert sum(len(v) for v in crit["criterions"].values()) == 23
    assert abs(sum(crit["dimension_weight"].values()) - 1) < 1e-6
    assert len(drb[2].reference["reference_article"]) == 25429     # the Claude 3.7 report as a stand-in reference
    sqa = load_benchmark(p, "sqa_cs_v2").items
    assert [i.id for i in sqa] == ["42", "41", "91", "9", "65"] and sqa[0].reference["ingredients"] is None


def test_arena_answers_with_u2028_and_a_missing_baseline(tmp_path):
    questions = tmp_path / "question.jsonl"
    answers = tmp_path / "baseline.jsonl"
    questions.write_text("".join(json.dumps({"uid": u, "category": c, "subcategory": c, "prompt": f"Write {u}"}) + "\n"
                                 for u, c in [("u1", "creative_writing"), ("u2", "hard_prompt"),
                                              ("u3", "creative_writing")]))
    story = "line one\u2028still the same record"
    answers.write_bytes((json.dumps({"uid": "u1", "model": "base", "messages": [
        {"role": "user", "content": "Write u1"}, {"role": "assistant", "content": {"answer": story}}]},
        ensure_ascii=False) + "\n").encode())
    assert len(answers.read_text().splitlines()) == 2        # str.splitlines() would break this record
    result = load_benchmark(params_for(tmp_path, {"arena_hard_cw": [str(questions), str(answers)]}), "arena_hard_cw")
    assert [i.id for i in result.items] == ["u1"] and result.items[0].reference["baseline_answer"] == story
    assert [(Path(p.file).name, p.line) for p in result.problems] == [("question.jsonl", 3)]   # u3: no baseline
    assert "no baseline answer for uid u3" in result.problems[0].reason


# -- fixtures in native schemas ----------------------------------------------------------------------------


def test_fixture_loaders_in_native_schemas():
    p = params_for(FIXTURES, {"popqa": "popqa_test.jsonl", "bamboogle": "bamboogle_verl.jsonl",
                              "wildbench": "wildbench_test.jsonl", "researchqa": "researchqa_test.json",
                              "researchrubrics": "researchrubrics.jsonl", "sqa_cs_v2": "sqa_rubrics.json",
                              "researchplangen": ["ml.jsonl", "arxiv.jsonl", "pubmed.jsonl"]})
    pop = load_benchmark(p, "popqa").items
    assert pop[0].reference["golden_answers"] == ["cartographer", "map maker", "mapmaker"]
    bam = load_benchmark(p, "bamboogle").items
    assert bam[1].question.startswith("In what year") and bam[1].reference["golden_answers"] == ["1931"]
    wb = load_benchmark(p, "wildbench").items
    assert [i.id for i in wb] == ["wb-aaa1", "wb-bbb2", "wb-ccc3"] and [m["role"] for m in wb[1].messages] == \
        ["user", "assistant", "user"]
    assert wb[1].meta["secondary_tags"] == ["Information seeking", "Planning"]
    rqa = load_benchmark(p, "researchqa").items
    assert [len(i.reference["rubric"]) for i in rqa] == [3, 10]
    rr = load_benchmark(p, "researchrubrics").items
    assert [r["weight"] for r in rr[0].reference["rubrics"]] == [4.0, 2.0, -3.0]
    sqa = load_benchmark(p, "sqa_cs_v2").items
    assert sqa[0].id == "sqa-7" and len(sqa[0].reference["ingredients"]) == 3
    rpg = load_benchmark(p, "researchplangen").items
    assert [i.id for i in rpg] == ["ml-0", "arxiv-0", "pubmed-0"]
    assert "Research goal:\nReduce the memory" in rpg[0].question and rpg[0].reference["goal"].startswith("Reduce")


def test_search_r1_parquet_keeps_its_own_dataset(tmp_path):
    import pandas as pd

    rows = [{"id": "test_0", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare"], "data_source": "nq",
             "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}}},
            {"id": "test_0", "question": "capital of peru?", "golden_answers": ["Lima"], "data_source": "triviaqa",
             "reward_model": {"style": "rule", "ground_truth": {"target": ["Lima"]}}},
            {"id": "test_1", "question": "largest ocean?", "golden_answers": ["Pacific", "Pacific Ocean"],
             "data_source": "nq", "reward_model": {"style": "rule", "ground_truth": {"target": ["Pacific"]}}}]
    pd.DataFrame(rows).to_parquet(tmp_path / "test.parquet")
    p = params_for(tmp_path, {"nq": "test.parquet", "triviaqa": "test.parquet"})
    nq = load_benchmark(p, "nq").items
    assert [i.id for i in nq] == ["test_0", "test_1"] and nq[1].reference["golden_answers"] == ["Pacific",
                                                                                              "Pacific Ocean"]
    assert [i.question for i in load_benchmark(p, "triviaqa").items] == ["capital of peru?"]


def test_malformed_records_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "hb.jsonl"
    good = json.loads((FIXTURES / "researchrubrics.jsonl").read_text().splitlines()[0])
    lines = [json.dumps(good), "{not json", json.dumps({"prompt": "no rubrics"}), "",
             json.dumps({**good, "rubrics": [{"criterion": "only a penalty", "weight": -1}]}), json.dumps(good), "[1]"]
    path.write_text("\n".join(lines))
    result = load_benchmark(params_for(tmp_path, {"researchrubrics": str(path)}), "researchrubrics")
    assert len(result.items) == 1
    found = [(p.line, p.reason) for p in result.problems]
    assert [line for line, _ in found] == [2, 3, 5, 6, 7]
    assert "not valid JSON" in found[0][1] and found[1][1] == "no rubrics"
    assert "no positive weight" in found[2][1] and "duplicate id 'rr-1'" in found[3][1]
    assert all(p.file == str(path) for p in result.problems)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{oops\n")
    with pytest.raises(BenchmarkDataError, match=r"no usable items.*empty\.jsonl:1: not valid JSON"):
        load_benchmark(params_for(tmp_path, {"researchrubrics": str(empty)}), "researchrubrics")


def test_missing_files_and_failed_downloads_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(BenchmarkDataError, match=r"evaluation.data_files.nq: no such file"):
        benchmark_files(params_for(tmp_path, {"nq": "nowhere.jsonl"}), "nq")
    import httpx

    def offline(*args, **kwargs):
        raise httpx.ConnectError("network is unreachable")

    monkeypatch.setattr(httpx, "stream", offline)
    with pytest.raises(BenchmarkDataError, match=r"healthbench: could not download .*oss_eval\.jsonl.*ConnectError.*"
                                                 r"evaluation\.data_files\.healthbench"):
        fetch_benchmark("healthbench", tmp_path / "hb")


# -- subsampling and manifests ------------------------------------------------------------------------------


def test_subsample_methods():
    ids = [f"i{k}" for k in range(2500)]
    scope = subsample(ids, 1000, 42)
    assert len(scope) == 1000 and scope == sorted(scope, key=ids.index) and scope == subsample(ids, 1000, 42)
    assert scope != subsample(ids, 1000, 43)
    shuffled = subsample(ids, 1000, 42, "drtulu_shuffle_head")
    assert len(set(shuffled)) == 1000 and shuffled != sorted(shuffled, key=ids.index)
    assert subsample(ids, 1000, 1, "simple_evals") == subsample(ids, 1000, 2, "simple_evals")   # always Random(0)
    assert subsample(ids[:125], 1000, 42) == ids[:125]          # Bamboogle's 125 stay whole, in order
    with pytest.raises(ValueError, match="unknown sample method"):
        subsample(ids, 10, 0, "random")


def test_manifest_is_written_once_and_reused(shared_data, tmp_path):
    p = params_for(shared_data, {"nq": "qa/nq.jsonl"}, tmp_path, **{"evaluation.max_examples": 10})
    items, manifest = select_items(p, "nq")
    assert len(items) == 10 and manifest["n_total"] == 100 and manifest["ids"] == [i.id for i in items]
    assert manifest["method"] == "scope_sorted" and manifest["seed"] == 42 and len(manifest["ids_sha256"]) == 64
    path = tmp_path / "run" / "eval" / "manifests" / "nq.json"
    assert json.loads(path.read_text())["ids"] == manifest["ids"]
    again, _ = select_items(p, "nq")
    assert [i.id for i in again] == manifest["ids"]
    other = params_for(shared_data, {"nq": "qa/nq.jsonl"}, tmp_path, **{"evaluation.max_examples": 20})
    with pytest.raises(BenchmarkDataError, match="was drawn with .*max_examples.*10.*Delete the manifest"):
        select_items(other, "nq")


# -- Solver prompts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect_name", ["qwen2.5", "qwen3", "olmo3"])
def test_solver_prompt_kinds(dialect_name, shared_data):
    dialect = get_dialect(dialect_name)
    p = params_for(shared_data, {"nq": "qa/nq.jsonl", "healthbench": "openended/healthbench_sample.jsonl",
                                 "arena_hard_cw": ["openended/arena_hard_v2_creative.jsonl",
                                                   "openended/arena_hard_v2_o3mini_answers.jsonl"]})
    nq = load_benchmark(p, "nq").items[0]
    [single] = solver_conversation(BENCHMARKS["nq"], nq, dialect, 5)
    assert single["content"].endswith("Question: " + nq.question + "?") and dialect.search_example in single["content"]
    hb = load_benchmark(p, "healthbench").items[0]            # 3 turns: user, assistant, user
    multi = solver_conversation(BENCHMARKS["healthbench"], hb, dialect, 5)
    assert [m["role"] for m in multi] == [m["role"] for m in hb.messages]
    assert multi[0]["content"].endswith(hb.messages[0]["content"]) and dialect.search_example in multi[0]["content"]
    assert multi[1:] == hb.messages[1:] and "at most 5 time(s)" in multi[0]["content"]
    arena = load_benchmark(p, "arena_hard_cw").items[0]
    assert solver_conversation(BENCHMARKS["arena_hard_cw"], arena, dialect, 5) == arena.messages   # raw prompt
