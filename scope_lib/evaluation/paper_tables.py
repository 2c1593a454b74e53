"""The paper's reported numbers (arXiv 2605.31433, Tables 2, 3, 4 and 6), for side-by-side comparison.

Rows are keyed by the checkpoint names the evaluation writes ("base", "iter_01-solver", ...) plus "GRPO_data"
(the curated-data baseline, which this toolkit does not train). Scores are 0-100, as printed.
"""

from __future__ import annotations

TABLE2_COLUMNS = ("DRB", "Rubrics", "ResQA", "SQAv2", "ResPlan", "HealthB", "WildB", "AH-CW")
TABLE3_COLUMNS = ("NQ", "TriviaQA", "PopQA", "HotpotQA", "2Wiki", "MuSiQue", "Bamboogle")
ROWS = ("base", "GRPO_data", "iter_01-solver", "iter_02-solver", "iter_03-solver")

_T2 = {
    "Qwen2.5-7B": [
        [33.2, 13.1, 32.0, 25.8, 32.4, 16.1, 33.8, 8.5], [52.1, 24.4, 46.4, 33.3, 43.1, 20.7, 35.4, 11.9],
        [47.5, 19.8, 46.0, 31.0, 40.5, 17.2, 34.6, 10.6], [50.0, 24.3, 48.5, 31.0, 43.6, 19.4, 35.7, 11.5],
        [53.2, 27.3, 50.5, 32.8, 45.4, 20.1, 35.0, 13.9]],
    "Qwen3-8B": [
        [49.2, 24.2, 40.0, 37.5, 53.9, 25.9, 45.7, 24.9], [56.8, 33.1, 51.2, 40.4, 57.0, 25.1, 47.0, 21.0],
        [51.3, 25.8, 47.8, 38.5, 55.3, 26.2, 46.2, 26.5], [55.5, 30.1, 51.6, 39.8, 56.8, 26.8, 46.9, 27.6],
        [57.6, 31.3, 53.7, 41.8, 57.7, 28.1, 46.1, 28.4]],
    "OLMo-3-7B": [
        [40.3, 19.0, 35.9, 33.0, 51.1, 16.2, 35.5, 14.8], [50.7, 32.8, 52.3, 37.8, 58.8, 23.9, 42.7, 12.8],
        [45.4, 27.2, 44.1, 34.8, 57.7, 19.5, 41.4, 16.8], [47.7, 31.3, 48.3, 38.0, 58.8, 19.9, 41.2, 18.0],
        [47.9, 31.6, 51.1, 37.3, 59.5, 21.2, 40.9, 18.7]],
}
_T2_AVG = {"Qwen2.5-7B": [24.4, 33.4, 30.9, 33.0, 34.8], "Qwen3-8B": [37.7, 41.5, 39.7, 41.9, 43.1],
           "OLMo-3-7B": [30.7, 39.0, 35.8, 37.9, 38.5]}
_T3 = {
    "Qwen2.5-7B": [
        [56.4, 71.6, 44.9, 49.0, 36.0, 17.9, 45.6], [68.1, 77.0, 50.8, 63.7, 53.6, 28.8, 52.0],
        [64.2, 73.7, 47.2, 57.8, 45.8, 26.6, 51.2], [67.2, 76.8, 50.2, 65.7, 53.1, 31.3, 50.4],
        [74.4, 81.0, 53.5, 65.6, 52.3, 32.6, 58.4]],
    "Qwen3-8B": [
        [62.8, 77.2, 48.7, 56.8, 52.3, 24.4, 56.0], [69.0, 79.0, 52.5, 71.5, 57.6, 32.7, 62.3],
        [68.4, 78.9, 49.3, 60.9, 55.6, 29.7, 64.0], [70.5, 81.1, 53.3, 62.8, 55.5, 34.0, 59.2],
        [71.9, 80.9, 54.5, 65.8, 60.5, 34.4, 64.8]],
    "OLMo-3-7B": [
        [53.1, 61.3, 45.4, 41.7, 32.4, 15.7, 30.4], [73.0, 64.0, 52.0, 60.0, 32.0, 21.0, 38.0],
        [57.6, 67.4, 46.0, 46.2, 39.5, 16.7, 27.2], [63.3, 71.3, 48.9, 53.3, 44.7, 20.9, 33.6],
        [67.3, 71.8, 49.2, 55.0, 43.4, 23.1, 34.4]],
}
_T3_AVG = {"Qwen2.5-7B": [45.9, 56.3, 52.4, 56.4, 59.7], "Qwen3-8B": [54.0, 60.7, 58.1, 59.5, 61.8],
           "OLMo-3-7B": [40.0, 48.6, 42.9, 48.0, 49.2]}

