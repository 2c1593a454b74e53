"""Notebooks: committed without outputs, a title then a papermill `parameters` cell defaulting to the smoke
run, and executable by papermill into a report with HTML (what `scope run` / `make demo` do). nbval runs
every notebook as well (`pytest --nbval-lax notebooks/`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import papermill
import pytest

from scope_lib.reports.export import notebook_paths

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_the_numbered_notebooks_exist():
    names = [p.stem for p in NOTEBOOKS]
    assert names[:4] == ["01_retrieval_setup", "02_prompts_and_gates", "03_rubric_analysis", "04_grpo_training"]
    assert notebook_paths(REPO, ["02"]) == [REPO / "notebooks" / "02_prompts_and_gates.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_parameterised(path):
    nb = nbformat.read(str(path), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip outputs before committing"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    params = nb.cells[1]
    assert params.cell_type == "code" and "parameters" in params.metadata.get("tags", [])
    assert 'params = "params/smoke.yaml"' in params.source
    # papermill reads every parameter with its default (a comment holding "=" on the same line hides it, with a
    # warning on every run)
    assigned = [m.group(1) for m in re.finditer(r"^(\w+)\s*(?::[^=\n]*)?=", params.source, re.MULTILINE)]
    assert list(papermill.inspect_notebook(str(path))) == assigned


def test_papermill_report_with_html(report_run):
    """Notebook 01 executed by papermill with injected parameters, then rendered to HTML (the browser checks
    of the reports are in test_reports.py)."""
    executed = report_run / "reports" / "01_retrieval_setup.ipynb"
    html = executed.with_suffix(".html")
    nb = json.loads(executed.read_text())
    injected = [c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
    assert injected and "retrieval.top_k=2" in "".join(injected[0]["source"])
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    text = html.read_text()
    assert text.count("Plotly.newPlot") >= 3 and "Retrieval setup" in text and "recall@2" in text
