"""JupyterLab, the tool the design names first for stepping through the notebooks: the project's environment starts
it, headless Chromium (playwright, as in test_reports.py) opens notebook 01 as a reader would, runs all its cells
from the Run menu, and every code cell ran, none holds an error output and every plotly figure drew.

The server runs with its own settings, workspaces and runtime folders (autosave off): the committed notebook is
never written, and the test fails if it was."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from servers import free_port, server_process

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = "notebooks/01_retrieval_setup.ipynb"
PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"

# Settings a reader's JupyterLab may differ in, fixed for the test: no autosave (the committed notebook stays as it
# is) and every cell rendered (JupyterLab 4 otherwise skips drawing cells scrolled out of view).
SETTINGS = {"@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
            "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                               "checkForUpdates": False}}

# The open notebook as JupyterLab holds it (the app is exposed to the page by --LabApp.expose_app_in_browser).
_NOTEBOOK_STATE = """() => {
    if (!window.jupyterapp || !window.jupyterapp.shell) return null;
    const panel = window.jupyterapp.shell.currentWidget;
    if (!panel || !panel.content || !panel.content.model) return null;
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    const cells = [];
    for (const cell of panel.content.model.cells) {
        if (cell.type !== 'code') continue;
        const outputs = [];
        for (let i = 0; i < cell.outputs.length; i++) outputs.push(cell.outputs.get(i).toJSON());
        cells.push({count: cell.executionCount, outputs: outputs});
    }
    return {kernel: kernel ? kernel.status : null, cells: cells};
}"""

# Every plotly figure JupyterLab's plotly renderer drew: a sized .main-svg with elements in it.
_FIGURES_DRAWN = """() => [...document.querySelectorAll('.jp-Notebook .jp-RenderedPlotly')].map(d => {
    const svg = d.querySelector('svg.main-svg');
    if (!svg) return 0;
    const box = svg.getBoundingClientRect();
    return box.width > 0 && box.height > 0 ? d.querySelectorAll('svg.main-svg *').length : 0;
})"""


@pytest.fixture
def jupyterlab(tmp_path, shared_data):
    """`python -m jupyterlab` from this environment on a loopback port, rooted at the repository; its URL and token."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (the `notebooks` extra; make install has it)")
    for name, values in SETTINGS.items():
        path = tmp_path / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), os.urandom(16).hex()
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "SCOPE_DATA_DIR": str(shared_data),
           # the kernels import this checkout's scope_lib (their folder is notebooks/, and an environment may hold
           # another checkout installed in editable mode)
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={REPO}",
               "--LabApp.expose_app_in_browser=True",
               *(["--allow-root"] if os.geteuid() == 0 else [])]   # a container's root, as in CI
    before = (REPO / NOTEBOOK).read_bytes()
    url = f"http://127.0.0.1:{port}"
    try:
        with server_process(command, f"{url}/api/status?token={token}", tmp_path / "jupyterlab.log", env=env,
                            cwd=REPO, timeout_s=60):
            yield url, token
    finally:
        if (REPO / NOTEBOOK).read_bytes() != before:
            (REPO / NOTEBOOK).write_bytes(before)
            pytest.fail(f"JupyterLab wrote {NOTEBOOK} (restored)")


def test_a_notebook_runs_cell_by_cell_in_jupyterlab(jupyterlab, browser):
    url, token = jupyterlab
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))
    try:
        page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}", wait_until="domcontentloaded", timeout=60_000)
        page.wait_for_function(f"() => {{ const s = ({_NOTEBOOK_STATE})(); return s && s.kernel === 'idle'; }}",
                               timeout=60_000)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()          # the Run menu ...
        page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()  # ... Run All Cells
        try:   # every cell ran, or one failed (Run All stops there)
            page.wait_for_function(
                f"() => {{ const s = ({_NOTEBOOK_STATE})(); return s.kernel === 'idle' && (s.cells.every(c => c.count)"
                " || s.cells.some(c => c.outputs.some(o => o.output_type === 'error'))); }", timeout=120_000,
                polling=500)
        except Exception:  # playwright's TimeoutError: the assertions below say which cells did not run
            pass
        state = page.evaluate(_NOTEBOOK_STATE)
        figures = sum(PLOTLY_MIMETYPE in o.get("data", {}) for c in state["cells"] for o in c["outputs"])
        try:
            page.wait_for_function(f"() => {{ const d = ({_FIGURES_DRAWN})(); "
                                   f"return d.length === {figures} && d.every(n => n > 0); }}", timeout=10_000)
        except Exception:  # playwright's TimeoutError: the assertions below say what is missing
            pass
        drawn = page.evaluate(_FIGURES_DRAWN)
    finally:
        context.close()
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(state["cells"]) for o in c["outputs"]
              if o.get("output_type") == "error"]
    assert errors == [], errors
    not_run = [i for i, c in enumerate(state["cells"]) if not c["count"]]
    assert not_run == [] and len(state["cells"]) >= 10, (not_run, state["kernel"])
    assert figures >= 3 and len(drawn) == figures and all(n > 0 for n in drawn), (figures, drawn)
    assert page_errors == [], page_errors
