"""`model.loader: unsloth` on CPU, through Unsloth's own CPU backend: `scope train` on the smoke run trains both
roles and writes the records the HF loader writes; the adapters move between the two loaders (resume, the
evaluation engine) with the same log-probabilities; 4-bit loading trains.

Importing Unsloth patches transformers, PEFT and TRL for the whole process, so these tests run only in a pytest
process of their own (`pytest -m unsloth`, the second command of `make test`; conftest deselects them
elsewhere and checks that no other test process ever imports Unsloth)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import AlternatingEngine, fast_params

from scope_lib.config import load_params
from scope_lib.models.loading import load_training_model
from scope_lib.protocol.dialects import get_dialect
from scope_lib.runs import Stage, read_jsonl
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.methods.scope import SCOPE
from scope_lib.selfplay.policy import ROLES, Policy
from scope_lib.selfplay.rollout import make_challenger_prompts
from scope_lib.selfplay.training import StageContext, train_role

pytestmark = pytest.mark.unsloth

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "params" / "smoke.yaml"
#: A learning rate that moves the adapters well past float noise in the smoke run's two steps per role.
LEARNING_RATE = 5e-3


def start_scope_train(runs_dir: Path, data_dir: Path, loader: str) -> subprocess.Popen:
    """`scope train params/smoke.yaml` with `model.loader` set (the Done-when command of issue 26), started in a
    process of its own on one thread, its output in `runs_dir/train.log`."""
    args = [sys.executable, "-m", "scope_lib.cli", "train", str(SMOKE), "-o", f"run.runs_dir={runs_dir}",
            "-o", f"run.data_dir={data_dir}", "-o", f"model.loader={loader}",
            "-o", f"grpo.learning_rate={LEARNING_RATE}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    runs_dir.mkdir(parents=True, exist_ok=True)
    with open(runs_dir / "train.log", "w") as log:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish_scope_train(process: subprocess.Popen, runs_dir: Path) -> str:
    """Wait for a started `scope train` (15 minutes at most); its output, which must end with exit code 0."""
    try:
        process.wait(timeout=900)
    finally:
        process.kill()
    out = (runs_dir / "train.log").read_text()
    assert process.returncode == 0, out[-6000:]
    return out


def smoke_params(runs_dir: Path, data_dir: Path, loader: str):
    """The parameters of `scope_train`'s run, with the warm-started smoke model recorded (it is cached)."""
    from scope_lib.smoke.warm_start import prepare

    return prepare(load_params(SMOKE, {"run.runs_dir": str(runs_dir), "run.data_dir": str(data_dir),
                                       "model.loader": loader, "grpo.learning_rate": LEARNING_RATE}))


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory, wiki_sample):
    """The smoke run trained once with each loader (same seeds, same warm-started model): run folders and logs."""
    root = tmp_path_factory.mktemp("unsloth_runs")
    # the two runs at once, one thread each: the 2 cores do both in about the time of one
    started = {loader: start_scope_train(root / loader, wiki_sample.parent, loader) for loader in ("hf", "unsloth")}
    logs = {loader: finish_scope_train(process, root / loader) for loader, process in started.items()}
    return root, logs


