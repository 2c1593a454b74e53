"""GRPO for the Challenger and the Solver with TRL (paper eq. 2-3, §3.1, Appendix E, Table 9).

    policy = Policy.load(params)                       # M0 + the two roles (LoRA adapters or full copies)
    result = train_role(StageContext(...), ids, items)  # one stage: a fresh GRPOTrainer, `steps_per_role` steps

- Roles. LoRA mode (default): one base M0 with two PEFT adapters, `challenger` and `solver` (fp32 adapter
  weights, all linear layers); the Judge and the reference policy are M0 with adapters disabled. Full mode (the
  paper's): a copy of M0 per role, a frozen M0 as Judge and reference. Either way `policy.engine` generates for
  a role with `adapter="challenger"` / `"solver"` and for the Judge with `adapter=None`.
- One fresh `GRPOTrainer` per role per stage; the policy's weights carry over in memory and are saved by us to
  `iter_NN/<role>/adapter` (or `model`). With `run.checkpoint_steps`, transformers' checkpoints resume a killed
  stage mid-way (`scope_lib.selfplay.checkpoints`), with the weights saved and loaded by us: transformers' own
  loading reloads every adapter folder of a checkpoint and would overwrite the other role.
- The trainer is built with beta = 0 and given beta afterwards: with named adapters TRL otherwise looks for an
  adapter called "default" and, for one with that name, measures KL against a copy of it, not against M0.
- `rollout_func` drives `scope_lib.selfplay.rollout.run_rollouts`: TRL hands it every prompt G times; it returns one row
  per entry, in order, with the turn-end token appended under mask 0 and the trajectory record as an extra
  field. The reward function scores the records by the method's `RoleRules` (`selfplay.methods`; SCOPE's Stage 1:
  `evaluate_tasks`; Stage 3: `grade_rollouts` + `solver_rewards`): one batched Judge call per stage. A row that never ran (its prompt did not fit) gets None:
  TRL gives it advantage 0 and keeps it out of its group's baseline.
- Qwen3 re-renders each turn without earlier thinking, so a trajectory is not one token stream: each
  assistant turn becomes its own training row sharing the trajectory's advantage (App. E; ScopeGRPOTrainer).

TRL 1.15 computes log-probabilities with a Triton kernel. Off the GPU the same computation in plain torch runs
instead (`install_logprob_fallback`): in its place where Triton is missing, in front of it where Triton is
installed but has no GPU to run on.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
import torch  # noqa: E402

from scope_lib.config import Params, ParamsError  # noqa: E402
from scope_lib.models.engine import Engine  # noqa: E402
from scope_lib.protocol.dialects import Dialect  # noqa: E402
from scope_lib.runs import Stage, safe_point, writing  # noqa: E402
from scope_lib.selfplay import health, ranks  # noqa: E402
from scope_lib.selfplay.checkpoints import checkpoint_step, latest_checkpoint, marker_callback, role_folder
from scope_lib.selfplay.judge import Judge  # noqa: E402
from scope_lib.selfplay.policy import AdapterSync, Policy, check_role, serves_adapters
from scope_lib.selfplay.rollout import (
    RolloutLimits,
    RolloutStats,
    Trajectory,
    per_turn_datums,
    run_rollouts,
)

log = logging.getLogger(__name__)


class TorchChunkedLogProb:
    """Plain-torch stand-in for TRL 1.15's Triton `ChunkedLogProbFunction`, installed only when Triton is
    unavailable. Same call and outputs: per-token log p(target) of temperature-scaled logits (after the
    model's logit scale and soft-capping), and on request the entropy, log Σp², the mean logit and whether
    the target is the argmax. Autograd runs through ordinary ops, `chunk_size` rows at a time."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        parts: dict[str, list] = {name: [] for name in ("log_probs", "entropy", "log_sum_sq_probs",
                                                        "mean_logits", "is_top1")}
        size = max(1, int(chunk_size or hidden.shape[0] or 1))
        for start in range(0, hidden.shape[0], size):
            logits = hidden[start:start + size].float() @ weight.float().t()
            if bias is not None:
                logits = logits + bias.float()
            logits = logits * logit_scale
            if final_logit_softcapping is not None:
                logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
            logits = logits / temperature
            logp = torch.log_softmax(logits, dim=-1)
            target = targets[start:start + size].long().unsqueeze(-1)
            parts["log_probs"].append(logp.gather(-1, target).squeeze(-1))
            if "entropy" in outputs:
                parts["entropy"].append(-(logp.exp() * logp).sum(-1))
            if "log_sum_sq_probs" in outputs:
                parts["log_sum_sq_probs"].append(torch.logsumexp(2 * logp, dim=-1).detach())
            if "mean_logits" in outputs:
                parts["mean_logits"].append(logits.mean(-1).detach())
            if "is_top1" in outputs:
                parts["is_top1"].append(logits.argmax(-1) == target.squeeze(-1))
        empty = hidden.new_zeros((0,), dtype=torch.float32)

        def joined(name):
            if name != "log_probs" and name not in outputs:
                return None
            return torch.cat(parts[name]) if parts[name] else empty

        return tuple(joined(n) for n in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))


