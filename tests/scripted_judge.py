"""A test double of the benchmark judge: reads a judge prompt (our templates in scope_lib/prompts/eval and the SCOPE
grader) and answers in that benchmark's format with a deterministic verdict, so `scope eval` can run end to end
without a model. The first sample of every WildBench request is garbage, so the retry path runs too.

Where a calibration probe checks the judge it reads, as a judge one can trust does: the short-form grader says 1
when the response holds one of the rubric's gold answers, the criterion graders say a fact criterion ("Identifies
X by name.") is met when the reply names X, and the pairwise judge calls identical answers a tie and otherwise
prefers the longer one. Other criteria get a fixed verdict by the criterion's length.

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


_FACT_CRITERION = re.compile(r"Identifies (.+) by name\.")


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def _holds(response: str, phrase: str) -> bool:
    return bool(_normal(phrase)) and f" {_normal(phrase)} " in f" {_normal(response)} "


def _criterion_met(text: str) -> bool:
    criterion = _between(_between(text, "<criterion", "</criterion>"), ">", "\0")
    reply = _between(text, "<reply>", "</reply>") if "<reply>" in text else _between(text, "<report>", "</report>")
    fact = _FACT_CRITERION.fullmatch(criterion.strip())
    if fact:
        return _holds(reply, fact.group(1))
    attribute = _between(text, "weight=", "</criterion>") if "weight=" in text else _between(text, "points=", "</criterion>")
    return len(attribute.strip()) % 2 == 0


def _arena(text: str) -> str:
    a = _between(text, "[Assistant A]\n", "\n[End of Assistant A]")
    b = _between(text, "[Assistant B]\n", "\n[End of Assistant B]")
    verdict = "A=B" if a == b else ("A>B" if len(a) > len(b) else "B>A")
    return f"Comparing the two replies. [[{verdict}]]"


def judge_reply(messages: list[dict[str, str]], seen: int) -> str:
    """The reply to a judge prompt; `seen` = how often this exact prompt was asked before."""
    text = messages[-1]["content"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    if "impartial judge of two AI assistants" in system:
        return _arena(text)
    if "<rubric>" in text and "<score>" in text:            # the SCOPE grader (short-form QA)
        response = _between(text, "<response>", "</response>")
        golds = re.findall(r'"([^"]+)"', _between(text, "<rubric>", "</rubric>"))
        return f"<think>checking</think>\n<score>{int(any(_holds(response, g) for g in golds))}</score>"
    if "against ONE rubric criterion" in text or "against ONE evaluation criterion" in text:
        return json.dumps({"explanation": "deterministic", "criteria_met": _criterion_met(text)})
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
        text = state.get("reply", judge_reply)(body["messages"], seen)
        self.reply(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 50, "completion_tokens": 10}})


@contextmanager
def scripted_judge_server(reply=judge_reply):
    """A loopback /v1/chat/completions endpoint answering with `reply(messages, seen)` (default `judge_reply`);
    yields (base_url, state)."""
    with loopback(_Handler, {"bodies": [], "seen": {}, "authorization": None, "reply": reply}) as served:
        yield served


class ScriptedJudgeBackend:
    """The same replies in process (a `BenchmarkJudge` back end); `reply` replaces `judge_reply`."""

    name = "scripted"

    def __init__(self, reply=judge_reply):
        self.seen: dict[str, int] = {}
        self.requests = []
        self.reply = reply

    def send(self, requests, on_reply):
        from scope_lib.evaluation.judge import JudgeReply

        for i, r in enumerate(requests):
            key = json.dumps(r.messages, sort_keys=True)
            seen = self.seen.get(key, 0)
            self.seen[key] = seen + 1
            self.requests.append(r)
            on_reply(i, JudgeReply(self.reply(r.messages, seen), r.key, prompt_tokens=50, completion_tokens=10))


def fixed_reply(verdict: bool | None):
    """A judge that does not read: the same verdict to every prompt in each prompt's own format (True: yes, "A is
    better"; False: no, "B is better"; None: an unparseable sentence)."""

    def reply(messages: list[dict[str, str]], seen: int) -> str:
        if verdict is None:
            return "Hard to say; both have merits."
        text = messages[-1]["content"]
        system = messages[0]["content"] if messages[0]["role"] == "system" else ""
        if "impartial judge of two AI assistants" in system:
            return "[[A>B]]" if verdict else "[[B>A]]"
        if "<score>" in text:
            return f"<think>no need to read</think>\n<score>{int(verdict)}</score>"
        return json.dumps({"explanation": "no need to read", "criteria_met": verdict})

    return reply
