"""The offline tiny model: a random Qwen3 and a byte-level BPE tokenizer trained on the corpus, built locally.

Smoke runs and tests use it instead of a hub model, so the whole SCOPE loop (rollouts, Judge, GRPO) runs on a
CPU with no downloads. Nothing about it is pretrained: its replies are noise, but every code path (chat
template, protocol tags, generation, logprobs, LoRA adapters, saving and loading) is the real one.

    path = tiny_model_path("data/wiki-18.jsonl", params.model.tiny)     # built once, then cached
    model, tokenizer = load_model_and_tokenizer("tiny", dtype="float32", device="cpu",
                                                tiny_cfg=params.model.tiny, corpus_path=corpus)

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
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scope_lib.config import TinyModelConfig

log = logging.getLogger(__name__)

#: Bump when the recipe below changes, so cached builds from an older recipe are not reused.
RECIPE_VERSION = 1
#: Bump when the warm start's SFT recipe changes (the teacher has its own TEACHER_VERSION).
WARM_RECIPE_VERSION = 2
#: Where a name comes, the share of the warm start's loss on WHICH name (the rest is on "a name comes here";
#: `_sft_trainer_class`). Without the class term a tiny model spreads its guess over a thousand names, and a
#: single protocol word ("Plan" after <search>) outweighs each of them: on 16 held-out documents the class term
#: took the Challenger's task rate from 0.72 to 0.92 and the Solver's answer rate from 0.70 to 0.86.
NAME_LOSS_WEIGHT = 0.1

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


# -- corpus ----------------------------------------------------------------------------------------


def _read_passages(corpus_path: Path, limit: int = TOKENIZER_PASSAGES) -> tuple[list[str], str]:
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
    return _read_passages(Path(corpus_path))[1]


# -- building --------------------------------------------------------------------------------------


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


def build_tiny_model(out_dir: str | os.PathLike, corpus_path: str | os.PathLike, cfg: TinyModelConfig) -> Path:
    """Train the tokenizer on `corpus_path`, make a seeded random Qwen3 and save both to `out_dir`.

    The directory loads offline with AutoTokenizer / AutoModelForCausalLM.from_pretrained. Same config and
    corpus give byte-identical files. `out_dir` is written in place; `tiny_model_path` builds atomically.
    """
    if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 2:
        raise TinyModelError(f"model.tiny: hidden_size ({cfg.hidden_size}) must be num_heads ({cfg.num_heads}) "
                             "times an even head size")
    out = Path(out_dir)
    passages, corpus_sha256 = _read_passages(Path(corpus_path))
    extra = None
    if cfg.warm_start.enabled:
        from scope_lib.teacher import protocol_texts

        extra = protocol_texts(passages, cfg.warm_start.seed)
    tokenizer = _wrap_tokenizer(_train_tokenizer(passages, cfg, extra), cfg)
    model = _random_model(tokenizer, cfg)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "scope_tiny.json").write_text(json.dumps(
        {"recipe_version": RECIPE_VERSION, "config": _config_record(cfg),
         "corpus": str(corpus_path), "corpus_sha256": corpus_sha256,
         "vocab_size": len(tokenizer), "parameters": n_params}, indent=2) + "\n")
    log.info("built tiny model in %s: vocab %d, %d parameters", out, len(tokenizer), n_params)
    return out


def _config_record(cfg: TinyModelConfig) -> dict[str, Any]:
    """The config as it enters the cache key: warm-start settings only when the warm start is on, so the
    random model's key does not move with settings it ignores; never the SFT thread count (1 and 2 threads
    gave bit-identical weights)."""
    return cfg.model_dump(mode="json", exclude={"warm_start": {"threads"}} if cfg.warm_start.enabled
                          else {"warm_start"})


# -- warm start ------------------------------------------------------------------------------------

#: Folder (under the cache root) of the teacher's retrieval indexes, one per corpus and embedder.
TEACHER_INDEX_DIR = "_teacher_index"


def _index_name(corpus_path: str | os.PathLike, cfg: TinyModelConfig) -> str:
    from scope_lib.corpus import corpus_checksum

    return f"{cfg.warm_start.embedder}-flat-{corpus_checksum(corpus_path)[:16]}"


class _ProgressLog:
    """A trainer callback that logs SFT progress (loss, steps) through `logging`: about ten lines a build at
    INFO (a report shows them), every logged step at DEBUG."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            reported = 0

            def on_log(self, args, state, control, logs=None, **kwargs):
                if not logs or "loss" not in logs:
                    return
                tenth = 10 * state.global_step // max(1, state.max_steps)
                level = logging.INFO if tenth > self.reported else logging.DEBUG
                self.reported = max(self.reported, tenth)
                log.log(level, "warm start step %d/%d: loss %.3f", state.global_step, state.max_steps, logs["loss"])

        return Callback()


