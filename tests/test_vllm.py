"""VLLMEngine against vLLM itself, on CPU (`make install` puts vLLM's CPU build in the environment): the engine
contract next to an fp32 HF forward, LoRA adapters and the base in one batched call, re-registering an adapter,
what the CPU backend lacks (sleep mode, head sizes), and a clean shutdown. One in-process engine serves the
module (~5 s to start). The tests' tiny model has head_dim 16, which vLLM's CPU attention rejects: these use the
head_dim 64 variant (`tiny_vllm_model_dir`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from test_engines import (
    assert_same_completions,
    chat_prompts,
    check_contract,
    continue_a_stop_inside_thinking,
    forward_logprobs,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from scope_lib.models.engine import Engine, Sampling
from scope_lib.models.vllm_engine import VLLMEngine, cut_at_stop

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (its CPU build) or the gpu extra")

REPO = Path(__file__).resolve().parents[1]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shared_memory() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def tokenizer(tiny_vllm_model_dir):
    return AutoTokenizer.from_pretrained(tiny_vllm_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_vllm_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_vllm_model_dir, tokenizer):
    """One in-process vLLM engine with LoRA for the module; closing it leaves no shared memory behind."""
    import llvmlite.binding.ffi  # noqa: F401  (the suite loads it through bm25s -> numba; vLLM must start anyway)

    before = shared_memory()
    engine = VLLMEngine(tiny_vllm_model_dir, tokenizer=tokenizer, enable_lora=True, max_loras=2, max_lora_rank=8,
                        max_model_len=512, threads=1, enable_sleep_mode=True)
    yield engine
    engine.close()
    engine.close()
    assert engine.llm is None and shared_memory() <= before, "vLLM left shared memory behind"
    assert not torch.distributed.is_initialized() and "llvmlite.binding.ffi" in sys.modules


@pytest.fixture(scope="module")
def adapters(tiny_vllm_model_dir, tmp_path_factory):
    """Two random LoRA adapters (B not zero, so each changes the model), saved as PEFT folders."""
    from peft import LoraConfig, get_peft_model

    folder = tmp_path_factory.mktemp("adapters")
    paths = {}
    for i, name in enumerate(("challenger", "solver")):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir, dtype=torch.float32)
        peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS,
                                               init_lora_weights=False))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.mul_(20.0)  # enough to move a random model's sampling away from the base
        peft.save_pretrained(folder / name)
        paths[name] = folder / name
    return paths


def test_the_engine_runs_in_process_with_the_checkpoints_dtype(engine):
    assert isinstance(engine, Engine) and engine.on_cpu
    assert engine.llm.llm_engine.model_config.dtype == torch.float32   # dtype "auto" kept the fp32 checkpoint
    assert torch.get_num_threads() == 1 and torch.set_num_threads.__module__ == "torch"   # vLLM's patch undone
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ            # not left to processes started later


def test_contract_seeds_stops_and_logprobs_match_an_fp32_forward(engine, tokenizer, hf_model):
    prompts = chat_prompts(tokenizer)
    calls = engine.calls
    free = engine.generate(prompts, Sampling(max_new_tokens=24, seed=7))
    again = engine.generate(prompts, Sampling(max_new_tokens=24, seed=7))
    assert [c.token_ids for c in free] == [c.token_ids for c in again]            # seeded: reproducible
    assert [c.token_ids for c in free] != [c.token_ids for c in engine.generate(prompts, Sampling(24, seed=8))]
    stops = {row: tokenizer.decode(c.token_ids[4:6]) for row, c in enumerate(free)}
    stops = {row: stop for row, stop in stops.items() if stop.strip()}
    assert len(stops) >= 2
    for seed_row, stop in stops.items():   # a stop the model is known to write: a row's sampled tokens 4-5
        sampling = Sampling(max_new_tokens=24, seed=7, stop=(stop,))
        out = engine.generate(prompts, sampling)
        assert out[seed_row].finish_reason == "stop" and len(out[seed_row].token_ids) <= 6
        for prompt, first, completion in zip(prompts, free, out, strict=True):
            check_contract(completion, tokenizer, sampling, hf_model.config.vocab_size)
            assert completion.token_ids == first.token_ids[:len(completion.token_ids)]
            reference = forward_logprobs(hf_model, prompt, completion.token_ids)
            assert completion.logprobs == pytest.approx(reference, abs=1e-4)
    assert engine.calls == calls + 3 + len(stops)
    # temperature: logprobs are log_softmax(logits / T)
    sampling = Sampling(max_new_tokens=16, temperature=0.7, seed=3)
    for prompt, completion in zip(prompts, engine.generate(prompts, sampling), strict=True):
        reference = forward_logprobs(hf_model, prompt, completion.token_ids, temperature=0.7)
        assert completion.logprobs == pytest.approx(reference, abs=1e-4)
    # top-p < 1: vLLM's logprobs are renormalised over the nucleus (a known difference, docs/gpus.md; rollouts
    # that train sample with top_p 1)
    sampling = Sampling(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=3)
    for prompt, completion in zip(prompts, engine.generate(prompts, sampling), strict=True):
        reference = forward_logprobs(hf_model, prompt, completion.token_ids, temperature=0.7)
        assert all(got >= ref - 1e-4 for got, ref in zip(completion.logprobs, reference))


def test_a_stop_inside_thinking_continues_the_turn(engine, tokenizer, hf_model):
    """The rollout loop over vLLM: a stop inside thinking continues the turn from its exact tokens (prefix cache
    or not), next to an fp32 HF forward of the whole turn."""
    continue_a_stop_inside_thinking(engine, tokenizer, hf_model)


def test_eos_ends_the_completion_and_is_not_returned(engine, tokenizer, tiny_vllm_model_dir):
    prompts = chat_prompts(tokenizer)
    free = engine.generate(prompts, Sampling(max_new_tokens=24, seed=7))
    eos = free[0].token_ids[5]   # declared an end-of-sequence token: vLLM must stop on it and the engine drop it
    same_llm = VLLMEngine(tiny_vllm_model_dir, tokenizer=tokenizer, llm=engine.llm,
                          eos_token_ids=engine.eos_token_ids | {eos})
    out = same_llm.generate(prompts, Sampling(max_new_tokens=24, seed=7))
    assert out[0].finish_reason == "eos" and out[0].token_ids == free[0].token_ids[:free[0].token_ids.index(eos)]
    for first, completion in zip(free, out, strict=True):
        assert eos not in completion.token_ids
        if eos not in first.token_ids:
            assert completion.token_ids == first.token_ids and completion.finish_reason == first.finish_reason


def test_budget_and_greedy_and_empty_batch(engine, tokenizer):
    prompts = chat_prompts(tokenizer)
    greedy = engine.generate(prompts, Sampling(max_new_tokens=8, temperature=0.0))
    assert_same_completions(engine.generate(prompts, Sampling(max_new_tokens=8, temperature=0.0, seed=1)), greedy)
    assert engine.generate([], Sampling(max_new_tokens=4)) == []
    long = [1] * 510    # two tokens of room in a 512-token context, then none
    out = engine.generate([long, [1] * 512], Sampling(max_new_tokens=8, temperature=0.0))
    assert len(out[0].token_ids) <= 2 and out[1].token_ids == [] and out[1].finish_reason == "length"


def test_seeded_prompts_beyond_one_prefill_budget_are_split_not_chunked(engine):
    """vLLM 0.31's CPU build crashes ("CPU Generator does not use offset") when a seeded request's prefill is split
    over two scheduler steps, which happens once a call's prompts exceed max_num_batched_tokens (SmolLM2's
    600-token Challenger contexts did, 11 at a time under vLLM's default). The engine sets that budget to
    CPU_PREFILL_TOKENS and keeps each call within it."""
    from scope_lib.models.vllm_engine import CPU_PREFILL_TOKENS

    n, length = CPU_PREFILL_TOKENS // 480 + 2, 480        # a little over one budget
    prompts = [[1 + (7 * i + j) % 300 for j in range(length)] for i in range(n)]
    calls = engine._batches(list(range(n)), [None] * n, [length] * n)
    assert len(calls) == 2 and sum(map(len, calls)) == n
    assert all(sum(length for _ in call) <= CPU_PREFILL_TOKENS for call in calls)
    out = engine.generate(prompts, Sampling(max_new_tokens=2, temperature=1.0, seed=3))
    assert len(out) == n and all(c.token_ids or c.finish_reason == "eos" for c in out)
    assert_same_completions(engine.generate(prompts[:3], Sampling(max_new_tokens=2, temperature=1.0, seed=3)), out[:3])


def test_two_adapters_and_the_base_in_one_call(engine, tokenizer, adapters, tiny_vllm_model_dir):
    from peft import PeftModel

    for name, path in adapters.items():
        engine.add_adapter(name, path)
    prompt = chat_prompts(tokenizer)[1]
    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    calls = engine.calls
    mixed = engine.generate([prompt] * 3, greedy, adapter=["challenger", None, "solver"])
    assert engine.calls == calls + 1
    alone = {name: engine.generate([prompt], greedy, adapter=name)[0] for name in ("challenger", None, "solver")}
    assert [c.token_ids for c in mixed] == [alone[n].token_ids for n in ("challenger", None, "solver")]
    assert len({tuple(c.token_ids) for c in mixed}) == 3                 # each adapter changes the model
    for name, completion in (("challenger", mixed[0]), ("solver", mixed[2])):
        base = AutoModelForCausalLM.from_pretrained(tiny_vllm_model_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, adapters[name]).eval()
        assert completion.logprobs == pytest.approx(forward_logprobs(peft, prompt, completion.token_ids), abs=1e-3)
    with pytest.raises(ValueError, match="unknown adapter 'judge'"):
        engine.generate([prompt], greedy, adapter="judge")
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([prompt] * 2, greedy, adapter=["solver"])


def test_re_registering_an_adapter_serves_the_new_weights(engine, tokenizer, adapters, tmp_path):
    prompt = chat_prompts(tokenizer)[0]
    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    engine.add_adapter("solver", adapters["solver"])
    solver = engine.generate([prompt], greedy, adapter="solver")[0].token_ids
    challenger = engine.generate([prompt], greedy, adapter="challenger")[0].token_ids
    engine.add_adapter("solver", adapters["challenger"])                 # a new version under the same name
    assert engine.generate([prompt], greedy, adapter="solver")[0].token_ids == challenger != solver
    engine.add_adapter("solver", adapters["solver"])
    assert engine.generate([prompt], greedy, adapter="solver")[0].token_ids == solver
    with pytest.raises(FileNotFoundError, match="adapter_config"):
        engine.add_adapter("solver", tmp_path)


def test_no_sleep_mode_on_cpu(engine, tokenizer, caplog):
    prompt = chat_prompts(tokenizer)[0]
    before = engine.generate([prompt], Sampling(max_new_tokens=6, temperature=0.0))
    with caplog.at_level("INFO", logger="scope_lib.models.vllm_engine"):
        engine.sleep()
        engine.sleep()
        engine.wake_up()
    assert not engine.sleep_mode and not engine.sleeping
    assert len([r for r in caplog.records if "without sleep mode" in r.message]) <= 1   # said once per engine
    assert_same_completions(engine.generate([prompt], Sampling(max_new_tokens=6, temperature=0.0)), before)


def test_a_head_size_the_cpu_backend_lacks_is_refused_before_loading(tiny_model_dir):
    with pytest.raises(ValueError, match=r"head_dim 16 is not supported by vLLM's CPU attention.*engine.backend: hf"):
        VLLMEngine(tiny_model_dir, max_model_len=512)


def test_a_stop_seen_one_token_late_is_cut_where_it_completes(tokenizer):
    """Byte-level BPE: a character split over two tokens. A stop ending in it completes at the second token."""
    text = "river ǂ city"
    ids = tokenizer.encode(text, add_special_tokens=False)
    split = [i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i])]
    assert split, "the test needs a character the tokenizer splits into bytes"
    stop = "ǂ"
    done = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
    logprobs = [-float(i) for i in range(len(ids))]
    cut_ids, cut_logprobs = cut_at_stop(ids, logprobs, (stop,), tokenizer.decode)
    assert cut_ids == ids[:done] and cut_logprobs == logprobs[:done]
    assert cut_at_stop(ids, logprobs, ("nowhere",), tokenizer.decode) is None
    assert cut_at_stop(ids, None, (stop,), tokenizer.decode)[1] is None


@pytest.mark.heavy   # a vLLM server process of its own (~35 s): `make test-slow` (docs/testing.md)
def test_openai_engine_loads_adapters_into_a_real_vllm_server(engine, tiny_vllm_model_dir, tokenizer, adapters,
                                                              tmp_path):
    """`OpenAIEngine.add_adapter` (runtime LoRA loading, one served name per version) against vLLM's OpenAI
    server on loopback, started by `scope serve model` (as `python -m vllm.entrypoints.openai.api_server`:
    `vllm serve` fails with the CPU build). Its greedy replies equal the in-process engine's."""
    from servers import free_port, server_process

    from scope_lib.config import load_params
    from scope_lib.models.openai_engine import OpenAIEngine
    from scope_lib.models.vllm_server import server_command

    settings = {"model.base": str(tiny_vllm_model_dir), "model.dtype": "float32", "model.max_model_len": 512,
                "model.warm_start.enabled": False, "engine.kv_cache_gib": 0.25, "engine.max_loras": 2,
                "engine.torch_threads": 1}
    argv, env = server_command(load_params(REPO / "params" / "smoke.yaml", settings), port=8000, cpu=True)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enable-lora" in argv
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and "--enforce-eager" in argv
    # no prefill split over two steps (the CPU build's seeded-prefill crash; tests/test_selfplay_vllm.py)
    assert "--no-enable-chunked-prefill" in argv
    assert int(argv[argv.index("--max-num-batched-tokens") + 1]) >= 512
    port = free_port()
    argv = [sys.executable, "-m", "scope_lib.cli", "serve", "model", "--params", str(REPO / "params" / "smoke.yaml"),
            "--port", str(port), *[arg for key, value in settings.items() for arg in ("-o", f"{key}={value}")]]
    url = f"http://127.0.0.1:{port}"
    prompts = chat_prompts(tokenizer)[:2]
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    with server_process(argv, f"{url}/health", tmp_path / "vllm.log", timeout_s=240):
        client = OpenAIEngine(url, str(tiny_vllm_model_dir), tokenizer, max_retries=1, backoff_s=0.1,
                              max_model_len=512)
        base = client.generate(prompts, greedy)
        assert client.prompt_format == "tokens" and all(c.logprobs for c in base)   # vLLM takes token ids
        assert client.add_adapter("solver", adapters["solver"], version=1) == "solver@1"
        solver = client.generate(prompts, greedy, adapter="solver")
        assert client.add_adapter("solver", adapters["challenger"], version=2) == "solver@2"   # the old one out
        swapped = client.generate(prompts, greedy, adapter="solver")
        client.close()
    assert [c.token_ids for c in solver] != [c.token_ids for c in base] != [c.token_ids for c in swapped]
    engine.add_adapter("served-solver", adapters["solver"])
    engine.add_adapter("served-swap", adapters["challenger"])
    for served, name in ((base, None), (solver, "served-solver"), (swapped, "served-swap")):
        assert [c.token_ids for c in served] == [c.token_ids for c in engine.generate(prompts, greedy, adapter=name)]
    for completion in base + solver + swapped:
        check_contract(completion, tokenizer, greedy, len(tokenizer))
