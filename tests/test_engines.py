"""scope_lib.models engines: the one generation interface over HF transformers, vLLM and OpenAI-compatible servers.

The tiny model is random, so it rarely writes a given stop string by itself. Stops are forced honestly:
either the stop is text the model is known to produce (taken from a first seeded run), or the model is
given a logit bias (a forward hook on its output layer) that makes it likely to emit the token, and the
reference forward pass runs with the same hook.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from servers import JSONHandler, free_port, loopback, server_process
from transformers import AutoModelForCausalLM, AutoTokenizer

from scope_lib.config import validate_params
from scope_lib.models.engine import Completion, Engine, EngineRequestError, EngineUnavailable, Sampling
from scope_lib.models.hf_engine import HFEngine, length_chunks
from scope_lib.models.loading import make_engine
from scope_lib.models.openai_engine import OpenAIEngine
from scope_lib.models.vllm_engine import VLLMEngine

QUESTIONS = ["Who?", "What did Evan Morris lobby for in Washington, and for which company?",
             "Name the river that flows through the city."]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def chat_prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


@contextmanager
def logit_bias(model, token_id: int, bias: float):
    """Make the model itself favour one token (a hook on its output layer, seen by every forward pass)."""

    def hook(_module, _inputs, logits):
        logits = logits.clone()
        logits[..., token_id] += bias
        return logits

    handle = model.get_output_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each completion token, from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    steps = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)] / temperature
    return torch.log_softmax(steps, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


#: How far float32 log-probs of the same tokens may move when the same model computes them in another batch
#: (other rows, padding or kernel split): 4.8e-7 seen on an AVX2-only CPU (issue 31), 0 where the tests were
#: written. A real change (another adapter, another sampling temperature) moves them by 1e-2 or more.
LOGPROB_NOISE = 1e-5


def assert_same_completions(got: list[Completion], expected: list[Completion], *, abs_logprob: float = LOGPROB_NOISE
                            ) -> None:
    """The same tokens, text and finish reasons, with log-probs equal within float noise (`LOGPROB_NOISE`)."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert a.logprobs == pytest.approx(b.logprobs, abs=abs_logprob, rel=0)


def check_contract(completion: Completion, tokenizer, sampling: Sampling, vocab: int) -> None:
    ids = completion.token_ids
    assert all(0 <= i < vocab for i in ids)
    assert tokenizer.decode(ids) == completion.text
    eos = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert not eos & set(ids), "eos/pad must not be in token_ids"
    assert completion.finish_reason in ("stop", "eos", "length")
    if completion.finish_reason == "length":
        assert len(ids) == sampling.max_new_tokens
    assert len(ids) <= sampling.max_new_tokens
    if completion.finish_reason == "stop":
        assert any(s in completion.text for s in sampling.stop)
        assert not any(s in tokenizer.decode(ids[:-1]) for s in sampling.stop), "must end at the first stop"
    if sampling.logprobs:
        assert completion.logprobs is not None and len(completion.logprobs) == len(ids)
        assert all(math.isfinite(x) and x <= 0 for x in completion.logprobs)


# -- HFEngine --------------------------------------------------------------------------------------