#: Table 2 (open-ended) per model: {row: {column: score, ..., "Avg": printed average}}.
TABLE2: dict[str, dict[str, dict[str, float]]] = {
    model: {row: {**dict(zip(TABLE2_COLUMNS, values, strict=True)), "Avg": _T2_AVG[model][r]}
            for r, (row, values) in enumerate(zip(ROWS, rows, strict=True))}
    for model, rows in _T2.items()}
#: Table 3 (short-form QA, LLM-judge accuracy) per model, same layout.
TABLE3: dict[str, dict[str, dict[str, float]]] = {
    model: {row: {**dict(zip(TABLE3_COLUMNS, values, strict=True)), "Avg": _T3_AVG[model][r]}
            for r, (row, values) in enumerate(zip(ROWS, rows, strict=True))}
    for model, rows in _T3.items()}

#: Table 4 (Qwen3-8B): (search checkpoint, answer checkpoint) -> benchmark -> score.
TABLE4: dict[tuple[str, str], dict[str, float]] = {
    ("iter_01-solver", "iter_01-solver"): {"nq": 68.4, "hotpotqa": 60.9, "researchqa": 47.8, "healthbench": 26.2},
    ("iter_01-solver", "iter_03-solver"): {"nq": 71.1, "hotpotqa": 61.8, "researchqa": 51.3, "healthbench": 27.5},
    ("iter_03-solver", "iter_01-solver"): {"nq": 69.0, "hotpotqa": 64.5, "researchqa": 50.0, "healthbench": 26.6},
    ("iter_03-solver", "iter_03-solver"): {"nq": 71.9, "hotpotqa": 65.8, "researchqa": 53.7, "healthbench": 28.1},
}

#: Table 6 (Qwen3-8B, iteration 3): leave-one-out task type.
TABLE6: dict[str, dict[str, float]] = {
    label: {**dict(zip(TABLE2_COLUMNS, values[:8], strict=True)), "Avg": values[8]}
    for label, values in {
        "SCOPE": [57.6, 31.3, 53.7, 41.8, 57.7, 28.1, 46.1, 28.4, 43.1],
        "w/o Planning": [55.3, 29.4, 51.5, 38.5, 54.8, 30.9, 45.1, 25.5, 41.4],
        "w/o Writing": [55.7, 29.2, 54.7, 39.0, 58.1, 30.2, 42.4, 20.3, 41.2],
        "w/o Summarisation": [54.9, 29.9, 51.4, 38.3, 58.1, 28.9, 44.2, 26.3, 41.5],
        "w/o Long-form QA": [53.9, 27.4, 49.2, 34.8, 57.0, 30.5, 43.2, 24.3, 40.0],
    }.items()}

#: Which task type each leave-one-out variant drops (Table 6 row -> selfplay.task_types entry).
TABLE6_DROPPED = {"w/o Planning": "planning", "w/o Writing": "writing", "w/o Summarisation": "summarisation",
                  "w/o Long-form QA": "long_form_qa"}


def paper_model(model_id: str) -> str | None:
    """The paper's name for a base model id (Qwen/Qwen3-8B -> "Qwen3-8B"), or None if the paper has no row."""
    name = model_id.lower()
    if "qwen3-8b" in name:
        return "Qwen3-8B"
    if "qwen2.5-7b" in name:
        return "Qwen2.5-7B"
    if "olmo-3-7b" in name or "olmo3-7b" in name:
        return "OLMo-3-7B"
    return None