class DeviceLogProb:
    """TRL's Triton kernel for tensors on a GPU, `TorchChunkedLogProb` for the rest. Triton installed on a
    machine without a GPU (it comes with the `unsloth` extra) imports fine but fails at the first launch with
    "0 active drivers", so where Triton is present the choice is made per call, by the tensors' device."""

    triton_kernel = None

    @classmethod
    def apply(cls, hidden, *args, **kwargs):
        if cls.triton_kernel is not None and hidden.device.type in ("cuda", "xpu"):
            return cls.triton_kernel.apply(hidden, *args, **kwargs)
        return TorchChunkedLogProb.apply(hidden, *args, **kwargs)


def install_logprob_fallback() -> bool:
    """Give TRL 1.15 a log-prob kernel off the GPU: `TorchChunkedLogProb` where Triton is missing, and
    `DeviceLogProb` in front of the Triton kernel where it is installed. True when something was installed;
    a dispatch already there (ours, or Unsloth's CPU backend's) is left alone. TRL 1.16 ships its own torch
    path; until the pin moves (Unsloth needs trl <= 1.15) this is ours."""
    import trl.trainer.utils as trl_utils

    kernel = getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if kernel is None:
        trl_utils._ChunkedLogProbFunction = TorchChunkedLogProb
        log.info("Triton is unavailable: TRL's chunked log-prob kernel runs in plain torch")
        return True
    if kernel is TorchChunkedLogProb or kernel is DeviceLogProb or not kernel.__module__.startswith("trl."):
        return False
    DeviceLogProb.triton_kernel = kernel
    trl_utils._ChunkedLogProbFunction = DeviceLogProb
    log.info("TRL's Triton log-prob kernel runs for GPU tensors only; plain torch elsewhere")
    return True


def grpo_args(params: Params, role: str, *, seed: int, output_dir: str | os.PathLike, steps: int | None = None,
              world_size: int | None = None, group_size: int | None = None):
    """trl.GRPOConfig for one role's stage. One generation batch per optimiser step: `batch_size` prompts x G
    rollouts, reached by gradient accumulation over micro-batches of `grpo.per_device_batch_size`. `group_size`:
    the role's rollouts per prompt when not G (1: REINFORCE, `RoleRules.group_size`)."""
    from trl import GRPOConfig

    check_role(role)
    g, r = params.grpo, getattr(params, role)
    sp = params.selfplay
    steps = steps or (sp.challenger_steps if role == "challenger" and sp.challenger_steps else sp.steps_per_role)
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    group = group_size or g.group_size
    rows = r.batch_size * group
    per_device = min(g.per_device_batch_size, rows)
    if rows % (per_device * world):
        raise ParamsError(
            f"{role}.batch_size x rollouts per prompt = {r.batch_size} x {group} = {rows} rollouts per step must "
            f"divide evenly over grpo.per_device_batch_size ({per_device}) x {world} device(s); change one of them")
    on_gpu = torch.cuda.is_available() and params.engine.device != "cpu"
    every = params.run.checkpoint_steps * g.num_epochs  # a checkpoint falls between two generation batches
    saving = {"save_strategy": "steps", "save_steps": every, "save_total_limit": 2} if every else {
        "save_strategy": "no"}
    config = GRPOConfig(
        output_dir=str(output_dir), seed=seed, max_steps=steps, logging_steps=1, **saving,
        report_to=list(g.report_to) or "none", disable_tqdm=True,
        learning_rate=g.learning_rate_for(params.model.finetuning), lr_scheduler_type=g.lr_scheduler,
        warmup_steps=int(g.warmup_ratio * steps),  # verl's floor: 0.03 x 20 steps -> no warmup step
        weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm,
        beta=0.0,  # set on the trainer after init (module docstring)
        use_bias_correction_kl=g.kl_importance_ratio,
        epsilon=r.clip_low, epsilon_high=r.clip_high, delta=g.dual_clip,
        num_generations=group if group > 1 else rows, scale_rewards=g.scale_rewards, loss_type=g.loss_type,
        num_iterations=g.num_epochs, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=rows // (per_device * world),
        temperature=r.temperature, top_p=r.top_p,  # the log-probs are recomputed at the rollout sampling
        max_completion_length=r.max_response_tokens, mask_truncated_completions=False,
        gradient_checkpointing=g.gradient_checkpointing, disable_dropout=True,
        bf16=on_gpu and params.model.dtype == "bfloat16", use_cpu=not on_gpu,
        shuffle_dataset=True, remove_unused_columns=False,
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=g.importance_sampling,
        vllm_importance_sampling_clip_max=g.importance_sampling_clip)
    # TRL's config refuses fewer than 2 generations per prompt; one rollout per prompt (REINFORCE) is set after
    # its checks: the trainer then repeats no prompt and `reinforce` gives the advantages (ScopeGRPOTrainer)
    config.num_generations = group
    return config


def _unwrap(trainer):
    return trainer.accelerator.unwrap_model(trainer.model)


