"""The policy: M0 and the two roles. In LoRA mode (one GPU) Challenger and Solver are two adapters on one frozen
M0, made by PEFT or by Unsloth (`model.loader`); the Judge and the reference policy are M0 with the adapters
off. In full fine-tuning mode (the paper's) each role has its own weights. With `model.shared_policy` (SPICE, SSP,
SCORE) one policy plays both roles: one adapter, `policy` (or one copy of M0), trained on both roles' batches,
saved by each role's stage and generating under either role's name. `AdapterSync` publishes the trained adapter to
a serving engine after every optimiser step (vLLM, `vllm serve`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch  # noqa: E402

from scope_lib.config import Params  # noqa: E402
from scope_lib.models.engine import Completion, Engine, Sampling  # noqa: E402
from scope_lib.models.hf_engine import HFEngine  # noqa: E402
from scope_lib.models.loading import add_role_adapters, load_training_model
from scope_lib.models.openai_engine import OpenAIEngine
from scope_lib.runs import load_weights, safe_point, writing

log = logging.getLogger(__name__)


ROLES: tuple[str, ...] = ("challenger", "solver")

#: The one adapter both roles train and generate with under `model.shared_policy`.
SHARED_ADAPTER = "policy"


class RoleEngine:
    """One Engine over several models (full fine-tuning): `adapter` names the role, None is M0 (the Judge)."""

    name = "hf-roles"

    def __init__(self, engines: dict[str | None, HFEngine]):
        self.engines = engines
        self.tokenizer = engines[None].tokenizer
        self.calls = 0

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None = None) -> list[Completion]:
        if adapter not in self.engines:
            raise ValueError(f"unknown role {adapter!r}; this policy has {', '.join(map(str, self.engines))}")
        self.calls += 1
        return self.engines[adapter].generate(prompt_token_ids, sampling)


class SharedAdapterEngine:
    """An engine over a PeftModel with one adapter that both roles use (`model.shared_policy`): a role's name
    generates with that adapter, None with M0 (the Judge); everything else is the wrapped engine's."""

    def __init__(self, engine: Engine, adapters: dict[str, str]):
        self.engine, self.adapters = engine, adapters

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling,
                 adapter: str | None = None) -> list[Completion]:
        return self.engine.generate(prompt_token_ids, sampling, adapter=self.adapters.get(adapter, adapter))

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class Policy:
    """M0 with a Challenger and a Solver. LoRA: `model` is one PeftModel holding both adapters (one, `policy`,
    with `model.shared_policy`). Full: `models` holds a copy of M0 per role (one copy under both names when shared)
    and `base` the frozen M0 (Judge and reference)."""

    def __init__(self, params: Params, base, tokenizer, *, seed: int = 0):
        self.params = params
        self.tokenizer = tokenizer
        self.finetuning = params.model.finetuning
        self.shared = params.model.shared_policy
        #: role -> the adapter (LoRA) that holds its weights: itself, or the one shared adapter
        self.adapters = {role: SHARED_ADAPTER if self.shared else role for role in ROLES}
        self.base = base
        base.requires_grad_(False)
        device = str(next(base.parameters()).device)
        length, chunk = params.model.max_model_len, params.engine.max_batch_size
        if self.finetuning == "lora":  # PEFT or Unsloth (`model.loader`); B starts at 0: each role starts at M0
            self.model = add_role_adapters(base, params, tuple(dict.fromkeys(self.adapters.values())), seed=seed)
            self.models: dict[str, Any] = {}
            self.engine: Engine = HFEngine(self.model, tokenizer, max_model_len=length, max_batch_size=chunk)
            if self.shared:
                self.engine = SharedAdapterEngine(self.engine, self.adapters)
        else:
            import copy

            self.model = None
            shared = copy.deepcopy(base).requires_grad_(True) if self.shared else None
            self.models = {role: shared if shared is not None else copy.deepcopy(base).requires_grad_(True)
                           for role in ROLES}
            engines = {id(m): HFEngine(m, tokenizer, max_model_len=length, max_batch_size=chunk)
                       for m in self.models.values()}
            self.engine = RoleEngine({None: HFEngine(base, tokenizer, max_model_len=length, max_batch_size=chunk),
                                      **{r: engines[id(m)] for r, m in self.models.items()}})
        log.info("policy: %s fine-tuning of %s on %s%s", self.finetuning, params.model.base, device,
                 " (one policy plays both roles)" if self.shared else "")

    @classmethod
    def load(cls, params: Params, *, seed: int | None = None) -> Policy:
        """M0 from `model.base` (the tiny model is built or reused) through `model.loader` (transformers or
        Unsloth), float32 adapters in LoRA mode."""
        model, tokenizer = load_training_model(params)
        return cls(params, model, tokenizer, seed=params.grpo.seed if seed is None else seed)

    # -- what a trainer trains -------------------------------------------------------------------------
    def trainable(self, role: str):
        """The module GRPOTrainer trains for `role`: the PeftModel with `role` active (only its weights need
        gradients), or the role's own copy of M0."""
        check_role(role)
        if self.finetuning == "lora":
            self.model.set_adapter(self.adapters[role])
            return self.model
        return self.models[role]

    @property
    def reference(self):
        """pi_ref = M0 (§3.1). LoRA: None (TRL disables the adapters); full: the frozen M0 itself."""
        return None if self.finetuning == "lora" else self.base

    # -- saving and loading ------------------------------------------------------------------------------
    def save(self, role: str, stage_dir: str | os.PathLike, state_dict: dict | None = None) -> Path:
        """Write the role to `stage_dir/adapter` (LoRA: adapter_config.json + weights) or `stage_dir/model`,
        atomically (a temporary folder renamed into place; a SIGTERM waits for it). `state_dict`: the weights
        gathered from sharded ranks (FSDP2, ZeRO-3), in place of the module's own shards. A full disk is an
        OSError (ENOSPC) naming the folder, whichever library was writing (safetensors says it its own way)."""
        check_role(role)
        target = Path(stage_dir) / ("adapter" if self.finetuning == "lora" else "model")
        with safe_point(), writing(target):
            return self._save(role, target, state_dict)

    def _save(self, role: str, target: Path, state_dict: dict | None) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            if self.finetuning == "lora":
                self.model.save_pretrained(tmp, selected_adapters=[self.adapters[role]], state_dict=state_dict)
                saved = tmp / self.adapters[role]  # PEFT writes adapters other than "default" into a subfolder
            else:
                self.models[role].save_pretrained(tmp, state_dict=state_dict)
                self.tokenizer.save_pretrained(tmp)
                saved = tmp
            if target.exists():
                shutil.rmtree(target)
            saved.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def load_role(self, role: str, folder: str | os.PathLike) -> None:
        """Put the weights saved by `save` back into the role (resume; the next iteration in a new process)."""
        check_role(role)
        folder = Path(folder)
        if self.finetuning == "lora":
            from peft import set_peft_model_state_dict

            weights = folder / "adapter_model.safetensors"
            if not weights.is_file():
                raise FileNotFoundError(f"{folder}: no adapter_model.safetensors (saved with Policy.save?)")
            result = set_peft_model_state_dict(self.model, load_weights(weights), adapter_name=self.adapters[role])
            unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
            if unexpected:
                raise ValueError(f"{folder}: adapter weights do not fit this model ({unexpected[:3]} ...)")
        else:
            from transformers import AutoModelForCausalLM

            for weights in sorted(folder.glob("*.safetensors")):
                load_weights(weights)  # names a damaged file instead of failing inside transformers
            loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=next(self.base.parameters()).dtype)
            self.models[role].load_state_dict(loaded.state_dict())
        log.info("loaded %s from %s", role, folder)

    def publish(self, role: str, folder: str | os.PathLike, engine, version: int | None = None) -> Path:
        """Save the role and register it with a serving engine (vLLM in this process, or a `vllm serve` through
        the OpenAI engine), which then generates for it under the role's name (and, with a shared policy, for
        every role that shares its weights)."""
        path = self.save(role, folder)
        for name in [r for r in ROLES if self.adapters[r] == self.adapters[role]]:
            if isinstance(engine, _http_engine_type()):
                engine.add_adapter(name, path, version=version)
            else:
                engine.add_adapter(name, path)
        return path

    def state(self, role: str) -> dict[str, torch.Tensor]:
        """A copy of the role's trainable weights (tests compare them before and after a step)."""
        if self.finetuning == "lora":
            return {n: p.detach().clone() for n, p in self.model.named_parameters() if f".{self.adapters[role]}." in n}
        return {n: p.detach().clone() for n, p in self.models[role].named_parameters()}


