"""A run's index page, runs/<name>/reports/index.html: the page a reader opens first. The run's name, params
hash, package versions and git sha (from manifest.json), then one line per executed notebook: its title, what
it shows, the health alarms raised while it ran, its wall time, links to its HTML report and .ipynb."""

from __future__ import annotations

import html
import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scope_lib.runs import git_state, package_versions
from scope_lib.selfplay.health import read_alarms

#: How much of a notebook's introduction the index quotes as "what it shows".
SUMMARY_CHARS = 320


def _timestamp(value: str | None) -> float | None:
    """papermill's start/end times (ISO, UTC, naive) as epoch seconds."""
    if not value:
        return None
    moment = datetime.fromisoformat(value)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _introduction(source: str) -> tuple[str, str]:
    """(title, summary) of a notebook's opening markdown cell: the summary is the first paragraph as plain
    text, whole sentences up to SUMMARY_CHARS (a closing "This notebook:" that leads into a list dropped)."""
    lines = source.strip().splitlines()
    title = lines[0].lstrip("# ").strip() if lines else ""
    paragraphs = "\n".join(lines[1:]).strip().split("\n\n")
    text = re.sub(r"\*\*|`", "", " ".join(paragraphs[0].split())) if paragraphs else ""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
    while len(sentences) > 1 and sentences[-1].endswith(":"):
        sentences.pop()
    summary = ""
    for sentence in sentences:
        if summary and len(summary) + len(sentence) > SUMMARY_CHARS:
            return title, summary + " …"
        summary = f"{summary} {sentence}".strip()
    return title, summary


def notebook_entry(notebook: Path, alarms: list[dict[str, Any]]) -> dict[str, Any]:
    """What the index says about one executed notebook; `alarms` are the run's, each counted for the notebook
    whose execution window holds its time."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    markdown = next((c for c in nb.get("cells", []) if c.get("cell_type") == "markdown"), None)
    title, summary = _introduction("".join(markdown["source"]) if markdown else notebook.stem)
    run = nb.get("metadata", {}).get("papermill", {})
    start, end = _timestamp(run.get("start_time")), _timestamp(run.get("end_time"))
    raised = [a for a in alarms if start is not None and end is not None and start <= a.get("time", -1) <= end]
    errors = sum(o.get("output_type") == "error" for c in nb.get("cells", []) for o in c.get("outputs", []))
    report = notebook.with_suffix(".html")
    return {"name": notebook.stem, "title": title or notebook.stem, "summary": summary, "alarms": raised,
            "duration_s": run.get("duration"), "failed": bool(run.get("exception")) or errors > 0,
            "html": report.name if report.is_file() else None,
            "html_bytes": report.stat().st_size if report.is_file() else None, "ipynb": notebook.name}


def _manifest(run_dir: Path) -> tuple[dict[str, Any], str]:
    """The run's manifest (written by training), or the versions and git state now when there is none yet."""
    path = run_dir / "manifest.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8")), "from manifest.json"
    return ({"params_hash": None, "packages": package_versions(), "git": git_state()},
            "no manifest.json yet (training writes it): package versions and git state when this page was written")


def _size(n: int | None) -> str:
    return "" if n is None else f"{n / 1e6:.1f} MB"


def _duration(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.0f} s"


def render(run_dir: Path, entries: list[dict[str, Any]], manifest: dict[str, Any], source: str,
           all_alarms: list[dict[str, Any]]) -> str:
    e = html.escape
    git = manifest.get("git") or {}
    sha = git.get("sha") or "unknown"
    dirty = " (with uncommitted changes)" if git.get("dirty") else ""
    packages = ", ".join(f"{k} {v}" for k, v in (manifest.get("packages") or {}).items() if v)
    rows = []
    for entry in entries:
        links = " · ".join(f'<a href="{e(name)}">{label}</a>' for name, label in
                           ((entry["html"], "report"), (entry["ipynb"], ".ipynb")) if name)
        alarms = "; ".join(f"{a.get('alarm')} ({a.get('role')}, iteration {a.get('iteration')})"
                           for a in entry["alarms"])
        status = '<span class="failed">failed</span>' if entry["failed"] else "ok"
        rows.append(f'<tr><td><a href="{e(entry["html"] or entry["ipynb"])}">{e(entry["title"])}</a></td>'
                    f'<td>{e(entry["summary"])}</td><td>{status}</td>'
                    f'<td class="alarms">{len(entry["alarms"])}{": " + e(alarms) if alarms else ""}</td>'
                    f'<td class="num">{_duration(entry["duration_s"])}</td>'
                    f'<td class="num">{_size(entry["html_bytes"])}</td><td>{links}</td></tr>')
    outside = len(all_alarms) - sum(len(x["alarms"]) for x in entries)
    name = run_dir.name
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>SCOPE run {e(name)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 80em; }}
table {{ border-collapse: collapse; }} td, th {{ border-bottom: 1px solid #ddd; padding: .4em .6em; vertical-align: top; }}
th {{ text-align: left; }} .num {{ text-align: right; white-space: nowrap; }} .failed {{ color: #b00; font-weight: bold; }}
code {{ background: #f4f4f4; padding: 0 .2em; }}
</style></head><body>
<h1>SCOPE run <code>{e(name)}</code></h1>
<p>Params hash <code>{e(str(manifest.get("params_hash") or "none"))}</code> · git <code>{e(sha)}</code>{e(dirty)}
<br><small>{e(source)}</small></p>
<p>Packages: {e(packages)}</p>
<p>Health alarms in the run: {len(all_alarms)}{f" ({outside} outside the notebooks below, e.g. from scope train)" if outside else ""}
(<code>health.jsonl</code> in the run folder).</p>
<table><thead><tr><th>notebook</th><th>what it shows</th><th>status</th><th>health alarms</th><th>wall time</th>
<th>report size</th><th>files</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
<p><small>Each report is a single HTML file with plotly.js embedded: it opens offline. Send this folder.</small></p>
</body></html>
"""


def write_index(run_dir: str | os.PathLike, reports_dir: str | os.PathLike | None = None) -> Path:
    """Write index.html in `reports_dir` (default <run_dir>/reports) from the executed notebooks there and the
    run's manifest and health alarms."""
    run_dir = Path(run_dir)
    reports = Path(reports_dir) if reports_dir else run_dir / "reports"
    if not reports.is_dir():
        raise FileNotFoundError(f"{reports} does not exist: run `scope run PARAMS` first")
    alarms = read_alarms(run_dir)
    entries = [notebook_entry(p, alarms) for p in sorted(reports.glob("[0-9][0-9]_*.ipynb"))]
    manifest, source = _manifest(run_dir)
    target = reports / "index.html"
    tmp = target.with_suffix(".html.tmp")
    tmp.write_text(render(run_dir, entries, manifest, source, alarms), encoding="utf-8")
    tmp.replace(target)
    return target
