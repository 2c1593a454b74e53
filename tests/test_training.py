"""GRPO with TRL on the tiny model: real gradient steps, two adapters over one base, the reference is M0,
environment tokens get no gradient, per-turn datums (Qwen3), full fine-tuning, and the TRL settings of Table 9.

Rollouts come from a scripted engine that follows the protocol (so rewards have spread); the model being
trained, the trainer and the update are real."""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import AlternatingEngine, fast_params, load_policy
from transformers import AutoModelForCausalLM
from trl.trainer.utils import nanstd

from scope_lib.config import ParamsError
from scope_lib.protocol.dialects import get_dialect
from scope_lib.runs import Stage
from scope_lib.selfplay.judge import Judge
from scope_lib.selfplay.methods.scope import SCOPE
from scope_lib.selfplay.rollout import make_challenger_prompts
from scope_lib.selfplay.training import (
    DeviceLogProb,
    RoleSession,
    StageContext,
    TorchChunkedLogProb,
    _metrics_callback,
    grpo_args,
    install_logprob_fallback,
    make_trainer,
    permute_rewards,
    zero_spread_share,
)


@pytest.fixture(scope="module")
def params(tmp_path_factory, wiki_sample):
    return fast_params(tmp_path_factory.mktemp("runs"), wiki_sample.parent)


def challenger_stage(policy, retriever, passages, tmp_path, dialect="qwen2.5"):
    dialect = get_dialect(dialect)
    engine = AlternatingEngine(policy.tokenizer, dialect)
    ctx = StageContext(policy.params, 1, "challenger", policy, retriever, dialect, Judge(engine, policy.params.judge,
                       seed=0), Stage(tmp_path / "iter_01" / "challenger"), seed=7, engine=engine,
                       rules=SCOPE.role_rules("challenger"))
    prompts = make_challenger_prompts(passages[:4], ["long_form_qa", "planning"], [1, 1], seed=7,
                                      tokenizer=policy.tokenizer, document_max_tokens=96, id_prefix="i01-c")
    return ctx, {p.id: p for p in prompts}


def build_trainer(ctx, items, role="challenger"):
    session = RoleSession(ctx, items)
    args = grpo_args(ctx.params, role, seed=ctx.seed, output_dir=ctx.stage.path / "trainer")
    trainer = make_trainer(ctx.policy, role, args, dataset_ids=list(items), rollout_func=session.rollout_func,
                           reward_func=session.scope_reward, callbacks=[_metrics_callback(session)],
                           per_turn=session.per_turn, serving=ctx.rollout_engine,
                           sync_folder=ctx.stage.path / "published")
    return session, trainer


def instrument(trainer):
    """d loss / d log p of every micro-batch's tokens, the micro-batches' masks, and generation outputs."""
    seen = {"grads": [], "batches": [], "generated": []}
    logps, loss, generate = (trainer._get_per_token_logps_and_entropies, trainer._compute_loss,
                             trainer._generate_and_score_completions)

    def logps_hook(model, *args, **kwargs):
        out = logps(model, *args, **kwargs)
        if torch.is_grad_enabled() and out[0].requires_grad:
            out[0].register_hook(lambda g: seen["grads"].append(g.detach().clone()))
        return out

    def loss_hook(model, inputs):
        seen["batches"].append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v) and v.ndim})
        return loss(model, inputs)

    def generate_hook(inputs):
        out = generate(inputs)
        seen["generated"].append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in out.items()})
        seen.setdefault("inputs", []).append(inputs)
        return out

    trainer._get_per_token_logps_and_entropies = logps_hook
    trainer._compute_loss = loss_hook
    trainer._generate_and_score_completions = generate_hook
    return seen


