"""Model dialects: how each model family writes a search and reads its results (paper Table 11).

Only the search action differs between families; tasks (<task>) and answers (<answer>) are XML for all.

| dialect | search action                                                    | results come back as          |
|---------|------------------------------------------------------------------|-------------------------------|
| qwen2.5 | <search>query</search>                                           | user turn <information>…      |
| qwen3   | <tool_call>{"name": "search", "arguments": {"query": …}}</tool_call> | tool turn (<tool_response>) |
| olmo3   | <function_calls>search(query="…")</function_calls>               | tool turn ("environment")     |

SmolLM2 (ChatML, no tool role in its template) speaks qwen2.5: its searches come back as a user turn.

Parsing is positional, like the models' own servers: the first action outside thinking is the turn's action.
Thinking is what `scope_lib.protocol.parsing` hides from tasks and answers: complete <think> blocks, a block left
open at the end, and (with `starts_in_think`, when the chat template opened <think>) everything before the first
</think>. The first closer pairs with the NEAREST opener before it, as tasks and answers do: in
"I will use <search> now. <search>q</search>" the action is the search for "q". Every parser here is total: it
never raises on any text.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from scope_lib.protocol.parsing import strip_think

ActionKind = Literal["search", "malformed", "none"]

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_SENTINEL = "\u2063SCOPE-ASSISTANT-SENTINEL\u2063"


@dataclass(frozen=True)
class SearchAction:
    """The search action of one assistant turn: a valid search (with its query), a malformed attempt
    (the tag is there but the call is unusable), or none at all."""

    kind: ActionKind
    query: str | None = None

    @property
    def valid(self) -> bool:
        return self.kind == "search"


NO_ACTION = SearchAction("none")
MALFORMED = SearchAction("malformed")


@dataclass(frozen=True)
class Dialect:
    """One model family's protocol. Subclasses differ in the search action and the results turn."""

    name: str
    search_open: str
    search_close: str
    search_example: str
    results_description: str
    results_role: str
    strips_earlier_thinking: bool = False

    # -- what the model writes ---------------------------------------------------------------------
    def format_search(self, query: str) -> str:
        raise NotImplementedError

    def parse_query(self, body: str) -> str | None:
        """The query inside one action's body, or None when the body is unusable."""
        raise NotImplementedError

    def parse_search(self, text: Any, *, starts_in_think: bool = False) -> SearchAction:
        """The first search action outside thinking (positional parsing): the first closer after an opener, with
        the nearest opener before it (an opener mentioned earlier in the text is not part of the action).
        `starts_in_think`: the chat template opened <think> (`parsing.strip_think`)."""
        if not isinstance(text, str):
            return NO_ACTION
        visible = strip_think(text, starts_in_think=starts_in_think)
        start = visible.find(self.search_open)
        if start < 0:
            return NO_ACTION
        end = visible.find(self.search_close, start + len(self.search_open))
        if end < 0:
            return MALFORMED
        start = visible.rfind(self.search_open, start, end)
        query = self.parse_query(visible[start + len(self.search_open):end])
        return SearchAction("search", query) if query else MALFORMED

    def count_searches(self, turns: list[str], *, starts_in_think: bool = False) -> tuple[int, int]:
        """(valid, malformed) search actions over assistant turns, one action per turn at most."""
        kinds = [self.parse_search(t, starts_in_think=starts_in_think).kind for t in turns]
        return kinds.count("search"), kinds.count("malformed")

    # -- stop strings ------------------------------------------------------------------------------
    def challenger_stops(self) -> tuple[str, ...]:
        return ("</task>", self.search_close)

    def solver_stops(self) -> tuple[str, ...]:
        return ("</answer>", self.search_close)

    # -- what the environment writes ---------------------------------------------------------------
    def results_message(self, formatted_results: str) -> dict[str, str]:
        """The chat message that carries one search's (already neutralised) results."""
        raise NotImplementedError

    def environment_text(self, tokenizer, messages: list[dict[str, str]]) -> str:
        """Text the environment appends after an assistant turn that stopped at a stop string: the end of
        that assistant turn, the environment's messages, and the next assistant header.

        Derived from the tokenizer's own chat template, so any template renders correctly.
        """
        convo = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _SENTINEL}]
        full = tokenizer.apply_chat_template(convo + list(messages), tokenize=False, add_generation_prompt=True)
        _head, sep, tail = full.partition(_SENTINEL)
        if not sep:
            raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', tokenizer)!r} "
                             "dropped the assistant content; cannot derive environment turns")
        return tail

    def render_history(self, messages: list[dict[str, str]], keep_last: bool = True) -> list[dict[str, str]]:
        """Messages as the model sees them at inference: Qwen3 drops thinking from earlier assistant turns
        (App. E). With keep_last the final assistant turn (the one being trained on) keeps its thinking."""
        messages = [{**m, "content": m.get("content") if isinstance(m.get("content"), str) else ""}
                    for m in messages]  # a message without text content renders as empty, never raises
        if not self.strips_earlier_thinking:
            return messages
        assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        keep = assistant[-1] if keep_last and assistant else -1
        return [{**m, "content": strip_thinking(m["content"])} if m.get("role") == "assistant" and i != keep
                else m for i, m in enumerate(messages)]


