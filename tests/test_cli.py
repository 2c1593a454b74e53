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
