"""`scope plan`: GPU memory arithmetic against the figures worked out by hand for Qwen3-8B (36 layers, hidden
4096, MLP 12288, 32 query and 8 KV heads of 128, vocabulary 151,936), and refusals of what cannot fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scope_lib.cli import main
from scope_lib.config import ParamsError, load_params
from scope_lib.models.gpu_plan import GIB, KNOWN, Architecture, architecture, plan_gpu

REPO = Path(__file__).resolve().parents[1]


def qwen3(*overrides):
    return load_params(REPO / "params" / "qwen3-8b.yaml", list(overrides))


def test_qwen3_8b_arithmetic():
    arch = KNOWN["Qwen/Qwen3-8B"]
    assert arch.parameters / 1e9 == pytest.approx(8.19, abs=0.01)
    # LoRA r=64 on q, k, v, o, gate, up, down: per layer 0.52 + 0.33 + 0.33 + 0.52 + 3 x 1.05 M
    assert arch.lora_parameters(64) / 1e6 == pytest.approx(174.6, abs=0.1)
    assert arch.kv_bytes_per_token() == 144 * 1024                    # 2 x 36 x 8 x 128 x 2 B
    rows = {r.item: r.gib for r in plan_gpu(qwen3()).rows}
    assert rows["base weights M0 (Judge, reference)"] * GIB / 1e9 == pytest.approx(16.4, abs=0.05)
    assert rows["trained adapter + gradient + AdamW (fp32)"] * GIB / 1e9 == pytest.approx(2.79, abs=0.01)
    assert rows["frozen second adapter (fp32)"] * GIB / 1e9 == pytest.approx(0.70, abs=0.01)


def test_the_default_lora_run_fits_one_h100_and_the_paper_full_run_does_not():
    report = plan_gpu(qwen3(), gpu_gib=80)
    assert report.fits and "headroom" in report.advice[0]
    assert report.generate_peak == pytest.approx(report.resident + 0.6 * 80)
    greedy = plan_gpu(qwen3("engine.gpu_memory_utilization=0.85", "grpo.per_device_batch_size=8"), gpu_gib=80)
    assert not greedy.fits and any("gpu_memory_utilization to at most 0.6" in a for a in greedy.advice)
    full = plan_gpu(qwen3("model.finetuning=full"), gpu_gib=80)
    assert not full.fits and any("LoRA" in a for a in full.advice)
    sharded = plan_gpu(qwen3("model.finetuning=full", "engine.backend=openai"), gpu_gib=80, gpus=8)
    assert sharded.fits and sharded.train_peak < full.train_peak / 4
    awake = plan_gpu(qwen3(), gpu_gib=80, sleep=False)
    assert awake.train_peak == pytest.approx(report.train_peak + 0.6 * 80)
    hf = plan_gpu(qwen3("engine.backend=hf"), gpu_gib=80)
    assert not hf.fits and any("engine.max_batch_size" in a for a in hf.advice)   # 2048 rollouts at once
    assert plan_gpu(qwen3("engine.backend=hf", "engine.max_batch_size=16"), gpu_gib=80).fits


def test_architecture_from_a_local_config_the_tiny_model_or_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}))
    arch = architecture(load_params(None, {"model.base": str(tmp_path)}))
    assert arch == Architecture(2, 64, 192, 4, 2, 16, 1000, True)
    smoke = load_params(REPO / "params" / "smoke.yaml")
    assert architecture(smoke).layers == smoke.model.tiny.num_layers
    with pytest.raises(ParamsError, match="config.json"):
        architecture(load_params(None, {"model.base": "someone/unknown-model"}))


def test_scope_plan_exits_1_when_it_cannot_fit(capsys):
    assert main(["plan", "--params", str(REPO / "params" / "qwen3-8b.yaml")]) == 0
    assert "FITS" in capsys.readouterr().out
    assert main(["plan", "--params", str(REPO / "params" / "qwen3-8b.yaml"), "-o", "model.finetuning=full"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_unsloth_4bit_and_fast_inference_in_the_plan():
    """4-bit loading: the 6.95B projection weights of Qwen3-8B in NF4 with double quantization (4 + 8/64 +
    32/16384 bits = 0.516 B each), the other 1.24B (embeddings, lm_head, norms) in bf16: 3.58 + 2.49 = 6.07 GB
    instead of 16.4. fast_inference: vLLM shares the trainer's weights, so its share is all KV cache."""
    arch = KNOWN["Qwen/Qwen3-8B"]
    assert arch.linear_parameters / 1e9 == pytest.approx(6.95, abs=0.01)
    rows = {r.item: r.gib for r in plan_gpu(qwen3("model.loader=unsloth", "model.unsloth.load_in_4bit=true")).rows}
    assert rows["base weights M0 (Judge, reference), 4-bit"] * GIB / 1e9 == pytest.approx(6.07, abs=0.01)
    plain = plan_gpu(qwen3())
    four_bit = plan_gpu(qwen3("model.loader=unsloth", "model.unsloth.load_in_4bit=true"))
    assert plain.train_peak - four_bit.train_peak == pytest.approx((16.38e9 - 6.07e9) / GIB, abs=0.02)
    assert four_bit.generate_peak - four_bit.resident == pytest.approx(0.6 * 80)   # its own vLLM loads bf16
    own = plain.vllm[0] - plain.vllm[1]
    shared = plan_gpu(qwen3("model.loader=unsloth", "model.unsloth.fast_inference=true"))
    assert shared.vllm[1] == 0.0 and shared.vllm[0] - shared.vllm[1] == pytest.approx(own + 16.38e9 / GIB, abs=0.01)


