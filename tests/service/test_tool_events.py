"""A choice whose answer is text, then tool calls, through the API side's real pipeline (the tiny tokenizer's ids as
the engine's TokenEvents -> TextStream -> ToolStream -> chat chunks, the non-streamed choice and Responses'
events): on the random tiny model such an answer almost never comes, so its token ids are fed as the engine would
send them. The message closes before a call's item opens; a cut call is partial in every shape (issue 62)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.tokenizer import build_tiny_tokenizer
from dsv4_serve.service.api.chat import TextStream
from dsv4_serve.service.api.metrics import Metrics
from dsv4_serve.service.api.protocol import ChatCompletionRequest
from dsv4_serve.service.api.responses import ResponseBuilder
from dsv4_serve.service.api.responses_request import ResponsesRequest, to_chat
from dsv4_serve.service.api.streaming import Generation
from dsv4_serve.service.api.tool_stream import ToolStream
from dsv4_serve.service.engine.request import FinishReason, TokenEvent

TOK = build_tiny_tokenizer(ModelArgs.tiny().vocab_size)
P = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>\n'
ANSWER = ('Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n' + P.format("city", "true", "Paris")
          + P.format("days", "false", "3") + '</｜DSML｜invoke>\n<｜DSML｜invoke name="g">\n'
          + P.format("q", "true", "a long query") + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")  # fmt: skip
CALLS = [("f", '{"city": "Paris", "days": 3}'), ("g", '{"q": "a long query"}')]
IDS = TOK.encode(ANSWER, add_special_tokens=False).ids


def generation(ids: list[int], finish: FinishReason) -> Generation:
    async def events() -> AsyncIterator[TokenEvent]:
        for i, t in enumerate(ids):
            yield TokenEvent("r", token_id=t, finish_reason=finish if i == len(ids) - 1 else None)

    return Generation(request_id="r", kind="chat", events=events(), text=TextStream(TOK), abort=lambda _: None,
                      metrics=Metrics(lambda: {}), on_done=lambda _: None, t0=time.perf_counter(),
                      tools=ToolStream())  # fmt: skip


def test_tokens_round_trip() -> None:
    assert TOK.decode(IDS, skip_special_tokens=False) == ANSWER and len(IDS) > 50


def run(agen: AsyncIterator[Any]) -> list[Any]:
    async def go() -> list[Any]:
        return [x async for x in agen]

    return asyncio.run(go())


def test_chat_chunks_and_choice() -> None:
    chunks = run(generation(IDS, FinishReason.STOP).chunks())
    text = "".join(c["delta"].get("content") or "" for c in chunks)
    deltas = [tc for c in chunks for tc in c["delta"].get("tool_calls", ())]
    heads = [d for d in deltas if "id" in d]
    assert text == "Let me check." and [(d["index"], d["function"]) for d in heads] == [
        (0, {"name": "f", "arguments": ""}), (1, {"name": "g", "arguments": ""})]  # fmt: skip
    joined = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)]
    assert list(zip(["f", "g"], joined, strict=True)) == CALLS and len(deltas) > 6
    assert chunks[-1]["finish_reason"] == "tool_calls"
    choice = asyncio.run(generation(IDS, FinishReason.STOP).collect())
    msg = choice["message"]
    assert msg["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == CALLS


def builder(stream: bool) -> ResponseBuilder:
    req = ResponsesRequest.model_validate({"input": "hi", "stream": stream})
    return ResponseBuilder(req, ChatCompletionRequest.model_validate(to_chat(req)), "m", 3)


def events(ids: list[int], finish: FinishReason) -> list[dict[str, Any]]:
    frames = run(builder(True).events(generation(ids, finish)))
    return [json.loads(f.split("data: ", 1)[1]) for f in frames]


def test_responses_events_text_then_calls() -> None:
    evs = events(IDS, FinishReason.STOP)
    items = [(e["type"].rsplit(".", 1)[1], e["item"]["type"], e["output_index"])
             for e in evs if e["type"].startswith("response.output_item.")]  # fmt: skip
    assert items == [("added", "message", 0), ("done", "message", 0), ("added", "function_call", 1),
                     ("done", "function_call", 1), ("added", "function_call", 2), ("done", "function_call", 2)]
    for i, (name, args) in enumerate(CALLS, start=1):
        pieces = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == i]  # fmt: skip
        assert "".join(pieces) == args and len(pieces) > 1
        [done] = [e for e in evs if e["type"] == "response.output_item.done" and e["output_index"] == i]
        assert done["item"]["name"] == name and done["item"]["status"] == "completed"
    final = evs[-1]
    assert final["type"] == "response.completed" and [o["type"] for o in final["response"]["output"]] == [
        "message", "function_call", "function_call"]
    assert final["response"]["id"].startswith("resp_") and final["response"]["output"][0]["status"] == "completed"
    whole = asyncio.run(builder(False).collect(generation(IDS, FinishReason.STOP)))
    assert [(o["type"], o.get("arguments")) for o in whole["output"]] == [(o["type"], o.get("arguments"))
                                                                          for o in final["response"]["output"]]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_cut_call(stream: bool) -> None:
    """Cut inside the second call's value: the message and the first call "completed", the second "incomplete"
    with the arguments it has, the response "incomplete"."""
    cut = next(n for n in range(len(IDS)) if TOK.decode(IDS[:n], skip_special_tokens=False).endswith("a long"))
    gen = generation(IDS[:cut], FinishReason.LENGTH)
    body = run(builder(True).events(gen))[-1] if stream else asyncio.run(builder(False).collect(gen))
    if stream:
        body = json.loads(body.split("data: ", 1)[1])["response"]
    assert body["status"] == "incomplete"
    assert [(o["type"], o["status"], o.get("arguments")) for o in body["output"]] == [
        ("message", "completed", None), ("function_call", "completed", CALLS[0][1]),
        ("function_call", "incomplete", '{"q": "a long')]  # fmt: skip
