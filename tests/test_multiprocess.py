"""`scope train --processes 2`: two ranks under torchrun on CPU (gloo), the tiny model, one smoke iteration.

- From scratch, 2 ranks against 1 process: the same record files with the same ids and counts (the sampled text
  differs: each rank samples its share with its own seed), no id written twice, both ranks' weights identical.
- The Solver stage (Stage 1 and the pool prepared in-process with the scripted engine, so the pool has tasks):
  SIGKILL one rank mid-stage -> the other ends with one `error:` line (no hang, no traceback); the resumed
  run (`--processes 2`) writes every record
  once (nothing lost, nothing duplicated), the records written before the kill again (same seeds), and both
  ranks end with the same weights.
- One GRPO step on a fixed batch: 2 ranks x B rows give the weights of 1 process x 2B with gradient accumulation.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import free_port
from test_resume import cache_env, command, comparable, lines, prepare  # noqa: F401 (cache_env: a fixture)

from scope_lib.runs import read_jsonl

pytestmark = [pytest.mark.multiprocess, pytest.mark.heavy]  # `make test-slow`

#: One step per role, 2 rollouts per rank per step; a short collective timeout so a lost rank is noticed fast
#: (gloo notices a closed connection at once; the timeout bounds a rank that hangs without closing it).
SETTINGS = {"selfplay.steps_per_role": 1, "selfplay.max_candidate_batches": 2, "run.collective_timeout_s": 60}
SOLVER = {**SETTINGS, "selfplay.steps_per_role": 2, "challenger.max_new_tokens_per_turn": 112,
          "solver.max_new_tokens_per_turn": 112}
RECORDS = ("challenger/rollouts", "challenger/solver_rollouts", "challenger/metrics", "pool/candidates",
           "pool/chunks", "pool/tasks")


def train(runs_dir: Path, data_dir: Path, settings: dict, env: dict, processes: int, log_name: str):
    args = command(runs_dir, data_dir, settings) + ["--processes", str(processes)]
    log = open(runs_dir / log_name, "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[1])


def finished(process, runs_dir: Path, log_name: str, timeout=600) -> str:
    code = process.wait(timeout=timeout)
    text = (runs_dir / log_name).read_text()
    assert code == 0, text[-4000:]
    return text


def rank_digests(log_text: str, role: str) -> dict[str, str]:
    """Each rank's logged sha256 of its trained weights."""
    return dict(re.findall(rf"rank (\d) of 2: {role} weights after iteration 1: sha256 (\w+)", log_text))


def ids(path: Path) -> list[str]:
    return [r["id"] for r in read_jsonl(path)] if path.is_file() else []


@pytest.mark.slow
def test_two_ranks_write_the_records_of_one_process(tmp_path, wiki_sample, cache_env):  # noqa: F811
    data = wiki_sample.parent
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    started = time.perf_counter()
    finished(train(one, data, SETTINGS, cache_env, 1, "train.log"), one, "train.log")
    one_s = time.perf_counter() - started
    started = time.perf_counter()
    text = finished(train(two, data, SETTINGS, cache_env, 2, "train.log"), two, "train.log")
    two_s = time.perf_counter() - started
    print(f"wall time: 1 process {one_s:.1f} s, 2 processes {two_s:.1f} s")

    digests = rank_digests(text, "challenger")
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], digests   # DDP kept the ranks equal
    for name in RECORDS:
        mine, theirs = ids(two / "smoke" / "iter_01" / f"{name}.jsonl"), ids(one / "smoke" / "iter_01" / f"{name}.jsonl")
        assert len(mine) == len(set(mine)), f"{name}: a record written twice"
        if name != "challenger/solver_rollouts":  # how many tasks parse depends on the sampled text
            assert sorted(mine) == sorted(theirs), name
    assert len(ids(two / "smoke" / "iter_01" / "challenger" / "rollouts.jsonl")) == 4   # batch 2 x group 2
    for stage in ("challenger", "pool", "solver"):
        assert (two / "smoke" / "iter_01" / stage / "DONE").is_file()
    assert (two / "smoke" / "iter_01" / "challenger" / "adapter" / "adapter_model.safetensors").is_file()
    assert text.count("1 iteration(s) done") == 1   # the main rank reports; the other does not


