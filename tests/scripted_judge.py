"""A test double of the benchmark judge: reads a judge prompt (our templates in scope_lib/prompts/eval and the SCOPE
grader) and answers in that benchmark's format with a deterministic verdict, so `scope eval` can run end to end
without a model. The first sample of every WildBench request is garbage, so the retry path runs too.

Only for tests: it drives the evaluation's logic; it is never the product.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager

from servers import JSONHandler, loopback

DIMENSIONS = ("comprehensiveness", "insight", "instruction_following", "readability")


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[-1].split(end, 1)[0]


def _race(text: str) -> str:
    listing = _between(text, "numbered within each dimension:\n", "\n\nFor every criterion")
    reference = "<report_2>" in text
    out = {}
    for dim in DIMENSIONS:
        block = _between(listing, f"{dim}:\n", "\n\n") if f"{dim}:\n" in listing else ""
        block = re.split(r"\n(?=[a-z_]+:\n)", block)[0]
        count = len(re.findall(r"^\s+\d+\. ", block, re.M))
        out[dim] = [{"criterion": k, "report_1": 6.0, **({"report_2": 4.0} if reference else {})}
                    for k in range(1, count + 1)]
    return json.dumps(out)


def judge_reply(messages: list[dict[str, str]], seen: int) -> str:
    """The reply to a judge prompt; `seen` = how often this exact prompt was asked before."""
    text = messages[-1]["content"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    if "impartial judge of two AI assistants" in system:
        return "Assistant B follows the request more closely. [[B>A]]"
    if "<rubric>" in text and "<score>" in text:            # the SCOPE grader (short-form QA)
        response = _between(text, "<response>", "</response>")
        return f"<think>checking</think>\n<score>{int(bool(response.strip()))}</score>"
    if "against ONE rubric criterion" in text or "against ONE evaluation criterion" in text:
        criterion = _between(text, "weight=", "</criterion>") if "weight=" in text else _between(text, "points=", "</criterion>")
        return json.dumps({"explanation": "deterministic", "criteria_met": len(criterion.strip()) % 2 == 0})
    if "covers each item of a rubric" in text:
        count = int(re.search(r"Write exactly (\d+) line", text).group(1))
        return "\n".join(f"{k}: Mostly" for k in range(1, count + 1))
    if "covers a list of required ingredients" in text:
        count = int(re.search(r"Write exactly (\d+) line", text).group(1))
        return "\n".join(f"{k}: 1" for k in range(1, count + 1))
    if "last user message of a conversation" in text:
        return "I think it is fine." if seen == 0 else '{"strengths": "s", "weaknesses": "w", "score": "6"}'
    if "scoring research reports written for the same task" in text:
        return _race(text)
    if "grading a research report written for the task" in text:
        return '{"depth": 3, "structure": 4, "relevance": 5, "accuracy": 2, "completeness": 1}'
    if "grading an answer to a scientific question" in text:
        return '{"score": 4}'
    return "I cannot tell what this prompt wants."


class _Handler(JSONHandler):
    def do_POST(self):
        state = self.server.state
        body = self.read_json()
        key = json.dumps(body["messages"], sort_keys=True)
        with state["lock"]:
            state["bodies"].append(body)
            state["authorization"] = self.headers.get("Authorization")
            seen = state["seen"].get(key, 0)
            state["seen"][key] = seen + 1
        text = judge_reply(body["messages"], seen)
        self.reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 50, "completion_tokens": 10}})


@contextmanager
def scripted_judge_server():
    """A loopback /v1/chat/completions endpoint answering with `judge_reply`; yields (base_url, state)."""
    with loopback(_Handler, {"bodies": [], "seen": {}, "authorization": None}) as served:
        yield served


class ScriptedJudgeBackend:
    """The same replies in process (a `BenchmarkJudge` back end)."""

    name = "scripted"

    def __init__(self):
        self.seen: dict[str, int] = {}
        self.requests = []

    def send(self, requests, on_reply):
        from scope_lib.evaluation.judge import JudgeReply

        for i, r in enumerate(requests):
            key = json.dumps(r.messages, sort_keys=True)
            seen = self.seen.get(key, 0)
            self.seen[key] = seen + 1
            self.requests.append(r)
            on_reply(i, JudgeReply(judge_reply(r.messages, seen), r.key, prompt_tokens=50, completion_tokens=10))
