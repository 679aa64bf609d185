"""Tool calls on the wire, through a real server on the default tiny model and the openai SDK (issue 48): the
built-in model's context takes a tools prompt and a long answer; a streamed call sends no empty content deltas
while its markup is held back; a call cut by max_tokens comes back with the arguments it has (issue 62; complete
ones whole), never as raw DSML; Responses lists no empty message item before function_call items and marks a cut
message "incomplete", a cut call's item too."""

from __future__ import annotations

import concurrent.futures as cf
import json
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, Server, joined

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"]}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                         "parameters": PARAMS}}  # fmt: skip
MSGS = [{"role": "user", "content": "Weather in Paris and Rome?"}]
REQUIRED = {"model": MODEL, "messages": MSGS, "tools": [TOOL], "tool_choice": "required", "temperature": 1.0}
# A short call (the tiny tokenizer spends a token on nearly every DSML character): the truncation tests below.
SHORT = {"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"d": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["d"]}}}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def _args(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 9, args
    return args


def test_default_model_takes_a_tools_request(server: Server, client: openai.OpenAI) -> None:
    """tool_choice "required" with max_tokens 400 on the default model: answered with a call (was a 400: its
    1,024 positions could not hold the tools prompt and 400 tokens)."""
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["max_model_len"] >= 8192
    r = client.chat.completions.create(**REQUIRED, max_tokens=400, seed=0, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and r.usage.prompt_tokens > 700, r
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _args(choice.message.tool_calls[0])
    assert not choice.message.content


def test_streamed_call_sends_no_empty_deltas(client: openai.OpenAI) -> None:
    """While the markup is held back nothing is sent: every chunk carries text, a call or the finish reason;
    a call's chunk has content null, as OpenAI's."""
    kw = {**REQUIRED, "max_tokens": 400, "seed": 0, "parallel_tool_calls": False}
    with cf.ThreadPoolExecutor(2) as ex:  # one batch of two rows
        whole_f = ex.submit(client.chat.completions.create, **kw)
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        whole = whole_f.result()
    choices = [c.choices[0] for c in chunks if c.choices]
    empty = [ch for ch in choices if not (ch.delta.content or ch.delta.tool_calls or ch.finish_reason)]
    assert not empty, empty[:3]
    # As OpenAI: content null (or absent) beside tool_calls, and no chunk's content an empty string.
    assert all(ch.delta.content is None for ch in choices if ch.delta.tool_calls)
    assert not [ch for ch in choices if ch.delta.content == ""], choices
    calls = joined(choices)
    assert [c["name"] for c in calls] == ["get_weather"] and choices[-1].finish_reason == "tool_calls"
    assert choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens > len(choices)  # tokens were generated with nothing to send
    assert calls[0]["arguments"] == whole.choices[0].message.tool_calls[0].function.arguments


def greedy(question: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "tools": [SHORT],
            "tool_choice": "required", "temperature": 0}  # fmt: skip


@dataclass
class TwoCalls:
    """A greedy answer with two or more calls, in token counts (with logprobs every token has its chunk)."""

    question: str
    first_end: int  # tokens up to the end of the first call
    first: dict[str, Any]  # the first call: name, arguments
    second_args: int  # tokens up to the second call's first arguments piece
    second_piece: str  # that piece


@pytest.fixture(scope="module")
def two_calls(client: openai.OpenAI) -> TwoCalls:
    """Eight questions a batch (8 rows) until one's greedy answer holds two calls."""

    def two(question: str) -> TwoCalls | None:
        chunks = client.chat.completions.create(**greedy(question), max_tokens=500, logprobs=True, stream=True)
        choices = [c.choices[0] for c in chunks if c.choices]
        calls = joined(choices)
        if len(calls) < 2:
            return None
        at = [(i, tc) for i, ch in enumerate(choices) for tc in ch.delta.tool_calls or ()]
        end = max(i for i, tc in at if tc.index == 0) + 1
        i2, piece = next((i, tc.function.arguments) for i, tc in at if tc.index == 1 and tc.function.arguments)
        return TwoCalls(question, end, calls[0], i2 + 1, piece)

    with cf.ThreadPoolExecutor(8) as ex:
        for batch in range(3):
            questions = [f"Weather in Paris and Rome? ({batch * 8 + i})" for i in range(8)]
            for found in ex.map(two, questions):
                if found:
                    return found
    pytest.fail("no question of 24 gave two calls")


def _calls(msg: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in msg.tool_calls or ()]


def test_cut_call_comes_back_partial(client: openai.OpenAI, two_calls: TwoCalls) -> None:
    """max_tokens inside the second call, at its first arguments piece: finish "length", the first call whole and
    the second with the arguments it has (was dropped), no DSML in the content, whole and streamed alike."""
    t = two_calls
    kw = {**greedy(t.question), "max_tokens": t.second_args}
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == t.second_args
    want = [(t.first["name"], t.first["arguments"]), ("w", t.second_piece)]
    assert _calls(choice.message) == want and not choice.message.content, choice.message
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert [(c["name"], c["arguments"]) for c in joined(chunks)] == want
    assert "".join(ch.delta.content or "" for ch in chunks) == "" and chunks[-1].finish_reason == "length"


def test_cut_inside_the_first_call(client: openai.OpenAI, two_calls: TwoCalls) -> None:
    """max_tokens a few tokens before the first call's end: that call alone, its arguments a proper prefix of the
    whole call's, nothing raw in the content."""
    t = two_calls
    r = client.chat.completions.create(**greedy(t.question), max_tokens=t.first_end - 3)
    choice = r.choices[0]
    [(name, args)] = _calls(choice.message)
    assert choice.finish_reason == "length" and name == t.first["name"] and not choice.message.content
    assert t.first["arguments"].startswith(args) and args != t.first["arguments"], (args, t.first)


def _respond(client: openai.OpenAI, question: str, max_output_tokens: int, stream: bool, **kw: Any) -> Any:
    """The Responses twin of `greedy(question)`: the final response object, and the events when streamed."""
    tool = {"type": "function", **SHORT["function"]}
    kw = {"model": MODEL, "input": question, "tools": [tool], "tool_choice": "required", "temperature": 0,
          "max_output_tokens": max_output_tokens, **kw}  # fmt: skip
    if not stream:
        return client.responses.create(**kw), []
    events = list(client.responses.create(**kw, stream=True))
    return events[-1].response, events


def test_responses_calls_without_an_empty_message(client: openai.OpenAI, two_calls: TwoCalls) -> None:
    """A turn of tool calls only: a function_call item and no message item before it, whole and streamed."""
    t = two_calls
    with cf.ThreadPoolExecutor(2) as ex:
        whole_f = ex.submit(_respond, client, t.question, 400, False, parallel_tool_calls=False)
        streamed, events = _respond(client, t.question, 400, True, parallel_tool_calls=False)
        whole, _ = whole_f.result()
    assert whole.status == "completed"
    assert [(o.type, o.status, o.arguments) for o in whole.output] == [
        ("function_call", "completed", t.first["arguments"])]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.item.type, e.output_index) for e in added] == [("function_call", 0)]
    assert [(o.type, o.status, o.name, o.arguments) for o in streamed.output] == [
        ("function_call", "completed", "w", t.first["arguments"])]


