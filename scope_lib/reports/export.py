"""Executed notebooks as reports: `scope run PARAMS` runs every numbered notebook with papermill and writes
the executed copy and a self-contained HTML rendering (opens offline; docs/reports.md) to <run_dir>/reports/."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from scope_lib.config import display_path
from scope_lib.reports.notebook import repo_root

log = logging.getLogger(__name__)


def notebook_paths(root: Path, only: list[str] | None = None) -> list[Path]:
    """The numbered notebooks in order; `only` keeps those whose name starts with one of the prefixes."""
    found = sorted(p for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if only:
        found = [p for p in found if any(p.name.startswith(prefix) for prefix in only)]
    if not found:
        raise FileNotFoundError(f"no notebooks matching {only or 'NN_*.ipynb'} under {root / 'notebooks'}")
    return found


def _params_argument(params: str | os.PathLike, root: Path) -> str:
    path = Path(params).resolve()
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def run_notebooks(params: str | os.PathLike, overrides: list[str] | None = None, *,
                  notebooks: list[str] | None = None, html: bool = True,
                  reports_dir: str | os.PathLike | None = None) -> list[Path]:
    """Execute the notebooks in order with papermill (`params` and `overrides` are injected into each
    notebook's `parameters` cell). Stops at the first failing notebook; its partial output is kept."""
    import papermill

    root = repo_root()
    out_dir = Path(reports_dir) if reports_dir else root / "runs" / "reports"
    out_dir = out_dir if out_dir.is_absolute() else root / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    parameters = {"params": _params_argument(params, root), "overrides": list(overrides or [])}
    written: list[Path] = []
    for source in notebook_paths(root, notebooks):
        target = out_dir / source.name
        log.info("executing %s -> %s", source.name, target)
        papermill.execute_notebook(str(source), str(target), parameters=parameters, cwd=str(root),
                                   kernel_name="python3", progress_bar=False)
        _shareable_metadata(target, root)
        written.append(target)
        if html:
            written.append(to_html(target))
    return written


def _shareable_metadata(notebook: Path, root: Path) -> None:
    """papermill records the absolute paths it was given (`input_path`, `output_path`) in the executed notebook's
    metadata: keep them relative to the repository (else `display_path`), so a shared .ipynb names no local folder."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    record = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if record.get(key):
            path = Path(record[key])
            record[key] = str(path.relative_to(root)) if path.is_relative_to(root) else display_path(path)
    nbformat.write(nb, str(notebook))


#: The mimetype plotly figures carry in the executed notebooks (JupyterLab renders it live).
PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"

# nbconvert's lab template without anything fetched from the network: no require.js, MathJax, mermaid or widget
# manager from CDNs (the notebooks use none of them), and plotly.js inlined once in the head when there are figures.
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}
{%- if resources.plotly_js -%}
<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: 'local'};</script>
<script type="text/javascript">{{ resources.plotly_js }}</script>
{%- endif -%}
{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def _figures_as_html(nb) -> int:
    """Replace each plotly figure output (of this in-memory copy) by the div and `Plotly.newPlot` call plotly
    writes for it; returns the number of figures."""
    import plotly.io as pio

    count = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            figure = output.get("data", {}).get(PLOTLY_MIMETYPE)
            if figure is None:
                continue
            figure = dict(figure)
            config = figure.pop("config", None) or {}
            output["data"] = {"text/html": pio.to_html(figure, config=config, include_plotlyjs=False,
                                                       full_html=False, validate=False)}
            count += 1
    return count


def to_html(notebook: Path) -> Path:
    """Render an executed notebook to a self-contained HTML report beside it: nbconvert's lab template with no
    script from a CDN, plotly.js embedded once, every figure drawn from its plotly mimetype output. The report
    opens offline (a mailed file, a cluster behind a firewall, an archive)."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter
    from plotly.offline import get_plotlyjs

    nb = nbformat.read(str(notebook), as_version=4)
    figures = _figures_as_html(nb)
    exporter = HTMLExporter(template_name="lab", template_file="scope_report.html.j2",
                            extra_loaders=[jinja2.DictLoader({"scope_report.html.j2": _TEMPLATE})])
    body, _ = exporter.from_notebook_node(nb, resources={"plotly_js": get_plotlyjs() if figures else ""})
    target = notebook.with_suffix(".html")
    tmp = target.with_suffix(".html.tmp")
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(target)
    return target