def test_hf_batch_with_stop_matches_forward_pass(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    assert isinstance(engine, Engine)
    prompts = chat_prompts(tokenizer)
    assert len({len(p) for p in prompts}) == 3
    free = engine.generate(prompts, Sampling(max_new_tokens=24, seed=7))
    assert engine.calls == 1
    # a stop string the model is known to write at this seed: row 0's sampled tokens 4-5
    stop = tokenizer.decode(free[0].token_ids[4:6])
    assert stop.strip()
    sampling = Sampling(max_new_tokens=24, seed=7, stop=(stop,))
    out = engine.generate(prompts, sampling)
    assert engine.calls == 2 and len(out) == 3
    assert out[0].finish_reason == "stop" and out[0].text.endswith(stop)
    assert len(out[0].token_ids) <= 6
    for prompt, first, completion in zip(prompts, free, out, strict=True):
        check_contract(completion, tokenizer, sampling, model.config.vocab_size)
        # same seed: the same tokens, cut at the stop
        assert completion.token_ids == first.token_ids[:len(completion.token_ids)]
        reference = forward_logprobs(model, prompt, completion.token_ids)
        assert completion.logprobs == pytest.approx(reference, abs=1e-4)


def test_hf_tag_stop_with_temperature_and_top_p(model, tokenizer):
    """A protocol tag (one added token) as the stop; logprobs are log_softmax(logits / T), before top-p."""
    engine = HFEngine(model, tokenizer)
    tag = "</search>"
    tag_id = tokenizer.convert_tokens_to_ids(tag)
    prompts = chat_prompts(tokenizer)
    sampling = Sampling(max_new_tokens=40, temperature=0.7, top_p=0.9, stop=(tag,), seed=3)
    with logit_bias(model, tag_id, 7.0):
        out = engine.generate(prompts, sampling)
        references = [forward_logprobs(model, p, c.token_ids, temperature=0.7) for p, c in zip(prompts, out, strict=True)]
    assert engine.calls == 1
    for completion, reference in zip(out, references, strict=True):
        check_contract(completion, tokenizer, sampling, model.config.vocab_size)
        assert completion.finish_reason == "stop"
        assert completion.text.endswith(tag) and completion.token_ids[-1] == tag_id
        assert completion.token_ids.count(tag_id) == 1
        assert completion.logprobs == pytest.approx(reference, abs=1e-4)


def test_hf_eos_ends_the_completion_and_is_left_out(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    prompts = chat_prompts(tokenizer) * 2
    sampling = Sampling(max_new_tokens=30, seed=11)
    with logit_bias(model, tokenizer.eos_token_id, 6.0):
        out = engine.generate(prompts, sampling)
        references = [forward_logprobs(model, p, c.token_ids) for p, c in zip(prompts, out, strict=True)]
    finishes = [c.finish_reason for c in out]
    assert finishes.count("eos") >= 3
    assert len({len(c.token_ids) for c in out}) > 1  # rows ended at different steps: padding followed
    for completion, reference in zip(out, references, strict=True):
        check_contract(completion, tokenizer, sampling, model.config.vocab_size)
        assert completion.logprobs == pytest.approx(reference, abs=1e-4)


def test_hf_greedy_is_deterministic_and_respects_max_new_tokens(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    prompts = chat_prompts(tokenizer)
    sampling = Sampling(max_new_tokens=8, temperature=0.0)
    first = engine.generate(prompts, sampling)
    torch.manual_seed(1234)  # the global RNG must not matter for greedy decoding
    second = engine.generate(prompts, sampling)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.finish_reason for c in first] == ["length"] * 3
    for prompt, completion in zip(prompts, first, strict=True):
        check_contract(completion, tokenizer, sampling, model.config.vocab_size)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
        argmax = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        assert completion.token_ids == argmax


def test_hf_stop_strings_are_matched_in_generated_text_only(model, tokenizer):
    """A stop string that would straddle the prompt's end ("assistant\n" + a sampled first character) must not
    end a completion that never wrote it."""
    engine = HFEngine(model, tokenizer)
    prompts = chat_prompts(tokenizer)
    greedy = engine.generate(prompts, Sampling(max_new_tokens=8, temperature=0.0))
    for prompt, free in zip(prompts, greedy, strict=True):
        stop = tokenizer.decode(prompt)[-1] + free.text[0]
        sampling = Sampling(max_new_tokens=8, temperature=0.0, stop=(stop,))
        [completion] = engine.generate([prompt], sampling)
        check_contract(completion, tokenizer, sampling, model.config.vocab_size)
        assert completion.token_ids == free.token_ids[:len(completion.token_ids)]
        assert completion.finish_reason == ("stop" if stop in free.text else "length")


class NoRetrieval:
    """A rollout whose turns never leave their thinking has nothing to look up."""

    def search(self, queries, k=None):
        raise AssertionError(f"searched {queries} from inside thinking")


def continue_a_stop_inside_thinking(engine, tokenizer, reference_model, budget: int = 24, seed: int = 7):
    """A real model's turn that starts inside thinking (as under a chat template that opens <think>) and writes
    a stop string: the turn goes on in further engine calls, from its own tokens, until its budget. The first
    call is the model's own seeded turn cut at the stop; the log-probs of the whole turn equal one forward pass
    over prompt + turn, so every continuation was sampled from the exact prefix."""
    from dataclasses import replace

    from scope_lib.protocol.dialects import get_dialect
    from scope_lib.selfplay.rollout import RolloutLimits, new_trajectory, run_rollouts

    traj = new_trajectory("t0", "solver", [{"role": "user", "content": QUESTIONS[1]}], tokenizer, max_searches=2)
    free = engine.generate([traj.prompt_ids], Sampling(max_new_tokens=budget, seed=seed))[0]
    stop = tokenizer.decode(free.token_ids[4:6])   # a stop string this model writes at this seed
    first = next(n for n in range(1, len(free.token_ids) + 1) if stop in tokenizer.decode(free.token_ids[:n]))
    assert stop.strip() and "think>" not in free.text and first < budget
    dialect = replace(get_dialect("qwen2.5"), search_close=stop)
    traj.opens_think = True
    limits = RolloutLimits(max_turns=3, max_new_tokens_per_turn=budget, max_response_tokens=4 * budget,
                           max_model_len=512, max_prompt_tokens=256, seed=seed)
    calls = engine.calls
    stats = run_rollouts([traj], engine, NoRetrieval(), dialect, limits)
    assert traj.completion_ids[:first] == free.token_ids[:first] and len(traj.completion_ids) > first
    assert len(traj.turns) == 1 and traj.turn_spans == [(0, len(traj.completion_ids))] and all(traj.env_mask)
    assert traj.stops_in_thinking == stats.stops_in_thinking >= 1
    assert engine.calls - calls == stats.engine_calls == 1 + stats.stops_in_thinking   # one call per round
    assert traj.turns[0] == tokenizer.decode(traj.completion_ids)
    assert traj.finish == ("length" if len(traj.completion_ids) == budget else "no_action")
    reference = forward_logprobs(reference_model, traj.prompt_ids, traj.completion_ids)
    assert traj.logprobs == pytest.approx(reference, abs=1e-4)
    return traj, stats


def test_hf_a_stop_inside_thinking_continues_the_turn(model, tokenizer):
    continue_a_stop_inside_thinking(HFEngine(model, tokenizer), tokenizer, model)


def test_hf_seeds(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    prompts = chat_prompts(tokenizer)
    seeded = [engine.generate(prompts, Sampling(max_new_tokens=6, seed=5)) for _ in range(2)]
    assert [c.token_ids for c in seeded[0]] == [c.token_ids for c in seeded[1]]
    before = torch.random.get_rng_state()
    engine.generate(prompts, Sampling(max_new_tokens=6, seed=5))
    assert torch.equal(before, torch.random.get_rng_state()), "a seeded call must not touch the global RNG"
    unseeded = [engine.generate(prompts, Sampling(max_new_tokens=6)) for _ in range(2)]
    assert [c.token_ids for c in unseeded[0]] != [c.token_ids for c in unseeded[1]]
    no_logprobs = engine.generate(prompts, Sampling(max_new_tokens=3, seed=5, logprobs=False))
    assert all(c.logprobs is None for c in no_logprobs)


def test_hf_chunks_keep_order(model, tokenizer):
    engine = HFEngine(model, tokenizer, max_batch_size=2)
    prompts = chat_prompts(tokenizer)
    out = engine.generate(prompts, Sampling(max_new_tokens=5, seed=2))
    assert engine.calls == 1 and len(out) == 3
    for prompt, completion in zip(prompts, out, strict=True):
        assert completion.logprobs == pytest.approx(forward_logprobs(model, prompt, completion.token_ids), abs=1e-4)
    assert engine.generate([], Sampling(max_new_tokens=5)) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], Sampling(max_new_tokens=5))


def test_length_chunks_split_where_a_prompt_is_less_than_half_the_longest():
    lengths = [3000, 1600, 1400, 700, 500, 300, 100]
    order = list(range(len(lengths)))
    assert length_chunks(order, lengths) == [[0, 1], [2, 3], [4, 5, 6]]   # the last chunk is at most 512 wide
    assert length_chunks(order, lengths, max_size=2) == [[0, 1], [2, 3], [4, 5], [6]]
    assert length_chunks([0, 1, 2], [400, 100, 30]) == [[0, 1, 2]]
    # a call dominated by generation (a 2,000-token budget) is not split: each chunk would decode on its own
    assert length_chunks(order, lengths, new_tokens=2000) == [[0, 1, 2, 3, 4, 5, 6]]
    assert length_chunks(order, lengths, new_tokens=1000) == [[0, 1], [2, 3, 4, 5, 6]]
    assert length_chunks([], []) == []


def test_hf_prompts_of_mixed_lengths_are_generated_in_chunks_like_one_by_one(model, tokenizer):
    """Prompts of 20 to 1,400 tokens go in three chunks, in one generate call, and each completion is what the
    prompt gets alone (greedy), its log-probs those of a forward pass."""
    engine = HFEngine(model, tokenizer)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 200) for _ in range(n)] for n in (1400, 20, 600, 1300, 650)]
    greedy = Sampling(max_new_tokens=4, temperature=0.0)
    sizes = []
    original = engine._generate_chunk
    engine._generate_chunk = lambda chunk, *a: sizes.append(len(chunk)) or original(chunk, *a)  # type: ignore
    batch = engine.generate(prompts, greedy)
    assert sizes == [2, 2, 1] and engine.calls == 1
    engine._generate_chunk = original  # type: ignore
    for prompt, completion in zip(prompts, batch, strict=True):
        assert completion.token_ids == engine.generate([prompt], greedy)[0].token_ids
        assert completion.logprobs == pytest.approx(forward_logprobs(model, prompt, completion.token_ids), abs=1e-4)


