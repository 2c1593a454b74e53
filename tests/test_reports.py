"""Reports people can share: every HTML report of an executed run opens in a real browser (Debian's Chromium,
driven by playwright) with the network blocked, draws each of its plotly figures and logs no console error; the
run's index page lists the reports. A report made the old way (plotly.js from its CDN) fails the same check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scope_lib.reports.export import PLOTLY_MIMETYPE

CHROMIUM = Path(os.environ.get("SCOPE_CHROMIUM", "/usr/bin/chromium"))

# Every figure div that got a non-empty plot: a `.main-svg` with a size and drawn elements in it.
_DRAWN = """() => [...document.querySelectorAll('div.plotly-graph-div')].map(d => {
    const svg = d.querySelector('svg.main-svg');
    if (!svg) return 0;
    const box = svg.getBoundingClientRect();
    return box.width > 0 && box.height > 0 ? d.querySelectorAll('svg.main-svg *').length : 0;
})"""


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: `make chromium` installs Debian's package (make test does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM))
        yield launched
        launched.close()


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
    assert "Retrieval setup" in text and "retrieval index over an unlabelled corpus" in text


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
    assert "<td>It trains.</td>" in text and ">04 · Training</a>" in text
    assert "1: zero_spread (solver, iteration 1)" in text and "empty_pool" not in text
    assert "Health alarms in the run: 2 (1 outside" in text
    assert 'class="failed"' in text and "60 s" in text
    assert "abc123" in text and "f00d" in text and "torch 2.13.0" in text and "uncommitted" in text
