"""What every notebook does first: find the repository, load the run's parameters, set up logging.

Notebooks run from three places — Jupyter (cwd = notebooks/), nbval (cwd = notebooks/) and papermill
(`scope run`, cwd = the repository) — so paths in params files are resolved from the repository root.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from scope_lib.config import Params, load_params


def repo_root(start: Path | None = None) -> Path:
    """The nearest folder upwards that holds pyproject.toml and scope_lib/."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "scope_lib").is_dir():
            return folder
    raise FileNotFoundError(f"no SCOPE checkout above {here}: run the notebook from inside the repository")


def init(params: str, overrides: list[str] | None = None, *, level: int = logging.INFO) -> Params:
    """chdir to the repository root, configure logging for a report, and load the parameters."""
    os.chdir(repo_root())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "chromadb", "urllib3", "sentence_transformers", "transformers", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    loaded = load_params(params, overrides or [])
    loaded.run_dir.mkdir(parents=True, exist_ok=True)
    return loaded
