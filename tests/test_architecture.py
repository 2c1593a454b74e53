"""The package's architecture (docs/architecture.md): layers and no import circles, checked by import-linter's
contracts in pyproject.toml; the drawing in docs/ matches the code; light commands import no heavy library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_import_contracts_hold():
    """`lint-imports` (as `make lint` runs it): the layers, no circles at any depth, backends below the dispatcher."""
    done = subprocess.run([str(BIN / "lint-imports")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "4 kept, 0 broken" in done.stdout


def test_a_circle_breaks_the_contracts(tmp_path):
    """The contracts can fail: a copy of the package with one lazy import that closes a circle is refused."""
    import shutil

    shutil.copytree(REPO / "scope_lib", tmp_path / "scope_lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    judge = tmp_path / "scope_lib" / "selfplay" / "judge.py"
    judge.write_text(judge.read_text() + "\n\ndef _circle():\n    from scope_lib.selfplay.tasks import filter_tasks\n\n"
                     "    return filter_tasks\n")
    done = subprocess.run([str(BIN / "lint-imports")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path), "PATH": str(BIN)})
    assert done.returncode == 1
    assert "no import circles" in done.stdout and "BROKEN" in done.stdout


def test_the_drawing_in_docs_matches_the_code():
    # this checkout's package, not another one the environment may hold installed in editable mode
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(REPO / "docs" / "architecture.py"), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr


def test_light_commands_import_no_heavy_library():
    """`scope params show` and `scope plan` answer without importing torch, chromadb, transformers or faiss
    (they took 5.7 s when params validation pulled them in; now about 0.4 s on 2 cores)."""
    probe = (
        "import sys\n"
        "from scope_lib.cli import main\n"
        "assert main(['params', 'show', 'params/smoke.yaml']) == 0\n"
        "assert main(['params', 'show', 'params/smollm.yaml']) == 0\n"
        "main(['plan', '--params', 'params/qwen3-8b.yaml', '--gpu-gib', '80'])\n"
        "heavy = sorted(m for m in ('torch', 'chromadb', 'transformers', 'faiss', 'trl', 'vllm') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HEAVY []" in done.stdout, done.stdout[-500:]


def test_unsloth_is_imported_only_when_the_params_choose_it():
    """Every module of the package imports without Unsloth (whose import patches transformers, PEFT and TRL
    for the whole process), and so does the loader with `model.loader: hf`; `unsloth` imports it."""
    probe = (
        "import importlib, pkgutil, sys\n"
        "import scope_lib\n"
        "for module in pkgutil.walk_packages(scope_lib.__path__, 'scope_lib.'):\n"
        "    importlib.import_module(module.name)\n"
        "from scope_lib.config import load_params\n"
        "from scope_lib.models.loading import import_training_loader\n"
        "import_training_loader(load_params('params/smoke.yaml'))\n"
        "print('HF', 'unsloth' in sys.modules)\n"
        "import_training_loader(load_params('params/smoke.yaml', ['model.loader=unsloth']))\n"
        "print('UNSLOTH', 'unsloth' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HF False" in done.stdout and "UNSLOTH True" in done.stdout, done.stdout[-500:]


def _concept_rows() -> dict[str, str]:
    """The concepts table of docs/architecture.md: subpackage (or flat module) -> its modules column."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("## Concepts, subpackages and the paper", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`(\w+)/?`", cells[1]) if len(cells) == 4 else None
        if name:
            rows[name.group(1)] = cells[2]
    return rows


def test_the_concepts_table_names_every_module_and_command():
    """docs/architecture.md's concepts table has a row per subpackage naming each of its modules (`name`), the flat
    modules have rows of their own, and the `cli` row names every `scope` command and subcommand."""
    import argparse
    import re

    from scope_lib.cli import build_parser

    rows = _concept_rows()
    named = {row: set(re.findall(r"`(\w+)", cell)) for row, cell in rows.items()}
    missing = []
    for path in sorted((REPO / "scope_lib").rglob("*.py")):
        parts = path.relative_to(REPO / "scope_lib").with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        if len(parts) == 1:
            missing += [] if parts[0] in rows else [parts[0]]
        elif parts[-1] not in named.get(parts[0], set()):
            missing.append(".".join(parts))
    assert not missing, f"modules missing from docs/architecture.md's concepts table: {missing}"

    def commands(parser: argparse.ArgumentParser) -> list[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return [name for sub in subs for name, child in sub.choices.items() for name in [name, *commands(child)]]

    words = set(re.findall(r"[\w-]+", rows["cli"]))
    absent = sorted(set(commands(build_parser())) - words)
    assert not absent, f"`scope` commands missing from the concepts table's cli row: {absent}"
