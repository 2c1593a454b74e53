"""Draw scope_lib's layers from its real imports, as the Mermaid diagram in docs/architecture.md.

    python docs/architecture.py            # rewrite the diagram between the markers in docs/architecture.md
    python docs/architecture.py --check    # exit 1 when the committed diagram no longer matches the code

The import graph is import-linter's own (grimp), lazy imports inside functions included; the layer order is the
one `pyproject.toml` gives import-linter, so the drawing and the CI check cannot disagree.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
BEGIN, END = "<!-- layers:begin (python docs/architecture.py) -->", "<!-- layers:end -->"


def layer_order() -> list[list[str]]:
    """The layers contract of pyproject.toml, top first; each layer a list of sibling subpackages."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    return [[name.strip() for name in layer.split("|")] for layer in layers]


def package_of(module: str, packages: list[str]) -> str:
    """The layer a module belongs to (the longest layer name that is it or its parent)."""
    return max((p for p in packages if module == p or module.startswith(p + ".")), key=len)


def diagram() -> str:
    graph = grimp.build_graph("scope_lib")
    layers = layer_order()
    packages = [p for layer in layers for p in layer]
    members: dict[str, list[str]] = {p: [] for p in packages}
    for module in sorted(graph.modules):
        if module != "scope_lib":
            members[package_of(module, packages)].append(module)
    edges: Counter[tuple[str, str]] = Counter()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if module == "scope_lib" or imported == "scope_lib":
                continue
            a, b = package_of(module, packages), package_of(imported, packages)
            if a != b:
                edges[a, b] += 1

    def node(p: str) -> str:
        return p.removeprefix("scope_lib.")

    lines = ["```mermaid", "flowchart TB"]
    for depth, layer in enumerate(layers):
        lines.append(f'  subgraph L{depth}["layer {len(layers) - depth}"]')
        for p in layer:
            inside = [m.removeprefix(p + ".") for m in members[p] if m != p]
            label = node(p) + (":<br/>" + ", ".join(inside) if inside else "")
            lines.append(f'    {node(p)}["{label}"]')
        lines.append("  end")
    for (a, b), n in sorted(edges.items()):
        lines.append(f"  {node(a)} -->|{n}| {node(b)}")
    lines.append("```")
    return "\n".join(lines)


def render(text: str) -> str:
    """`text` with the diagram between the markers replaced by the current one."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{diagram()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/architecture.md is out of date")
    args = parser.parse_args()
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing", file=sys.stderr)
        return 2
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run `python docs/architecture.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
