"""scope_lib.evaluation.judge: the benchmark judge over /v1/chat/completions (a loopback server with a scripted reply
function, and a real `transformers serve`), the local-engine judge, the on-disk cache, accounting, retries and
credentials that never reach a file or a log."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from servers import JSONHandler, free_port, loopback, server_process

from scope_lib.evaluation.judge import (
    BenchmarkJudge,
    ChatCompletionsBackend,
    JudgeCache,
    JudgeRequest,
    JudgeSettings,
    JudgeUnavailable,
    LocalEngineBackend,
)

SECRET = "sk-judge-TOPSECRET-9876543210"


class ChatServer(JSONHandler):
    """/v1/chat/completions answered by `state["reply"](body, n)` -> (status, payload, headers); records bodies and
    the Authorization header; tracks requests in flight."""

    def do_POST(self):
        state = self.server.state
        body = self.read_json()
        with state["lock"]:
            state["bodies"].append(body)
            state["auth"] = self.headers.get("Authorization")
            n = len(state["bodies"])
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            time.sleep(state.get("delay", 0.0))
            status, payload, headers = state["reply"](body, n)
        finally:
            with state["lock"]:
                state["in_flight"] -= 1
        self.reply(status, payload, headers)


def ok(text, prompt_tokens=100, completion_tokens=20, reasoning=5):
    return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "completion_tokens_details": {"reasoning_tokens": reasoning}}}, {}


@contextmanager
def chat_server(reply, **state):
    with loopback(ChatServer, {"bodies": [], "reply": reply, "in_flight": 0, "max_in_flight": 0, **state}) as served:
        yield served


def request(text, model="judge-m", effort=None, sample=0, tag="bench/scorer", max_tokens=256):
    return JudgeRequest([{"role": "user", "content": text}], JudgeSettings(model, 1.0, effort, max_tokens), "tpl@1",
                        sample, tag)


def test_requests_cache_and_accounting(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    with chat_server(lambda body, n: ok(f"echo {body['messages'][0]['content']}"), delay=0.05) as (url, state):
        backend = ChatCompletionsBackend(url + "/v1", api_key_env="JUDGE_KEY", concurrency=4)
        judge = BenchmarkJudge(backend, JudgeCache(tmp_path / "cache.sqlite"), prices={"judge-m": (1.0, 2.0)})
        batch = [request(f"q{k}", effort="high" if k == 0 else None) for k in range(8)] + [request("q1")]
        replies = judge.complete(batch)
        assert [r.text for r in replies] == [f"echo q{k}" for k in range(8)] + ["echo q1"]
        assert len(state["bodies"]) == 8                     # the repeated request went out once
        assert state["max_in_flight"] > 1 and state["max_in_flight"] <= 4
        first = next(b for b in state["bodies"] if b["messages"][0]["content"] == "q0")
        assert first["reasoning_effort"] == "high" and first["max_completion_tokens"] == 256
        assert first["model"] == "judge-m" and first["temperature"] == 1.0
        assert all("reasoning_effort" not in b for b in state["bodies"] if b is not first)
        assert state["auth"] == f"Bearer {SECRET}"
        usage = judge.usage["bench/scorer"]
        assert (usage.requests, usage.cached, usage.prompt_tokens, usage.completion_tokens) == (8, 1, 800, 160)
        assert usage.reasoning_tokens == 40 and usage.cost_usd == pytest.approx((800 * 1 + 160 * 2) / 1e6)
        # the same requests again: all from the cache; a new sample index is a new request
        again = BenchmarkJudge(backend, JudgeCache(tmp_path / "cache.sqlite"))
        assert [r.text for r in again.complete(batch)] == [r.text for r in replies]
        assert len(state["bodies"]) == 8 and again.sent == 0 and all(r.cached for r in again.complete(batch))
        again.complete([request("q0", effort="high", sample=1)])
        assert len(state["bodies"]) == 9
        backend.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("cache.sqlite*"))     # the database and its WAL
    assert SECRET.encode() not in raw and b"echo q3" in raw


def test_retries_rate_limits_and_server_errors(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    def flaky(body, n):
        if n == 1:
            return 429, {"error": "slow down"}, {"Retry-After": "0.3"}
        if n == 2:
            return 503, {"error": "restarting"}, {}
        return ok("fine")

    with chat_server(flaky) as (url, state):
        backend = ChatCompletionsBackend(url, concurrency=1, backoff_s=0.01, max_retries=3)
        started = time.monotonic()
        [reply] = BenchmarkJudge(backend).complete([request("x")])
        assert reply.text == "fine" and len(state["bodies"]) == 3
        assert time.monotonic() - started >= 0.28            # waited for Retry-After, not the 0.04 s backoff
    with chat_server(lambda body, n: (500, {"error": "down"}, {})) as (url, state):
        backend = ChatCompletionsBackend(url, concurrency=1, backoff_s=0.01, max_retries=2)
        with pytest.raises(JudgeUnavailable, match=r"no usable reply after 3 attempt.*evaluation.judge_base_url"):
            BenchmarkJudge(backend).complete([request("x")])
    closed = ChatCompletionsBackend(f"http://127.0.0.1:{free_port()}", backoff_s=0.01, max_retries=1, timeout_s=2)
    with pytest.raises(JudgeUnavailable, match="judge is running and reachable"):
        BenchmarkJudge(closed).complete([request("x")])


def test_a_rejected_request_is_an_error_reply_not_a_crash(tmp_path):
    def reply(body, n):
        if "too long" in body["messages"][0]["content"]:
            return 400, {"error": "context length exceeded"}, {}
        return ok("fine")

    with chat_server(reply) as (url, state):
        judge = BenchmarkJudge(ChatCompletionsBackend(url, backoff_s=0.01), JudgeCache(tmp_path / "c.sqlite"))
        replies = judge.complete([request("too long"), request("short")])
        assert replies[0].text == "" and "HTTP 400" in replies[0].error and replies[1].text == "fine"
        assert judge.usage["bench/scorer"].errors == 1
        judge.complete([request("too long")])                # errors are not cached: asked again
        assert len(state["bodies"]) == 3


@pytest.mark.parametrize("status", [401, 404])
def test_credentials_and_models_refused_stop_at_once_and_the_key_never_leaks(status, monkeypatch, caplog):
    caplog.set_level("DEBUG", logger="scope_lib.evaluation.judge")
    monkeypatch.setenv("JUDGE_KEY", SECRET)

    def echo(body, n):
        return status, {"error": f"no access for key {SECRET}", "authorization": f"Bearer {SECRET}"}, {}

    with chat_server(echo) as (url, state):
        backend = ChatCompletionsBackend(url, api_key_env="JUDGE_KEY", backoff_s=0.01)
        with pytest.raises(JudgeUnavailable) as raised:
            BenchmarkJudge(backend).complete([request("x")])
    assert len(state["bodies"]) == 1 and f"HTTP {status}" in str(raised.value) and "$JUDGE_KEY" in str(raised.value)
    assert SECRET not in str(raised.value) and "TOPSECRET" not in caplog.text
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(JudgeUnavailable, match="needs an API key: set the environment variable OPENAI_API_KEY"):
        ChatCompletionsBackend(None)


def test_local_engine_judge_batches_per_sample(tiny_model_dir, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from scope_lib.models.hf_engine import HFEngine

    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tiny_tokenizer)
    judge = BenchmarkJudge(LocalEngineBackend(engine, seed=3))
    reqs = [request(f"grade {k}", model="tiny", max_tokens=12) for k in range(3)] + \
        [request("grade 0", model="tiny", sample=1, max_tokens=12)]
    replies = judge.complete(reqs)
    assert engine.calls == 2                       # sample 0 in one batched call, sample 1 in another
    assert all(r.completion_tokens > 0 for r in replies) and replies[0].prompt_tokens > 0
    again = BenchmarkJudge(LocalEngineBackend(engine, seed=3)).complete(reqs)
    assert [r.text for r in again] == [r.text for r in replies]     # seeded by the sample index: reproducible
    assert replies[3].text != replies[0].text                       # another sample of the same request differs


@pytest.fixture(scope="module")
def served_judge(tiny_model_dir, tmp_path_factory):
    """`transformers serve` on loopback with the tiny model (CPU): an OpenAI-compatible chat endpoint."""
    cli = Path(sys.executable).with_name("transformers")
    if not cli.is_file() or importlib.util.find_spec("fastapi") is None:
        pytest.skip("`transformers serve` needs transformers[serving] (the `serving` extra)")
    port = free_port()
    log_path = tmp_path_factory.mktemp("judge_serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(log_path.parent / "hf")}
    command = [str(cli), "serve", str(tiny_model_dir), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]
    with server_process(command, f"http://127.0.0.1:{port}/health", log_path, env=env):
        yield f"http://127.0.0.1:{port}"


def test_judge_against_transformers_serve(served_judge, tiny_model_dir, tmp_path):
    backend = ChatCompletionsBackend(served_judge, concurrency=2, backoff_s=0.05, max_retries=1,
                                     token_field="max_tokens")
    judge = BenchmarkJudge(backend, JudgeCache(tmp_path / "c.sqlite"))
    reqs = [JudgeRequest([{"role": "user", "content": f"Is {k} even? Answer <score>1</score> or <score>0</score>."}],
                         JudgeSettings(str(tiny_model_dir), 1.0, None, 8), "tpl@1", 0, "t") for k in range(3)]
    replies = judge.complete(reqs)
    assert all(r.error is None and r.text and r.completion_tokens > 0 for r in replies), replies
    assert judge.sent == 3 and judge.complete(reqs)[0].cached
    backend.close()


def test_scope_eval_against_a_served_judge(served_judge, tiny_model_dir, shared_data, tmp_path):
    """`scope eval` with the judge served by `transformers serve` (the tiny model: its verdicts rarely parse, so
    they are retried and counted as invalid — the point is the real HTTP path end to end). The tiny judge fails its
    calibration probe: accepted here, its scores are marked untrusted."""
    from scope_lib.cli import main

    repo = Path(__file__).resolve().parents[1]
    spec = tmp_path / "eval.yaml"
    spec.write_text(
        f"inherit: {repo / 'params' / 'smoke.yaml'}\n"
        f"run: {{name: served, runs_dir: {tmp_path}, data_dir: {shared_data}}}\n"
        "retrieval: {embedder: hashing}\n"
        "evaluation:\n  benchmarks: [nq]\n  max_examples: 2\n  max_searches: 1\n  max_answer_tokens: 16\n"
        "  bootstrap_samples: 10\n  judge_backend: openai\n"
        f"  judge_base_url: {served_judge}\n  judge_token_field: max_tokens\n"
        f"  short_form_judge: {{model: {tiny_model_dir}, max_tokens: 8}}\n")
    assert main(["eval", str(spec), "--accept-untrusted-judge"]) == 0
    summary = json.loads((tmp_path / "served" / "eval" / "base" / "nq" / "summary.json").read_text())
    assert summary["scorers"]["scope_paper"]["trusted"] is False
    usage = summary["judge_usage"]["scope_paper"]
    assert usage["requests"] >= 2 and usage["errors"] == 0 and usage["completion_tokens"] > 0
    assert summary["scorers"]["scope_paper"]["n_units"] == 2
    records = [json.loads(line) for line in (tmp_path / "served" / "eval" / "base" / "nq" / "items.jsonl").open()]
    units = [u for r in records for u in r["scores"]["scope_paper"]["units"]]
    # Every attempt is recorded with its cache key and no transport error. A sampled tiny model may legitimately
    # answer with nothing (EOS first), so emptiness is judged over the run, not per reply.
    assert units and all(u["replies"] and len(u["replies"]) == len(u["request_keys"]) and not u["errors"]
                         for u in units)
    assert any(reply for u in units for reply in u["replies"])
