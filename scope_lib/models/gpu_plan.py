"""`scope plan`: GPU memory of a SCOPE run, per GPU, before any GPU is rented.

    report = plan_gpu(params, gpu_gib=80, gpus=1)
    print(report.table()); report.fits

Arithmetic from the model's architecture (its config.json, or the table below for the paper's models):

- weights: parameters × bytes of `model.dtype`; with Unsloth's 4-bit loading (`model.unsloth.load_in_4bit`)
  the projections of every layer take NF4's 0.516 bytes per weight (embeddings and norms keep `model.dtype`);
- LoRA (`model.finetuning: lora`): the adapters on all seven linear projections of every layer, float32; the
  trained one with its gradient and two AdamW moments (16 bytes per parameter), the frozen other one 4 bytes;
- full fine-tuning: the trained copy with bf16 gradients, a float32 master copy and AdamW (16 bytes per
  parameter) sharded over the GPUs (ZeRO-3 / FSDP), plus the frozen M0 (Judge and reference);
- activations of one micro-batch (`grpo.per_device_batch_size` rows of prompt + response tokens): with gradient
  checkpointing the input of every layer plus one layer recomputed with its gradients; without it every
  layer's intermediates. The log-probabilities are computed in chunks (TRL's fused LM head), so no
  vocabulary-sized logits are kept;
- generation: vLLM holds its own copy of the weights in `model.dtype` (Unsloth's `fast_inference` shares the
  trainer's) and a KV cache of 2 × layers × KV heads × head dim × 2 bytes per token; the HF engine needs the
  KV cache of one generation chunk (`engine.max_batch_size` rollouts, all of them when unset).

With vLLM sleeping while the trainer steps (level 1, the base never changes), the two phases peak separately;
without sleep they add up. Estimates, not measurements: leave the headroom the table shows.

Several GPUs (`layout`, issue 24; accelerate/<layout>.yaml): `ddp` keeps everything whole on every GPU; `zero2`
shards gradients and optimizer state (weights whole); `fsdp2` and `zero3` shard weights, gradients and optimizer
state, plus two gathered layers in flight (the one computing, the one prefetched). `plan_serving` is one
`vllm serve` over `tensor_parallel` GPUs (weights split, KV cache in the rest); `plan_cluster` tries every layout
on a cluster split into trainer GPUs and serving GPUs and says which fit.

    plan_cluster(params, gpus=8, gpu_gib=80)   # `scope plan --cluster 8`
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from scope_lib.config import Params, ParamsError

GIB = 1024 ** 3
#: Share of a GPU a plan may fill (CUDA context, allocator fragmentation and NCCL buffers take the rest).
USABLE = 0.92


@dataclass(frozen=True)
class Architecture:
    """What memory depends on in a decoder-only transformer (Qwen2/3, OLMo, Llama shapes)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.linear_parameters + self.layers * 2 * self.hidden + self.hidden

    @property
    def linear_parameters(self) -> int:
        """The seven projections of every layer (what 4-bit loading quantizes; embeddings and norms are not)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (h * q + 2 * h * kv + q * h + 3 * h * self.intermediate)

    def lora_parameters(self, rank: int) -> int:
        """r × (in + out) for q, k, v, o, gate, up and down in every layer ("all-linear", lm_head excluded)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
        return self.layers * sum(rank * (a + b) for a, b in shapes)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_config(cls, config: dict) -> Architecture:
        text = config.get("text_config", config)
        heads = text["num_attention_heads"]
        return cls(layers=text["num_hidden_layers"], hidden=text["hidden_size"],
                   intermediate=text["intermediate_size"], heads=heads,
                   kv_heads=text.get("num_key_value_heads") or heads,
                   head_dim=text.get("head_dim") or text["hidden_size"] // heads, vocab=text["vocab_size"],
                   tied_embeddings=bool(text.get("tie_word_embeddings", False)))