def test_multi_gpu_layouts_of_full_fine_tuning_against_hand_figures():
    """Qwen3-8B full fine-tuning on 4 trainer GPUs, per GPU (8.19B parameters): DDP keeps 16 B x 8.19B = 131 GB
    whole; ZeRO-2 2 B whole + 14 B / 4 = 45.0 GB plus M0 whole 16.4 GB; ZeRO-3 / FSDP2 16 B / 4 = 32.8 GB plus M0
    / 4 = 4.1 GB plus two gathered layers of 6.95B / 36 x 2 B = 0.77 GB."""
    p = KNOWN["Qwen/Qwen3-8B"].parameters
    full = qwen3("model.finetuning=full", "engine.backend=openai")

    def rows(layout):
        return {r.item: r.gib * GIB / 1e9 for r in plan_gpu(full, gpus=4, layout=layout).rows}

    assert rows("ddp")["trained copy: bf16 weights and gradients, fp32 master, AdamW"] == pytest.approx(16 * p / 1e9)
    assert not plan_gpu(full, gpus=4, layout="ddp").fits
    zero2 = rows("zero2")
    assert zero2["trained copy: bf16 weights; gradients, fp32 master, AdamW sharded"] == pytest.approx(45.0, abs=0.1)
    assert zero2["frozen M0 (Judge, reference)"] == pytest.approx(16.4, abs=0.05)
    for layout in ("zero3", "fsdp2"):
        sharded = rows(layout)
        assert sharded["trained copy: bf16 weights and gradients, fp32 master, AdamW"] == pytest.approx(32.8, abs=0.05)
        assert sharded["frozen M0 (Judge, reference)"] == pytest.approx(4.1, abs=0.05)
        assert sharded["gathered layers in flight"] == pytest.approx(0.77, abs=0.01)
        assert plan_gpu(full, gpus=4, layout=layout).fits
    assert plan_gpu(full, gpus=4, layout="zero3").peak < plan_gpu(full, gpus=4, layout="zero2").peak
    hf = plan_gpu(qwen3("model.finetuning=full", "engine.backend=hf"), gpus=4, layout="fsdp2")
    assert any("engine.backend: hf cannot generate" in a for a in hf.advice)
    with pytest.raises(ParamsError, match="layout"):
        plan_gpu(full, gpus=4, layout="tp")


