"""POST /v1/responses (OpenAI's Responses API) on top of the chat path: the request is translated into a chat
completion request (instructions -> system, input items -> messages, max_output_tokens, reasoning.effort ->
thinking) and validated as one, so every chat feature and check applies; the one choice's steps become
output items (a reasoning item in thinking mode, then the assistant message) or the streamed events.

Tools: `tools`, `tool_choice` and function_call / function_call_output input items translate into the chat
request's `tools` / `tool_choice` / tool messages (the DSML tool-call parser lives with the chat path); the
chat choice's tool calls come back as function_call output items after the message item (empty when the turn
is only tool calls: the streamed events and the final body list the same items)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from dsv4_serve.service.api import routes
from dsv4_serve.service.api.limits import StallGuardedStream
from dsv4_serve.service.api.protocol import (
    _REQ,
    APIError,
    Body,
    ChatCompletionRequest,
    new_id,
    now,
    validation_to_api_error,
)
from dsv4_serve.service.api.streaming import Generation

router = APIRouter()


class Reasoning(BaseModel):
    model_config = _REQ
    effort: Literal["none", "minimal", "low", "medium", "high", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: reasoning comes back in full


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text"}}; other formats go to response_format
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # nothing is stored: only false is accepted
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None


def _has(field: str) -> bool:
    return field in ChatCompletionRequest.model_fields


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise APIError(400, f"{where}: only text content parts are supported", param="input")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise APIError(400, f"{where}: content must be a string or a list of text parts", param="input")


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request body this Responses request means."""
    if req.store:
        raise APIError(400, "store=true is not supported: this server keeps no responses", param="store")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role"), "content": _content(item.get("content"), f"input[{i}]")})
        elif kind == "function_call" and _has("tools"):
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and _has("tools"):
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
        else:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported", param="input")
    body: dict[str, Any] = {"messages": msgs, "model": req.model, "stream": req.stream, "user": req.user,
                            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p}  # fmt: skip
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        if not _has("response_format"):
            raise APIError(400, f"text.format of type {fmt.get('type')!r} is not supported", param="text")
        body["response_format"] = fmt
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        value = getattr(req, field)
        if value is None:
            continue
        if not _has(field):
            raise APIError(400, f"'{field}' is not supported on /v1/responses yet", param=field)
        body[field] = [_chat_tool(t) for t in value] if field == "tools" else value
    return {k: v for k, v in body.items() if v is not None}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """Responses' flat function tool -> chat completions' {"type": "function", "function": {...}}."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools of type {tool.get('type')!r} are not supported", param="tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


class ResponseBuilder:
    """The response object and its output items, filled from one chat choice's steps."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, model: str, prompt_tokens: int) -> None:
        self.id, self.created = new_id("resp"), now()
        self.req, self.chat, self.model, self.prompt_tokens = req, chat, model, prompt_tokens
        self.msg_id, self.rs_id = new_id("msg"), new_id("rs")
        self.reasoning, self.text = "", ""
        self.calls: list[dict[str, Any]] = []  # the chat choice's tool calls, in order
        self.output_tokens = 0
        self.cached_tokens = 0  # the prefix cache's hit (0: none, or no cache)
        self.finish: str | None = None

    def _items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.chat.thinking:
            items.append(self.reasoning_item(self.reasoning))
        items.append(self.message_item(self.text, "completed" if self.finish else "in_progress"))
        items += [self.call_item(c, "completed") for c in self.calls]
        return items

    @staticmethod
    def call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
        """A chat tool call as a Responses function_call item (its id derived from the call's)."""
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"], "status": status}  # fmt: skip

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.rs_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}  # fmt: skip

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, status: str | None = None) -> dict[str, Any]:
        done = self.finish is not None
        incomplete = self.finish == "length"
        status = status or ("incomplete" if incomplete else "completed" if done else "in_progress")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self._items() if done else [],
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
            "temperature": self.chat.temperature if self.chat.temperature is not None else 1.0,
            "top_p": self.chat.top_p if self.chat.top_p is not None else 1.0,
            "tools": self.req.tools or [], "tool_choice": self.req.tool_choice or "auto",
            "parallel_tool_calls": self.req.parallel_tool_calls is not False,
            "text": {"format": (self.req.text or {}).get("format") or {"type": "text"}},
            "reasoning": {"effort": self.req.reasoning.effort if self.req.reasoning else None, "summary": None},
            "metadata": self.req.metadata or {}, "store": False, "user": self.req.user,
            "usage": self.usage() if done else None,
        }  # fmt: skip

    def usage(self) -> dict[str, Any]:
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.output_tokens}  # fmt: skip

    async def collect(self, gen: Generation) -> dict[str, Any]:
        async for s in gen.steps():
            self.reasoning += s.delta.reasoning
            self.text += s.delta.content
            self.calls += s.tool_calls
            self.finish = s.finish_reason or self.finish
        self.output_tokens, self.cached_tokens = gen.completion_tokens, gen.cached_tokens or 0
        return self.body()

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """The streamed events, in OpenAI's order, each with its sequence_number."""
        seq = 0

        def ev(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq - 1, **data}
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

        yield ev("response.created", response=self.body("in_progress"))
        yield ev("response.in_progress", response=self.body("in_progress"))
        out, ids = 0, {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        if self.chat.thinking:
            yield ev("response.output_item.added", output_index=0, item=self.reasoning_item(""))
            out, ids["output_index"] = 1, 1
        in_message = False
        steps = gen.steps()
        try:
            async for s in steps:
                if s.delta.reasoning:
                    self.reasoning += s.delta.reasoning
                    yield ev("response.reasoning_text.delta", item_id=self.rs_id, output_index=0, content_index=0,
                             delta=s.delta.reasoning)  # fmt: skip
                if (s.delta.content or s.finish_reason) and not in_message:
                    in_message = True
                    if self.chat.thinking:
                        yield ev("response.reasoning_text.done", item_id=self.rs_id, output_index=0,
                                 content_index=0, text=self.reasoning)  # fmt: skip
                        yield ev("response.output_item.done", output_index=0, item=self.reasoning_item(self.reasoning))
                    item = self.message_item(None, "in_progress")
                    yield ev("response.output_item.added", output_index=out, item=item)
                    yield ev("response.content_part.added", **ids, part=self.part(""))
                if s.delta.content:
                    self.text += s.delta.content
                    yield ev("response.output_text.delta", **ids, delta=s.delta.content, logprobs=[])
                self.calls += s.tool_calls
                self.finish = s.finish_reason or self.finish
        except APIError as e:
            yield ev("error", code=e.code, message=e.message, param=e.param)
            return
        finally:
            await steps.aclose()
        self.output_tokens, self.cached_tokens = gen.completion_tokens, gen.cached_tokens or 0
        yield ev("response.output_text.done", **ids, text=self.text, logprobs=[])
        yield ev("response.content_part.done", **ids, part=self.part(self.text))
        yield ev("response.output_item.done", output_index=out, item=self.message_item(self.text, "completed"))
        for i, call in enumerate(self.calls):  # each whole when its closing tag arrived: one delta each
            at = {"output_index": out + 1 + i, "item_id": self.call_item(call, "")["id"]}
            yield ev("response.output_item.added", output_index=at["output_index"],
                     item=self.call_item(call, "in_progress") | {"arguments": ""})  # fmt: skip
            yield ev("response.function_call_arguments.delta", **at, delta=call["function"]["arguments"])
            yield ev("response.function_call_arguments.done", **at, arguments=call["function"]["arguments"])
            yield ev("response.output_item.done", output_index=at["output_index"],
                     item=self.call_item(call, "completed"))  # fmt: skip
        done = "response.incomplete" if self.finish == "length" else "response.completed"
        yield ev(done, response=self.body())


# A chat field's error names the Responses field it came from.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "reasoning_effort": "reasoning"}


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    t0, ctl = time.perf_counter(), routes._ctl(request)
    try:
        await ctl.wait_ready()
        req: ResponsesRequest = await routes._parse(request, ResponsesRequest)
        try:
            chat = ChatCompletionRequest.model_validate(to_chat(req))
        except ValidationError as e:
            err = validation_to_api_error(e)
            name = _PARAMS.get(err.param or "", err.param)
            raise APIError(400, err.message.replace(f"'{err.param}", f"'{name}"), param=name, code=err.code) from None
        routes._check_model(ctl, chat.model)
        reply = await routes.submit_chat(request, ctl, chat, t0)
        builder = ResponseBuilder(req, chat, ctl.settings.served_name, reply.prompt_tokens)
        gen = reply.gens[0]
        if req.stream:
            return StallGuardedStream(builder.events(gen), media_type="text/event-stream", headers=routes._SSE_HEADERS,
                                      stall_timeout=ctl.settings.stream_stall_timeout)  # fmt: skip
        return JSONResponse(await builder.collect(gen))
    except APIError as e:
        routes._count_rejection(ctl, e)
        raise