@pytest.mark.slow
def test_sigkill_one_rank_then_resume(tmp_path, wiki_sample, tiny_model_dir, cache_env):  # noqa: F811
    data = wiki_sample.parent
    killed_root = tmp_path / "killed"
    params = prepare(killed_root, data, tiny_model_dir, SOLVER, pool=True)
    solver = params.run_dir / "iter_01" / "solver"

    # the two ranks started by hand (as a cluster scheduler would), so nothing but the collective notices the loss
    port = free_port()
    ranks_ = []
    for rank in (0, 1):
        env = {**cache_env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = open(killed_root / f"rank{rank}.log", "w")  # noqa: SIM115 (closed with the process)
        ranks_.append(subprocess.Popen(command(killed_root, data, SOLVER), stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=Path(__file__).parents[1]))
    deadline = time.monotonic() + 300
    while not (lines(solver / "metrics.jsonl") >= 1 and not (solver / "DONE").exists()):
        assert all(p.poll() is None for p in ranks_), (killed_root / "rank0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "Stage 3 never started"
        time.sleep(0.05)
    ranks_[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    code = ranks_[0].wait(timeout=SOLVER["run.collective_timeout_s"] + 60)   # no hang
    gone_s = time.monotonic() - killed_at
    ranks_[1].wait()
    text = (killed_root / "rank0.log").read_text()
    errors = [line for line in re.split(r"[\r\n]", text) if line.startswith("error:")]  # \r: after a progress bar
    assert code == 3 and len(errors) == 1, text[-3000:]
    assert "rank 0 of 2: another rank died or stopped answering" in errors[0]
    assert "resumes from its records with the same command" in errors[0]
    assert "Traceback" not in text and not (solver / "DONE").exists()
    print(f"rank 0 ended {gone_s:.1f} s after rank 1's SIGKILL")

    before = [r for r in comparable(solver / "rollouts.jsonl") if r["step"] == 1]   # written before the kill
    assert before, "the kill came before the first step's records"

    resumed_text = finished(train(killed_root, data, SOLVER, cache_env, 2, "resumed.log"), killed_root,
                            "resumed.log")
    rollouts = ids(solver / "rollouts.jsonl")
    assert len(rollouts) == len(set(rollouts)) == SOLVER["selfplay.steps_per_role"] * 4   # 0 duplicated, 0 lost
    assert [r for r in comparable(solver / "rollouts.jsonl") if r["step"] == 1] == before  # the same seeds again
    assert [m["id"] for m in comparable(solver / "metrics.jsonl")] == ["solver-01-0001", "solver-01-0002"]
    digests = rank_digests(resumed_text, "solver")
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], digests
    assert (solver / "DONE").is_file() and (solver / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_two_ranks_step_like_one_process_with_gradient_accumulation(tmp_path, tiny_model_dir, cache_env):  # noqa: F811
    """The same result: one GRPO step over a fixed batch of 4 rollouts, 2 ranks x 2 rows against 1 process x 2
    micro-batches of 2 (gradient accumulation), gives the same LoRA weights. The rollouts are scripted
    (tests/same_result_child.py): TRL samples each rank's share with that rank's RNG, so sampled text cannot
    agree; what must agree is the loss and the gradient of one batch, which plain SGD writes into the weights."""
    import torch

    child = str(Path(__file__).with_name("same_result_child.py"))
    env = {**cache_env, "PYTHONPATH": str(Path(__file__).parents[1])}
    one = subprocess.run([sys.executable, child, str(tiny_model_dir), str(tmp_path / "one.pt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and "gradient accumulation 2" in one.stdout, one.stdout[-2000:] + one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          child, str(tiny_model_dir), str(tmp_path / "two.pt")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0 and two.stdout.count("gradient accumulation 1") == 2, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert a.keys() == b.keys() and len(a) > 0
    moved = max(a[k].abs().max().item() for k in a if "lora_B" in k)   # B starts at zero: this is the update
    assert moved > 1e-3
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6   # measured 1.4e-9: summation order only


def test_processes_is_refused_inside_a_launched_rank(monkeypatch, capsys):
    from scope_lib.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", str(Path(__file__).parents[1] / "params" / "smoke.yaml"), "--processes", "2"]) == 2
    assert "--processes starts the ranks itself" in capsys.readouterr().err
