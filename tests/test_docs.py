"""The README is a front door and the docs' links hold (issue 45): the README stays within 120 lines and links
docs/results.md, where every measured result lives; every page it links exists; every relative link in the README and
docs/ reaches an existing file and, with an anchor, an existing heading of that file (GitHub's slugs); no other
page states a measured result (an interval of gains, a wall time), which belongs in docs/results.md."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 120

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks, where a `](x)` is code, not a link."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]          # http:, https:, mailto: are not checked


def test_slugs_follow_github():
    assert slug("The CPU models' protocol rates") == "the-cpu-models-protocol-rates"
    assert slug("`make demo` (the smoke run)") == "make-demo-the-smoke-run"
    assert slug("The sample and 100,000 passages") == "the-sample-and-100000-passages"
    assert slug("Mid-stage resume (`run.checkpoint_steps`)") == "mid-stage-resume-runcheckpoint_steps"


def test_readme_is_a_front_door_of_at_most_120_lines():
    n_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert n_lines <= README_MAX_LINES, (
        f"README.md has {n_lines} lines, more than {README_MAX_LINES}: keep it a front door and move measured "
        f"results to docs/results.md, reference to the docs/ pages")


def test_readme_links_the_results_page():
    assert (DOCS / "results.md").is_file(), "docs/results.md is missing: every measured result lives there"
    targets = [target.split("#")[0] for target in relative_links(README)]
    assert "docs/results.md" in targets, "README.md does not link docs/results.md"


def test_every_docs_page_the_readme_links_exists():
    missing = [target for target in relative_links(README)
               if target.split("#")[0].endswith(".md") and not (ROOT / target.split("#")[0]).is_file()]
    assert not missing, f"README.md links pages that do not exist: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_a_heading(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        linked = page if not file_part else (page.parent / file_part).resolve()
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}")
            continue
        if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


#: What a measured result looks like in these pages: a bootstrap interval of signed gains ("[+0.024, +0.092]") or a
#: wall time in minutes and seconds ("27 min 49 s"). Configuration values (a window "[0.05, 0.95]") are neither.
MEASURED = re.compile(r"\[[+−-]\d\.\d{3}, [+−-]\d\.\d{3}\]|\b\d+ min \d+ s\b")


@pytest.mark.parametrize("page", [p for p in pages() if p.name != "results.md"],
                         ids=lambda page: page.relative_to(ROOT).as_posix())
def test_measured_results_live_only_in_results_md(page):
    found = MEASURED.findall(prose(page.read_text(encoding="utf-8")))
    assert not found, (f"{page.relative_to(ROOT)} states measured results {found[:3]}: they belong in "
                       "docs/results.md (dated, with commit, CPU, command and params); link there instead")


def test_the_measured_result_pattern_finds_intervals_and_times():
    assert MEASURED.findall("rose +0.057, 95% interval [+0.024, +0.092], in 27 min 49 s") == [
        "[+0.024, +0.092]", "27 min 49 s"]
    assert not MEASURED.findall("the window [0.05, 0.95] and `grpo.seed` 42")