def test_hf_lora_adapters(tiny_model_dir, tokenizer):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tokenizer)
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, lora, adapter_name="challenger")
    peft_model.add_adapter("solver", LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                init_lora_weights=False))
    peft_model.set_adapter("challenger")
    peft_model.train()
    grads = {n: p.requires_grad for n, p in peft_model.named_parameters()}
    engine = HFEngine(peft_model, tokenizer)
    prompts = chat_prompts(tokenizer)
    greedy = Sampling(max_new_tokens=6, temperature=0.0)

    judge = engine.generate(prompts, greedy)  # adapter=None: the frozen base model
    assert [c.token_ids for c in judge] == [c.token_ids for c in plain.generate(prompts, greedy)]
    solver = engine.generate(prompts, greedy, adapter="solver")
    assert [c.token_ids for c in solver] != [c.token_ids for c in judge]
    peft_model.set_adapter("solver")
    for prompt, completion in zip(prompts, solver, strict=True):
        with torch.no_grad():
            assert completion.logprobs == pytest.approx(
                forward_logprobs(peft_model, prompt, completion.token_ids), abs=1e-4)
    peft_model.set_adapter("challenger")
    for n, p in peft_model.named_parameters():
        p.requires_grad_(grads[n])
    engine.generate(prompts, greedy, adapter="solver")
    assert peft_model.active_adapter == "challenger" and peft_model.training
    assert {n: p.requires_grad for n, p in peft_model.named_parameters()} == grads
    assert engine.calls == 3
    with pytest.raises(ValueError, match="unknown adapter 'judge'"):
        engine.generate(prompts, greedy, adapter="judge")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        plain.generate(prompts, greedy, adapter="solver")


