"""Shared pieces of the training tests: smoke parameters for a fast run, a real tiny policy, and a scripted
engine whose groups have reward spread (so GRPO has something to learn from)."""

from __future__ import annotations

from pathlib import Path

import torch
from scripted_engine import ScriptedEngine

from scope_lib.config import load_params

REPO = Path(__file__).resolve().parents[1]

#: Small, fast settings on top of params/smoke.yaml: the hashing embedder (no MiniLM build), room for the
#: scripted protocol text, the random tiny model (the session's; not the smoke run's warm-started one).
FAST = {
    "model.tiny": {}, "model.warm_start": {}, "challenger.temperature": 1.0, "solver.temperature": 1.0,   # the paper's sampling
    "retrieval.embedder": "hashing", "retrieval.max_result_tokens": 120,
    "challenger.max_new_tokens_per_turn": 160, "challenger.max_response_tokens": 2048,
    "solver.max_new_tokens_per_turn": 160, "solver.max_response_tokens": 2048,
    "judge.rubric_max_tokens": 256, "judge.gate_max_tokens": 64, "judge.grading_max_tokens": 64,
    "selfplay.steps_per_role": 1, "selfplay.challenger_prompts": 4, "selfplay.candidate_batch_size": 4,
    "selfplay.target_tasks": 3, "selfplay.max_candidate_batches": 2, "selfplay.solver_rollouts_train": 2,
    "selfplay.solver_rollouts_filter": 2, "challenger.batch_size": 2, "solver.batch_size": 2,
    "grpo.group_size": 2, "grpo.per_device_batch_size": 2, "grpo.learning_rate": 5e-3,
    # the scripted Solver answers with the titles it found, half the group not at all: g-bar moves in steps of
    # 1/6, so a slightly wider window keeps a few tasks per batch whatever the retriever returns
    "selfplay.difficulty_window": [0.1, 0.9],
    # the Judge's probes (about 4 s a run on the tiny model) are tested where they are the subject
    # (tests/test_calibration.py, tests/test_stage_probes.py) and run in every params/smoke.yaml run (notebooks, demo)
    "judge.calibration.enabled": False,
}

POOR = {"challenger": "I would rather not write a task.",
        "solver": "<think>No need to look anything up.</think>\n<answer>I do not know.</answer>"}


#: Fields measured by the wall clock: the only ones two runs of the same seeds may differ in.
CLOCK = ("time_", "tokens_per_s")


def comparable(path) -> list[dict]:
    """A record file's records sorted by id, without wall-clock measurements (what a resumed run and an
    uninterrupted one must agree on)."""
    from scope_lib.runs import read_jsonl

    return sorted(({k: v for k, v in r.items() if not k.startswith(CLOCK)} for r in read_jsonl(path)),
                  key=lambda r: r["id"])


def fast_params(tmp_path, data_dir, **overrides):
    return load_params(REPO / "params" / "smoke.yaml",
                       {"run.runs_dir": str(tmp_path), "run.data_dir": str(data_dir), **FAST, **overrides})


class AlternatingEngine(ScriptedEngine):
    """The scripted engine, except that odd rows of each batch start badly (the Challenger writes no task, the
    Solver answers at once without searching). TRL puts a group's copies next to each other, so every group
    has a good and a poor member: rewards have spread and advantages are not zero."""

    def generate(self, prompt_token_ids, sampling, adapter=None):
        out = super().generate(prompt_token_ids, sampling, adapter)
        for i, ids in enumerate(prompt_token_ids):
            if i % 2 == 0:
                continue
            context = self.tokenizer.decode(ids)
            role = self.role(context)
            if role in POOR and self._turns_so_far(context) == 0:
                out[i] = self._complete(POOR[role], sampling)
        return out


def load_policy(params, tiny_model_dir, finetuning="lora"):
    """A real Policy over the tiny model (fresh weights each call: training changes them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scope_lib.selfplay.policy import Policy

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    p = params.model_copy(deep=True)
    p.model.finetuning = finetuning
    return Policy(p, base, tokenizer, seed=0)
