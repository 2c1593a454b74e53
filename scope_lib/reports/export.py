"""Executed notebooks as reports: `scope run PARAMS` runs every numbered notebook with papermill and writes
the executed copy and an HTML rendering to <run_dir>/reports/."""

from __future__ import annotations

import logging
import os
from pathlib import Path

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
        written.append(target)
        if html:
            written.append(to_html(target))
    return written


def to_html(notebook: Path) -> Path:
    """Render an executed notebook to a standalone HTML file beside it (plotly figures included)."""
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(notebook), as_version=4))
    target = notebook.with_suffix(".html")
    tmp = target.with_suffix(".html.tmp")
    tmp.write_text(body, encoding="utf-8")
    tmp.replace(target)
    return target
