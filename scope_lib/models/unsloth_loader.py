"""`model.loader: unsloth`: M0 and the LoRA roles through Unsloth's `FastLanguageModel`.

    model, tokenizer = load_model_and_tokenizer(source, params, dtype=torch.float32)   # from_pretrained
    peft_model = add_role_adapters(model, params, ("challenger", "solver"), seed=0)    # get_peft_model

Unsloth patches transformers, PEFT and TRL for the whole process when it is imported, so only this module
imports it, and only `scope_lib.models.loading` imports this module, lazily, when the params choose the loader.
On a GPU, Unsloth loads M0 with its fused LoRA kernels (optionally 4-bit, optionally with a vLLM engine that
shares the weights) and rewrites TRL's trainers; without a GPU it runs its CPU backend: stock transformers,
PEFT and TRL underneath, its own dtype policy, and a device dispatch for TRL's Triton log-prob kernel.

The roles: `get_peft_model` makes one adapter called "default" (and applies Unsloth's patches to the
PeftModel). Each role then gets its own adapter with that adapter's LoRA settings, which are the HF loader's
(`model.lora_*`), its random A matrices drawn from the same seed as the HF loader's; "default" is removed. The
PeftModel holds exactly the HF loader's adapters and PEFT saves them in the same files, so a run moves
between the two loaders.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import TYPE_CHECKING, Any

from scope_lib.models.cpu import cpu_runs_avx512_bf16, is_x86

if TYPE_CHECKING:
    from scope_lib.config import Params

log = logging.getLogger(__name__)

UNSLOTH_MISSING = (
    "model.loader: unsloth needs Unsloth, which is not installed here. CPU: `make install` (the `unsloth` extra, "
    "then `pip uninstall -y torchvision torchaudio torchcodec`, whose PyPI builds break a CPU torch); GPU: "
    "environment.yml. Or set model.loader: hf.")


#: vLLM's CPU build for x86 ships one kernel library per instruction set; vLLM loads the one the CPU runs
#: (`vllm.platforms.cpu.CpuPlatform.import_kernels`). `vllm._C` is the AVX-512 + AVX512-BF16 build.
VLLM_CPU_KERNELS_NEEDING_AVX512_BF16 = ("vllm._C",)


def keep_vllm_kernels_this_cpu_runs() -> list[str]:
    """Stand-ins for the vLLM kernel libraries this CPU cannot run, registered before Unsloth is imported.

    Unsloth's import (`unsloth/_gpu_init.py` -> `import_fixes.disable_broken_vllm`) checks vLLM by force-loading
    every compiled extension it knows, `vllm._C` first. On vLLM's CPU build for x86 that library is the
    AVX-512-BF16 one, and loading it on a CPU without those instructions kills the process with SIGILL, although
    vLLM itself would have loaded `vllm._C_AVX2` (or `_C_AVX512`) there and run fine (docs/gpus.md, "vLLM on CPU").
    On such a CPU each of `VLLM_CPU_KERNELS_NEEDING_AVX512_BF16` gets an empty module in `sys.modules`, so the
    probe finds it imported and loads nothing; vLLM never imports that name on this CPU, so nothing else sees it.
    Nothing is done on a GPU build of vLLM, on a CPU that runs the library, off x86, or without vLLM. Returns the
    names given a stand-in."""
    import importlib.util
    import sys
    import types

    if not is_x86() or importlib.util.find_spec("vllm") is None:
        return []
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or cpu_runs_avx512_bf16():
        return []
    registered = []
    for name in VLLM_CPU_KERNELS_NEEDING_AVX512_BF16:
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name, f"stand-in: this CPU cannot load {name} (AVX-512-BF16); "
                                                       "vLLM loads its own kernels for it (scope_lib.models.unsloth_loader)")
            registered.append(name)
    if registered:
        log.info("vLLM CPU kernels %s need AVX-512-BF16, which this CPU lacks: kept from Unsloth's import probe",
                 ", ".join(registered))
    return registered


def import_unsloth(params: Params):
    """Unsloth's FastLanguageModel (importing Unsloth on first use). With `fast_inference` and
    `engine.sleep_mode`, Unsloth's standby is switched on first: it must be set before its vLLM engine exists.
    vLLM kernel libraries this CPU cannot run are kept from Unsloth's import probe first
    (`keep_vllm_kernels_this_cpu_runs`)."""
    if params.model.unsloth.fast_inference and params.engine.sleep_mode:
        os.environ.setdefault("UNSLOTH_VLLM_STANDBY", "1")
    keep_vllm_kernels_this_cpu_runs()
    try:
        from unsloth import FastLanguageModel
    except ModuleNotFoundError as exc:
        if exc.name != "unsloth":
            raise
        raise ImportError(UNSLOTH_MISSING) from exc
    return FastLanguageModel


def checkpointing(params: Params) -> str | bool:
    """Unsloth's `use_gradient_checkpointing`: "unsloth" (its offloaded checkpointing) when
    `grpo.gradient_checkpointing` is on."""
    return "unsloth" if params.grpo.gradient_checkpointing else False


def load_model_and_tokenizer(source: str | os.PathLike, params: Params, *, dtype: Any = None):
    """(model, tokenizer) from `FastLanguageModel.from_pretrained`, in eval mode, the tokenizer left-padded with
    a pad token. `dtype` is a torch dtype (None: Unsloth chooses). 4-bit loading and `fast_inference` come from
    `model.unsloth`; the longest sequence is `model.max_model_len`."""
    fast = import_unsloth(params)
    u = params.model.unsloth
    extra: dict[str, Any] = {}
    if u.fast_inference:  # Unsloth's vLLM engine: sized like ours, serving LoRA up to the run's rank
        extra.update(fast_inference=True, max_lora_rank=params.model.lora_rank,
                     gpu_memory_utilization=params.engine.gpu_memory_utilization)
    model, tokenizer = fast.from_pretrained(str(source), max_seq_length=params.model.max_model_len, dtype=dtype,
                                            load_in_4bit=u.load_in_4bit, use_gradient_checkpointing=checkpointing(params),
                                            **extra)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def add_role_adapters(model, params: Params, roles: tuple[str, ...], *, seed: int):
    """A PeftModel with one LoRA adapter per role, from `FastLanguageModel.get_peft_model` with `model.lora_*`.
    The caller seeds torch as for the HF loader; the roles' A matrices are drawn after reseeding with `seed`, so
    both loaders start from the same adapters."""
    import torch

    fast = import_unsloth(params)
    m = params.model
    peft_model = fast.get_peft_model(model, r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                                     target_modules=m.lora_target_modules,
                                     use_gradient_checkpointing=checkpointing(params), random_state=seed)
    config = peft_model.peft_config["default"]
    torch.manual_seed(seed)
    for role in roles:
        peft_model.add_adapter(role, copy.deepcopy(config))
    peft_model.set_adapter(roles[0])
    peft_model.delete_adapter("default")
    log.info("Unsloth LoRA roles %s (r=%d) on %s", ", ".join(roles), m.lora_rank, type(model).__name__)
    return peft_model
