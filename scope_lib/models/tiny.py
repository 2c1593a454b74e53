"""The offline tiny model: a random Qwen3 and a byte-level BPE tokenizer trained on the corpus, built locally.

Smoke runs and tests use it instead of a hub model, so the whole SCOPE loop (rollouts, Judge, GRPO) runs on a
CPU with no downloads. Nothing about it is pretrained: its replies are noise, but every code path (chat
template, protocol tags, generation, logprobs, LoRA adapters, saving and loading) is the real one.

    path = tiny_model_path("data/wiki-18.jsonl", params.model.tiny)     # built once, then cached
    model, tokenizer = load_model_and_tokenizer(path, dtype="float32", device="cpu")   # models.loading

The smoke run's warm-started model is built on top of this one by `scope_lib.smoke.warm_start`.

The tokenizer keeps the protocol tags (<search>, </answer>, <tool_call>, ...) as single added tokens that are
NOT special, so they survive ``decode(..., skip_special_tokens=True)`` and the parsers can read them. Only
``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>`` (end of a turn, the eos) are special.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scope_lib.config import TinyModelConfig
from scope_lib.config import cache_dir as scope_cache_dir
from scope_lib.runs import build_directory

log = logging.getLogger(__name__)


#: Bump when the recipe below changes, so cached builds from an older recipe are not reused.
RECIPE_VERSION = 1


ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)


#: Protocol tags of every dialect, prompt and parser; each one token, kept by skip_special_tokens decoding.
PROTOCOL_TAGS: tuple[str, ...] = tuple(
    tag for name in ("think", "search", "information", "answer", "task", "tool_call", "tool_response",
                     "function_calls", "rubrics", "score")
    for tag in (f"<{name}>", f"</{name}>"))


#: Passages read from the head of the corpus to train the tokenizer (and to fingerprint the corpus).
TOKENIZER_PASSAGES = 20_000


#: ChatML as Qwen writes it: system/user/assistant turns; consecutive tool results share one user turn,
#: each wrapped in <tool_response>. No default system prompt.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


class TinyModelError(ValueError):
    """The tiny model cannot be built from what was given (corpus missing or empty, bad shape)."""


def read_passages(corpus_path: Path, limit: int = TOKENIZER_PASSAGES) -> tuple[list[str], str]:
    """The `contents` of the first `limit` passages and a sha256 over exactly the lines read."""
    if not corpus_path.is_file():
        raise TinyModelError(f"{corpus_path}: corpus file not found; the tiny model's tokenizer is trained on "
                             "it (run `scope data fetch`, or point retrieval.corpus at a JSONL file)")
    digest = hashlib.sha256()
    passages: list[str] = []
    with corpus_path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if len(passages) >= limit:
                break
            if not raw.strip():
                continue
            digest.update(raw)
            try:
                record = json.loads(raw)
                contents = record["contents"]
            except (ValueError, KeyError, TypeError) as exc:
                raise TinyModelError(f"{corpus_path}:{lineno}: expected a JSON object with a 'contents' "
                                     f"string ({type(exc).__name__}: {exc})") from None
            if not isinstance(contents, str):
                raise TinyModelError(f"{corpus_path}:{lineno}: 'contents' must be a string")
            passages.append(contents)
    if not passages:
        raise TinyModelError(f"{corpus_path}: no passages; cannot train the tiny model's tokenizer")
    return passages, digest.hexdigest()


def corpus_fingerprint(corpus_path: str | os.PathLike) -> str:
    """sha256 over the corpus lines the tiny tokenizer is trained on (the first TOKENIZER_PASSAGES)."""
    return read_passages(Path(corpus_path))[1]


def _kv_heads(num_heads: int) -> int:
    """Key/value heads: heads / 2 (grouped-query attention, as in Qwen3), or the largest divisor below it."""
    for kv in range(max(1, num_heads // 2), 0, -1):
        if num_heads % kv == 0:
            return kv
    return 1


#: The warm-started model's pre-tokenizer: capitalised words and digit runs (with a leading space) are
#: pieces of their own, so names and years become single tokens; everything else may merge across words.
NAME_PIECES = r" ?\p{Lu}[\p{L}\p{N}'’-]*| ?\p{N}+"


#: Longest token (characters) of the warm-started model's tokenizer.
WARM_MAX_TOKEN_CHARS = 24


def _train_tokenizer(passages: list[str], cfg: TinyModelConfig, extra_texts: list[str] | None = None):
    """Byte-level BPE on the passages (shuffled by seed), with the protocol tags added as single tokens.

    With `extra_texts` (the warm start's protocol text) the tokenizer is the warm start's: it also learns
    from them, names and numbers are pieces of their own (NAME_PIECES) and other merges may cross word
    boundaries. Names then become single tokens, which a tiny model learns to copy within minutes, and the
    prompts' fixed phrases become long tokens, so contexts are about three times shorter."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    order = list(range(len(passages)))
    random.Random(cfg.seed).shuffle(order)
    extra = list(extra_texts or [])

    def texts() -> Iterator[str]:
        for i in order:
            yield passages[i]
        yield from extra

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    if extra_texts is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(NAME_PIECES), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size - len(PROTOCOL_TAGS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        max_token_length=None if extra_texts is None else WARM_MAX_TOKEN_CHARS,
    )
    tok.train_from_iterator(texts(), trainer=trainer, length=len(order) + len(extra))
    tok.add_tokens([AddedToken(tag, special=False, normalized=False, single_word=False, lstrip=False,
                               rstrip=False) for tag in PROTOCOL_TAGS])
    return tok


def _wrap_tokenizer(tok, cfg: TinyModelConfig, padding_side: str = "left"):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        padding_side=padding_side,
        model_max_length=cfg.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _random_model(tokenizer, cfg: TinyModelConfig):
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=3 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=_kv_heads(cfg.num_heads),
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(config)
    model.to(torch.float32)
    # A plain sampler: no top-k, no repetition penalty; a turn ends at <|im_end|> (or <|endoftext|>).
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    return model


def build_tiny_model(out_dir: str | os.PathLike, corpus_path: str | os.PathLike, cfg: TinyModelConfig,
                     extra_texts: list[str] | None = None) -> Path:
    """Train the tokenizer on `corpus_path` (and `extra_texts`, e.g. the protocol's fixed phrases), make a
    seeded random Qwen3 and save both to `out_dir`.

    The directory loads offline with AutoTokenizer / AutoModelForCausalLM.from_pretrained. Same config and
    corpus give byte-identical files. `out_dir` is written in place; `tiny_model_path` builds atomically.
    """
    if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 2:
        raise TinyModelError(f"model.tiny: hidden_size ({cfg.hidden_size}) must be num_heads ({cfg.num_heads}) "
                             "times an even head size")
    out = Path(out_dir)
    passages, corpus_sha256 = read_passages(Path(corpus_path))
    tokenizer = _wrap_tokenizer(_train_tokenizer(passages, cfg, extra_texts), cfg)
    model = _random_model(tokenizer, cfg)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "scope_tiny.json").write_text(json.dumps(
        {"recipe_version": RECIPE_VERSION, "config": cfg.model_dump(mode="json"),
         "corpus": str(corpus_path), "corpus_sha256": corpus_sha256,
         "vocab_size": len(tokenizer), "parameters": n_params}, indent=2) + "\n")
    log.info("built tiny model in %s: vocab %d, %d parameters", out, len(tokenizer), n_params)
    return out


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where tiny builds are cached: `cache_dir`, else $SCOPE_CACHE_DIR/tiny, else ~/.cache/scope/tiny."""
    return Path(cache_dir) if cache_dir is not None else scope_cache_dir("tiny")


def cache_key(corpus_path: str | os.PathLike, cfg: TinyModelConfig, **extra: Any) -> str:
    """A short hash of the recipe version, the tiny config and the corpus
    lines the tokenizer reads, plus `extra` (what a build on top of it adds, e.g. the warm start's recipe)."""
    record: dict[str, Any] = {"recipe_version": RECIPE_VERSION,
                              "config": cfg.model_dump(mode="json"),
                              "corpus_sha256": corpus_fingerprint(corpus_path), **extra}
    payload = json.dumps(record, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_model_path(corpus_path: str | os.PathLike, cfg: TinyModelConfig | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached random tiny model for this corpus and config, built on first use (atomically: see
    `runs.build_directory`). A warm start is built on top of it elsewhere (`scope_lib.smoke.warm_start`)."""
    cfg = cfg or TinyModelConfig()
    final = cache_root(cache_dir) / cache_key(corpus_path, cfg)
    return build_directory(final, lambda tmp: build_tiny_model(tmp, corpus_path, cfg))


def describe_tiny(path: str | os.PathLike) -> dict[str, Any]:
    """One row about a tiny model folder: its architecture and size (a warm start adds its own row:
    `scope_lib.smoke.warm_start.describe_warm_start`)."""
    info = json.loads((Path(path) / "scope_tiny.json").read_text())
    cfg = info["config"]
    return {"model": f"Qwen3, {cfg['num_layers']} layers x {cfg['hidden_size']} wide, vocabulary {info['vocab_size']}",
            "parameters": info["parameters"], "weights": "random"}