def strip_thinking(text: Any) -> str:
    """Drop complete <think> blocks and a thinking prefix that ends in a lone </think>; non-text gives ""."""
    if not isinstance(text, str):
        return ""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text and "<think>" not in text:
        text = text.split("</think>", 1)[1]
    return text.strip()


class Qwen25Dialect(Dialect):
    def format_search(self, query: str) -> str:
        return f"<search>{query}</search>"

    def parse_query(self, body: str) -> str | None:
        query = body.strip()
        return query or None

    def results_message(self, formatted_results: str) -> dict[str, str]:
        return {"role": "user", "content": f"<information>{formatted_results}</information>"}


class Qwen3Dialect(Dialect):
    def format_search(self, query: str) -> str:
        call = {"name": "search", "arguments": {"query": query}}
        return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"

    def parse_query(self, body: str) -> str | None:
        try:
            call = json.loads(body.strip())
        except (ValueError, RecursionError):
            return None
        if not isinstance(call, dict) or call.get("name") != "search":
            return None
        args = call.get("arguments")
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        query = args.get("query") if isinstance(args, dict) else None
        return query.strip() or None if isinstance(query, str) else None

    def results_message(self, formatted_results: str) -> dict[str, str]:
        return {"role": "tool", "content": formatted_results}


_OLMO_CALL = re.compile(r"^\s*search\s*\(\s*query\s*=\s*(?P<lit>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')\s*\)\s*$",
                        re.DOTALL)


class Olmo3Dialect(Dialect):
    def format_search(self, query: str) -> str:
        return f"<function_calls>search(query={json.dumps(query, ensure_ascii=False)})</function_calls>"

    def parse_query(self, body: str) -> str | None:
        match = _OLMO_CALL.match(body)
        if not match:
            return None
        try:
            query = ast.literal_eval(match.group("lit"))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
        return query.strip() or None if isinstance(query, str) else None

    def results_message(self, formatted_results: str) -> dict[str, str]:
        return {"role": "tool", "content": formatted_results}


DIALECTS: dict[str, Dialect] = {
    "qwen2.5": Qwen25Dialect(
        name="qwen2.5", search_open="<search>", search_close="</search>",
        search_example="<search>your search query</search>",
        results_description="between <information> and </information>", results_role="user"),
    "qwen3": Qwen3Dialect(
        name="qwen3", search_open="<tool_call>", search_close="</tool_call>",
        search_example='<tool_call>\n{"name": "search", "arguments": {"query": "your search query"}}\n</tool_call>',
        results_description="in a tool response", results_role="tool", strips_earlier_thinking=True),
    "olmo3": Olmo3Dialect(
        name="olmo3", search_open="<function_calls>", search_close="</function_calls>",
        search_example='<function_calls>search(query="your search query")</function_calls>',
        results_description="in a message from the environment", results_role="tool"),
}


def detect_dialect(model_name: str) -> str:
    """The dialect a model family uses, from its hub id or path ('tiny' and SmolLM2 speak qwen2.5)."""
    name = model_name.lower().replace("_", "-")
    if "qwen3" in name:
        return "qwen3"
    if "olmo" in name:
        return "olmo3"
    if "qwen2" in name or "smollm" in name or name == "tiny":
        return "qwen2.5"
    raise ValueError(f"cannot tell the search dialect of model {model_name!r}; set model.dialect to one of "
                     f"{', '.join(DIALECTS)}")


def get_dialect(name: str, model_name: str = "") -> Dialect:
    """A dialect by name; 'auto' detects it from the model name."""
    key = detect_dialect(model_name) if name == "auto" else name
    if key not in DIALECTS:
        raise ValueError(f"unknown dialect {name!r}; choose one of auto, {', '.join(DIALECTS)}")
    return DIALECTS[key]


def thinks_natively(model_name: str) -> bool:
    """Whether a model writes its own <think> blocks without being asked: Qwen3 (but not its 2507
    Instruct releases) and models named as thinking variants (e.g. OLMo-3-7B-Think). 'tiny' does not."""
    name = str(model_name).lower()
    if "instruct-2507" in name:
        return False
    return "qwen3" in name or "think" in name
