"""The local evaluation judges as a LoRA adapter on M0 (`evaluation.judge_adapter`; CPU demos only, not in the
paper, whose benchmark judges are other models than M0).

When M0 is also the benchmark judge (`evaluation.judge_backend: local`), what teaches its judge prompts
(`smoke.eval_judge_teacher`) can be trained into an adapter instead of into M0: the short-form QA judge and the
criterion grader then improve without changing the weights the Challenger, the Solver and the self-play Judge
share, so a run, its held-out learning check and the warm start stay as they were. The traces come from the
warm start's teacher documents and settings (`model.warm_start`: documents, seed, fact lengths, sentence
grades), the same ones M0's warm start teaches with `eval_judges`; the adapter's own settings say how many times
each role's traces are seen and how it is trained.

    params = prepare(params, judges=True)   # smoke.warm_start: M0, then this adapter; make_benchmark_judge uses it

Built once per M0, corpus and settings, cached beside the warm-started models (`judge_adapter_path`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from scope_lib.config import JudgeAdapterConfig, WarmStartConfig
from scope_lib.config import cache_dir as scope_cache_dir
from scope_lib.retrieval.corpus import corpus_checksum, read_corpus, teacher_documents
from scope_lib.runs import build_directory
from scope_lib.smoke import eval_judge_teacher
from scope_lib.smoke.sft import sft
from scope_lib.smoke.teacher import TeacherStats, sft_passes

log = logging.getLogger(__name__)

#: What the adapter's SFT did (examples, steps, loss, time), written beside it.
ADAPTER_INFO = "scope_judge_adapter.json"


def adapter_settings(ws: WarmStartConfig, cfg: JudgeAdapterConfig) -> WarmStartConfig:
    """The warm start's teacher settings with the adapter's training settings: a LoRA of `cfg.lora_rank`, its
    rate, passes, batch and threads, each judge role repeated `cfg.repeats` times, plain cross-entropy."""
    return ws.model_copy(update={
        "method": "lora", "lora_rank": cfg.lora_rank, "learning_rate": cfg.learning_rate, "epochs": cfg.epochs,
        "batch_size": cfg.batch_size, "threads": cfg.threads, "role_repeats": dict(cfg.repeats),
        "name_swap_share": 0.0, "name_loss_weight": 1.0})


def adapter_key(m0: str | os.PathLike, corpus_path: str | os.PathLike, ws: WarmStartConfig,
                cfg: JudgeAdapterConfig) -> str:
    """The adapter's cache key: M0 (its folder name, which is its own cache key for a warm-started model, and its
    config), the corpus file, the teacher settings the traces depend on, the adapter's settings and what the
    traces are made of (`eval_judge_teacher.fingerprint`)."""
    m0 = Path(m0)
    record = {"m0": m0.name, "m0_config": hashlib.sha256((m0 / "config.json").read_bytes()).hexdigest(),
              "corpus_file_sha256": corpus_checksum(corpus_path),
              "teacher": ws.model_dump(mode="json", include={"documents", "held_out_share", "seed", "fact_max_tokens",
                                                             "sentence_grades"}),
              "adapter": cfg.model_dump(mode="json", exclude={"enabled", "threads"}),
              "traces": eval_judge_teacher.fingerprint()}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def train_judge_adapter(m0: str | os.PathLike, corpus_path: str | os.PathLike, ws: WarmStartConfig,
                        cfg: JudgeAdapterConfig, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Train the adapter on M0 in `m0` and save it (PEFT's adapter files) with ADAPTER_INFO in `out_dir`."""
    from transformers import AutoTokenizer

    started, out = time.perf_counter(), Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(m0))
    documents = teacher_documents(read_corpus(corpus_path).passages, ws)
    traces = eval_judge_teacher.eval_judge_traces(tokenizer, documents, ws)
    if not traces:
        raise ValueError(f"evaluation.judge_adapter: the teacher wrote no judge traces from {len(documents)} "
                         "documents (each needs four names or years)")
    stats = TeacherStats(documents=len(documents))
    for trace in traces:
        stats.add(trace.example)
        stats.count(trace.role, trace.verdict)
    settings = adapter_settings(ws, cfg)
    passes = sft_passes([t.example for t in traces], tokenizer, settings)
    model, trained = sft(m0, passes, tokenizer, settings, work_dir=out)
    model.save_pretrained(str(out))
    info = {"m0": Path(m0).name, "examples": stats.examples, "verdicts": stats.verdicts, **trained,
            "total_s": round(time.perf_counter() - started, 1)}
    (out / ADAPTER_INFO).write_text(json.dumps(info, indent=2) + "\n")
    log.info("evaluation judge adapter: %d traces, %d steps, mean loss %.3f, %.0f s", len(traces),
             trained["steps"], trained["mean_loss"], time.perf_counter() - started)
    return info


def judge_adapter_path(m0: str | os.PathLike, corpus_path: str | os.PathLike, ws: WarmStartConfig,
                       cfg: JudgeAdapterConfig, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached adapter for M0 in folder `m0` (`adapter_key`), trained on first use (`train_judge_adapter`)."""
    root = Path(cache_dir) if cache_dir is not None else scope_cache_dir("warm")
    final = root / f"{Path(m0).name[:48]}-judge-{adapter_key(m0, corpus_path, ws, cfg)}"
    return build_directory(final, lambda tmp: train_judge_adapter(m0, corpus_path, ws, cfg, tmp),
                           marker=ADAPTER_INFO)