def test_hf_adapters_loaded_into_a_transformers_model(tiny_model_dir, tokenizer):
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tokenizer)
    model.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                      adapter_name="solver")
    engine = HFEngine(model, tokenizer)
    prompts = chat_prompts(tokenizer)
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    base = engine.generate(prompts, greedy)
    assert [c.token_ids for c in base] == [c.token_ids for c in plain.generate(prompts, greedy)]
    solver = engine.generate(prompts, greedy, adapter="solver")
    assert [c.token_ids for c in solver] != [c.token_ids for c in base]
    for prompt, completion in zip(prompts, solver, strict=True):  # adapters are on again after the call
        assert completion.logprobs == pytest.approx(forward_logprobs(model, prompt, completion.token_ids), abs=1e-4)


def test_sampling_validation():
    assert Sampling(max_new_tokens=4, stop="</answer>").stop == ("</answer>",)
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=4, temperature=-1), dict(max_new_tokens=4, top_p=0)):
        with pytest.raises(ValueError):
            Sampling(**bad)


# -- vLLM ------------------------------------------------------------------------------------------


def test_vllm_engine_without_vllm_says_how_to_install_it(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)   # as on a machine without vLLM (`import vllm` fails)
    with pytest.raises(ImportError, match=r"make install.*\.\[gpu\]"):
        VLLMEngine(tiny_model_dir)