def assert_same(a, b, where=""):
    """Equal records, floats within 1e-4 (log-probs, timings aside)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            if not key.endswith("_s"):
                assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-4), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_scope_train_with_unsloth_trains_both_roles_like_the_hf_loader(smoke_runs):
    root, logs = smoke_runs
    assert "Unsloth (CPU): Qwen3ForCausalLM" in logs["unsloth"] and "Unsloth" not in logs["hf"]
    runs = {loader: root / loader / "smoke" for loader in ("hf", "unsloth")}
    for loader, run_dir in runs.items():
        for stage in ("challenger", "pool", "solver"):
            assert (run_dir / "iter_01" / stage / "DONE").is_file(), (loader, stage)
        for role in ROLES:  # both roles trained: B starts at 0, so a non-zero B is an update
            weights = load_file(str(run_dir / "iter_01" / role / "adapter" / "adapter_model.safetensors"))
            assert any(float(w.abs().max()) > 1e-4 for k, w in weights.items() if "lora_B" in k), (loader, role)
    # the same rollouts, rewards, tasks and step metrics as the HF loader (the model generated them: the
    # smoke run rolls out with the policy's own engine)
    for stage, name in (("challenger", "rollouts"), ("challenger", "solver_rollouts"), ("pool", "tasks"),
                        ("solver", "rollouts"), ("challenger", "metrics"), ("solver", "metrics")):
        hf, unsloth = (read_jsonl(runs[loader] / "iter_01" / stage / f"{name}.jsonl") for loader in ("hf", "unsloth"))
        assert hf, (stage, name)
        assert_same(hf, unsloth, f"{stage}/{name}")
    # the same adapters: Adam's normalised step turns float-level differences of near-zero gradients (Unsloth's
    # CPU backend computes the log-probs with its own chunked kernel and switches TRL to fused AdamW) into at
    # most a step's size on a few weights (measured: 0.5% of one tensor off by up to 0.003 at lr 5e-3)
    for role in ROLES:
        hf, unsloth = (load_file(str(runs[loader] / "iter_01" / role / "adapter" / "adapter_model.safetensors"))
                       for loader in ("hf", "unsloth"))
        assert hf.keys() == unsloth.keys()
        gaps = torch.cat([(hf[k] - unsloth[k]).abs().flatten() for k in hf])
        assert float(gaps.max()) <= 2 * LEARNING_RATE and float((gaps > 1e-5).float().mean()) < 0.01, role
    config = {loader: json.loads((runs[loader] / "iter_01" / "solver" / "adapter" / "adapter_config.json").read_text())
              for loader in runs}
    for key in ("r", "lora_alpha", "lora_dropout", "peft_type", "task_type"):
        assert config["hf"][key] == config["unsloth"][key], key
    assert sorted(config["hf"]["target_modules"]) == sorted(config["unsloth"]["target_modules"])  # a set in PEFT


def token_logprobs(model, sequences: list[list[int]]) -> torch.Tensor:
    """log p(token | prefix) of every token after the first, the sequences right-padded into one batch."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp[mask[:, 1:].bool()]


def sample_sequences(run_dir: Path) -> list[list[int]]:
    """Token ids of the run's own Solver rollouts (prompt and completion)."""
    rows = read_jsonl(run_dir / "iter_01" / "solver" / "rollouts.jsonl")[:4]
    return [r["trajectory"]["prompt_ids"] + r["trajectory"]["completion_ids"] for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("trained,loaded", [("unsloth", "hf"), ("hf", "unsloth")])
def test_a_run_resumes_and_evaluates_with_the_other_loader(smoke_runs, wiki_sample, trained, loaded):
    """Adapters trained by one loader, restored by the other when the run is reopened (resume), and loaded by
    the evaluation engine (transformers), give the log-probs of the model that trained them."""
    from scope_lib.evaluation.evaluate import open_policies
    from scope_lib.selfplay.loop import open_run

    root, _ = smoke_runs
    other = smoke_params(root / trained, wiki_sample.parent, loaded)
    run = open_run(other)  # the manifest accepts the other loader; the roles are restored from disk
    assert callable(run.policy.model.base_model.model.__dict__.get("for_inference")) == (loaded == "unsloth")
    adapter = other.run_dir / "iter_01" / "solver" / "adapter"
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    restored = {k.replace(".solver.", "."): v for k, v in run.policy.state("solver").items()}
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)

    sequences = sample_sequences(other.run_dir)
    trainer = Policy.load(smoke_params(root / trained, wiki_sample.parent, trained))
    trainer.load_role("solver", adapter)
    trainer.model.set_adapter("solver")
    expected = token_logprobs(trainer.model, sequences)
    run.policy.model.set_adapter("solver")
    assert torch.allclose(token_logprobs(run.policy.model, sequences), expected, atol=1e-5)
    evaluation = open_policies(other, ["iter_01/solver"])["iter_01-solver"]
    model = evaluation.engine.model
    model.set_adapter("iter_01-solver")
    assert torch.allclose(token_logprobs(model, sequences), expected, atol=1e-5)
    with trainer.model.disable_adapter():  # the comparison is not vacuous: the adapter moved the log-probs
        assert float((token_logprobs(trainer.model, sequences) - expected).abs().max()) > 1e-3