def _sft_trainer_class(name_ids: list[int] | None = None, name_weight: float = 1.0):
    """TRL's SFTTrainer, with the loss computed here: TRL 1.15 always scores through its fused LM head, whose
    kernel needs Triton, which CPU-only torch lacks. The loss is the token mean over the assistant's tokens,
    projecting only those positions through the LM head.

    Where the target is a name (a token of `name_ids`), the loss is `name_weight` x the token's cross-entropy
    plus (1 - `name_weight`) x the cross-entropy of the name *class* (-log of the total probability of all
    names): the model must be sure that a name comes there, and learns which one mostly by copying it from
    the context rather than by memorising it."""
    import torch
    from trl import SFTTrainer

    class CompletionSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"][:, 1:]
            backbone = getattr(model, model.base_model_prefix)
            hidden = backbone(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                              use_cache=False).last_hidden_state[:, :-1]
            mask = labels != -100
            targets = labels[mask]
            logits = model.get_output_embeddings()(hidden[mask]).float()
            per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            if name_ids and name_weight != 1.0:
                names = torch.as_tensor(name_ids, device=logits.device)
                lookup = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                lookup[names] = True
                is_name = lookup[targets]
                total = torch.where(is_name, name_weight * per_token, per_token).sum()
                if is_name.any():
                    at_names = logits[is_name]
                    name_class = torch.logsumexp(at_names, -1) - torch.logsumexp(at_names[:, names], -1)
                    total = total + (1.0 - name_weight) * name_class.sum()
                loss = total / max(1, targets.numel())
            else:
                count = num_items_in_batch if num_items_in_batch is not None else mask.sum()
                loss = per_token.sum() / torch.as_tensor(count, device=per_token.device).clamp(min=1)
            return (loss, None) if return_outputs else loss

    return CompletionSFTTrainer


