"""What every notebook does first: find the repository, load the run's parameters, set up logging.

Notebooks run from three places — Jupyter (cwd = notebooks/), nbval (cwd = notebooks/) and papermill
(`scope run`, cwd = the repository) — so paths in params files are resolved from the repository root.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scope_lib.config import Params, load_params
from scope_lib.models.loading import apply_torch_threads, import_training_loader, make_engine
from scope_lib.models.noise import quiet_library_noise
from scope_lib.protocol.dialects import get_dialect
from scope_lib.reports.index_page import SUMMARY_MIMETYPE
from scope_lib.retrieval.corpus import read_corpus, sample_documents
from scope_lib.retrieval.index import open_retriever
from scope_lib.runs import (
    atomic_write_json,
    imported_package_versions,
    log_to_run_file,
    read_jsonl,
    write_jsonl,
)
from scope_lib.selfplay.judge import make_judge
from scope_lib.selfplay.rollout import (
    ChallengerPrompt,
    Trajectory,
    challenger_trajectories,
    make_challenger_prompts,
    run_rollouts,
)
from scope_lib.selfplay.tasks import challenger_limits
from scope_lib.smoke.warm_start import prepare


def repo_root(start: Path | None = None) -> Path:
    """The nearest folder upwards that holds pyproject.toml and scope_lib/."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "scope_lib").is_dir():
            return folder
    raise FileNotFoundError(f"no SCOPE checkout above {here}: run the notebook from inside the repository")


def init(params: str, overrides: list[str] | None = None, *, level: int = logging.INFO,
         show: int = logging.WARNING, models: bool = True) -> Params:
    """chdir to the repository root, configure logging and figures for a report, load the parameters and prepare
    the models the loader cannot build itself (the smoke model's warm start, built once and cached; not with
    `models=False`, for a notebook that only reads what a command wrote, e.g. 07).

    A report shows log records at `show` and above (warnings: health alarms, damaged records); every record at
    `level` and above goes to the run's log file, <run>/run.log. Library notices that say nothing to a
    researcher are dropped where they are logged (`models.noise`)."""
    os.chdir(repo_root())
    _report_logging(show)
    _report_figures()
    loaded = load_params(params, overrides or [])
    loaded.run_dir.mkdir(parents=True, exist_ok=True)
    log_to_run_file(loaded.run_dir, level)

    if not models:
        return loaded
    apply_torch_threads(loaded)
    prepared = prepare(loaded, judges=True)   # notebooks 05-06 judge benchmarks (evaluation.judge_adapter)
    import_training_loader(prepared)  # Unsloth, when chosen, before transformers (the warm start is built without it)
    return prepared


