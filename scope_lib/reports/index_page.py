"""A run's index page, runs/<name>/reports/index.html: the page a reader opens first. The run's name, params
hash and git sha (from manifest.json), whether each stage of the Judge passed its calibration probe when the run
opened (the grader, the gates, the rubric writer), the packages that ran, then one line per executed notebook: its
title, its result in one line (the summary record the notebook wrote, `reports.notebook.summary`), the health
alarms raised while it ran, its wall time, links to its HTML report and .ipynb."""

from __future__ import annotations

import html
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scope_lib.runs import git_state, package_versions
from scope_lib.selfplay.grader_probe import Calibration
from scope_lib.selfplay.health import read_alarms
from scope_lib.selfplay.stage_probes import MANIFEST_KEY, StageProbes

#: The mimetype of a notebook's summary output (`reports.notebook.summary`): {"result", "facts", "packages"}.
SUMMARY_MIMETYPE = "application/vnd.scope.summary+json"

#: How much of an error the index quotes for a notebook that failed.
ERROR_CHARS = 200


def _timestamp(value: str | None) -> float | None:
    """papermill's start/end times (ISO, UTC, naive) as epoch seconds."""
    if not value:
        return None
    moment = datetime.fromisoformat(value)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _title(source: str) -> str:
    """The first line of a notebook's opening markdown cell, without its `#`."""
    lines = source.strip().splitlines()
    return lines[0].lstrip("# ").strip() if lines else ""


def _outputs(nb: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for c in nb.get("cells", []) for o in c.get("outputs", [])]


def notebook_summary(nb: dict[str, Any]) -> dict[str, Any] | None:
    """The last summary record an executed notebook wrote (None when it wrote none)."""
    records = [o["data"][SUMMARY_MIMETYPE] for o in _outputs(nb) if SUMMARY_MIMETYPE in o.get("data", {})]
    return records[-1] if records else None


def _result(nb: dict[str, Any], summary: dict[str, Any] | None) -> str:
    """The notebook's result line: its summary's, else the error it stopped at, else a line saying it wrote none."""
    errors = [o for o in _outputs(nb) if o.get("output_type") == "error"]
    if errors:
        text = f"{errors[0].get('ename', 'error')}: {errors[0].get('evalue', '')}".strip().rstrip(":")
        return "failed: " + (text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + " …")
    if summary and str(summary.get("result", "")).strip():
        return str(summary["result"]).strip()
    return "no result: the notebook wrote no summary (reports.notebook.summary in its last cell)"


def notebook_entry(notebook: Path, alarms: list[dict[str, Any]]) -> dict[str, Any]:
    """What the index says about one executed notebook; `alarms` are the run's, each counted for the notebook
    whose execution window holds its time."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    markdown = next((c for c in nb.get("cells", []) if c.get("cell_type") == "markdown"), None)
    title = _title("".join(markdown["source"])) if markdown else ""
    summary = notebook_summary(nb)
    run = nb.get("metadata", {}).get("papermill", {})
    start, end = _timestamp(run.get("start_time")), _timestamp(run.get("end_time"))
    raised = [a for a in alarms if start is not None and end is not None and start <= a.get("time", -1) <= end]
    errors = sum(o.get("output_type") == "error" for o in _outputs(nb))
    report = notebook.with_suffix(".html")
    return {"name": notebook.stem, "title": title or notebook.stem, "result": _result(nb, summary),
            "packages": dict((summary or {}).get("packages") or {}), "alarms": raised,
            "duration_s": run.get("duration"), "failed": bool(run.get("exception")) or errors > 0,
            "html": report.name if report.is_file() else None,
            "html_bytes": report.stat().st_size if report.is_file() else None, "ipynb": notebook.name}


def packages_that_ran(entries: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Every package the notebooks' kernels imported, with the versions they ran (several if they differ)."""
    found: dict[str, list[str]] = {}
    for entry in entries:
        for name, version in entry["packages"].items():
            if version not in found.setdefault(name, []):
                found[name].append(version)
    return found


def _manifest(run_dir: Path) -> tuple[dict[str, Any], str]:
    """The run's manifest (written by training), or the versions and git state now when there is none yet."""
    path = run_dir / "manifest.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8")), "from manifest.json"
    return ({"params_hash": None, "packages": package_versions(), "git": git_state()},
            "no manifest.json yet (training writes it): package versions and git state when this page was written")


def judge_probes_line(manifest: dict[str, Any]) -> str:
    """The Judge's calibration probes when the run opened, in one line: each stage that decides (the grader, each
    gate as `judge.gates_by` decides it, the rubric writer), trusted or not, with its separation."""
    found = []
    if manifest.get("judge_calibration"):
        found.append(Calibration.from_record(manifest["judge_calibration"]))
    if manifest.get(MANIFEST_KEY):
        found += StageProbes.from_record(manifest[MANIFEST_KEY]).configured()
    if not found:
        return "Judge probes: none stored (training probes the Judge when the run opens; judge.calibration)"
    parts = [f"{c.judge}: {'trusted' if c.trusted else 'UNTRUSTED'}, separation "
             f"{'n/a' if c.separation is None else f'{c.separation:.2f}'}" for c in found]
    return "Judge probes when the run opened: " + "; ".join(parts)


def _size(n: int | None) -> str:
    return "" if n is None else f"{n / 1e6:.1f} MB"


def _duration(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.0f} s"


def _versions(packages: dict[str, Any]) -> str:
    return ", ".join(f"{name} {' / '.join(v) if isinstance(v, list) else v}" for name, v in packages.items() if v)


def render(run_dir: Path, entries: list[dict[str, Any]], manifest: dict[str, Any], source: str,
           all_alarms: list[dict[str, Any]]) -> str:
    e = html.escape
    git = manifest.get("git") or {}
    sha = git.get("sha") or "unknown"
    dirty = " (with uncommitted changes)" if git.get("dirty") else ""
    ran = _versions(packages_that_ran(entries)) or "none recorded (the notebooks wrote no summary)"
    installed = _versions(manifest.get("packages") or {})
    rows = []
    for entry in entries:
        links = " · ".join(f'<a href="{e(name)}">{label}</a>' for name, label in
                           ((entry["html"], "report"), (entry["ipynb"], ".ipynb")) if name)
        alarms = "; ".join(f"{a.get('alarm')} ({a.get('role')}, iteration {a.get('iteration')})"
                           for a in entry["alarms"])
        status = '<span class="failed">failed</span>' if entry["failed"] else "ok"
        rows.append(f'<tr><td><a href="{e(entry["html"] or entry["ipynb"])}">{e(entry["title"])}</a></td>'
                    f'<td class="result">{e(entry["result"])}</td><td>{status}</td>'
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
<p>Params hash <code>{e(str(manifest.get("params_hash") or "none"))}</code> · git <code>{e(sha)}</code>{e(dirty)}</p>
<p>Packages that ran (imported by the notebooks' kernels): {e(ran)}
<br><small>Installed ({e(source)}): {e(installed)}</small></p>
<p>{e(judge_probes_line(manifest))}
(<code>manifest.json</code>; docs/protocol.md, Judge calibration).</p>
<p>Health alarms in the run: {len(all_alarms)}{f" ({outside} outside the notebooks below, e.g. from scope train)" if outside else ""}
(<code>health.jsonl</code> in the run folder).</p>
<table><thead><tr><th>notebook</th><th>result</th><th>status</th><th>health alarms</th><th>wall time</th>
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