def serves_adapters(engine) -> bool:
    """True for an engine that generates from saved adapter folders (vLLM, a served model), not from the model
    being trained: its rollouts need the adapter published every step and an importance-sampling correction."""
    return callable(getattr(engine, "add_adapter", None))


def _http_engine_type():
    return OpenAIEngine


class AdapterSync:
    """Stands where TRL keeps its own vLLM engine (`trainer.vllm_generation`). TRL calls `sync_weights()` once per
    optimiser step, before the rollouts: the trained adapter is saved and registered with the serving engine as
    a new version (adapter-only sync: the base on the engine never changes), and a sleeping engine wakes.
    With `trainer.use_vllm` set, TRL also applies its importance-sampling correction to the engine's logprobs."""

    def __init__(self, policy: Policy, role: str, engine, folder: str | os.PathLike, keep: int = 2):
        self.policy, self.role, self.engine, self.folder, self.keep = policy, role, engine, Path(folder), keep
        self.trainer = None
        self.versions: list[int] = []

    def sync_weights(self) -> None:
        version = self.trainer.state.global_step if self.trainer is not None else len(self.versions)
        if hasattr(self.engine, "wake_up"):
            self.engine.wake_up()
        self.policy.publish(self.role, self.folder / f"v{version:04d}", self.engine, version=version)
        self.versions.append(version)
        for old in self.versions[:-self.keep]:
            shutil.rmtree(self.folder / f"v{old:04d}", ignore_errors=True)


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose challenger or solver")