def test_responses_cut_call(client: openai.OpenAI, two_calls: TwoCalls) -> None:
    """max_output_tokens at the second call's first arguments piece: an "incomplete" response, the first call
    "completed", the second "incomplete" with that piece; streamed, its item opened with the name and its delta
    events carry the same arguments."""
    t = two_calls
    with cf.ThreadPoolExecutor(2) as ex:  # one batch
        runs = [f.result() for f in [ex.submit(_respond, client, t.question, t.second_args, s) for s in (0, 1)]]
    for r, _ in runs:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert [(o.type, o.status, o.arguments) for o in r.output] == [
            ("function_call", "completed", t.first["arguments"]), ("function_call", "incomplete", t.second_piece)]
    events = runs[1][1]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == 1]
    assert "".join(deltas) == t.second_piece
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.status, i.arguments) for i in done] == [(o.status, o.arguments) for o in runs[1][0].output]


def test_responses_cut_message_is_incomplete(client: openai.OpenAI, two_calls: TwoCalls) -> None:
    """max_output_tokens before the first call's name is complete: an "incomplete" response whose one message
    item is "incomplete" and holds no markup."""
    t = two_calls
    with cf.ThreadPoolExecutor(2) as ex:  # one batch
        cut = [ex.submit(_respond, client, t.question, 8, stream) for stream in (False, True)]
        for r, _ in (f.result() for f in cut):
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
            assert [(o.type, o.status) for o in r.output] == [("message", "incomplete")], r.output
            assert r.output_text == ""