# The engine against vLLM itself (its CPU build): tests/test_vllm.py.


# -- OpenAI-compatible HTTP ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served_tiny(tiny_model_dir, tmp_path_factory):
    """`transformers serve` on loopback with the tiny model (CPU); yields its base URL."""
    cli = Path(sys.executable).with_name("transformers")
    if not cli.is_file() or importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        pytest.skip("`transformers serve` needs transformers[serving] (the `serving` extra)")
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(log_path.parent / "hf")}
    url = f"http://127.0.0.1:{port}"
    command = [str(cli), "serve", str(tiny_model_dir), "--device", "cpu", "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning"]
    with server_process(command, f"{url}/health", log_path, env=env):
        yield url


def test_openai_engine_against_transformers_serve(served_tiny, tiny_model_dir, tokenizer):
    engine = OpenAIEngine(served_tiny, str(tiny_model_dir), tokenizer, concurrency=4, max_retries=1,
                          backoff_s=0.05)
    prompts = chat_prompts(tokenizer, QUESTIONS + ["One more question?"])
    sampling = Sampling(max_new_tokens=8, seed=1)
    out = engine.generate(prompts, sampling)
    assert engine.calls == 1 and len(out) == 4
    assert engine.prompt_format == "text"  # transformers serve only takes text prompts
    for completion in out:
        assert completion.token_ids and completion.logprobs is None  # the server returns no logprobs
        assert tokenizer.decode(completion.token_ids) == completion.text
        assert completion.finish_reason in ("length", "eos", "stop")
    # greedy over HTTP is greedy: the same as the in-process engine, then a stop string it is known to write
    greedy = engine.generate(prompts[:2], Sampling(max_new_tokens=8, temperature=0.0))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    local = HFEngine(model, tokenizer).generate(prompts[:2], Sampling(max_new_tokens=8, temperature=0.0))
    assert [c.text for c in greedy] == [c.text for c in local]
    # a stop string the server is known to write: the middle of a seeded sample's text. One request at a
    # time: transformers serve seeds the global torch RNG, so concurrent seeded requests are not reproducible.
    text = engine.generate(prompts[1:2], Sampling(max_new_tokens=8, seed=5))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = engine.generate(prompts[1:2], Sampling(max_new_tokens=8, seed=5, stop=(stop,)))
    assert engine.calls == 4
    assert stopped[0].finish_reason == "stop" and stop in stopped[0].text
    assert text.startswith(stopped[0].text[:stopped[0].text.index(stop) + len(stop)])
    engine.close()


def test_openai_engine_closed_port_fails_fast(tokenizer):
    url = f"http://127.0.0.1:{free_port()}"
    engine = OpenAIEngine(url, "tiny", tokenizer, max_retries=2, backoff_s=0.01, timeout_s=2, prompt_format="text")
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match=r"127\.0\.0\.1.*3 attempt.*server is running"):
        engine.generate(chat_prompts(tokenizer), Sampling(max_new_tokens=4))
    assert time.monotonic() - started < 5


