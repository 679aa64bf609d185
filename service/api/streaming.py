"""TokenEvents -> SSE chunks (one per generated token) or one JSON body. A client that goes away
(the generator is cancelled or closed) aborts its request in the worker."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from service.api.chat import Delta, TextStream
from service.api.metrics import Metrics
from service.api.protocol import APIError, new_id, now, usage
from service.api.tools import ToolStream
from service.engine.request import TokenEvent

log = logging.getLogger(__name__)


@dataclass
class Step:
    token_id: int | None
    delta: Delta
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    text_offset: int = 0
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Generation:
    """One request's token stream; the API side of `worker.submit`."""

    request_id: str
    kind: str  # "chat" | "completion"
    model: str
    prompt_len: int
    events: AsyncIterator[TokenEvent]
    text: TextStream
    abort: Callable[[str], None]
    metrics: Metrics
    on_done: Callable[[str], None]
    t0: float  # request arrival (perf_counter), for TTFT and e2e latency
    logprobs: bool = False
    thinking: bool = False
    token_str: Callable[[int], str] = str
    tools: ToolStream | None = None  # chat with tools: DSML tool calls are parsed out of the content
    created: int = field(default_factory=now)
    completion_tokens: int = 0
    finish_reason: str | None = None

    async def steps(self) -> AsyncIterator[Step]:
        last = self.t0
        outcome = "client_disconnect"
        engine_done = False  # the engine ended the request itself: nothing to abort
        try:
            async for ev in self.events:
                if ev.error:
                    outcome = "error"
                    raise APIError(
                        500, f"engine error: {ev.error}", type="internal_error", code="engine_error"
                    )
                delta, offset = Delta(), self.text.text_len
                if ev.token_id is not None:
                    t = time.perf_counter()
                    (self.metrics.itl if self.completion_tokens else self.metrics.ttft).observe(t - last)
                    last = t
                    self.completion_tokens += 1
                    self.metrics.generation_tokens.inc()
                    delta = self.text.push(ev.token_id)
                engine_done = ev.finish_reason is not None
                finish = "stop" if delta.stopped else (ev.finish_reason.value if ev.finish_reason else None)
                if finish and not delta.stopped:
                    tail = self.text.finish()
                    delta = Delta(delta.reasoning + tail.reasoning, delta.content + tail.content)
                calls: list[dict[str, Any]] = []
                if self.tools is not None:
                    content, calls = self.tools.push(delta.content)
                    if finish:
                        content += self.tools.finish()
                    delta = Delta(delta.reasoning, content, delta.stopped)
                    if finish == "stop" and self.tools.calls:
                        finish = "tool_calls"
                self.finish_reason = finish
                yield Step(ev.token_id, delta, ev.logprob, ev.top_logprobs, offset, finish, calls)
                if finish:
                    break
            if self.finish_reason is None:  # the iterator ended without a finish event
                self.finish_reason = "abort"
                yield Step(None, self.text.finish(), finish_reason="abort")
            outcome = self.finish_reason
        finally:
            if not engine_done:  # client gone, stop string or error: free the row now
                self.abort(self.request_id)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - closing a finished iterator must not mask the outcome
                    log.debug("closing the event iterator failed", exc_info=True)
            self.on_done(self.request_id)
            self.metrics.outcome(outcome)
            self.metrics.e2e.observe(time.perf_counter() - self.t0)

    # ---- logprobs in OpenAI shapes -------------------------------------------------------------
    def _chat_lp(self, s: Step) -> dict[str, Any] | None:
        if not self.logprobs or s.token_id is None or s.logprob is None:
            return None

        def entry(tid: int, lp: float) -> dict[str, Any]:
            tok = self.token_str(tid)
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

        return {
            "content": [{**entry(s.token_id, s.logprob), "top_logprobs": [entry(i, lp) for i, lp in s.top]}]
        }

    def _comp_lp(self, steps: list[Step]) -> dict[str, Any] | None:
        steps = [s for s in steps if s.token_id is not None and s.logprob is not None]
        if not self.logprobs:
            return None
        return {
            "tokens": [self.token_str(s.token_id) for s in steps],  # type: ignore[arg-type]
            "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [{self.token_str(i): lp for i, lp in s.top} for s in steps],
            "text_offset": [s.text_offset for s in steps],
        }

    # ---- streaming -----------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}
        body["choices"] = choices
        body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        first = True
        gen = self.steps()
        try:
            async for s in gen:
                choice: dict[str, Any] = {"index": 0}
                if self.kind == "chat":
                    delta: dict[str, Any] = {"role": "assistant"} if first else {}
                    if s.delta.reasoning:
                        delta["reasoning_content"] = s.delta.reasoning
                    if s.token_id is not None or s.delta.content:
                        delta["content"] = s.delta.content  # every token chunk carries content, maybe ""
                    if s.tool_calls:
                        delta["tool_calls"] = s.tool_calls
                    choice["delta"] = delta
                    choice["logprobs"] = self._chat_lp(s)
                else:
                    choice["text"] = s.delta.reasoning + s.delta.content
                    choice["logprobs"] = self._comp_lp([s])
                choice["finish_reason"] = s.finish_reason
                first = False
                yield self._chunk([choice])
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            await gen.aclose()  # runs steps()' cleanup now, even when the client went away
        if include_usage:
            yield self._chunk([], usage=usage(self.prompt_len, self.completion_tokens))
        yield "data: [DONE]\n\n"

    # ---- one JSON body -------------------------------------------------------------------------
    async def collect(self, is_disconnected: Callable[[], Any] | None = None) -> dict[str, Any]:
        reasoning, content, steps = [], [], []
        checked = time.perf_counter()
        gen = self.steps()
        try:
            async for s in gen:
                reasoning.append(s.delta.reasoning)
                content.append(s.delta.content)
                steps.append(s)
                if is_disconnected is not None and time.perf_counter() - checked > 0.25:
                    checked = time.perf_counter()
                    if await is_disconnected():
                        break
        finally:
            await gen.aclose()  # a client gone before the end: steps() aborts the request
        use = usage(self.prompt_len, self.completion_tokens)
        if self.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
            calls = [{k: v for k, v in c.items() if k != "index"} for s in steps for c in s.tool_calls]
            if calls:
                msg["tool_calls"] = calls
                msg["content"] = msg["content"] or None
            if self.thinking:
                msg["reasoning_content"] = "".join(reasoning)
            lp = None
            if self.logprobs:
                lp = {"content": [c for s in steps if (x := self._chat_lp(s)) for c in x["content"]]}
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            text = "".join(r + c for r, c in zip(reasoning, content, strict=True))
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._comp_lp(steps),
                "finish_reason": self.finish_reason,
            }
            obj = "text_completion"
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": use,
        }


def request_id(kind: str) -> str:
    return new_id("chatcmpl" if kind == "chat" else "cmpl")