def base_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """log p(completion) under a plain model, computed independently of TRL."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits.float()
    logits = logits[:, prompt_ids.size(1) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def test_a_grpo_step_trains_only_the_active_adapter(params, retriever, passages, tiny_model_dir, tmp_path):
    policy = load_policy(params, tiny_model_dir)
    ctx, items = challenger_stage(policy, retriever, passages, tmp_path)
    session, trainer = build_trainer(ctx, items)
    seen = instrument(trainer)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    trainer.train()

    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".challenger." in n for n in changed)           # only the active adapter moved
    assert any("lora_B.challenger" in n for n in changed)                   # by the policy gradient, not decay
    assert sorted(policy.model.peft_config) == ["challenger", "solver"]    # no "default", no "ref" copy
    # environment tokens (retrieved text, chat headers, the appended turn end) get exactly zero gradient
    env_tokens = model_tokens = 0
    for grad, batch in zip(seen["grads"], seen["batches"], strict=True):
        env = (batch["completion_mask"] == 1) & (batch["tool_mask"] == 0)
        model = (batch["completion_mask"] * batch["tool_mask"]) == 1
        env_tokens += int(env.sum())
        model_tokens += int((grad[model] != 0).sum())
        assert float(grad[env].abs().max()) == 0.0
    assert env_tokens > 0 and model_tokens > 0
    advantages = seen["generated"][0]["advantages"]
    assert advantages.abs().sum() > 0                                        # the groups had reward spread
    # the reference is M0 itself: TRL's reference log-probs equal a plain forward of the base model
    generated = seen["generated"][0]
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = base_logps(plain, generated["prompt_ids"], generated["prompt_mask"], generated["completion_ids"],
                          generated["completion_mask"])
    mask = generated["completion_mask"].bool()
    assert torch.allclose(generated["ref_per_token_logps"][mask], expected[mask], atol=1e-4)
    # records and metrics of the step
    assert len(session.records) == 4 and len(session.metrics) == 1
    metrics = next(iter(session.metrics))
    for key in ("reward", "kl", "entropy", "clip_fraction", "gate_pass_rate", "searches_per_rollout",
                "time_generation_s", "time_judge_s", "time_update_s", "judge_parse_failure_rate"):
        assert metrics[key] is not None, key
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: the adapters start at M0 (B = 0)


def test_zero_spread_share_reads_flat_groups_where_trls_float32_std_does_not():
    third = torch.tensor([[1 / 3]] * 8)                                       # one flat group of eight eq. 4 rewards
    assert not torch.isclose(nanstd(third.view(-1, 8), dim=1), torch.zeros(1)).item()  # TRL's test: "spread"
    assert zero_spread_share(third, 8) == 1.0
    mixed = torch.tensor([[1 / 3]] * 4 + [[1 / 3], [0.5], [1 / 3], [1 / 3]])  # two groups of four: one flat
    assert zero_spread_share(mixed, 4) == 0.5
    nan = float("nan")
    lone = torch.tensor([[nan], [nan], [0.7], [nan], [0.2], [0.2 + 1e-9], [0.9], [0.1]])   # groups of two
    assert zero_spread_share(lone, 2) == 0.75   # unscored rows do not count; 1e-9 apart is no spread; 0.9/0.1 is
    two = torch.tensor([[0.5, nan], [0.5, 0.25]])                             # functions are summed, NaN as 0
    assert zero_spread_share(two, 2) == 0.0


def test_a_step_logs_the_share_of_flat_groups(params, retriever, passages, tiny_model_dir, tmp_path, monkeypatch):
    """Two groups of eight Challenger rollouts whose rewards are planted: one flat at eq. 4's 1/3 (no task in the
    window), one with spread. The step's `zero_spread_share` is 0.5 (TRL's own reading was 0.0: eight is a group
    size whose float32 mean of 1/3 rounds)."""
    wide = params.model_copy(deep=True)
    wide.grpo.group_size, wide.challenger.batch_size, wide.grpo.per_device_batch_size = 8, 2, 4
    policy = load_policy(wide, tiny_model_dir)
    ctx, items = challenger_stage(policy, retriever, passages, tmp_path)
    earned = ctx.rules.rewards

    def planted(session, trajectories, step):
        values, numbers = earned(session, trajectories, step)   # the real step's records and numbers
        assert len(values) == 16
        return [1 / 3] * 8 + [1 / 3, 0.5] * 4, numbers

    monkeypatch.setattr(ctx.rules, "rewards", planted)
    session, trainer = build_trainer(ctx, items)
    trainer.train()
    (metrics,) = list(session.metrics)
    assert metrics["zero_spread_share"] == 0.5


def test_adapters_save_and_load(params, retriever, passages, tiny_model_dir, tmp_path):
    policy = load_policy(params, tiny_model_dir)
    ctx, items = challenger_stage(policy, retriever, passages, tmp_path)
    _, trainer = build_trainer(ctx, items)
    trainer.train()
    folder = policy.save("challenger", tmp_path / "out")
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    trained = policy.state("challenger")

    fresh = load_policy(params, tiny_model_dir)
    assert any(not torch.equal(fresh.state("challenger")[n], v) for n, v in trained.items())
    fresh.load_role("challenger", folder)
    assert all(torch.equal(fresh.state("challenger")[n], v) for n, v in trained.items())
    ids = torch.tensor([policy.tokenizer.encode("The river flows through the city.")])
    with torch.no_grad():
        fresh.model.set_adapter("challenger")
        as_challenger = fresh.model(ids).logits
        fresh.model.set_adapter("solver")
        as_solver = fresh.model(ids).logits
        with fresh.model.disable_adapter():
            as_base = fresh.model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(ids).logits
    assert not torch.allclose(as_challenger, as_solver)
    assert torch.allclose(as_solver, as_base) and torch.allclose(as_base, plain, atol=1e-6)  # solver still at M0
    with pytest.raises(FileNotFoundError, match="adapter_model"):
        fresh.load_role("solver", tmp_path)


def test_full_finetuning_trains_its_own_copy_against_a_frozen_m0(params, retriever, passages, tiny_model_dir,
                                                                  tmp_path):
    policy = load_policy(params, tiny_model_dir, finetuning="full")
    ctx, items = challenger_stage(policy, retriever, passages, tmp_path)
    _, trainer = build_trainer(ctx, items)
    assert trainer.ref_model is policy.base
    base_before = {n: p.clone() for n, p in policy.base.named_parameters()}
    solver_before = policy.state("solver")
    challenger_before = policy.state("challenger")
    trainer.train()
    assert all(torch.equal(base_before[n], p) for n, p in policy.base.named_parameters())
    assert all(torch.equal(solver_before[n], v) for n, v in policy.state("solver").items())
    assert any(not torch.equal(challenger_before[n], v) for n, v in policy.state("challenger").items())
    folder = policy.save("challenger", tmp_path / "out")
    assert (folder / "config.json").is_file()
    again = load_policy(params, tiny_model_dir, finetuning="full")
    again.load_role("challenger", folder)
    assert all(torch.equal(again.state("challenger")[n], v) for n, v in policy.state("challenger").items())


def test_qwen3_trains_on_per_turn_datums(params, retriever, passages, tiny_model_dir, tmp_path):
    """App. E: each assistant turn is its own row, with earlier thinking stripped from its context, and every
    row of a trajectory carries that trajectory's advantage."""
    policy = load_policy(params, tiny_model_dir)
    ctx, items = challenger_stage(policy, retriever, passages, tmp_path, dialect="qwen3")
    session, trainer = build_trainer(ctx, items)
    assert session.per_turn
    seen = instrument(trainer)
    trainer.train()
    out, inputs = seen["generated"][0], seen["inputs"][0]
    records = {r["id"]: r for r in session.records}
    turns = [len(inp["trajectory"]["turns"]) for inp in inputs]
    spg = trainer.args.steps_per_generation
    n_rows = out["completion_ids"].size(0)
    assert n_rows == math.ceil(sum(turns) / spg) * spg and sum(turns) > len(inputs)
    # group advantages of the trajectories (TRL: mean-centred, Bessel std, eps 1e-4), repeated per turn
    rewards = [records[inp["trajectory"]["id"]]["reward"] for inp in inputs]
    expected = []
    for g in range(0, len(rewards), 2):
        pair = torch.tensor(rewards[g:g + 2])
        std = pair.std()
        expected += [float((r - pair.mean()) / (std + 1e-4)) for r in pair]
    per_row = [a for a, n in zip(expected, turns, strict=True) for _ in range(n)]
    assert out["advantages"][:len(per_row)].tolist() == pytest.approx(per_row, abs=1e-4)
    assert out["advantages"][len(per_row):].abs().sum() == 0                # padding rows carry nothing
    tok = policy.tokenizer
    turn_texts = [text for inp in inputs for text in inp["trajectory"]["turns"]]
    loss_mask = out["completion_mask"] * out["tool_mask"]
    for row, text in enumerate(turn_texts):
        context = tok.decode([t for t, m in zip(out["prompt_ids"][row].tolist(), out["prompt_mask"][row].tolist())
                              if m])
        earlier = [seg.split("<|im_end|>", 1)[0] for seg in context.split("<|im_start|>assistant\n")[1:-1]]
        assert all("<think>" not in turn for turn in earlier)               # earlier thinking stripped
        completion = tok.decode([t for t, m in zip(out["completion_ids"][row].tolist(), loss_mask[row].tolist())
                                 if m])
        assert completion == text                                           # the turn, thinking kept, whole
    assert any(len(t) > 1 and "<think>" in t[0] for t in (inp["trajectory"]["turns"] for inp in inputs))
    assert len(session.metrics) == 1