def test_both_loaders_start_from_the_same_adapters(tmp_path, wiki_sample, tiny_model_dir):
    """Unsloth's `get_peft_model` makes the roles with the HF loader's LoRA settings and initial weights, no
    "default" adapter left, and the Judge (adapters off) is M0."""
    policies = {}
    for loader in ("hf", "unsloth"):
        params = fast_params(tmp_path / loader, wiki_sample.parent, **{"model.loader": loader})
        params.use_local_model("tiny", tiny_model_dir)
        policies[loader] = Policy.load(params)
    hf, unsloth = policies["hf"].model, policies["unsloth"].model
    assert sorted(unsloth.peft_config) == sorted(ROLES)
    assert callable(unsloth.base_model.model.__dict__.get("for_inference"))   # loaded by Unsloth (CPU backend)
    assert "for_inference" not in hf.base_model.model.__dict__
    for role in ROLES:
        a, b = policies["hf"].state(role), policies["unsloth"].state(role)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), role
        assert unsloth.peft_config[role].r == hf.peft_config[role].r
        assert unsloth.peft_config[role].lora_alpha == hf.peft_config[role].lora_alpha
        assert unsloth.peft_config[role].target_modules == hf.peft_config[role].target_modules
    ids = [[5, 17, 99, 240, 31, 8]]
    with unsloth.disable_adapter():
        judge = token_logprobs(unsloth, ids)
    plain, _ = load_training_model(fast_params(tmp_path / "plain", wiki_sample.parent))  # no tiny folder recorded
    assert torch.allclose(judge, token_logprobs(plain, ids), atol=1e-6)


def test_four_bit_loading_trains_the_adapter_on_cpu(tmp_path, wiki_sample, tiny_model_dir, passages):
    """`model.unsloth.load_in_4bit`: M0's projections become bitsandbytes NF4 layers (its CPU backend), a GRPO
    stage on the 4-bit base moves only the active adapter, and the adapter loads into the HF loader's 16-bit M0."""
    from scope_lib.retrieval.index import build_or_open_index

    params = fast_params(tmp_path, wiki_sample.parent, **{"model.loader": "unsloth", "model.unsloth.load_in_4bit": True})
    params.use_local_model("tiny", tiny_model_dir)
    policy = Policy.load(params)
    kinds = {type(m).__name__ for m in policy.base.modules()}
    assert "Linear4bit" in kinds
    dialect = get_dialect("qwen2.5")
    engine = AlternatingEngine(policy.tokenizer, dialect)
    stage = Stage(tmp_path / "iter_01" / "challenger")
    ctx = StageContext(params, 1, "challenger", policy, build_or_open_index(params, progress=False), dialect,
                       Judge(engine, params.judge, seed=0), stage, seed=7, engine=engine,
                       rules=SCOPE.role_rules("challenger"))
    prompts = make_challenger_prompts(passages[:4], ["long_form_qa", "planning"], [1, 1], seed=7,
                                      tokenizer=policy.tokenizer, document_max_tokens=96, id_prefix="i01-c")
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
    result = train_role(ctx, {p.id: p for p in prompts})
    changed = {n for n, p in policy.model.named_parameters() if "lora_" in n and not torch.equal(before[n], p)}
    assert changed and all(".challenger." in n for n in changed)
    assert result.metrics and all(m["grad_norm"] is not None and m["grad_norm"] > 0 for m in result.metrics)
    hf = fast_params(tmp_path / "hf", wiki_sample.parent)
    hf.use_local_model("tiny", tiny_model_dir)
    sixteen_bit = Policy.load(hf)
    sixteen_bit.load_role("challenger", result.saved)
    assert all(torch.equal(a, b) for a, b in zip(sixteen_bit.state("challenger").values(),
                                                  policy.state("challenger").values(), strict=True))


def test_fast_inference_is_passed_to_unsloth_which_needs_a_gpu(tmp_path, wiki_sample, tiny_model_dir):
    """`model.unsloth.fast_inference` reaches FastLanguageModel.from_pretrained; Unsloth's CPU backend refuses
    it (it is a vLLM engine)."""
    params = fast_params(tmp_path, wiki_sample.parent, **{"model.loader": "unsloth", "engine.backend": "vllm",
                                                           "model.unsloth.fast_inference": True})
    params.use_local_model("tiny", tiny_model_dir)
    with pytest.raises(NotImplementedError, match="fast_inference"):
        Policy.load(params)
