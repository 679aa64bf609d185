"""POST /v1/responses (OpenAI's Responses API) on top of the chat path: the request is translated into a chat
completion request (responses_request.py) and validated as one, so every chat feature and check applies; the one
choice's steps become output items (a reasoning item in thinking mode, then the assistant message) or the
streamed events.

Tools: `tools`, `tool_choice` and function_call / function_call_output input items translate into the chat
request's `tools` / `tool_choice` / tool messages (the DSML tool-call parser lives with the chat path); the
chat choice's tool calls come back as function_call output items after the message item (no message item when
the turn is only tool calls; the streamed events and the final body list the same items). A message cut by
max_output_tokens is "incomplete", as the response; a cut tool call is an "incomplete" function_call item with
the arguments it has, complete ones "completed"."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dsv4_serve.service.api import routes
from dsv4_serve.service.api.limits import StallGuardedStream
from dsv4_serve.service.api.protocol import APIError, ChatCompletionRequest, new_id, now, validation_to_api_error
from dsv4_serve.service.api.responses_request import ResponsesRequest, to_chat
from dsv4_serve.service.api.streaming import Generation

router = APIRouter()


class ResponseBuilder:
    """The response object and its output items, filled from one chat choice's steps."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, model: str, prompt_tokens: int) -> None:
        self.id, self.created = new_id("resp", "_"), now()
        self.req, self.chat, self.model, self.prompt_tokens = req, chat, model, prompt_tokens
        self.msg_id, self.rs_id = new_id("msg", "_"), new_id("rs", "_")
        self.reasoning, self.text = "", ""
        self.calls: list[dict[str, Any]] = []  # the chat choice's tool calls, in order
        self.cut = False  # the last call was cut (max_output_tokens): its arguments stay partial
        self.output_tokens = 0
        self.cached_tokens = 0  # the prefix cache's hit (0: none, or no cache)
        self.finish: str | None = None

    def _items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.chat.thinking:
            items.append(self.reasoning_item(self.reasoning))
        if self.text or not self.calls:  # a turn of tool calls only has no (empty) message item before them
            items.append(self.message_item(self.text, self.message_status()))
        items += [self.call_item(c, "incomplete" if self.cut and c is self.calls[-1] else "completed")
                  for c in self.calls]  # fmt: skip
        return items

    def message_status(self) -> str:
        """OpenAI's: a message cut by max_output_tokens is "incomplete" (one that calls follow was whole)."""
        if self.finish == "length" and not self.calls:
            return "incomplete"
        return "completed" if self.finish else "in_progress"

    def close_reasoning(self, ev: Any) -> list[str]:
        """The reasoning item's closing events (thinking mode), once its text is whole."""
        if not self.chat.thinking:
            return []
        return [ev("response.reasoning_text.done", item_id=self.rs_id, output_index=0, content_index=0,
                   text=self.reasoning),
                ev("response.output_item.done", output_index=0, item=self.reasoning_item(self.reasoning))]

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
            self.finish = s.finish_reason or self.finish
        self._done(gen)
        return self.body()

    def _done(self, gen: Generation) -> None:
        self.output_tokens, self.cached_tokens = gen.completion_tokens, gen.cached_tokens or 0
        self.calls, self.cut = (gen.tools.calls, gen.tools.cut) if gen.tools else ([], False)

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """The streamed events, in OpenAI's order, each with its sequence_number: an item's closing events
        before the next one opens; a function_call item opens as soon as its name is known, its arguments
        follow in delta events as they stream."""
        seq = 0

        def ev(kind: str, **data: Any) -> str:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq - 1, **data}
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

        yield ev("response.created", response=self.body("in_progress"))
        yield ev("response.in_progress", response=self.body("in_progress"))
        nxt, ids = 0, {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        open_: Any = None  # the open item: "reasoning", "message" or a call (dict)
        if self.chat.thinking:
            yield ev("response.output_item.added", output_index=0, item=self.reasoning_item(""))
            nxt, open_ = 1, "reasoning"

        def close(status: str) -> list[str]:
            """The open item's closing events (`status`: a message's or a call's)."""
            if open_ == "reasoning":
                return self.close_reasoning(ev)
            if open_ == "message":
                return [ev("response.output_text.done", **ids, text=self.text, logprobs=[]),
                        ev("response.content_part.done", **ids, part=self.part(self.text)),
                        ev("response.output_item.done", output_index=ids["output_index"],
                           item=self.message_item(self.text, status))]  # fmt: skip
            if open_ is not None:
                at = {"output_index": nxt - 1, "item_id": self.call_item(open_, "")["id"]}
                return [ev("response.function_call_arguments.done", **at, arguments=open_["function"]["arguments"]),
                        ev("response.output_item.done", output_index=nxt - 1, item=self.call_item(open_, status))]
            return []

        steps = gen.steps()
        try:
            async for s in steps:
                if s.delta.reasoning:
                    self.reasoning += s.delta.reasoning
                    yield ev("response.reasoning_text.delta", item_id=self.rs_id, output_index=0, content_index=0,
                             delta=s.delta.reasoning)  # fmt: skip
                # The message item opens with its first text, or at the end of a turn with no text and no calls.
                no_calls = not (gen.tools and gen.tools.calls)
                if (s.delta.content or (s.finish_reason and no_calls)) and open_ != "message":
                    for e in close("completed"):
                        yield e
                    open_, ids["output_index"], nxt = "message", nxt, nxt + 1
                    yield ev("response.output_item.added", output_index=ids["output_index"],
                             item=self.message_item(None, "in_progress"))  # fmt: skip
                    yield ev("response.content_part.added", **ids, part=self.part(""))
                if s.delta.content:
                    self.text += s.delta.content
                    yield ev("response.output_text.delta", **ids, delta=s.delta.content, logprobs=[])
                for d in s.tool_calls:
                    if "id" in d:  # a new call: the item before it is whole
                        for e in close("completed"):
                            yield e
                        open_, nxt = gen.tools.calls[d["index"]], nxt + 1  # type: ignore[union-attr]
                        yield ev("response.output_item.added", output_index=nxt - 1,
                                 item=self.call_item(open_, "in_progress") | {"arguments": ""})  # fmt: skip
                    if d["function"]["arguments"]:
                        yield ev("response.function_call_arguments.delta", output_index=nxt - 1,
                                 item_id=self.call_item(open_, "")["id"], delta=d["function"]["arguments"])  # fmt: skip
                self.finish = s.finish_reason or self.finish
        except APIError as e:
            yield ev("error", code=e.code, message=e.message, param=e.param)
            return
        finally:
            await steps.aclose()
        self._done(gen)
        call_status = "incomplete" if self.cut else "completed"
        for e in close(call_status if isinstance(open_, dict) else self.message_status()):
            yield e
        done = "response.incomplete" if self.finish == "length" else "response.completed"
        yield ev(done, response=self.body())


# A chat field's error names the Responses field it came from.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "reasoning_effort": "reasoning",
           "response_format": "text.format"}