def test_permute_rewards_keeps_the_rewards_and_drops_the_assignment():
    values = [0.9, None, 0.1, 0.5, 0.0, 0.7, None, 0.3]
    shuffled = permute_rewards(values, seed=11)
    assert shuffled == permute_rewards(values, seed=11)                       # deterministic by seed
    assert sorted(v for v in shuffled if v is not None) == sorted(v for v in values if v is not None)
    assert [i for i, v in enumerate(shuffled) if v is None] == [1, 6]          # rows that never ran stay unscored
    assert shuffled != values                                                 # another assignment
    orders = {tuple(permute_rewards(values, seed=s)) for s in range(20)}
    assert len(orders) > 10                                                   # the seed decides the order


def scored_step(params, policy, retriever, passages, tmp_path, control: str):
    """One Stage-1 reward call on real rollouts of the scripted engine, under `grpo.reward_control: control`:
    (the values handed to TRL, the step's records)."""
    from types import SimpleNamespace

    policy.params = params.model_copy(update={"grpo": params.grpo.model_copy(update={"reward_control": control})})
    ctx, items = challenger_stage(policy, retriever, passages, tmp_path / control)
    session = RoleSession(ctx, items)
    state = SimpleNamespace(global_step=0)
    prompts = [i for i in items for _ in range(params.grpo.group_size)]      # TRL repeats each prompt G times
    rows = session.rollout_func(prompts, SimpleNamespace(state=state))
    values = session.scope_reward(prompts, None, None, rows["trajectory"], trainer_state=state)
    return values, list(session.records)


