"""Shared fixtures. Real data comes from ../shared/data (or $SCOPE_DATA_DIR); tests that need it skip,
saying why, when it is absent."""

from __future__ import annotations

import os
from pathlib import Path

# One torch thread in the test process and every process it starts (notebook kernels, servers, `scope train`):
# the models here are tiny, and two threads on two shared cores spin against whatever else runs (measured:
# 0.33 s vs 30 s for the same generate call while another process was busy).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from fixtures_smollm import smollm_cache, smollm_dir, smollm_tokenizer  # noqa: F401  (session fixtures)
from fixtures_tiny import shared_data_dir, tiny_corpus, tiny_model_dir, tiny_vllm_model_dir  # noqa: F401  (session fixtures)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real public samples (Wikipedia passages, QA sets, open-ended prompts)."""
    path = shared_data_dir()
    if not (path / "wiki18_sample.jsonl").is_file():
        pytest.skip(f"real data not found at {path} (set SCOPE_DATA_DIR or put ../shared/data beside the repo)")
    return path


@pytest.fixture(scope="session")
def wiki_sample(shared_data: Path) -> Path:
    """1000 wiki-18 passages (ids "0".."999")."""
    return shared_data / "wiki18_sample.jsonl"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No test may reach a model hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def _unsloth_process(config) -> bool:
    """True in the pytest process that runs the Unsloth tests (`-m unsloth`, the second command of `make test`)."""
    return "unsloth" in (config.option.markexpr or "")


#: The tests that share the repository's runs/smoke: nbval's notebooks (each reads what the one before it wrote),
#: JupyterLab's notebook 01 and the papermill report fixture. Under `pytest -n` they run in one worker, in order.
RUNS_SMOKE_UNIT = "runs/smoke"
_RUNS_SMOKE_FILES = {"test_jupyterlab.py", "test_notebooks.py", "test_reports.py"}


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under pytest-xdist (`make test` runs 2 workers): its file, so a module's
    fixtures are built once, except that everything touching runs/smoke is one unit (RUNS_SMOKE_UNIT)."""
    file = nodeid.split("::", 1)[0]
    return RUNS_SMOKE_UNIT if file.endswith(".ipynb") or Path(file).name in _RUNS_SMOKE_FILES else file


#: Units handed out first, in this order: the longest first (`make test` runs both tiers in one run of 2 workers,
#: and each worker takes the next unit when it is nearly done with its own), so no worker is left alone with a long
#: unit at the end. SmolLM2's warm-start slice and the runs/smoke unit (which builds the warm-started smoke model the
#: notebooks run on) start at once, one per worker; then the other end-to-end checks, each several minutes.
_FIRST_UNITS = ("tests/test_smollm_warm_start.py", RUNS_SMOKE_UNIT, "tests/test_multiprocess.py",
                "tests/test_selfplay_vllm.py", "tests/test_resume.py", "tests/test_eval_judge.py")
#: Inside the runs/smoke unit: the papermill report fixture (notebooks 01-03: it builds runs/smoke's index) first,
#: then nbval's notebooks, then JupyterLab's notebook 01 on the built index.
_RUNS_SMOKE_ORDER = {"test_notebooks.py": 0, "test_reports.py": 0, "test_jupyterlab.py": 2}


def _schedule_order(item) -> tuple[int, int]:
    unit = work_unit(item.nodeid)
    first = _FIRST_UNITS.index(unit) if unit in _FIRST_UNITS else len(_FIRST_UNITS)
    return first, _RUNS_SMOKE_ORDER.get(Path(str(item.path)).name, 1) if unit == RUNS_SMOKE_UNIT else 0


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out whole units (`work_unit`) in collection order. Its own `--dist loadgroup` reads
    `xdist_group` marks by renaming test ids, which pytest 9 no longer lets it do, so the units are told to the
    scheduler here."""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup", "worksteal"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False   # the workers' order (`_schedule_order`), not the largest unit first
    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    """Importing Unsloth patches transformers, PEFT and TRL for the whole process, so its tests never run beside
    the others: outside a `-m unsloth` process they are deselected (and counted as deselected). In a pytest-xdist
    worker the tests are ordered for the scheduler (`_FIRST_UNITS`, `_RUNS_SMOKE_ORDER`)."""
    if not _unsloth_process(config):
        isolated = [item for item in items if item.get_closest_marker("unsloth")]
        if isolated:
            items[:] = [item for item in items if not item.get_closest_marker("unsloth")]
            config.hook.pytest_deselected(items=isolated)
    if hasattr(config, "workerinput"):   # the workers collect; the controller schedules what they collected
        items.sort(key=_schedule_order)   # stable: the collection's order within each rank is kept


@pytest.fixture(scope="session", autouse=True)
def _no_unsloth_leak(request):
    """A test process other than the Unsloth one ends without Unsloth imported (its patches would have changed
    every later test)."""
    yield
    import sys

    if not _unsloth_process(request.config):
        assert "unsloth" not in sys.modules, "a test imported Unsloth outside `pytest -m unsloth`"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="session")
def minilm_embedder():
    """The real offline MiniLM embedder with the on-disk embedding cache the smoke run uses, shared by the tests
    that index the 1000-passage sample (each back end's recall test) and the notebook kernels: the sample is
    embedded once per machine (~40 s on 2 CPU cores), not once per back end and process."""
    from scope_lib.retrieval.embedders import EmbeddingCache, MiniLMOfflineEmbedder

    embedder = MiniLMOfflineEmbedder(device="cpu", batch_size=16)
    embedder.cache = EmbeddingCache(embedder.model_id)
    return embedder


@pytest.fixture(scope="module")
def retriever(params):
    """The index of the test module's own `params` fixture, built once per module."""
    from scope_lib.retrieval.index import build_or_open_index

    return build_or_open_index(params, progress=False)


@pytest.fixture(scope="module")
def passages(wiki_sample):
    """The real wiki-18 sample's passages."""
    from scope_lib.retrieval.corpus import read_corpus

    return read_corpus(wiki_sample).passages


#: The browser the report and JupyterLab tests drive (Debian's Chromium; `make chromium` installs it).
CHROMIUM = Path(os.environ.get("SCOPE_CHROMIUM", "/usr/bin/chromium"))


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by playwright (the system browser: playwright downloads none)."""
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: `make chromium` installs Debian's package (make test does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM))
        yield launched
        launched.close()


#: The notebooks the report tests execute (the quick ones; 04 trains, 05 and 06 evaluate).
REPORT_NOTEBOOKS = ["01", "02", "03"]


@pytest.fixture(scope="session")
def report_run(shared_data, tmp_path_factory) -> Path:
    """A run folder whose reports/ holds notebooks 01–03 executed by papermill under the smoke parameters
    (`retrieval.top_k=2` injected), with their HTML reports: what `scope run` writes, executed once for the
    notebook and report tests."""
    from scope_lib.reports.export import run_notebooks

    run = tmp_path_factory.mktemp("report") / "smoke"
    with pytest.MonkeyPatch.context() as m:  # the kernels inherit it; the autouse fixture is per test
        m.setenv("HF_HUB_OFFLINE", "1")
        m.setenv("TRANSFORMERS_OFFLINE", "1")
        run_notebooks(REPO / "params" / "smoke.yaml", ["retrieval.top_k=2"], notebooks=REPORT_NOTEBOOKS,
                      reports_dir=run / "reports")
    return run
