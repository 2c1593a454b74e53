"""The `scope` command line: parameters, data fetch, clear errors with exit code 2."""

from __future__ import annotations

from pathlib import Path

from scope_lib.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_params_show_prints_resolved_values_with_docs(capsys):
    assert main(["params", "show", str(REPO / "params" / "qwen3-8b.yaml"), "-o", "grpo.beta=0.01"]) == 0
    out = capsys.readouterr().out
    assert "grpo.beta = 0.01  # KL coefficient beta in eq. 3" in out
    assert "model.base = 'Qwen/Qwen3-8B'" in out
    assert "solver.length_soft = 1024" in out


def test_bad_override_exits_2_with_the_key(capsys):
    assert main(["params", "show", str(REPO / "params" / "smoke.yaml"), "-o", "grpo.lr=1"]) == 2
    assert "unknown key 'lr'" in capsys.readouterr().err


def test_data_fetch_slice_from_a_local_file(tmp_path, monkeypatch, wiki_sample, capsys):
    monkeypatch.setenv("SCOPE_DATA_DIR", str(tmp_path))
    code = main(["data", "fetch", "--params", str(REPO / "params" / "smoke.yaml"),
                 "--url", wiki_sample.as_uri(), "--max-passages", "25"])
    assert code == 0
    fetched = tmp_path / "wiki18_sample.jsonl"
    assert fetched.read_text().splitlines() == wiki_sample.read_text().splitlines()[:25]


def test_data_fetch_without_network_fails_fast_with_a_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SCOPE_DATA_DIR", str(tmp_path))
    code = main(["data", "fetch", "--params", str(REPO / "params" / "smoke.yaml"),
                 "--url", "http://127.0.0.1:9/wiki-18.jsonl.gz"])
    assert code == 2
    err = capsys.readouterr().err
    assert "SCOPE_DATA_DIR" in err and "retrieval.corpus" in err


def test_every_command_drops_the_known_library_notices(caplog, capsys):
    """`scope ...` installs the filters of `models.noise` before a command runs (torchao's CUDA kernels that cannot
    load on CPU no longer open every `scope train`); other messages of the same logger still show."""
    import logging

    from scope_lib.models.noise import NOISE

    for noise in NOISE:                                   # as in a fresh process
        logging.getLogger(noise.logger).filters.clear()
    assert main(["params", "show", str(REPO / "params" / "smoke.yaml")]) == 0
    with caplog.at_level(logging.INFO):
        logging.getLogger("torchao").warning("Failed to load /venv/torchao/_C_mxfp8.abi3.so: Could not load")
        logging.getLogger("torchao").warning("something a researcher should see")
    assert [r.getMessage() for r in caplog.records] == ["something a researcher should see"]


_EVAL_THAT_LOGS = """
import logging, sys
from scope_lib import cli

def logging_eval(args):  # what a `scope eval` against a served judge logs, without the models
    logging.getLogger("httpx").info('HTTP Request: POST http://127.0.0.1:9/v1/chat/completions "HTTP/1.1 200 OK"')
    logging.getLogger("scope_lib.evaluation.evaluate").info("judged 4 items")
    logging.getLogger("httpx").warning("the judge endpoint answered slowly")
    return 0

cli.cmd_eval = cli.writes_run(logging_eval)
sys.exit(cli.main(sys.argv[1:]))
"""


def test_library_info_lines_go_to_the_run_log_not_the_terminal(tmp_path):
    """`scope eval` against a served judge: httpx's INFO line per request is in <run>/run.log, not on the terminal;
    the package's own INFO lines and every library's warnings are on both."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EVAL_THAT_LOGS, "eval", str(REPO / "params" / "smoke.yaml"),
                           "-o", f"run.runs_dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    run_log = (tmp_path / "smoke" / "run.log").read_text()
    assert "HTTP Request: POST" not in done.stderr
    assert "INFO scope_lib.evaluation.evaluate: judged 4 items" in done.stderr
    assert "WARNING httpx: the judge endpoint answered slowly" in done.stderr
    for line in ("INFO httpx: HTTP Request: POST", "judged 4 items", "WARNING httpx: the judge endpoint"):
        assert line in run_log