class _FakeVLLM(JSONHandler):
    """A loopback server that answers like `vllm serve` (token ids, logprobs, stop_reason), fails each
    prompt's first attempt with 503 and holds every request briefly, so retries and concurrency show."""

    def do_POST(self):
        state = self.server.state
        body = self.read_json()
        prompt = tuple(body["prompt"])
        with state["lock"]:
            state["bodies"].append(body)
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            first = prompt not in state["seen"]
            state["seen"].add(prompt)
        time.sleep(0.15)
        with state["lock"]:
            state["in_flight"] -= 1
        if body["model"] == "missing":
            return self.reply(404, {"error": "model 'missing' not found"})
        if first:
            return self.reply(503, {"error": "warming up"})
        n = prompt[-1] % 3  # vary the ending by prompt: stop string, eos (sent as the last id), length
        ids = state["replies"][n] + ([state["eos"]] if n == 1 else [])
        choice = {"index": 0, "text": "ignored", "token_ids": ids,
                  "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                  "finish_reason": "length" if n == 2 else "stop",
                  "stop_reason": "</search>" if n == 0 else None}
        self.reply(200, {"choices": [choice]})


def test_openai_engine_tokens_mode_retries_and_concurrency(tokenizer):
    texts = ["<search>river city</search>", "The river.", "a b c d e f g h"]
    replies = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    with loopback(_FakeVLLM, {"bodies": [], "seen": set(), "in_flight": 0, "max_in_flight": 0, "replies": replies,
                              "eos": tokenizer.eos_token_id}) as (url, state):
        engine = OpenAIEngine(f"{url}/v1", "base", tokenizer, concurrency=4, max_retries=2, backoff_s=0.01,
                              prompt_format="tokens")
        prompts = [p + [k] for k, p in enumerate(chat_prompts(tokenizer, QUESTIONS[:1] * 4))]
        sampling = Sampling(max_new_tokens=max(len(r) for r in replies), stop=("</search>",), seed=10)
        out = engine.generate(prompts, sampling, adapter="solver")
        assert engine.calls == 1 and len(out) == 4
        assert state["max_in_flight"] >= 2, "requests must run concurrently"
        assert len(state["bodies"]) == 8  # each prompt: one 503, one retry
        first = state["bodies"][0]
        assert first["model"] == "solver" and first["return_token_ids"] and first["include_stop_str_in_output"]
        assert sorted(b["seed"] for b in state["bodies"]) == [10, 10, 11, 11, 12, 12, 13, 13]
        for k, completion in enumerate(out):
            assert completion.token_ids == replies[k % 3]  # the server's ids, eos stripped
            assert completion.logprobs == [-0.5] * len(replies[k % 3])
            assert completion.text == texts[k % 3]
        assert [c.finish_reason for c in out] == ["stop", "eos", "length", "stop"]
        with pytest.raises(EngineRequestError, match="404"):
            engine.generate(prompts[:1], sampling, adapter="missing")
        engine.close()


# -- factory ---------------------------------------------------------------------------------------


def test_make_engine(model, tokenizer, tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("SCOPE_CACHE_DIR", str(tmp_path))
    params = validate_params({"model": {"base": "tiny"}, "engine": {"backend": "hf", "judge_backend": "openai"},
                              "retrieval": {"corpus": str(tiny_corpus)}})
    policy = make_engine(params, "policy", model=model, tokenizer=tokenizer)
    assert isinstance(policy, HFEngine) and policy.model is model
    with pytest.raises(ValueError, match="judge_base_url"):
        make_engine(params, "judge", tokenizer=tokenizer)
    monkeypatch.setenv("MY_KEY", "secret")
    params = validate_params({"model": {"base": "tiny"},
                              "engine": {"backend": "hf", "judge_backend": "openai", "base_url": "http://a:1",
                                         "judge_base_url": "http://j:2/v1", "api_key_env": "MY_KEY",
                                         "concurrency": 3, "max_retries": 1},
                              "retrieval": {"corpus": str(tiny_corpus)}})
    judge = make_engine(params, "judge", tokenizer=tokenizer)
    assert isinstance(judge, OpenAIEngine) and judge.url == "http://j:2/v1/completions"
    assert judge.concurrency == 3 and judge.max_retries == 1
    assert judge._client.headers["Authorization"] == "Bearer secret"
    judge.close()
    loaded = make_engine(validate_params({"model": {"base": "tiny", "dtype": "float32"},
                                          "engine": {"backend": "hf", "device": "cpu"},
                                          "retrieval": {"corpus": str(tiny_corpus)}}))
    assert isinstance(loaded, HFEngine) and len(loaded.tokenizer) == model.config.vocab_size
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "vllm", None)
        with pytest.raises(ImportError, match="gpu"):
            make_engine(validate_params({"model": {"base": "tiny"}, "engine": {"backend": "vllm"},
                                         "retrieval": {"corpus": str(tiny_corpus)}}), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="role"):
        make_engine(params, "critic")