def test_the_shuffled_controls_permute_each_batch_and_the_default_trains_on_the_rewards(
        params, retriever, passages, tiny_model_dir, tmp_path):
    """A Challenger step: 'shuffled' (the learning check's control) leaves its rewards alone, 'shuffled_both' and
    'shuffled_challenger' permute them (the Solver's under 'shuffled': tests/test_selfplay_loop.py; the Solver's
    never under 'shuffled_challenger': test_the_shuffled_roles)."""
    policy = load_policy(params, tiny_model_dir)
    given, records = scored_step(params, policy, retriever, passages, tmp_path, "none")
    earned = [r["reward"] for r in records]
    assert given == earned and len(set(earned)) > 1                           # default: untouched (eq. 4)
    assert all("trained_reward" not in r for r in records)
    solver_only, solver_only_records = scored_step(params, policy, retriever, passages, tmp_path, "shuffled")
    assert solver_only == earned and solver_only_records == records           # the Challenger's: untouched
    shuffled, control_records = scored_step(params, policy, retriever, passages, tmp_path, "shuffled_both")
    assert [r["reward"] for r in control_records] == earned                   # the rollouts earned the same ...
    assert sorted(shuffled) == sorted(earned) and shuffled != earned          # ... the trainer got them permuted
    assert [r["trained_reward"] for r in control_records] == shuffled
    again, _ = scored_step(params, policy, retriever, passages, tmp_path / "again", "shuffled_both")
    assert again == shuffled                                                  # seeded
    alone, _ = scored_step(params, policy, retriever, passages, tmp_path / "alone", "shuffled_challenger")
    assert alone == shuffled                                                  # the Challenger's alone: the same


def test_the_shuffled_roles():
    """Which role each grpo.reward_control value permutes: the Solver's control, the Challenger's, both, none."""
    from scope_lib.selfplay.training import shuffles_rewards

    table = {v: [r for r in ("challenger", "solver") if shuffles_rewards(v, r)]
             for v in ("none", "shuffled", "shuffled_challenger", "shuffled_both")}
    assert table == {"none": [], "shuffled": ["solver"], "shuffled_challenger": ["challenger"],
                     "shuffled_both": ["challenger", "solver"]}


