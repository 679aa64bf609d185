"""Tool calls as they are generated (issue 62), through a real server on the tiny model: a call's id and name
arrive in a delta of their own before its arguments are complete, then the arguments in pieces whose concatenation
is the final arguments string; through the openai SDK's `chat.completions.stream(...)` helper, a raw SSE reader
and instructor's `create_partial`. The tools' schemas are closed (enums, bounded integers, booleans, short
strings): on the random tiny model a free-text string almost never ends."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import httpx
import instructor
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL, Server

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days", "note"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
    "maximum": 9}, "note": {"type": "string", "minLength": 4, "maxLength": 12}}}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "plan_trip", "strict": True, "parameters": PARAMS}}
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Plan a trip."}], "tools": [TOOL],
       "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 600, "temperature": 0}  # fmt: skip


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def test_sdk_stream_helper(client: openai.OpenAI) -> None:
    """`chat.completions.stream`: the first chunk with the call holds its id and name and not its arguments;
    several `tool_calls.function.arguments.delta` events follow, their pieces the final arguments."""
    with client.chat.completions.stream(**ASK) as stream:
        events = [(time.monotonic(), e) for e in stream]
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "plan_trip"
    assert call.function.parsed_arguments == json.loads(call.function.arguments)
    first = next((t, e.chunk) for t, e in events if e.type == "chunk" and e.chunk.choices[0].delta.tool_calls)
    head = first[1].choices[0].delta.tool_calls[0]
    assert head.id and head.function.name == "plan_trip" and head.function.arguments == ""
    deltas = [(t, e.arguments_delta) for t, e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) >= 4 and "".join(d for _, d in deltas) == call.function.arguments
    [(done_t, done)] = [(t, e) for t, e in events if e.type == "tool_calls.function.arguments.done"]
    assert done.arguments == call.function.arguments and first[0] <= deltas[0][0] <= done_t


def sse_chunks(server: Server, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """The data objects of a raw SSE stream, each with the time its line was read."""
    out = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append((time.monotonic(), json.loads(line[len("data: ") :])))
    return out


def test_raw_sse(server: Server, client: openai.OpenAI) -> None:
    """On the wire: the call's first delta (index, id, type, name, arguments "") in a chunk before any of its
    arguments; later deltas hold the index and an arguments piece only; they join to the non-streamed call's
    arguments (greedy: the same call); content null beside tool_calls."""
    chunks = sse_chunks(server, {**ASK, "stream": True})
    whole = client.chat.completions.create(**ASK).choices[0].message.tool_calls[0]
    deltas = [(t, c["choices"][0]["delta"]) for t, c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    (t0, head), rest = deltas[0], deltas[1:]
    assert head["tool_calls"] == [{"index": 0, "id": head["tool_calls"][0]["id"], "type": "function",
                                   "function": {"name": "plan_trip", "arguments": ""}}]  # fmt: skip
    assert head["content"] is None and head["tool_calls"][0]["id"].startswith("call_")
    assert len(rest) >= 4 and all(t >= t0 for t, _ in rest)
    assert all(d["tool_calls"] == [{"index": 0, "function": {"arguments": d["tool_calls"][0]["function"]["arguments"]}}]
               for _, d in rest)  # fmt: skip
    joined = "".join(d["tool_calls"][0]["function"]["arguments"] for _, d in rest)
    assert joined == whole.function.arguments and set(json.loads(joined)) == {"city", "days", "note"}
    assert chunks[-1][1]["choices"][0]["finish_reason"] == "tool_calls"


class Trip(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=9)
    by_train: bool
    note: str = Field(min_length=2, max_length=8)


def test_instructor_create_partial(server: Server) -> None:
    """instructor's create_partial (tools mode: a named tool_choice) yields a partial for each piece of the call as
    it streams, not one at the end; the last is the whole, valid model."""
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    ins = instructor.from_openai(oai, mode=instructor.Mode.TOOLS)
    partials = list(ins.chat.completions.create_partial(
        model=MODEL, response_model=Trip, messages=[{"role": "user", "content": "Plan a trip."}], max_tokens=800,
        temperature=0, max_retries=0))  # fmt: skip
    dumps = [p.model_dump() for p in partials]
    assert len({json.dumps(d, sort_keys=True) for d in dumps}) > 2, dumps
    Trip.model_validate(dumps[-1])