#: The paper's models and the judge-scaling sizes, from their published config.json files.
KNOWN: dict[str, Architecture] = {
    "Qwen/Qwen3-8B": Architecture(36, 4096, 12288, 32, 8, 128, 151936),
    "Qwen/Qwen3-4B": Architecture(36, 2560, 9728, 32, 8, 128, 151936, tied_embeddings=True),
    "Qwen/Qwen3-8B-Base": Architecture(36, 4096, 12288, 32, 8, 128, 151936),   # SPICE's base models (§3.1)
    "Qwen/Qwen3-4B-Base": Architecture(36, 2560, 9728, 32, 8, 128, 151936, tied_embeddings=True),
    "Qwen/Qwen3-1.7B": Architecture(28, 2048, 6144, 16, 8, 128, 151936, tied_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": Architecture(28, 3584, 18944, 28, 4, 128, 152064),
    "allenai/Olmo-3-7B-Instruct": Architecture(32, 4096, 11008, 32, 32, 128, 100278),
}

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
#: Bytes per weight of bitsandbytes NF4 with double quantization (Unsloth's 4-bit loading): 4 bits, an 8-bit
#: scale per block of 64 weights, and a float32 scale per 256 of those scales.
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8


def architecture(params: Params) -> Architecture:
    """The architecture of `model.base`: the tiny model's config, a local folder's config.json, or KNOWN."""
    name = params.model.base
    if name == "tiny":
        t = params.model.tiny
        return Architecture(t.num_layers, t.hidden_size, 3 * t.hidden_size, t.num_heads, max(1, t.num_heads // 2),
                            t.hidden_size // t.num_heads, t.vocab_size, tied_embeddings=True)
    config = Path(name) / "config.json"
    if config.is_file():
        return Architecture.from_config(json.loads(config.read_text()))
    if name in KNOWN:
        return KNOWN[name]
    raise ParamsError(f"model.base {name!r}: no config.json there and not one of {', '.join(KNOWN)}; point "
                      "model.base at a local model folder to plan its memory")


@dataclass
class PlanRow:
    item: str
    gib: float
    phase: str          # "train", "generate" or "both"
    note: str = ""


@dataclass
class GpuPlan:
    """Per-GPU memory by item and the two phase peaks; `fits` when both stay within USABLE of the GPU."""

    model: str
    gpu_gib: float
    gpus: int
    rows: list[PlanRow] = field(default_factory=list)
    sleep: bool = True
    advice: list[str] = field(default_factory=list)
    vllm: tuple[float, float, int] | None = None   # (its share in GiB, its weights in GiB, one rollout's tokens)
    layout: str = "ddp"

    @property
    def resident(self) -> float:
        """What the trainer keeps on the GPU in both phases."""
        return sum(r.gib for r in self.rows if r.phase == "both")

    def _sum(self, phase: str) -> float:
        return sum(r.gib for r in self.rows if r.phase in (phase, "both"))

    @property
    def train_peak(self) -> float:
        extra = 0.0 if self.sleep else sum(r.gib for r in self.rows if r.phase == "generate")
        return self._sum("train") + extra

    @property
    def generate_peak(self) -> float:
        return self._sum("generate")

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.generate_peak)

    @property
    def fits(self) -> bool:
        if self.vllm is not None:
            share, own, _ = self.vllm
            if share <= own:  # no room for any KV cache
                return False
        return self.peak <= USABLE * self.gpu_gib

    def table(self) -> str:
        lines = [f"GPU memory plan: {self.model} on {self.gpus} GPU(s) of {self.gpu_gib:.0f} GiB, {self.layout} "
                 f"(vLLM sleeps while training: {'yes' if self.sleep else 'no'})", "",
                 "| item | GiB per GPU | phase | note |", "|---|---|---|---|"]
        lines += [f"| {r.item} | {r.gib:.2f} | {r.phase} | {r.note} |" for r in self.rows]
        lines += ["", f"training peak {self.train_peak:.1f} GiB, generation peak {self.generate_peak:.1f} GiB, "
                  f"usable {USABLE * self.gpu_gib:.1f} GiB: {'FITS' if self.fits else 'DOES NOT FIT'}"]
        lines += [f"- {a}" for a in self.advice]
        return "\n".join(lines)


def plan_gpu(params: Params, *, gpu_gib: float = 80.0, gpus: int = 1, engine: str | None = None,
             sleep: bool = True, layout: str | None = None) -> GpuPlan:
    """The per-GPU memory plan of `params` on `gpus` trainer GPUs of `gpu_gib` GiB (see the module docstring).
    `layout`: ddp, zero2, fsdp2 or zero3 (default: ddp for LoRA, zero3 for full fine-tuning)."""
    arch = architecture(params)
    engine = engine or params.engine.backend
    b = DTYPE_BYTES[params.model.dtype]
    p = arch.parameters
    unsloth = params.model.unsloth if params.model.loader == "unsloth" else None
    report = GpuPlan(params.model.base, gpu_gib, gpus, sleep=sleep)
    add = report.rows.append
    weights = p * b / GIB
    layout = layout or ("ddp" if params.model.finetuning == "lora" else "zero3")
    if layout not in LAYOUTS:
        raise ParamsError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    report.layout = layout
    sharded = layout in SHARDED and gpus > 1
    split = gpus if sharded else 1   # how many GPUs the weights are split over
    if params.model.finetuning == "lora":
        lora = arch.lora_parameters(params.model.lora_rank)
        if unsloth is not None and unsloth.load_in_4bit:
            q = arch.linear_parameters
            add(PlanRow("base weights M0 (Judge, reference), 4-bit", (q * NF4_BYTES + (p - q) * b) / GIB, "both",
                        f"{q / 1e9:.2f}B projection weights in NF4 ({NF4_BYTES:.3f} B), the other "
                        f"{(p - q) / 1e9:.2f}B x {b} B"))
        else:
            add(PlanRow("base weights M0 (Judge, reference)", weights / split, "both",
                        f"{p / 1e9:.2f}B parameters x {b} B" + (f", sharded over {gpus} GPUs" if sharded else "")))
        add(PlanRow("trained adapter + gradient + AdamW (fp32)", 16 * lora / GIB / split, "both",
                    f"{lora / 1e6:.1f}M LoRA parameters (r={params.model.lora_rank}) x 16 B"))
        if not params.model.shared_policy:  # one policy for both roles (SPICE, SSP): no second adapter
            add(PlanRow("frozen second adapter (fp32)", 4 * lora / GIB / split, "both", ""))
    elif layout == "ddp":
        add(PlanRow("trained copy: bf16 weights and gradients, fp32 master, AdamW", 16 * p / GIB, "both",
                    "16 B per parameter on every GPU (DDP)"))
        add(PlanRow("frozen M0 (Judge, reference)", weights, "both", "whole on every GPU"))
    elif layout == "zero2":
        add(PlanRow("trained copy: bf16 weights; gradients, fp32 master, AdamW sharded", (2 + 14 / gpus) * p / GIB,
                    "both", f"2 B per parameter whole + 14 B sharded over {gpus} GPU(s) (ZeRO-2)"))
        add(PlanRow("frozen M0 (Judge, reference)", weights, "both", "whole on every GPU"))
    else:
        add(PlanRow("trained copy: bf16 weights and gradients, fp32 master, AdamW", 16 * p / GIB / gpus, "both",
                    f"16 B per parameter, sharded over {gpus} GPU(s) (ZeRO-3 / FSDP)"))
        add(PlanRow("frozen M0 (Judge, reference)", weights / gpus, "both", "sharded with the trainer"))
    if sharded:
        add(PlanRow("gathered layers in flight", 2 * arch.linear_parameters / arch.layers * b / GIB, "train",
                    f"{layout}: one layer computing, the next prefetched, whole"))
    rows, tokens = _micro_batch(params)
    add(PlanRow("activations of one micro-batch", _activations(arch, rows, tokens, b,
                                                               params.grpo.gradient_checkpointing) / GIB, "train",
                f"{rows} row(s) x {tokens} tokens, checkpointing {'on' if params.grpo.gradient_checkpointing else 'off'}"))
    context = _context(params)
    if engine == "vllm":
        shared = unsloth is not None and unsloth.fast_inference
        share = params.engine.gpu_memory_utilization * report.gpu_gib
        own = 0.0 if shared else weights  # a vLLM engine of its own loads M0 in model.dtype
        kv_tokens = max(0.0, share - own) * GIB / arch.kv_bytes_per_token()
        add(PlanRow("vLLM: weights + KV cache", share, "generate",
                    f"engine.gpu_memory_utilization x GPU; KV for {kv_tokens / 1e3:.0f}k tokens = "
                    f"{kv_tokens / context:.1f} concurrent {context}-token rollouts"
                    + (" (weights shared with the trainer: Unsloth fast_inference)" if shared else "")))
        report.vllm = (share, own, context)
    elif engine == "openai":
        add(PlanRow("generation", 0.0, "generate", "served on other GPUs (engine.base_url, vllm serve)"))
    else:
        chunk = params.engine.max_batch_size or params.solver.batch_size * params.grpo.group_size
        add(PlanRow("HF generation KV cache", chunk * context * arch.kv_bytes_per_token(b) / GIB, "generate",
                    f"{chunk} rollouts per generate call (engine.max_batch_size) x {context} tokens"))
    _advise(report, params, engine)
    return report


LAYOUTS = ("ddp", "zero2", "fsdp2", "zero3")
SHARDED = ("fsdp2", "zero3")   # the weights themselves are split: every rank takes part in every forward
#: Share of a serving GPU `vllm serve` takes (its --gpu-memory-utilization default).
SERVING_SHARE = 0.9


@dataclass
class ServingPlan:
    """One `vllm serve` of M0 with tensor parallelism over `tensor_parallel` GPUs, per GPU."""

    model: str
    gpu_gib: float
    tensor_parallel: int
    weights_gib: float        # per GPU
    kv_gib: float             # per GPU
    rollouts: float           # concurrent full-length rollouts the whole server's KV cache holds
    context: int

    @property
    def fits(self) -> bool:
        return self.kv_gib > 0 and self.rollouts >= 1

    def line(self) -> str:
        return (f"vllm serve, tensor parallel {self.tensor_parallel}: {self.weights_gib:.1f} GiB weights + "
                f"{self.kv_gib:.1f} GiB KV cache per GPU = {self.rollouts:.0f} concurrent {self.context}-token "
                f"rollouts: {'FITS' if self.fits else 'DOES NOT FIT'}")


def plan_serving(params: Params, *, gpu_gib: float = 80.0, tensor_parallel: int = 1) -> ServingPlan:
    """M0 served by vLLM over `tensor_parallel` GPUs: weights split over them, KV cache (split by KV heads) in
    the rest of `SERVING_SHARE` of each GPU."""
    arch = architecture(params)
    weights = arch.parameters * DTYPE_BYTES[params.model.dtype] / GIB / tensor_parallel
    kv = SERVING_SHARE * gpu_gib - weights
    context = _context(params)
    rollouts = max(0.0, kv) * GIB * tensor_parallel / arch.kv_bytes_per_token() / context
    return ServingPlan(params.model.base, gpu_gib, tensor_parallel, weights, kv, rollouts, context)


@dataclass
class ClusterOption:
    name: str
    trainer_gpus: int
    serving_gpus: int
    train: GpuPlan
    serving: ServingPlan | None

    @property
    def fits(self) -> bool:
        return self.train.fits and (self.serving is None or self.serving.fits)


def plan_cluster(params: Params, *, gpus: int, gpu_gib: float = 80.0) -> list[ClusterOption]:
    """Every layout of `params` on `gpus` GPUs: the trainer on one GPU with vLLM beside it, then each accelerate
    layout on half the GPUs with M0 served on the other half (tensor parallelism as small as fits; one server
    per group, `engine.base_url: [...]`). The paper's split for 7-8B: 4 GPUs training, 2-4 serving."""
    options = [ClusterOption("1 GPU, vLLM beside the trainer (sleeps while it steps)", 1, 0,
                             plan_gpu(params, gpu_gib=gpu_gib, gpus=1, engine="vllm", layout="ddp"), None)]
    if gpus < 2:
        return options
    train_gpus, serve_gpus = (gpus + 1) // 2, gpus // 2
    tp = next((t for t in (1, 2, 4, 8) if t <= serve_gpus and plan_serving(params, gpu_gib=gpu_gib,
                                                                             tensor_parallel=t).fits), serve_gpus)
    serving = plan_serving(params, gpu_gib=gpu_gib, tensor_parallel=tp)
    for layout in LAYOUTS:
        servers = max(1, serve_gpus // tp)
        options.append(ClusterOption(
            f"{layout} on {train_gpus} GPUs + {servers} vllm serve x TP {tp} on {serve_gpus} GPUs", train_gpus,
            serve_gpus, plan_gpu(params, gpu_gib=gpu_gib, gpus=train_gpus, engine="openai", layout=layout),
            serving))
    return options


def cluster_table(params: Params, options: list[ClusterOption]) -> str:
    fits = [o for o in options if o.fits]
    lines = [f"Layouts for {params.model.base} ({params.model.finetuning}) on {options[-1].trainer_gpus + options[-1].serving_gpus} "
             f"GPU(s) of {options[0].train.gpu_gib:.0f} GiB", "",
             "| layout | trainer peak GiB per GPU | serving | fits |", "|---|---|---|---|"]
    for o in options:
        serving = o.serving.line().split(": ")[0] if o.serving else "vLLM on the trainer's GPU"
        lines.append(f"| {o.name} | {o.train.peak:.1f} | {serving} | {'yes' if o.fits else 'no'} |")
    lines.append("")
    if fits:
        roomy = min(fits, key=lambda o: o.train.peak)
        lines.append(f"fits: {fits[0].name} (the fewest GPUs, least sharding)")
        lines.append(f"most headroom: {roomy.name} ({USABLE * roomy.train.gpu_gib - roomy.train.peak:.1f} GiB "
                     "per trainer GPU)")
    else:
        lines.append("no layout fits: use LoRA (model.finetuning: lora), more GPUs, or bigger ones")
    return "\n".join(lines)


def _context(params: Params) -> int:
    return min(params.model.max_model_len, max(params.challenger.max_prompt_tokens, params.solver.max_prompt_tokens)
               + max(params.challenger.max_response_tokens, params.solver.max_response_tokens))


def _micro_batch(params: Params) -> tuple[int, int]:
    """Rows and tokens of the largest training micro-batch (the Solver's, whose rows are longest)."""
    tokens = max(min(params.model.max_model_len, r.max_prompt_tokens + r.max_response_tokens)
                 for r in (params.challenger, params.solver))
    return params.grpo.per_device_batch_size, tokens


def _activations(arch: Architecture, rows: int, tokens: int, b: int, checkpointing: bool) -> float:
    """Bytes of activations kept for the backward pass of one micro-batch (an estimate)."""
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    per_token_layer = b * (4 * arch.hidden + q + 2 * kv + 3 * arch.intermediate)  # norms, qkv, attention out, MLP
    if checkpointing:
        saved = rows * tokens * arch.hidden * b * arch.layers
        return saved + 2 * rows * tokens * per_token_layer
    return rows * tokens * per_token_layer * arch.layers


def _advise(report: GpuPlan, params: Params, engine: str) -> None:
    usable = USABLE * report.gpu_gib
    if report.layout in SHARDED and report.gpus > 1 and engine == "hf":
        report.advice.append(f"{report.layout} shards the weights: generate with served M0 (engine.backend: openai "
                             "with engine.base_url: [...]); engine.backend: hf cannot generate on one rank")
    if report.fits:
        report.advice.append(f"headroom {usable - report.peak:.1f} GiB per GPU")
        return
    if params.model.finetuning == "full":
        report.advice.append("full fine-tuning keeps 16 B per parameter: use LoRA (model.finetuning: lora) on one "
                             "GPU, or more GPUs with ZeRO-3 / FSDP (scope train launches them per stage)")
    if report.train_peak > usable:
        report.advice.append("the training phase is over: lower grpo.per_device_batch_size or keep "
                             "grpo.gradient_checkpointing on")
    if report.generate_peak > usable:
        if engine == "vllm":
            room = (usable - report.resident) / report.gpu_gib
            report.advice.append(f"the generation phase is over: set engine.gpu_memory_utilization to at most "
                                 f"{room:.2f} (what the trainer leaves), or serve inference on other GPUs "
                                 "(engine.backend: openai with vllm serve)")
        else:
            report.advice.append("the generation phase is over: set engine.max_batch_size (rollouts per generate "
                                 "call), or generate with vLLM")
    if not report.sleep:
        report.advice.append("let vLLM sleep while the trainer steps (the phases then peak separately)")