# -- context caps, secrets and rate limits (issue #11, items 6 and 10) -----------------------------

SECRET = "sk-test-TOPSECRET-0123456789"


class _Strict(JSONHandler):
    """A loopback server with vLLM's strictness and a careless error body.

    - a request whose prompt plus max_tokens exceeds `max_model_len` gets HTTP 400 (as `vllm serve` does);
    - `mode` "echo": every request fails with the request headers echoed in the error body (API key included);
    - `mode` "ratelimit": the first request gets 429 with `Retry-After`, later ones succeed;
    - `mode` "text-only": token-id prompts get 400, text prompts succeed.
    """

    def do_POST(self):
        state = self.server.state
        body = self.read_json()
        with state["lock"]:
            state["bodies"].append((time.monotonic(), body))
            state["authorization"] = self.headers.get("Authorization")
            n = len(state["bodies"])
        mode = state["mode"]
        if mode == "echo":
            status = 500 if state.get("status_5xx") else 401
            return self.reply(status, {"error": "bad request", "headers": dict(self.headers.items())})
        if mode == "ratelimit" and n == 1:
            return self.reply(429, {"error": "slow down"}, {"Retry-After": str(state["retry_after"])})
        prompt = body["prompt"]
        if isinstance(prompt, list):
            if mode == "text-only":
                return self.reply(400, {"error": "prompt must be a string"})
            length = len(prompt)
        else:
            length = len(state["tokenizer"].encode(prompt, add_special_tokens=False))
        if length + body["max_tokens"] > state["max_model_len"]:
            return self.reply(400, {"error": f"This model's maximum context length is {state['max_model_len']}"})
        ids = state["tokenizer"].encode(" river", add_special_tokens=False)[: body["max_tokens"]]
        return self.reply(200, {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}]})


@contextmanager
def strict_server(tokenizer, mode="ok", **state):
    with loopback(_Strict, {"bodies": [], "mode": mode, "tokenizer": tokenizer, "max_model_len": 64, **state}) as served:
        yield served


def test_every_request_is_capped_at_the_context(tokenizer):
    """A batch asks for its largest budget; each request must ask only what its prompt leaves room for."""
    short, long = [1] * 10, [1] * 60
    with strict_server(tokenizer) as (url, state):
        engine = OpenAIEngine(url, "m", tokenizer, prompt_format="tokens", max_model_len=64, backoff_s=0.01)
        out = engine.generate([short, long, [1] * 64], Sampling(max_new_tokens=50))
        sent = sorted(b["max_tokens"] for _, b in state["bodies"])
        assert sent == [4, 50]                       # 64 - 60 and the full 50; nothing sent for the full prompt
        assert out[2].token_ids == [] and out[2].finish_reason == "length"
        assert all(len(c.token_ids) <= 64 - len(p) for c, p in zip(out, [short, long, [1] * 64]))
        engine.close()
        uncapped = OpenAIEngine(url, "m", tokenizer, prompt_format="tokens", backoff_s=0.01)
        with pytest.raises(EngineRequestError, match="maximum context length"):
            uncapped.generate([short, long], Sampling(max_new_tokens=50))
        uncapped.close()


def test_hf_engine_caps_each_prompt_at_the_context(model, tokenizer):
    prompts = chat_prompts(tokenizer, QUESTIONS[:2])
    room = 3
    engine = HFEngine(model, tokenizer, max_model_len=len(prompts[1]) + room)
    out = engine.generate(prompts + [[1] * (len(prompts[1]) + room)], Sampling(max_new_tokens=20, seed=0))
    assert len(out[1].token_ids) <= room
    assert len(out[0].token_ids) <= len(prompts[1]) + room - len(prompts[0])
    assert out[2].token_ids == [] and out[2].finish_reason == "length" and out[2].logprobs == []