def warm_start(model_dir: str | os.PathLike, corpus_path: str | os.PathLike, cfg: TinyModelConfig,
               index_dir: str | os.PathLike) -> dict[str, Any]:
    """Fine-tune the tiny model in `model_dir` in place on the teacher's protocol traces (TRL's SFTTrainer,
    loss on the assistant's tokens only) and record what was done in scope_tiny.json.

    The teacher (`scope_lib.teacher`) plays every role through the real rollout loop and Judge over its own
    chroma index in `index_dir` (built once per corpus and embedder, then reused). Same config and corpus give
    the same weights.
    """
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    from scope_lib.teacher import sft_passes, swappable_names, teacher_examples

    ws = cfg.warm_start
    out = Path(model_dir)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    examples, stats = teacher_examples(tokenizer, corpus_path, ws, index_dir)
    teacher_s = time.perf_counter() - started
    passes = sft_passes(examples, tokenizer, ws.epochs, ws.seed)
    dataset = Dataset.from_dict({"input_ids": [e.input_ids for e in passes],
                                 "completion_mask": [e.completion_mask for e in passes],
                                 "length": [len(e.input_ids) for e in passes]})
    longest = max(len(e.input_ids) for e in examples)
    if longest > cfg.max_position_embeddings:
        raise TinyModelError(f"model.tiny.max_position_embeddings ({cfg.max_position_embeddings}) is shorter than "
                             f"the longest teacher example ({longest} tokens)")
    threads = torch.get_num_threads()
    torch.set_num_threads(ws.threads)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        work = Path(tempfile.mkdtemp(prefix=".sft-", dir=out))
        try:
            args = SFTConfig(
                output_dir=str(work), per_device_train_batch_size=ws.batch_size, num_train_epochs=1,
                learning_rate=ws.learning_rate, lr_scheduler_type="cosine", warmup_steps=0.05, weight_decay=0.0,
                max_grad_norm=1.0, completion_only_loss=True, max_length=None, seed=ws.seed, data_seed=ws.seed,
                train_sampling_strategy="group_by_length", save_strategy="no", report_to=[], logging_steps=10,
                use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False, dataloader_num_workers=0,
                disable_tqdm=not log.isEnabledFor(logging.INFO), gradient_checkpointing=False)
            trainer = _sft_trainer_class(swappable_names(tokenizer), NAME_LOSS_WEIGHT)(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[_ProgressLog()])
            result = trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        finally:
            shutil.rmtree(work, ignore_errors=True)
            torch.set_num_threads(threads)
    model.to(torch.float32).save_pretrained(out)
    info = json.loads((out / "scope_tiny.json").read_text())
    info["warm_start"] = {
        "examples": stats.examples, "tokens": stats.tokens, "completion_tokens": stats.completion_tokens,
        "documents": stats.documents, "verdicts": stats.verdicts, "steps": result.global_step,
        "mean_loss": round(float(result.training_loss), 4),
        "last_loss": round(float(sum(losses[-5:]) / len(losses[-5:])), 4) if losses else None, "teacher_s": round(teacher_s, 1),
        "total_s": round(time.perf_counter() - started, 1)}
    (out / "scope_tiny.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("warm start: %d examples (%d tokens) in %d steps, mean loss %.3f, %.0f s",
             len(examples), sum(stats.tokens.values()), result.global_step, result.training_loss,
             time.perf_counter() - started)
    return info["warm_start"]


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where tiny builds are cached: `cache_dir`, else $SCOPE_CACHE_DIR/tiny, else ~/.cache/scope/tiny."""
    if cache_dir is not None:
        return Path(cache_dir)
    base = os.environ.get("SCOPE_CACHE_DIR")
    return (Path(os.path.expanduser(base)) if base else Path.home() / ".cache" / "scope") / "tiny"


def cache_key(corpus_path: str | os.PathLike, cfg: TinyModelConfig) -> str:
    """A short hash of the recipe version, the tiny config and the corpus lines the tokenizer reads; for a
    warm start also the whole corpus file (the teacher reads all of it) and the protocol fingerprint (prompt
    templates, task types, dialects, teacher version), so a prompt change rebuilds the model."""
    record: dict[str, Any] = {"recipe_version": RECIPE_VERSION, "config": _config_record(cfg),
                              "corpus_sha256": corpus_fingerprint(corpus_path)}
    if cfg.warm_start.enabled:
        from scope_lib.corpus import corpus_checksum
        from scope_lib.teacher import protocol_fingerprint

        record.update(warm_recipe_version=WARM_RECIPE_VERSION, name_loss_weight=NAME_LOSS_WEIGHT,
                      corpus_file_sha256=corpus_checksum(corpus_path),
                      protocol=protocol_fingerprint())
    payload = json.dumps(record, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_model_path(corpus_path: str | os.PathLike, cfg: TinyModelConfig | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny model for this corpus and config, built on first use.

    Built in a temporary directory beside the cache entry and renamed into place, so a reader never sees a
    half-written model; when two processes build at once, the first rename wins and the other build is
    discarded.
    """
    cfg = cfg or TinyModelConfig()
    root = cache_root(cache_dir)
    final = root / cache_key(corpus_path, cfg)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        build_tiny_model(tmp, corpus_path, cfg)
        if cfg.warm_start.enabled:
            warm_start(tmp, corpus_path, cfg, index_dir=root / TEACHER_INDEX_DIR / _index_name(corpus_path, cfg))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache entry is shared like any model directory
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            log.info("tiny model %s was built concurrently; using that one", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def describe_tiny(path: str | os.PathLike) -> dict[str, Any]:
    """One row about a tiny model folder: its size and, when warm-started, what the warm start did."""
    info = json.loads((Path(path) / "scope_tiny.json").read_text())
    cfg = info["config"]
    row: dict[str, Any] = {
        "model": f"Qwen3, {cfg['num_layers']} layers x {cfg['hidden_size']} wide, vocabulary {info['vocab_size']}",
        "parameters": info["parameters"], "weights": "random"}
    warm = info.get("warm_start")
    if warm:
        row.update({
            "weights": "warm-started by SFT on the scripted teacher's protocol traces (scope_lib.teacher)",
            "teacher documents": warm["documents"],
            "examples by role": ", ".join(f"{k} {v}" for k, v in warm["examples"].items()),
            "SFT steps": warm["steps"], "loss (last 5 logs)": warm["last_loss"], "build s": warm["total_s"]})
    return row


# -- loading ---------------------------------------------------------------------------------------


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


def load_model_and_tokenizer(name_or_path: str | os.PathLike, *, dtype: Any = "auto", device: str | None = "auto",
                             tiny_cfg: TinyModelConfig | None = None,
                             corpus_path: str | os.PathLike | None = None, padding_side: str = "left"):
    """(model, tokenizer) for M0: 'tiny' builds (or reuses) the offline tiny model from `corpus_path`;
    anything else is a hub id or local directory loaded with from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source: str | Path = name_or_path
    if str(name_or_path) == "tiny":
        if corpus_path is None:
            raise TinyModelError("model.base = 'tiny' needs the corpus (its tokenizer is trained on it): pass "
                                 "corpus_path, e.g. params.corpus_path")
        source = tiny_model_path(corpus_path, tiny_cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=_torch_dtype(dtype),
                                                 device_map=resolve_device(device))
    model.eval()
    return model, tokenizer