def test_grpo_settings_follow_table_9(params, tmp_path):
    from scope_lib.config import load_params

    paper = load_params(None, {"run.runs_dir": str(tmp_path)})
    args = grpo_args(paper, "solver", seed=3, output_dir=tmp_path)
    assert (args.num_generations, args.loss_type, args.scale_rewards) == (8, "dapo", "group")
    assert (args.epsilon, args.epsilon_high, args.delta) == (0.2, 0.28, 3.0)
    assert args.use_bias_correction_kl is False and args.beta == 0.0      # beta is set on the trainer
    assert (args.learning_rate, args.lr_scheduler_type.value, args.warmup_steps) == (1e-5, "constant_with_warmup", 0)
    assert (args.weight_decay, args.max_grad_norm, args.max_steps) == (0.01, 1.0, 20)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 256 * 8
    assert args.temperature == paper.solver.temperature and args.num_iterations == 1
    challenger = grpo_args(paper, "challenger", seed=3, output_dir=tmp_path)
    assert challenger.epsilon_high == 0.2 and challenger.per_device_train_batch_size * \
        challenger.gradient_accumulation_steps == 64 * 8
    assert challenger.max_steps == 20                                       # the paper: as many as the Solver
    fewer = load_params(None, {"selfplay.challenger_steps": 2})             # a CPU run's cheaper Challenger
    assert grpo_args(fewer, "challenger", seed=3, output_dir=tmp_path).max_steps == 2
    assert grpo_args(fewer, "solver", seed=3, output_dir=tmp_path).max_steps == 20
    full = load_params(None, {"model.finetuning": "full"})
    assert grpo_args(full, "solver", seed=3, output_dir=tmp_path).learning_rate == 1e-6
    bad = load_params(None, {"grpo.per_device_batch_size": 7})
    with pytest.raises(ParamsError, match="per_device_batch_size"):
        grpo_args(bad, "solver", seed=3, output_dir=tmp_path)


def test_torch_logprob_fallback_matches_log_softmax():
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 16, requires_grad=True), torch.randn(30, 16)
    targets = torch.randint(0, 30, (7,))
    logp, entropy, *_ = TorchChunkedLogProb.apply(hidden, weight, None, targets, 0.7, 3, 5.0, 2.0,
                                                  ("log_probs", "entropy"))
    logits = 5.0 * torch.tanh((hidden @ weight.t()) * 2.0 / 5.0) / 0.7
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(logp, reference.gather(-1, targets[:, None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(-1), atol=1e-5)
    logp.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_the_logprob_fallback_keeps_triton_for_gpu_tensors_only(monkeypatch):
    """Triton installed without a GPU (the `unsloth` extra brings it) imports, then fails at the first launch: the
    fallback then sits in front of TRL's kernel and sends CPU tensors to plain torch. Without Triton it replaces
    the missing kernel; another library's dispatch (Unsloth's CPU backend) is left in place."""
    import trl.trainer.utils as trl_utils

    class TritonKernel:  # what TRL's Triton kernel does on a machine without a GPU
        __module__ = "trl.kernels.chunked_logprob"

        @staticmethod
        def apply(*args, **kwargs):
            raise RuntimeError("0 active drivers ([]). There should only be one.")

    monkeypatch.setattr(DeviceLogProb, "triton_kernel", None)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", TritonKernel)
    assert install_logprob_fallback() and trl_utils._ChunkedLogProbFunction is DeviceLogProb
    assert not install_logprob_fallback()                                        # installed once
    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(5, 8), torch.randn(12, 8), torch.randint(0, 12, (5,))
    got = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 2)[0]
    assert torch.equal(got, TorchChunkedLogProb.apply(hidden, weight, None, targets, 1.0, 2)[0])
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", None)
    assert install_logprob_fallback() and trl_utils._ChunkedLogProbFunction is TorchChunkedLogProb

    class OtherDispatch:
        __module__ = "unsloth_zoo.cpu.ops"

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", OtherDispatch)
    assert not install_logprob_fallback() and trl_utils._ChunkedLogProbFunction is OtherDispatch


def test_a_shared_full_policy_is_one_copy_of_m0_under_both_roles(params, tiny_model_dir):
    """`model.shared_policy` with full fine-tuning: one trainable copy of M0 plays both roles; the Judge stays M0."""
    shared = params.model_copy(update={"model": params.model.model_copy(update={"shared_policy": True})})
    policy = load_policy(shared, tiny_model_dir, finetuning="full")
    assert policy.trainable("challenger") is policy.trainable("solver") is policy.models["solver"]
    assert policy.models["solver"] is not policy.base
    assert policy.engine.engines["challenger"] is policy.engine.engines["solver"]
    assert policy.engine.engines[None].model is policy.base

