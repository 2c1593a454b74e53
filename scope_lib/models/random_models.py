"""Random-initialised models with the real architectures (Qwen3-1.7B, Qwen3-8B, ...) for GPU tests and speed
benchmarks on machines that cannot download weights. Their outputs are noise, but every tensor has the real
shape, so memory, throughput and step times are those of the real model.

    path = build_shaped_model("Qwen/Qwen3-1.7B", "/tmp/qwen3-1.7b-random", corpus_path)

The tokenizer is the tiny model's byte-level BPE (trained on the corpus, protocol tags as single tokens, a
ChatML template) padded with placeholder tokens to the real vocabulary size, so the embedding and LM-head
matrices, and the cost of a softmax over the vocabulary, are the real ones.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from scope_lib.config import TinyModelConfig
from scope_lib.models.gpu_plan import KNOWN
from scope_lib.models.tiny import IM_END, tiny_model_path

log = logging.getLogger(__name__)


def build_shaped_model(name: str, out_dir: str | os.PathLike, corpus_path: str | os.PathLike, *,
                       dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Save a random model with the architecture of `name` (one of gpu_plan.KNOWN) and a tokenizer of its
    vocabulary size to `out_dir`; reuse it when already there."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    if name not in KNOWN:
        raise ValueError(f"no architecture for {name!r}; choose one of {', '.join(KNOWN)}")
    arch = KNOWN[name]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path(corpus_path, TinyModelConfig())))
    filler = [f"<|reserved_{i}|>" for i in range(arch.vocab - len(tokenizer))]
    tokenizer.add_tokens(filler)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                         num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                         num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
                         tie_word_embeddings=arch.tied_embeddings, max_position_embeddings=32768,
                         eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                                               do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info("random %s-shaped model (%.2fB parameters) saved to %s", name,
             sum(p.numel() for p in model.parameters()) / 1e9, out)
    return out