def test_tensor_parallel_serving_and_the_cluster_layouts(capsys):
    """vllm serve of Qwen3-8B (16.4 GB bf16) with TP 1 on 80 GiB: 15.25 GiB weights, 0.9 x 80 - 15.25 = 56.75
    GiB of KV cache at 144 KiB per token = 413k tokens; TP 2 halves the weights per GPU and doubles the cache."""
    from scope_lib.models.gpu_plan import plan_cluster, plan_serving

    params = qwen3()
    one = plan_serving(params, gpu_gib=80, tensor_parallel=1)
    assert one.weights_gib == pytest.approx(15.25, abs=0.01) and one.kv_gib == pytest.approx(56.75, abs=0.01)
    assert one.rollouts * one.context == pytest.approx(one.kv_gib * GIB / (144 * 1024), rel=1e-9)
    assert one.rollouts * one.context / 1e3 == pytest.approx(413, abs=0.5)
    two = plan_serving(params, gpu_gib=80, tensor_parallel=2)
    assert two.weights_gib == pytest.approx(one.weights_gib / 2) and two.rollouts > 2 * one.rollouts
    assert not plan_serving(params, gpu_gib=16, tensor_parallel=1).fits          # the weights alone fill it
    assert plan_serving(params, gpu_gib=16, tensor_parallel=2).fits
    full = qwen3("model.finetuning=full")
    options = {o.name.split(" ")[0]: o for o in plan_cluster(full, gpus=8, gpu_gib=80)}
    assert not options["1"].fits and not options["ddp"].fits                     # 131 GB of trainer state per GPU
    assert options["zero3"].fits and options["fsdp2"].fits and options["zero3"].trainer_gpus == 4
    assert main(["plan", "--params", str(REPO / "params" / "qwen3-8b.yaml"), "-o", "model.finetuning=full",
                 "--cluster", "8"]) == 0
    out = capsys.readouterr().out
    assert "zero3 on 4 GPUs + 4 vllm serve x TP 1 on 4 GPUs" in out and "fits: zero2" in out and "most headroom: fsdp2" in out
    assert main(["plan", "--params", str(REPO / "params" / "qwen3-8b.yaml"), "-o", "model.finetuning=full",
                 "--cluster", "1"]) == 1


def test_spice_at_the_papers_settings_has_a_plan(capsys):
    """params/spice-qwen3-4b.yaml (SPICE, Qwen3-4B-Base: 36 layers, hidden 2560, MLP 9728, 32 query and 8 KV heads of
    128, tied embeddings of 151,936 x 2560): 0.389B embedding + 36 x 100.9M per layer = 4.02B parameters x 2 B =
    7.49 GiB. One 80 GiB GPU fits its LoRA form; the paper's full fine-tuning (8 H200, ZeRO-2, App. B) fits 8 GPUs
    with ZeRO-2 and not one."""
    params = load_params(REPO / "params" / "spice-qwen3-4b.yaml")
    assert (params.method, params.model.base, params.grpo.group_size, params.selfplay.solver_rollouts_train,
            params.challenger.batch_size, params.spice.attempts) == ("spice", "Qwen/Qwen3-4B-Base", 8, 8, 128, 1024)
    arch = architecture(params)
    assert arch.parameters / 1e9 == pytest.approx(4.02, abs=0.01)
    rows = {r.item: r.gib for r in plan_gpu(params).rows}
    assert rows["base weights M0 (Judge, reference)"] == pytest.approx(4.022e9 * 2 / GIB, abs=0.01)
    assert plan_gpu(params, gpu_gib=80).fits
    assert main(["plan", "--params", str(REPO / "params" / "spice-qwen3-4b.yaml")]) == 0
    assert "FITS" in capsys.readouterr().out
    from scope_lib.models.gpu_plan import plan_cluster

    full = load_params(REPO / "params" / "spice-qwen3-4b.yaml", ["model.finetuning=full"])
    options = {o.name.split(" ")[0]: o for o in plan_cluster(full, gpus=8, gpu_gib=80)}
    assert not options["1"].fits and options["zero2"].fits