@functools.cache
def _trainer_class():
    from accelerate.utils import gather
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import RepeatSampler, pad, use_adapter

    class EpochSeededSampler(RepeatSampler):
        """TRL's sampler, its order a function of (seed, epoch): a resumed stage, which starts at a later epoch
        without iterating the earlier ones, draws the same prompts as an uninterrupted one (the generator is
        reseeded and advanced one permutation per earlier epoch, exactly as an uninterrupted run advanced it)."""

        def set_epoch(self, epoch: int) -> None:
            self.generator.manual_seed(self.seed)
            for _ in range(epoch):
                torch.randperm(self.num_samples, generator=self.generator)

    class ScopeGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with per-turn datums (App. E): rewards and group advantages are computed over one stub
        row per trajectory; then every assistant turn becomes a training row with that trajectory's
        advantage, its own context (earlier thinking stripped) and its own reference log-probs."""

        per_turn: bool = False
        reinforce: bool = False  # one rollout per prompt: the rewards are the advantages (RoleRules.group_size)
        reference_model = None  # full fine-tuning: the frozen M0
        scope_policy: Policy | None = None  # checkpoints hold this role's weights only (saved and loaded by us)
        scope_role: str | None = None

        def save_model(self, output_dir=None, _internal_call=False):
            if self.scope_policy is None:
                return super().save_model(output_dir, _internal_call)
            self.scope_policy.save(self.scope_role, output_dir or self.args.output_dir)

        def _maybe_log_save_evaluate(self, *args, **kwargs):
            with safe_point():  # a SIGTERM waits for the step's checkpoint and its seal (run.checkpoint_steps)
                return super()._maybe_log_save_evaluate(*args, **kwargs)

        def _save_checkpoint(self, model, trial):
            # torch.save reports a full disk as "RuntimeError: ... unexpected pos ...": name the folder instead
            with writing(self.args.output_dir, opaque=True):
                return super()._save_checkpoint(model, trial)

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            if self.scope_policy is None:
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
            self.scope_policy.load_role(self.scope_role, role_folder(resume_from_checkpoint))

        def _get_train_sampler(self, dataset=None):
            sampler = super()._get_train_sampler(dataset)
            if isinstance(sampler, RepeatSampler) and sampler.shuffle and sampler.seed is not None:
                sampler.__class__ = EpochSeededSampler
            return sampler

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._given_rewards = rewards  # every process's rows (REINFORCE reads this process's slice)
            return rewards

        def _scored(self, inputs):
            """TRL's generation and scoring; with `reinforce`, each row's advantage is its reward as the method
            gave it (already centred by its own baseline, e.g. SCORE's EMA), with no group normalisation: TRL's
            group of one would centre every reward to 0. A row that was not scored gets 0. The logged share of
            rows without signal (TRL's `frac_reward_zero_std`) is ours: `zero_spread_share`."""
            out = super()._generate_and_score_completions(inputs)
            metrics = self._metrics["train" if self.model.training else "eval"]
            if self.reinforce:
                start = self.accelerator.process_index * len(inputs)
                given = self._given_rewards[start:start + len(inputs)].nansum(dim=1)
                unscored = torch.isnan(self._given_rewards[start:start + len(inputs)]).all(dim=1)
                out["advantages"] = given.masked_fill(unscored, 0.0).to(out["advantages"].device)
                share = float((out["advantages"] == 0).float().mean())  # a group of one: no signal is A = 0
            else:
                share = zero_spread_share(self._given_rewards * self.reward_weights.to(self._given_rewards.device),
                                          self.num_generations)
            if metrics.get("frac_reward_zero_std"):
                metrics["frac_reward_zero_std"][-1] = share
            return out

        def _generate_and_score_completions(self, inputs):
            if not self.per_turn:
                return self._scored(inputs)
            beta, self.beta = self.beta, 0.0  # no reference pass over the stub rows
            try:
                out = self._scored(inputs)
            finally:
                self.beta = beta
            rows = [(datum[0], datum[1], datum[2], advantage, datum[3] if len(datum) > 3 else None)
                    for inp, advantage in zip(inputs, out["advantages"].tolist(), strict=True)
                    for datum in inp["turn_datums"]]
            per_step = self.args.steps_per_generation if self.model.training else 1
            pad_id, end_id = self._tokenizer.pad_token_id, self.eos_token_ids[0]
            while not rows or len(rows) % per_step:  # TRL's split drops a remainder: pad with loss-free rows
                rows.append(([pad_id], [end_id], [0], 0.0, None))
            device = self.accelerator.device

            def stack(values, fill, side, dtype=torch.long):
                return pad([torch.tensor(v, dtype=dtype) for v in values], padding_value=fill,
                           padding_side=side).to(device)

            prompt_ids = stack([r[0] for r in rows], pad_id, "left")
            prompt_mask = stack([[1] * len(r[0]) for r in rows], 0, "left")
            completion_ids = stack([r[1] for r in rows], pad_id, "right")
            completion_mask = stack([[1] * len(r[1]) for r in rows], 0, "right")
            tool_mask = stack([r[2] for r in rows], 1, "right")
            new = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                   "completion_mask": completion_mask, "tool_mask": tool_mask,
                   "advantages": torch.tensor([r[3] for r in rows], device=device),
                   "num_items_in_batch": gather((completion_mask * tool_mask).sum()).sum()}
            ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention = torch.cat([prompt_mask, completion_mask], dim=1)
            keep = completion_ids.size(1)
            size = self.args.per_device_train_batch_size
            corrected = self.use_vllm and self.vllm_importance_sampling_correction
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                if "old_per_token_logps" in out or corrected:
                    new["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                        self.model, ids, attention, keep, batch_size=size)[0]
                if self.beta != 0.0:
                    new["ref_per_token_logps"] = self._reference_logps(ids, attention, keep, size, use_adapter)
            if corrected:  # the turns were sampled by the serving engine: TRL's ratio, per turn row
                sampled = stack([r[4] if r[4] is not None else [0.0] * len(r[1]) for r in rows], 0.0, "right",
                                dtype=torch.float32)
                loss_mask = (completion_mask * tool_mask).bool()
                gap = new["old_per_token_logps"] - sampled
                ratio = importance_ratio(gap, loss_mask.float(), self.vllm_importance_sampling_mode,
                                         self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)
                new["importance_sampling_ratio"] = ratio
                # TRL logged these over the stub rows: replace them with the turn rows' values
                metrics = self._metrics["train" if self.model.training else "eval"]
                for key, value in (("sampling/sampling_logp_difference/mean", gap.abs()[loss_mask].mean()),
                                   ("sampling/importance_sampling_ratio/mean",
                                    ratio[loss_mask].mean() if ratio.shape == loss_mask.shape else ratio.mean())):
                    if metrics.get(key):
                        metrics[key][-1] = float(torch.nan_to_num(value, nan=0.0))
            return new

        def _reference_logps(self, ids, attention, keep, size, use_adapter):
            if self.ref_model is not None:
                return self._get_per_token_logps_and_entropies(self.ref_model, ids, attention, keep,
                                                               batch_size=size)[0]
            with use_adapter(_unwrap(self), adapter_name=None):  # pi_ref = M0: adapters off
                return self._get_per_token_logps_and_entropies(self.model, ids, attention, keep,
                                                               batch_size=size)[0]

    return ScopeGRPOTrainer


#: Rewards of one group closer than this count as equal (what TRL's float32 rewards can tell apart is ~1e-7).
SPREAD_TOLERANCE = 1e-6


def zero_spread_share(rewards: torch.Tensor, group: int) -> float:
    """The share of rows whose GRPO group has no reward spread (its advantages are 0: no signal), from the
    rewards TRL received (rows x reward functions, groups of `group` consecutive rows; a row that every function
    left unscored is NaN and does not count as a member). A group is flat when its scored members' rewards span at
    most `SPREAD_TOLERANCE`, or fewer than two members were scored. TRL's own `frac_reward_zero_std` tests the
    float32 std against 0 with `isclose`'s 1e-8, which the rounding of the group mean defeats: eight rewards of 1/3
    have a std of 3e-8, so a flat Challenger group (every eq. 4 reward 1/3) read as having spread."""
    rows = torch.where(torch.isnan(rewards).all(dim=1), torch.nan, rewards.nansum(dim=1)).view(-1, group)
    scored = ~torch.isnan(rows)
    high = rows.masked_fill(~scored, -math.inf).max(dim=1).values
    low = rows.masked_fill(~scored, math.inf).min(dim=1).values
    flat = (scored.sum(dim=1) < 2) | (high - low <= SPREAD_TOLERANCE)
    return float(flat.float().mean())


def importance_ratio(logp_diff: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None,
                     clip_max: float | None) -> torch.Tensor:
    """exp(log pi_train - log pi_sampler), per token or per sequence, truncated or masked (TRL's four modes)."""
    diff = torch.nan_to_num(logp_diff * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def make_trainer(policy: Policy, role: str, args, *, dataset_ids: list[str], rollout_func, reward_func,
                 callbacks=(), per_turn: bool = False, serving=None, sync_folder: str | os.PathLike | None = None):
    """A fresh trainer for `role`. The model's forward is restored first (each GRPOTrainer patches it with a
    fused LM head at its own temperature), so exactly one patch, this role's, is active. One rollout per prompt
    (`args.num_generations` 1) trains by REINFORCE: the rewards are the advantages (ScopeGRPOTrainer)."""
    from datasets import Dataset

    install_logprob_fallback()
    model = policy.trainable(role)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.__dict__.pop("forward", None)
    trainer = _trainer_class()(model=model, reward_funcs=[reward_func], args=args,
                               train_dataset=Dataset.from_dict({"prompt": list(dataset_ids)}),
                               processing_class=policy.tokenizer, rollout_func=rollout_func,
                               callbacks=list(callbacks))
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for noisy in (PrinterCallback, ProgressCallback):  # our callback shows progress and writes the metrics
        trainer.remove_callback(noisy)
    trainer.beta = policy.params.grpo.beta
    trainer.per_turn = per_turn
    trainer.reinforce = args.num_generations == 1
    trainer.use_vllm = False  # TRL's own vLLM engine is never built (it would hold merged weights: no Judge)
    if serving is not None and serves_adapters(serving):
        sync = AdapterSync(policy, role, serving, sync_folder or Path(args.output_dir) / "published")
        sync.trainer = trainer
        trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, sync, -1
    if policy.reference is not None:
        from trl.trainer.utils import add_fused_lm_head

        reference = policy.reference
        reference.__dict__.pop("forward", None)
        add_fused_lm_head(reference, temperature=args.temperature)
        trainer.ref_model = reference.eval()
    return trainer


def never_ran(traj: Trajectory) -> bool:
    """A rollout that produced no model token for a reason outside the policy (prompt or context too long)."""
    return not traj.turns and traj.finish in ("prompt_too_long", "budget")


def trajectory_rows(trajectories: list[Trajectory], tokenizer, *, per_turn: bool,
                    logprobs: bool = False) -> dict[str, list]:
    """rollout_func's output: one row per trajectory, in order. The turn-end token closes every completion
    under mask 0 (TRL counts a row without it as truncated). Per-turn mode: stub rows plus `turn_datums`.
    `logprobs`: the sampler's log-probabilities too (for the importance-sampling correction)."""
    end = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "env_mask": [], "trajectory": [],
                            "logprobs": []}
    if per_turn:
        out["turn_datums"] = []
    for traj in trajectories:
        out["trajectory"].append(traj.to_record())
        if per_turn or never_ran(traj):
            out["prompt_ids"].append([pad])
            out["completion_ids"].append([end])
            out["env_mask"].append([0])
            out["logprobs"].append([0.0])
        else:
            out["prompt_ids"].append(list(traj.prompt_ids))
            out["completion_ids"].append(list(traj.completion_ids) + [end])
            out["env_mask"].append(list(traj.env_mask) + [0])
            out["logprobs"].append(list(traj.logprobs) + [0.0])
        if per_turn:
            out["turn_datums"].append([(d.prompt_ids, d.completion_ids + [end], [1] * len(d.completion_ids) + [0],
                                        d.logprobs + [0.0]) for d in per_turn_datums(traj)])
    if not logprobs:  # TRL reads them only for its importance-sampling correction
        out["logprobs"] = None
    return out


def trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Searches, turns, truncation and empty retrievals of a batch of rollouts, and how many stops fell inside
    thinking (the turn went on: `rollout.stopped_in_thinking`), a count for the health panel."""
    n = max(1, len(trajectories))
    searches = [s for t in trajectories for s in t.searches if s.valid]
    return {"rollouts": len(trajectories),
            "searches_per_rollout": sum(t.n_valid_searches for t in trajectories) / n,
            "turns_per_rollout": sum(len(t.turns) for t in trajectories) / n,
            "model_tokens_per_rollout": sum(t.n_model_tokens for t in trajectories) / n,
            "truncation_rate": sum(t.finish in ("length", "budget") for t in trajectories) / n,
            "empty_retrieval_rate": (sum(not s.hit_ids for s in searches) / len(searches)) if searches else 0.0,
            "never_ran": sum(never_ran(t) for t in trajectories),
            "stops_in_thinking": sum(t.stops_in_thinking for t in trajectories)}


@dataclass
class StageContext:
    """What one training stage works with."""

    params: Params
    iteration: int
    role: str
    policy: Policy
    retriever: Any
    dialect: Dialect
    judge: Judge
    stage: Stage
    seed: int
    solver_adapter: str | None = "solver"   # S_{t-1} for Stage 1's difficulty estimate
    engine: Engine | None = None             # rollouts (default: the policy's engine)
    alarms: list[dict] = field(default_factory=list)
    rules: RoleRules | None = None           # the method's rules for this role (`Method.role_rules`)

    @property
    def rollout_engine(self) -> Engine:
        return self.engine or self.policy.engine


class RoleRules(Protocol):
    """One role of a self-play method (`selfplay.methods`): what it sees, its rollout budgets, how its rollouts are
    verified and rewarded. The shared training core (`RoleSession`, `train_role`) calls these and nothing
    method-specific."""

    #: Record logs this role's stage writes besides `rollouts` (SCOPE's Challenger: `solver_rollouts`).
    extra_records: tuple[str, ...]
    #: Whether the role's rollouts search (the `no_searches` alarm watches only those that do).
    searches: bool
    # Optional: `group_size`, the role's rollouts per prompt when not grpo.group_size; 1 trains by REINFORCE, the
    # rewards the rules return being the advantages (centred by the method's own baseline: SCORE's Evaluator).

    def limits(self, params: Params) -> RolloutLimits:
        """Turn and token budgets of the role's training rollouts."""

    def new_trajectory(self, ctx: StageContext, item_id: str, item: Any, traj_id: str) -> Trajectory:
        """A fresh rollout of dataset row `item_id` (`item`: the stage's prompt or pooled task): what the role sees."""

    def rewards(self, session: RoleSession, trajectories: list[Trajectory], step: int
                ) -> tuple[list[float | None], dict[str, Any]]:
        """Every row's reward (None for a row that never ran) and the step's numbers; the step's records go to
        `session.unwritten[<log name>]` (`rollouts` and `extra_records`)."""

    # Optional: `draw_rollouts(session, trajectories, limits, step) -> (trajectories, RolloutStats)` fills the step's
    # rows itself, one finished trajectory per given (unrolled) one, in order; without it the rows are rolled out by
    # `run_rollouts`. SPICE's Challenger draws more attempts than its group keeps (Algorithm 1, line 6); its
    # Reasoner can take the answers Stage 1 already sampled (§2.5).


class RoleSession:
    """rollout_func, reward function and per-step metrics of one role's stage, over the method's rules for the role
    (`ctx.rules`). `items` maps dataset ids to what the rules read (SCOPE: a ChallengerPrompt in Stage 1, a pooled
    TaskEvaluation in Stage 3)."""

    def __init__(self, ctx: StageContext, items: dict[str, Any]):
        if ctx.rules is None:
            raise ValueError(f"StageContext of the {ctx.role} stage has no rules: give it the method's "
                             "(`selfplay.methods.method_for(params).role_rules(role)`)")
        self.ctx = ctx
        self.rules = ctx.rules
        self.items = items
        self.records = ctx.stage.records("rollouts")
        self.extra_records = {name: ctx.stage.records(name) for name in self.rules.extra_records}
        self.metrics = ctx.stage.records("metrics")
        self.pending: dict[int, dict[str, Any]] = {}
        self.unwritten: dict[str, list[dict[str, Any]]] = {}  # this step's records, until the main rank writes
        self.per_turn = ctx.dialect.strips_earlier_thinking
        self._judge_before: dict[str, float] = {}

    # -- TRL hooks ------------------------------------------------------------------------------------
    def rollout_func(self, prompts: list[str], trainer) -> dict[str, list]:
        ctx, step = self.ctx, trainer.state.global_step
        started = time.perf_counter()
        seen: dict[str, int] = {}
        for earlier in ranks.gather([list(prompts)])[:ranks.rank()]:  # a group may span ranks: number it whole
            for item_id in earlier:
                seen[item_id] = seen.get(item_id, -1) + 1
        trajectories = []
        for item_id in prompts:  # TRL repeats each prompt G times: the copies are the group
            j = seen[item_id] = seen.get(item_id, -1) + 1
            item = self.items.get(item_id)
            if item is None:
                raise KeyError(f"training row {item_id!r} is not in this stage's prompts")
            trajectories.append(self.rules.new_trajectory(ctx, item_id, item, f"{item_id}/t{step:03d}/g{j}"))
        limits = self.rules.limits(ctx.params)
        limits.seed = ctx.seed * 1000 + step + 100_000 * ranks.rank()  # rank 0 keeps the 1-process seeds
        draw = getattr(self.rules, "draw_rollouts", None)  # optional (RoleRules): the role fills its rows itself
        if draw is None:
            stats = run_rollouts(trajectories, ctx.rollout_engine, ctx.retriever, ctx.dialect, limits,
                                 adapter=ctx.role)
        else:
            trajectories, stats = draw(self, trajectories, limits, step)
        self.pending[step] = {"rollout_s": time.perf_counter() - started, **_rollout_times(stats),
                              **trajectory_metrics(trajectories)}
        if not self.rules.searches:  # a closed-book role: no search count to watch
            self.pending[step]["searches_per_rollout"] = None
        return trajectory_rows(trajectories, ctx.policy.tokenizer, per_turn=self.per_turn,
                               logprobs=serves_adapters(ctx.rollout_engine))

    def scope_reward(self, prompts, completions, completion_ids, trajectory, trainer_state=None, **_):
        """R_C (eq. 4) or R_S (eq. 6) of every row, computed from the trajectory records; None for rows that
        never ran."""
        step = trainer_state.global_step if trainer_state is not None else 0
        started = time.perf_counter()
        judge_before = self.ctx.judge.stats.totals()
        trajectories = [Trajectory.from_record(r) for r in trajectory]
        values, metrics = self.rules.rewards(self, trajectories, step)
        if shuffles_rewards(self.ctx.params.grpo.reward_control, self.ctx.role):  # the learning check's control
            values = permute_rewards(values, control_seed(self.ctx.seed, step, ranks.rank()))
            for record, given in zip(self.unwritten["rollouts"], values, strict=True):
                record["trained_reward"] = given  # `reward` stays what the rollout earned (eq. 4 / eq. 6)
        judge_after = self.ctx.judge.stats.totals()
        engine = self.ctx.rollout_engine
        if self.ctx.params.engine.sleep_mode and callable(getattr(engine, "sleep", None)):
            engine.sleep()  # the trainer steps next: give it the GPU (woken by the next sync)
        asked = judge_after["prompts"] - judge_before["prompts"]
        self.pending.setdefault(step, {}).update(
            metrics, reward_s=time.perf_counter() - started, judge_s=judge_after["seconds"] - judge_before["seconds"],
            judge_calls=judge_after["calls"] - judge_before["calls"], judge_prompts=asked,
            judge_parse_failure_rate=(judge_after["unparseable"] - judge_before["unparseable"]) / asked if asked else 0.0)
        self._flush(step)
        return values

    def _flush(self, step: int) -> None:
        """Gather this step's records and numbers from every rank; the main rank writes the records, in rank
        order (with one process: this process's, as they are)."""
        unwritten, self.unwritten = self.unwritten, {}
        shares = ranks.gather([(unwritten, self.pending.get(step, {}))])
        if ranks.distributed():
            self.pending[step] = combine_ranks([numbers for _, numbers in shares])
        if ranks.is_main():
            for name, records in (("rollouts", self.records), *self.extra_records.items()):
                records.append(rec for written, _ in shares for rec in written.get(name, []))

    # -- per-step metrics ---------------------------------------------------------------------------
    def log_step(self, step: int, trl_logs: dict[str, float], step_s: float) -> dict[str, Any] | None:
        """Merge TRL's numbers for optimiser step `step` (1-based) with ours; write metrics.jsonl; check health."""
        ours = self.pending.pop(step - 1, None)
        if ours is None:
            return None
        ctx = self.ctx
        generated = ours.get("generation_s", 0.0)
        update = max(0.0, step_s - ours.get("rollout_s", 0.0) - ours.get("reward_s", 0.0))
        record = {
            "id": f"{ctx.role}-{ctx.iteration:02d}-{step:04d}", "role": ctx.role, "iteration": ctx.iteration,
            "step": step, **{k: v for k, v in ours.items() if not k.endswith("_s")},
            "reward_control": ctx.params.grpo.reward_control,
            "kl": trl_logs.get("kl"), "entropy": trl_logs.get("entropy"),
            "clip_fraction": trl_logs.get("clip_ratio/region_mean"), "loss": trl_logs.get("loss"),
            "grad_norm": trl_logs.get("grad_norm"), "learning_rate": trl_logs.get("learning_rate"),
            "zero_spread_share": trl_logs.get("frac_reward_zero_std"),
            "importance_ratio": trl_logs.get("sampling/importance_sampling_ratio/mean"),
            "sampler_logp_gap": trl_logs.get("sampling/sampling_logp_difference/mean"),
            "tokens_per_s": ours.get("generated_tokens", 0) / generated if generated else None,
            "time_step_s": step_s, "time_generation_s": generated, "time_retrieval_s": ours.get("retrieval_s", 0.0),
            "time_judge_s": ours.get("judge_s", 0.0), "time_solver_rollouts_s": ours.get("solver_rollout_s", 0.0),
            "time_update_s": update,
            "time_overhead_s": max(0.0, ours.get("rollout_s", 0.0) - generated - ours.get("retrieval_s", 0.0))
            + max(0.0, ours.get("reward_s", 0.0) - ours.get("judge_s", 0.0) - ours.get("solver_rollout_s", 0.0)),
        }
        history = [r for r in self.metrics if r.get("step", 0) < step] + [record]
        for alarm in health.check_step(record) + health.check_steps(history):
            ctx.alarms.append(alarm)
            if ranks.is_main():
                health.report(alarm, ctx.stage.path.parent.parent)
        if ranks.is_main():
            self.metrics.append([record])
        return record


def shuffles_rewards(reward_control: str, role: str) -> bool:
    """Whether `role`'s rewards are permuted under `grpo.reward_control`: 'shuffled' permutes the Solver's only
    (the control then differs from the trained run in the Solver's reward information alone: same Challenger,
    same Stage 1, same task pool), 'shuffled_challenger' the Challenger's only (the Challenger's learning check's
    control), 'shuffled_both' both roles', 'none' neither."""
    return role in SHUFFLED_ROLES[reward_control]


#: The roles whose rewards each `grpo.reward_control` value permutes.
SHUFFLED_ROLES: dict[str, tuple[str, ...]] = {"none": (), "shuffled": ("solver",),
                                              "shuffled_challenger": ("challenger",),
                                              "shuffled_both": ("challenger", "solver")}


def control_seed(stage_seed: int, step: int, rank: int = 0) -> int:
    """The seed of one step's reward permutation under `grpo.reward_control` (per stage, step, rank)."""
    return stage_seed * 1000 + step + 100_000 * rank


def permute_rewards(values: list[float | None], seed: int) -> list[float | None]:
    """The shuffled-reward control: the batch's rewards in a seeded uniformly random order over the rows that were
    scored (a row that never ran keeps None). Same multiset of rewards, so the same reward distribution, but no
    information about which rollout earned which (the control of "Spurious Rewards", arXiv 2506.10947)."""
    import random

    scored = [i for i, v in enumerate(values) if v is not None]
    order = list(scored)
    random.Random(seed).shuffle(order)
    out = list(values)
    for i, j in zip(scored, order, strict=True):
        out[i] = values[j]
    return out


#: Per-step numbers that add up over ranks; "*_s" times take the slowest rank; the rest are per-rollout means.
SUMMED = ("engine_calls", "retrieval_calls", "generated_tokens", "rollouts", "never_ran", "unscored_rows",
          "solver_rollouts", "judge_calls", "judge_prompts", "stops_in_thinking", "solver_stops_in_thinking")


def combine_ranks(shares: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's numbers over every rank's share: counts summed, times the slowest rank's, rates and means
    weighted by each rank's rollouts (None where no rank had a value)."""
    combined: dict[str, Any] = {}
    for key in dict.fromkeys(k for share in shares for k in share):
        values = [(share.get(key), share.get("rollouts") or 1) for share in shares]
        present = [(v, w) for v, w in values if v is not None]
        if key in SUMMED:
            combined[key] = sum(v for v, _ in present)
        elif key.endswith("_s"):
            combined[key] = max((v for v, _ in present), default=0.0)
        else:
            weight = sum(w for _, w in present)
            combined[key] = sum(float(v) * w for v, w in present) / weight if present else None
    return combined


def _rollout_times(stats: RolloutStats) -> dict[str, float]:
    return {"generation_s": stats.generation_s, "retrieval_s": stats.retrieval_s, "engine_calls": stats.engine_calls,
            "retrieval_calls": stats.retrieval_calls, "generated_tokens": stats.generated_tokens}


def reward_stats(values: list[float | None]) -> dict[str, Any]:
    scored = [v for v in values if v is not None]
    return {"reward": mean_of(scored) if scored else None, "unscored_rows": len(values) - len(scored)}


def mean_of(values) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


def _metrics_callback(session: RoleSession):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class MetricsCallback(TrainerCallback):
        """Times each optimiser step, hands TRL's logged numbers to the session, and shows one progress bar
        per stage (instead of TRL's printed log dictionaries)."""

        def __init__(self):
            self.started = time.perf_counter()
            self.bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            ctx = session.ctx
            self.bar = tqdm(total=args.max_steps, desc=f"iteration {ctx.iteration} {ctx.role}", unit="step",
                            leave=False)

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record = session.log_step(state.global_step, logs, time.perf_counter() - self.started)
                if self.bar is not None:
                    self.bar.update(1)
                    if record and record.get("reward") is not None:
                        self.bar.set_postfix(reward=f"{record['reward']:.3f}")

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return MetricsCallback()


@dataclass
class StageResult:
    steps: int
    seconds: float
    metrics: list[dict[str, Any]]
    saved: Path


def train_role(ctx: StageContext, items: dict[str, Any], dataset_ids: list[str] | None = None) -> StageResult:
    """Train `ctx.role` for `selfplay.steps_per_role` GRPO steps (the Challenger: `selfplay.challenger_steps` when
    set) on `items` (dataset rows are their ids, or `dataset_ids`), write records and metrics into the stage
    folder, save the role there."""
    started = time.perf_counter()
    session = RoleSession(ctx, items)
    ids = list(dataset_ids if dataset_ids is not None else items)
    batch = getattr(ctx.params, ctx.role).batch_size
    if len(ids) < batch:  # TRL's sampler drops incomplete batches: repeat a small pool to one full batch
        log.warning("%s stage of iteration %d has %d distinct prompts for a batch of %d: repeating them",
                    ctx.role, ctx.iteration, len(ids), batch)
        ids = [ids[i % len(ids)] for i in range(batch)]
    args = grpo_args(ctx.params, ctx.role, seed=ctx.seed, output_dir=ctx.stage.path / "trainer",
                     group_size=getattr(ctx.rules, "group_size", None))
    callbacks = [_metrics_callback(session)] + ([marker_callback()] if ctx.params.run.checkpoint_steps else [])
    trainer = make_trainer(ctx.policy, ctx.role, args, dataset_ids=ids, rollout_func=session.rollout_func,
                           reward_func=session.scope_reward, callbacks=callbacks,
                           per_turn=session.per_turn, serving=ctx.rollout_engine,
                           sync_folder=ctx.stage.path / "published" / (
                               f"rank{ranks.rank()}" if ranks.distributed() else ""))
    trainer.scope_policy, trainer.scope_role = ctx.policy, ctx.role
    resume = latest_checkpoint(ctx.stage.path / "trainer") if ctx.params.run.checkpoint_steps else None
    if resume is not None:
        k = checkpoint_step(resume)
        dropped = sum(records.retain(lambda rec, k=k: rec.get("step", 0) <= k)
                      for records in (session.records, *session.extra_records.values(), session.metrics))
        log.warning("iteration %d %s: resuming at step %d of %d from %s (weights, optimiser, scheduler and RNG "
                    "restored; %d record(s) of later steps dropped and redone)", ctx.iteration, ctx.role, k,
                    args.max_steps, resume, dropped)
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    if ranks.distributed():
        log.info("rank %d of %d: %s weights after iteration %d: sha256 %s", ranks.rank(), ranks.world_size(),
                 ctx.role, ctx.iteration, ranks.weights_digest(_unwrap(trainer)))
    saved = ctx.stage.path / ("adapter" if ctx.policy.finetuning == "lora" else "model")
    # sharded weights (FSDP2, ZeRO-3) are gathered by every rank together; DDP ranks each hold them whole
    gathered = trainer.accelerator.get_state_dict(trainer.model) if ranks.sharded_weights() else None
    if ranks.is_main():  # one rank writes them
        saved = ctx.policy.save(ctx.role, ctx.stage.path, state_dict=gathered)
        for scratch in ("trainer", "published"):
            shutil.rmtree(ctx.stage.path / scratch, ignore_errors=True)
    ranks.barrier()
    metrics = list(session.metrics)
    return StageResult(steps=trainer.state.global_step, seconds=time.perf_counter() - started, metrics=metrics,
                       saved=saved)
