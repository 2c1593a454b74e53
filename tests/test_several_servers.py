"""Generation on several servers (issue 24): `engine.base_url` as a list. Each batch is cut into contiguous
shares, one per server; adapters are registered on (and retired from) every server. Against two real
`transformers serve` processes of the tiny model, and two loopback `vllm serve --enable-lora` stand-ins."""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from servers import JSONHandler, free_port, loopback, server_process
from transformers import AutoModelForCausalLM, AutoTokenizer

from scope_lib.config import validate_params
from scope_lib.models.engine import EngineUnavailable, Sampling
from scope_lib.models.hf_engine import HFEngine
from scope_lib.models.loading import make_engine
from scope_lib.models.openai_engine import OpenAIEngine

QUESTIONS = ["Who?", "Name the river that flows through the city.", "What year was it founded?",
             "Which company did he lobby for?"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat_prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False)
            for q in questions]


@pytest.fixture(scope="module")
def two_served(tiny_model_dir, tmp_path_factory):
    """Two `transformers serve` processes of the tiny model on loopback ports; yields their URLs."""
    cli = Path(sys.executable).with_name("transformers")
    if not cli.is_file() or importlib.util.find_spec("fastapi") is None:
        pytest.skip("`transformers serve` needs transformers[serving] (the `serving` extra)")
    folder = tmp_path_factory.mktemp("serve")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(folder / "hf"), "OMP_NUM_THREADS": "1"}
    urls = []
    with ExitStack() as stack:
        for k in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(server_process(
                [str(cli), "serve", str(tiny_model_dir), "--device", "cpu", "--host", "127.0.0.1", "--port",
                 str(port), "--log-level", "warning"], f"{url}/health", folder / f"serve{k}.log", env=env))
            urls.append(url)
        yield urls


def test_a_batch_is_shared_over_two_real_servers(two_served, tiny_model_dir, tokenizer):
    engine = OpenAIEngine(two_served, str(tiny_model_dir), tokenizer, concurrency=4, max_retries=1, backoff_s=0.05)
    prompts = chat_prompts(tokenizer)
    greedy = engine.generate(prompts, Sampling(max_new_tokens=8, temperature=0.0))
    # two prompts per server; the first server also got the probe's token-id attempt (rejected, then text)
    assert engine.requests == [3, 2] and engine.prompt_format == "text"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    local = HFEngine(model, tokenizer).generate(prompts, Sampling(max_new_tokens=8, temperature=0.0))
    assert [c.text for c in greedy] == [c.text for c in local]   # in order, whichever server answered
    engine.generate(prompts[:3], Sampling(max_new_tokens=4, seed=1))
    assert engine.requests == [5, 3]   # 3 prompts: shares of 2 and 1
    engine.close()
    one_down = OpenAIEngine([two_served[0], f"http://127.0.0.1:{free_port()}"], str(tiny_model_dir), tokenizer,
                            max_retries=0, backoff_s=0.01, prompt_format="text")
    with pytest.raises(EngineUnavailable, match="reachable at http://127.0.0.1"):   # names the server that failed
        one_down.generate(prompts, Sampling(max_new_tokens=4))
    one_down.close()


class _LoraServer(JSONHandler):
    """`vllm serve --enable-lora` with runtime LoRA loading; completions echo the model that served them."""

    def do_POST(self):
        body, state = self.read_json(), self.server.state
        with state["lock"]:
            state["calls"].append((self.path, body))
        if self.path == "/v1/load_lora_adapter":
            state["loaded"].add(body["lora_name"])
            return self.reply(200, {"ok": True})
        if self.path == "/v1/unload_lora_adapter":
            state["loaded"].discard(body["lora_name"])
            return self.reply(200, {"ok": True})
        if body["model"] not in state["loaded"] | {"base"}:
            return self.reply(404, {"error": f"model {body['model']} not found"})
        return self.reply(200, {"choices": [{"text": "x", "token_ids": [5, body["prompt"][0]],
                                             "finish_reason": "length"}]})


def test_adapters_are_registered_on_every_server(tiny_tokenizer, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    with loopback(_LoraServer, {"calls": [], "loaded": set()}) as (a, first), \
            loopback(_LoraServer, {"calls": [], "loaded": set()}) as (b, second):
        params = validate_params({"engine": {"backend": "openai", "base_url": [a, f"{b}/v1"]}})
        engine = make_engine(params, "policy", tokenizer=tiny_tokenizer)
        engine.prompt_format = "tokens"
        assert engine.add_adapter("solver", folder, version=1) == "solver@1"
        assert first["loaded"] == second["loaded"] == {"solver@1"}
        out = engine.generate([[k] for k in range(10, 16)], Sampling(max_new_tokens=2), adapter="solver")
        assert [c.token_ids[-1] for c in out] == list(range(10, 16))   # the batch's order survives the split
        served = [sorted(body["prompt"][0] for path, body in state["calls"] if path == "/v1/completions")
                  for state in (first, second)]
        assert served == [[10, 11, 12], [13, 14, 15]]             # contiguous shares: groups stay together
        engine.add_adapter("solver", folder, version=2)           # the new version everywhere, the old one out
        assert first["loaded"] == second["loaded"] == {"solver@2"}
        engine.close()


def test_vllm_parallelism_reaches_the_engine(monkeypatch, tiny_tokenizer):
    """engine.tensor_parallel_size and engine.data_parallel_size reach vllm.LLM's arguments (recorded by a
    stand-in for VLLMEngine: vLLM itself needs CUDA)."""
    import scope_lib.models.loading as loading

    seen = {}
    monkeypatch.setattr(loading, "VLLMEngine", lambda model, **kwargs: seen.update(kwargs) or "engine")
    params = validate_params({"engine": {"backend": "vllm", "tensor_parallel_size": 2, "data_parallel_size": 4}})
    assert make_engine(params, "policy", tokenizer=tiny_tokenizer) == "engine"
    assert seen["tensor_parallel_size"] == 2 and seen["data_parallel_size"] == 4
    seen.clear()
    make_engine(validate_params({"engine": {"backend": "vllm"}}), "policy", tokenizer=tiny_tokenizer)
    assert seen["tensor_parallel_size"] == 1 and "data_parallel_size" not in seen   # vLLM's own default