def test_probe_does_not_take_a_context_error_for_unsupported_token_prompts(tokenizer):
    with strict_server(tokenizer) as (url, state):
        engine = OpenAIEngine(url, "m", tokenizer, prompt_format="auto", backoff_s=0.01)  # no cap known
        with pytest.raises(EngineRequestError, match="maximum context length"):
            engine.generate([[1] * 60], Sampling(max_new_tokens=50))
        assert engine.prompt_format == "auto"        # undecided: the server does take token prompts
        engine.generate([[1] * 10], Sampling(max_new_tokens=5))
        assert engine.prompt_format == "tokens"
        engine.close()
    with strict_server(tokenizer, "text-only") as (url, state):
        engine = OpenAIEngine(url, "m", tokenizer, prompt_format="auto", backoff_s=0.01)
        out = engine.generate(chat_prompts(tokenizer, QUESTIONS[:1]), Sampling(max_new_tokens=2))
        assert engine.prompt_format == "text" and out[0].token_ids
        engine.close()


@pytest.mark.parametrize("status_5xx", [False, True])
def test_credentials_never_reach_errors_or_logs(tokenizer, caplog, status_5xx):
    caplog.set_level("DEBUG", logger="scope_lib.models")
    with strict_server(tokenizer, "echo", status_5xx=status_5xx) as (url, state):
        engine = OpenAIEngine(url, "m", tokenizer, api_key=SECRET, prompt_format="auto", max_retries=1,
                              backoff_s=0.01)
        with pytest.raises((EngineRequestError, EngineUnavailable)) as raised:
            engine.generate(chat_prompts(tokenizer, QUESTIONS[:1]), Sampling(max_new_tokens=2))
        engine.close()
    assert state["authorization"] == f"Bearer {SECRET}"      # the server saw the key and echoed it back
    assert "401" in str(raised.value) or "500" in str(raised.value)
    assert SECRET not in str(raised.value) and "TOPSECRET" not in str(raised.value)
    assert "***" in str(raised.value)                      # the echoed header is there, redacted
    assert SECRET not in caplog.text


def test_redact_patterns():
    from scope_lib.models.retries import redact

    text = ('{"authorization": "Bearer abcdef123456", "x-api-key": "k-998877665544"} '
            'token sk-proj-ABCDEFGH12345678 and mykey-12345')
    out = redact(text, ["mykey-12345"])
    for leaked in ("abcdef123456", "k-998877665544", "sk-proj-ABCDEFGH12345678", "mykey-12345"):
        assert leaked not in out
    assert redact("no secrets in here: HTTP 500", ["sk-x"]) == "no secrets in here: HTTP 500"


def test_retry_after_is_honoured_and_429_backs_off_longer(tokenizer):
    import httpx

    from scope_lib.models.retries import retry_after_s

    assert retry_after_s("2") == 2.0 and retry_after_s("-3") == 0.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert retry_after_s("soon") is None and retry_after_s(None) is None and retry_after_s("nan") is None
    from scope_lib.models.retries import backoff_s

    assert backoff_s(0, 0.1, 5, httpx.Response(503)) == pytest.approx(0.1)
    assert backoff_s(0, 0.1, 5, httpx.Response(429)) == pytest.approx(0.4)     # a rate limit waits longer
    assert backoff_s(1, 0.1, 5, httpx.Response(429)) == pytest.approx(0.8)
    assert backoff_s(0, 0.1, 5, httpx.Response(503, headers={"Retry-After": "3"})) == pytest.approx(3.0)
    assert backoff_s(0, 0.1, 5, httpx.Response(429, headers={"Retry-After": "999"})) == pytest.approx(5.0)  # capped
    with strict_server(tokenizer, "ratelimit", retry_after=0.5) as (url, state):
        engine = OpenAIEngine(url, "m", tokenizer, prompt_format="tokens", backoff_s=0.01, max_retries=2)
        out = engine.generate([[1] * 5], Sampling(max_new_tokens=1))
        engine.close()
    (t0, _), (t1, _) = state["bodies"]
    assert out[0].token_ids and t1 - t0 >= 0.45       # waited for Retry-After, not the 0.04 s backoff
