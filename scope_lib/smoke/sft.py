"""The supervised fine-tuning both warm starts run (`smoke.warm_start`: M0 on the teacher's traces;
`smoke.judge_adapter`: the evaluation judges' adapter on M0): TRL's SFTTrainer with the loss computed here, a
full fine-tune or a LoRA adapter, seeded, logging its progress."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from scope_lib.config import WarmStartConfig
from scope_lib.smoke.teacher import swappable_names

log = logging.getLogger(__name__)


class _ProgressLog:
    """A trainer callback that logs SFT progress (loss, steps, tokens per second, time left) through `logging`:
    about ten lines a build at INFO (a report shows them), every logged step at DEBUG. The time left comes from the
    tokens still to go at the rate so far, not from the steps: the sampler serves the longest batches first, so
    the first steps take several times the average one."""

    def __new__(cls, total_tokens: int):
        import time

        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            reported = 0
            started = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if not logs or "loss" not in logs:
                    return
                tenth = 10 * state.global_step // max(1, state.max_steps)
                level = logging.INFO if tenth > self.reported else logging.DEBUG
                self.reported = max(self.reported, tenth)
                seen, elapsed = state.num_input_tokens_seen, time.perf_counter() - self.started
                rate = seen / elapsed if seen and elapsed > 0 else 0.0
                left = f", about {(total_tokens - seen) / rate / 60:.0f} min left" if rate else ""
                log.log(level, "warm start step %d/%d: loss %.3f, %.0f tokens/s%s", state.global_step,
                        state.max_steps, logs["loss"], rate, left)

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
            if hasattr(model, "get_base_model"):     # a PEFT model (LoRA warm start): its adapters sit inside
                model = model.get_base_model()
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


def sft_threads(wanted: int) -> int:
    """The SFT's torch threads: `wanted` (`threads` of the warm start or the judge adapter), at most
    $OMP_NUM_THREADS when that is set. A process told to use one thread (a test worker beside another on a
    2-core machine) keeps to it: two threads on a core another process keeps busy spin against it and build
    several times slower. The weights do not depend on the thread count."""
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(wanted, int(cap)) if cap.isdigit() and int(cap) > 0 else wanted


def sft(source: str | os.PathLike, passes: list, tokenizer, ws: WarmStartConfig, *, work_dir: str | os.PathLike):
    """TRL's SFTTrainer on `passes` (`teacher.sft_passes`: loss on the completion tokens only) over the model in
    `source`: every weight (`ws.method: full`) or a new LoRA adapter (`lora`; the returned model is then a
    PeftModel). Seeded by `ws.seed`, on `ws.threads` torch threads (`sft_threads`); scratch files go to a
    temporary folder in `work_dir`. Returns (model, what the SFT did: tokens, steps, mean loss, mean of the last five logged losses)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    dataset = Dataset.from_dict({"input_ids": [e.input_ids for e in passes],
                                 "completion_mask": [e.completion_mask for e in passes],
                                 "length": [len(e.input_ids) for e in passes]})
    threads = torch.get_num_threads()
    torch.set_num_threads(sft_threads(ws.threads))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ws.seed)
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        if ws.method == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=ws.lora_rank, lora_alpha=2 * ws.lora_rank,
                                                     target_modules="all-linear", task_type="CAUSAL_LM"))
        work = Path(tempfile.mkdtemp(prefix=".sft-", dir=work_dir))
        try:
            args = SFTConfig(
                output_dir=str(work), per_device_train_batch_size=ws.batch_size, num_train_epochs=1,
                learning_rate=ws.learning_rate, lr_scheduler_type="cosine", warmup_steps=0.05, weight_decay=0.0,
                max_grad_norm=1.0, completion_only_loss=True, max_length=None, seed=ws.seed, data_seed=ws.seed,
                train_sampling_strategy="group_by_length", save_strategy="no", report_to=[], logging_steps=10,
                use_cpu=not torch.cuda.is_available(), bf16=False, fp16=False, dataloader_num_workers=0,
                disable_tqdm=not log.isEnabledFor(logging.INFO), gradient_checkpointing=False,
                include_num_input_tokens_seen="non_padding")
            trainer_class = _sft_trainer_class(swappable_names(tokenizer), ws.name_loss_weight)
            trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                    callbacks=[_ProgressLog(sum(len(e.input_ids) for e in passes))])
            result = trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        finally:
            shutil.rmtree(work, ignore_errors=True)
            torch.set_num_threads(threads)
    return model, {"sft_tokens": sum(len(e.input_ids) for e in passes), "steps": result.global_step,
                   "mean_loss": round(float(result.training_loss), 4),
                   "last_loss": round(float(sum(losses[-5:]) / len(losses[-5:])), 4) if losses else None}
