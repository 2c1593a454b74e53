"""The smoke model's warm start: the tiny model fine-tuned on the scripted teacher's protocol traces
(`scope_lib.smoke.teacher`), so that it writes tasks, searches, answers, rubrics and grades in the protocol.

    params = prepare(params)     # build (or reuse) the warm-started model; the loader then loads it

Not in the paper: a random tiny model writes nothing parseable, so the smoke run warm-starts one. Built
deterministically and cached by corpus, configuration and a fingerprint of the prompts and the teacher.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from scope_lib.config import Params, TinyModelConfig
from scope_lib.models.tiny import TinyModelError, build_tiny_model, cache_key, cache_root, read_passages
from scope_lib.retrieval.corpus import corpus_checksum
from scope_lib.runs import build_directory
from scope_lib.smoke.teacher import (
    protocol_fingerprint,
    protocol_texts,
    sft_passes,
    swappable_names,
    teacher_examples,
)

log = logging.getLogger(__name__)


#: Bump when the warm start's SFT recipe changes (the teacher has its own TEACHER_VERSION).
WARM_RECIPE_VERSION = 2


#: Where a name comes, the share of the warm start's loss on WHICH name (the rest is on "a name comes here";
#: `_sft_trainer_class`). Without the class term a tiny model spreads its guess over a thousand names, and a
#: single protocol word ("Plan" after <search>) outweighs each of them: on 16 held-out documents the class term
#: took the Challenger's task rate from 0.72 to 0.92 and the Solver's answer rate from 0.70 to 0.86.
NAME_LOSS_WEIGHT = 0.1


#: Folder (under the cache root) of the teacher's retrieval indexes, one per corpus and embedder.
TEACHER_INDEX_DIR = "_teacher_index"


def _index_name(corpus_path: str | os.PathLike, cfg: TinyModelConfig) -> str:
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

    The teacher (`scope_lib.smoke.teacher`) plays every role through the real rollout loop and Judge over its own
    chroma index in `index_dir` (built once per corpus and embedder, then reused). Same config and corpus give
    the same weights.
    """
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

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


def warm_cache_key(corpus_path: str | os.PathLike, cfg: TinyModelConfig) -> str:
    """The warm-started model's cache key: the tiny model's (`models.tiny.cache_key`) plus the warm-start settings
    (never the SFT thread count: 1 and 2 threads gave bit-identical weights), the whole corpus file (the teacher
    reads all of it) and the protocol fingerprint (prompt templates, task types, dialects, the teacher), so a
    prompt change rebuilds the model."""
    return cache_key(corpus_path, cfg, warm_start=cfg.warm_start.model_dump(mode="json", exclude={"threads"}),
                     warm_recipe_version=WARM_RECIPE_VERSION, name_loss_weight=NAME_LOSS_WEIGHT,
                     corpus_file_sha256=corpus_checksum(corpus_path), protocol=protocol_fingerprint())


def build_protocol_model(out_dir: str | os.PathLike, corpus_path: str | os.PathLike, cfg: TinyModelConfig) -> Path:
    """The warm start's starting point: a tiny model whose tokenizer is trained on the corpus and on the
    protocol's fixed phrases (`teacher.protocol_texts`, so they become few tokens), with random weights."""
    passages, _ = read_passages(Path(corpus_path))
    return build_tiny_model(out_dir, corpus_path, cfg, extra_texts=protocol_texts(passages, cfg.warm_start.seed))


def warm_model_path(corpus_path: str | os.PathLike, cfg: TinyModelConfig,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached warm-started tiny model for this corpus and config (`warm_cache_key`), built on first use:
    `build_protocol_model`, then the warm start's SFT (`warm_start`)."""
    root = cache_root(cache_dir)

    def build(tmp: Path) -> None:
        build_protocol_model(tmp, corpus_path, cfg)
        warm_start(tmp, corpus_path, cfg, index_dir=root / TEACHER_INDEX_DIR / _index_name(corpus_path, cfg))

    return build_directory(root / warm_cache_key(corpus_path, cfg), build)


def prepare(params: Params, cache_dir: str | os.PathLike | None = None) -> Params:
    """Build (or reuse) every model of the run that the loader cannot build itself, and record it on `params`
    (`Params.use_local_model`): today the warm-started tiny model when `model.tiny.warm_start.enabled`. Call it
    before anything loads a model; a no-op for every other run. Returns `params`."""
    j = params.judge
    if params.model.tiny.warm_start.enabled and "tiny" in (params.model.base, j.model, j.rubric_model,
                                                            j.grader_model):
        params.use_local_model("tiny", warm_model_path(params.corpus_path, params.model.tiny, cache_dir))
    return params
