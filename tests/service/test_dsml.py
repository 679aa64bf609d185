"""DeepSeek-V4 prompts and DSML tool calls against the release's reference encoder (tests/fixtures)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.api.encoding import encode_messages
from service.api.tools import ToolStream, parse_completion
from tests.fixtures import encoding_dsv4 as ref

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {"name": "search", "description": "Web search, ünïcode", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}}},
}
NOARGS = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


SYS = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "Weather in Paris and Rome?"}
A_CALLS = {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
           "tool_calls": [call("c1", "get_weather", {"city": "Paris", "days": 2}),
                          call("c2", "get_weather", {"city": "Rome"})]}
T1 = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
T2 = {"role": "tool", "tool_call_id": "c2",
      "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "wind"}]}

# (messages, tools, thinking, reasoning_effort)
CASES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool, str | None]] = [
    ([U1], None, False, None),
    ([SYS, U1], [WEATHER], False, None),
    ([U1], [WEATHER, SEARCH, NOARGS], True, None),
    ([SYS, U1, A_CALLS, T1, T2], [WEATHER], False, None),
    ([SYS, U1, A_CALLS, T2, T1], [WEATHER], True, None),  # results sorted back into call order
    ([SYS, U1, A_CALLS, T1, T2, {"role": "assistant", "content": "Sunny, then rain.",
                                 "reasoning_content": "Summarise."}, {"role": "user", "content": "Thanks"}],
     [WEATHER], True, "max"),
    ([SYS, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "r1"},
      {"role": "user", "content": "again"}], None, True, None),  # no tools: earlier reasoning dropped
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None, False, None),  # one user turn
    ([{"role": "developer", "content": "dev rules"}, U1, {"role": "assistant", "content": "x"},
      {"role": "developer", "content": "later rules"}], None, True, "high"),
    ([U1, {"role": "assistant", "content": None, "tool_calls": [call("n1", "now", {})]},
      {"role": "tool", "tool_call_id": "n1", "content": "12:00"}, {"role": "user", "content": "and now?"}],
     [NOARGS], False, None),
    ([U1, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        call("s1", "search", {"q": "a \"quoted\" query", "filters": {"lang": ["en", "fr"], "n": 3}})]},
      {"role": "tool", "tool_call_id": "s1", "content": "{\"hits\": 0}"}], [SEARCH], True, None),
    ([SYS, U1, A_CALLS, T1, T2], None, True, "max"),  # tool history without tools declared
]


def ref_prompt(messages: list[dict[str, Any]], tools: Any, thinking: bool, effort: str | None) -> str:
    msgs = [dict(m) for m in messages]
    if tools:
        if msgs[0]["role"] == "system":
            msgs[0]["tools"] = tools
        else:
            msgs.insert(0, {"role": "system", "content": "", "tools": tools})
    return ref.encode_messages(msgs, thinking_mode="thinking" if thinking else "chat", reasoning_effort=effort)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_prompt_equals_reference(case: int) -> None:
    messages, tools, thinking, effort = CASES[case]
    ours = encode_messages(messages, tools=tools, thinking=thinking, reasoning_effort=effort)
    assert ours == ref_prompt(messages, tools, thinking, effort)


COMPLETIONS = [
    "Just text." + ref.eos_token,
    "Checking.\n\n" + ref.tool_calls_template.format(dsml_token=ref.dsml_token, tc_block_name="tool_calls",
        tool_calls="\n".join(ref.tool_call_template.format(dsml_token=ref.dsml_token, name=c["function"]["name"],
                             arguments=ref.encode_arguments_to_dsml(c["function"])) for c in A_CALLS["tool_calls"]))
    + ref.eos_token,
]


def assistant_texts() -> list[str]:
    """Assistant turns as the reference encoder writes them (chat mode), each a completion text."""
    out = [c for c in COMPLETIONS]
    for m in (A_CALLS, CASES[9][0][1], CASES[10][0][1]):
        p = ref.encode_messages([{"role": "user", "content": "q"}, m], thinking_mode="chat")
        out.append(p.split(ref.ASSISTANT_SP_TOKEN + ref.thinking_end_token, 1)[1])
    return out


@pytest.mark.parametrize("text", assistant_texts())
def test_parse_equals_reference(text: str) -> None:
    want = ref.parse_message_from_completion_text(text, thinking_mode="chat")
    body = text.removesuffix(ref.eos_token)
    content, calls = parse_completion(body)
    assert content == want["content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want["tool_calls"]
    ]
    # Streamed in small pieces: the same content and calls, indices in order.
    st, got_content, got_calls = ToolStream(), "", []
    for i in range(0, len(body), 3):
        c, cs = st.push(body[i : i + 3])
        got_content += c
        got_calls += cs
    got_content += st.finish()
    assert got_content == want["content"]
    assert [c["index"] for c in got_calls] == list(range(len(got_calls)))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_broken_markup_is_content() -> None:
    text = ("Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\nnot a parameter\n</｜DSML｜invoke>\n"
            "</｜DSML｜tool_calls>")
    assert parse_completion(text) == (text, [])
    st = ToolStream()
    out = "".join(st.push(text[i : i + 5])[0] for i in range(0, len(text), 5)) + st.finish()
    assert out == text and not st.calls