def _report_logging(show: int) -> None:
    """The notebook's output shows records at `show` and above, without known library noise; vLLM's records
    reach the same handlers (vLLM otherwise prints its INFO lines through a handler of its own)."""
    quiet_library_noise()
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")   # read when vLLM is first imported
    logging.basicConfig(level=show, format="%(levelname)s %(name)s: %(message)s", force=True)
    for handler in logging.getLogger().handlers:   # the output's own threshold: the run's log file takes more
        handler.setLevel(show)
    for noisy in ("httpx", "chromadb", "urllib3", "sentence_transformers", "transformers", "datasets",
                  "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _report_figures() -> None:
    """Plotly figures are stored as their mimetype only: JupyterLab draws it live, and the HTML export
    (`reports.export.to_html`) draws it with plotly.js embedded in the report, so no figure needs a CDN.
    Weight-loading progress bars are kept out of the reports."""
    import plotly.io as pio
    from huggingface_hub.utils import disable_progress_bars

    pio.renderers.default = "plotly_mimetype"
    disable_progress_bars()  # transformers reads this when it is imported (kept for Unsloth, which comes first)


@dataclass
class Components:
    """What the protocol notebooks work with, built once from the params."""

    params: Params
    corpus: Any
    retriever: Any
    dialect: Any
    policy: Any          # Engine for Challenger and Solver rollouts (M0 here)
    judge: Any           # Judge on M0 (or judge.model)
    tokenizer: Any       # the policy tokenizer


def components(params: Params) -> Components:
    """Corpus, retrieval index, dialect, policy engine and Judge for a run. In LoRA mode (and on the tiny
    model) the Judge shares the policy engine: it is M0 with adapters off."""
    r = params.retrieval
    corpus = read_corpus(params.corpus_path, on_error=r.on_error, max_passages=r.max_passages)
    retriever = open_retriever(params)
    dialect = get_dialect(params.model.dialect, params.model.base)
    policy = make_engine(params, "policy")
    same_backend = (params.engine.judge_backend or params.engine.backend) == params.engine.backend
    judges: dict[str, Any] = {}

    def engine_for(name: str):
        if same_backend and name == params.model.base:
            return policy          # the Judge is M0: the policy engine with adapters off
        if name not in judges:
            judges[name] = make_engine(params, "judge", name=name)
        return judges[name]

    return Components(params, corpus, retriever, dialect, policy, make_judge(params, engine_for), policy.tokenizer)


def challenger_batch(c: Components, n_documents: int, iteration: int = 1, group_size: int = 1):
    """Sample documents (slice `iteration` of the seeded permutation), build Challenger prompts (task types
    and 4:3:2 search strata apportioned exactly) and roll them out. Returns (prompts, trajectories, stats)."""
    sp = c.params.selfplay
    documents = sample_documents(c.corpus.passages, n_documents, seed=sp.seed, iteration=iteration)
    prompts = make_challenger_prompts(documents, sp.task_types, sp.search_turn_strata, seed=sp.seed,
                                      tokenizer=c.tokenizer, document_max_tokens=sp.document_max_tokens)
    trajectories = challenger_trajectories(prompts, c.dialect, c.tokenizer, group_size)
    stats = run_rollouts(trajectories, c.policy, c.retriever, c.dialect, challenger_limits(c.params))
    return prompts, trajectories, stats


def save_challenger_batch(run_dir: Path, prompts, trajectories) -> Path:
    """Write an exploration's prompts and rollouts to <run>/explore/ (replacing an earlier one)."""
    from dataclasses import asdict

    folder = Path(run_dir) / "explore"
    atomic_write_json(folder / "challenger_prompts.json", [asdict(p) for p in prompts])
    write_jsonl(folder / "challenger_rollouts.jsonl", (t.to_record() for t in trajectories))
    return folder


def load_challenger_batch(run_dir: Path):
    """(prompts, trajectories) saved by notebook 02, or None when there is none."""
    import json

    folder = Path(run_dir) / "explore"
    if not (folder / "challenger_rollouts.jsonl").is_file():
        return None
    prompts = [ChallengerPrompt(**p) for p in json.loads((folder / "challenger_prompts.json").read_text())]
    return prompts, [Trajectory.from_record(r) for r in read_jsonl(folder / "challenger_rollouts.jsonl")]


# -- the notebook's result, for the index page ---------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    """Numbers, strings, booleans and None as they are (numpy scalars as Python's); anything else as text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value else None   # NaN: no value
    item = getattr(value, "item", None)            # numpy scalars
    return _jsonable(item()) if callable(item) else str(value)


@dataclass
class Summary:
    """A notebook's result: one line a reader can quote, the facts behind it, and the versions of the packages the
    kernel imported (the packages that ran). Shown as a line and a table; the executed notebook also keeps it as
    an output of SUMMARY_MIMETYPE, which `reports.index_page` reads."""

    result: str
    facts: dict[str, Any]
    packages: dict[str, str]

    def record(self) -> dict[str, Any]:
        return {"result": self.result, "facts": self.facts, "packages": self.packages}

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        import html

        rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in self.facts.items())
        text = "\n".join([f"Result: {self.result}"] + [f"  {k}: {v}" for k, v in self.facts.items()])
        return {"text/plain": text,
                "text/html": f"<p><strong>Result:</strong> {html.escape(self.result)}</p><table>{rows}</table>",
                SUMMARY_MIMETYPE: self.record()}


def summary(result: str, facts: dict[str, Any] | None = None) -> Summary:
    """The notebook's result in one line (`result`, e.g. "recall@3 1.00 on 36 labelled queries") with the facts
    behind it. End the notebook's last cell with it: the index page states `result` on the notebook's line."""
    if not isinstance(result, str) or not result.strip() or "\n" in result.strip():
        raise ValueError(f"a notebook's result is one non-empty line, got {result!r}")
    return Summary(result.strip(), {str(k): _jsonable(v) for k, v in (facts or {}).items()},
                   imported_package_versions())