def _renamed(err: APIError) -> APIError:
    """The chat request's error as the Responses request's: its param (and the message's mention of it) renamed."""
    name = _PARAMS.get(err.param or "", err.param)
    if name == err.param:
        return err
    msg = err.message.replace(f"'{err.param}", f"'{name}").replace(f"{err.param} ", f"{name} ")
    return APIError(err.status, msg, param=name, code=err.code, type=err.type, headers=err.headers)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    t0, ctl = time.perf_counter(), routes._ctl(request)
    try:
        await ctl.wait_ready()
        ctl.check_room()  # a full queue: 429 before the body is read
        req: ResponsesRequest = await routes._parse(request, ResponsesRequest)
        try:
            chat = ChatCompletionRequest.model_validate(to_chat(req))
        except ValidationError as e:
            raise _renamed(validation_to_api_error(e)) from None
        routes._check_model(ctl, chat.model)
        try:
            reply = await routes.submit_chat(request, ctl, chat, t0)
        except APIError as e:  # response_format's (the structured extra missing, a bad schema) is text.format's
            raise _renamed(e) from None
        builder = ResponseBuilder(req, chat, ctl.settings.served_name, reply.prompt_tokens)
        gen = reply.gens[0]
        if req.stream:
            return StallGuardedStream(builder.events(gen), media_type="text/event-stream", headers=routes._SSE_HEADERS,
                                      stall_timeout=ctl.settings.stream_stall_timeout)  # fmt: skip
        return JSONResponse(await builder.collect(gen))
    except APIError as e:
        routes._count_rejection(ctl, e)
        raise
