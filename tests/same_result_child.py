"""One GRPO step of the Solver on a fixed batch, for the same-result test: `python same_result_child.py MODEL OUT`
alone (1 process, gradient accumulation over 2 micro-batches) or under `torchrun --nproc_per_node 2` (2 ranks,
one micro-batch each). The rollouts are scripted (fixed completions per prompt and copy, rewards from their
tokens), so sampling plays no part; everything else is the product's trainer (grpo_args, make_trainer: TRL's
GRPOTrainer with our per-rank settings), except plain SGD so the update shows the gradient itself. The main rank
saves the trained LoRA weights to OUT."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from scope_lib.config import load_params
from scope_lib.selfplay import ranks
from scope_lib.selfplay.training import grpo_args, make_trainer

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["alpha", "beta", "gamma", "delta"]


def rollout_func(prompts, trainer):
    seen: dict[str, int] = {}
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": []}
    for p in prompts:  # 2 ranks x per-device 2 = one group per rank, so the local copy index is the group's
        j = seen[p] = seen.get(p, -1) + 1
        k = PROMPTS.index(p)
        out["prompt_ids"].append([11 + k, 12 + k, 13 + k])
        completion = [20 + 3 * k + j, 30 + k, 40 + j, 2]
        out["completion_ids"].append(completion)
        out["env_mask"].append([1, 1, 1, 0])
    return out


def reward(prompts, completions, completion_ids, **_):
    return [float(ids[0] % 2) + 0.25 * ids[1] / 40 for ids in completion_ids]


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scope_lib.selfplay.policy import Policy

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    params = load_params(REPO / "params" / "smoke.yaml", {"solver.batch_size": 2, "grpo.group_size": 2,
                                                          "grpo.per_device_batch_size": 2, "grpo.learning_rate": 0.05})
    ranks.init(60, cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = Policy(params, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tokenizer, seed=0)
    args = grpo_args(params, "solver", seed=7, output_dir=out.parent / f"trainer{ranks.rank()}", steps=1)
    args.optim = "sgd"  # the update is lr x gradient: AdamW's first step (lr x sign) would hide a scaling error
    trainer = make_trainer(policy, "solver", args, dataset_ids=PROMPTS, rollout_func=rollout_func,
                           reward_func=reward)
    trainer.train()
    print(f"rank {ranks.rank()}: {trainer.accelerator.distributed_type}, gradient accumulation "
          f"{args.gradient_accumulation_steps}, "
          f"loss {trainer.state.log_history[0].get('loss')}", flush=True)
    if ranks.is_main():
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({n: p.detach().clone() for n, p in model.named_parameters() if "solver" in n}, out)
    ranks.barrier()
