"""One choice's TokenEvents -> OpenAI choice objects: streamed choice chunks or one choice. `fanout.py`
frames the choices of a request (n > 1, a list of prompts) into SSE or one JSON body. A client that goes
away (the generator is cancelled or closed) aborts its request in the worker."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from dsv4_serve.service.api.chat import Delta, TextStream
from dsv4_serve.service.api.metrics import TTFT_PHASES, Metrics
from dsv4_serve.service.api.protocol import APIError, new_id, now
from dsv4_serve.service.api.tool_stream import ToolStream, merged
from dsv4_serve.service.engine.request import FirstToken, PromptLogprob, TokenEvent

log = logging.getLogger(__name__)
# Past this many scored prompt positions a body's logprob objects are built, and its JSON written, on a worker
# thread in pieces: the event loop (and every other stream) gets the GIL back every switch interval.
OFF_LOOP_POSITIONS = 1024


@dataclass
class Step:
    token_id: int | None
    delta: Delta
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    text_offset: int = 0
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool-call deltas (tool_stream.py)


@dataclass
class Echo:
    """What a completion repeats before its own tokens (`echo`): the prompt's text, its tokens and their
    character offsets, and whether the legacy `logprobs` object includes the prompt's."""

    text: str
    ids: list[int]
    offsets: list[int]
    logprobs: bool


@dataclass
class Generation:
    """One choice's token stream; the API side of `worker.submit`."""

    request_id: str  # the engine row's id
    kind: str  # "chat" | "completion"
    events: AsyncIterator[TokenEvent]
    text: TextStream
    abort: Callable[[str], None]
    metrics: Metrics
    on_done: Callable[[str], None]
    t0: float  # request arrival (perf_counter), for TTFT and e2e latency
    index: int = 0
    logprobs: bool = False
    thinking: bool = False
    token_str: Callable[[int], str] = str
    token_bytes: Callable[[int], bytes] = lambda i: str(i).encode()
    echo: Echo | None = None
    prompt_ids: list[int] = field(default_factory=list)  # for vLLM's prompt_logprobs
    prompt_logprobs: bool = False  # report vLLM's `prompt_logprobs`
    scored: list[PromptLogprob] = field(default_factory=list)  # the prompt's, as the engine sends them
    tools: ToolStream | None = None  # chat with tools: DSML tool calls are parsed out of the content
    stop_ids: frozenset[int] = frozenset()  # the request's stop token ids (EOS aside): vLLM's stop_reason
    include_stop: bool = False  # include_stop_str_in_output: a stop token's text goes into the text
    stop_reason: str | int | None = None  # vLLM: the stop string or stop token id that ended the text
    created: int = field(default_factory=now)
    completion_tokens: int = 0
    cached_tokens: int | None = None  # from the engine's events (None: no prefix cache)
    finish_reason: str | None = None
    sampled_at: float = 0.0  # when the engine read its first token back, until that token's chunk is written

    def phases(self, first: FirstToken) -> None:
        """The time to first token's split up to the engine's read-back (/metrics' dsv4_ttft_phase_seconds)."""
        stamps = (self.t0, *first)  # arrival, then the engine's (submitted, admitted, prefilled, sampled)
        for name, a, b in zip(TTFT_PHASES, stamps, stamps[1:], strict=False):
            self.metrics.ttft_phase.labels(name).observe(max(0.0, b - a))
        self.sampled_at = first.sampled

    def sent(self) -> None:
        """A chunk of this choice was written (SSE framing): the first one's time since its token was sampled."""
        if self.sampled_at:
            self.metrics.ttft_phase.labels("first_byte").observe(max(0.0, time.perf_counter() - self.sampled_at))
            self.sampled_at = 0.0

    async def steps(self) -> AsyncIterator[Step]:
        last = self.t0
        outcome = "client_disconnect"
        engine_done = False  # the engine ended the request itself: nothing to abort
        base = len(self.echo.text) if self.echo else 0  # generated text_offsets follow the echoed prompt
        try:
            async for ev in self.events:
                if ev.error and ev.error_param:  # the request's own field ended it (a grammar too slow to mask)
                    outcome = "error"
                    raise APIError(400, ev.error, param=ev.error_param, code="grammar_too_slow")
                if ev.error:
                    outcome = "error"
                    raise APIError(
                        500, f"engine error: {ev.error}", type="internal_error", code="engine_error"
                    )
                if ev.cached_tokens is not None:
                    self.cached_tokens = ev.cached_tokens
                if ev.prompt_logprobs:
                    self.scored += ev.prompt_logprobs
                    if ev.token_id is None and ev.finish_reason is None:
                        continue
                delta, offset = Delta(), base + self.text.offset
                tid = ev.token_id if ev.token_id is not None else ev.stop_token
                if tid is not None:
                    t = time.perf_counter()
                    (self.metrics.itl if self.completion_tokens else self.metrics.ttft).observe(t - last)
                    last = t
                    if ev.first is not None:
                        self.phases(ev.first)
                    self.completion_tokens += 1
                    self.metrics.generation_tokens.inc()
                    if ev.token_id is not None or self.include_stop:  # a stop token adds no text, unless asked
                        delta = self.text.push(tid)
                        offset = base + self.text.last_offset
                engine_done = ev.finish_reason is not None
                finish = "stop" if delta.stopped else (ev.finish_reason.value if ev.finish_reason else None)
                if finish == "stop":
                    self.stop_reason = self.text.stop.matched if delta.stopped else (
                        ev.stop_token if ev.stop_token in self.stop_ids else None)
                if finish and not delta.stopped:
                    tail = self.text.finish()
                    delta = Delta(delta.reasoning + tail.reasoning, delta.content + tail.content)
                calls: list[dict[str, Any]] = []
                if self.tools is not None:
                    content, calls = self.tools.push(delta.content)
                    if finish:  # a cut call keeps the arguments it has (finish "length")
                        tail, more = self.tools.finish(truncated=finish == "length")
                        content, calls = content + tail, merged(calls + more)
                    delta = Delta(delta.reasoning, content, delta.stopped)
                    if finish == "stop" and self.tools.calls:
                        finish = "tool_calls"
                self.finish_reason = finish
                yield Step(tid, delta, ev.logprob, ev.top_logprobs, offset, finish, calls)
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
    def _lps(self, s: Step, first: bool) -> dict[str, Any]:
        """A completion chunk's logprobs; the first's hold the echoed prompt's and vLLM's prompt_logprobs."""
        out = {"logprobs": self._comp_lp([s], with_prompt=first)}
        if first and self.prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs_field()
        return out

    def _chat_lp(self, s: Step) -> dict[str, Any] | None:
        if not self.logprobs or s.token_id is None or s.logprob is None:
            return None

        def entry(tid: int, lp: float) -> dict[str, Any]:
            return {"token": self.token_str(tid), "logprob": lp, "bytes": list(self.token_bytes(tid))}

        return {
            "content": [{**entry(s.token_id, s.logprob), "top_logprobs": [entry(i, lp) for i, lp in s.top]}]
        }

    def _comp_lp(self, steps: list[Step], with_prompt: bool) -> dict[str, Any] | None:
        steps = [s for s in steps if s.token_id is not None and s.logprob is not None]
        if not self.logprobs:
            return None
        out: dict[str, Any] = {
            "tokens": [self.token_str(s.token_id) for s in steps],  # type: ignore[arg-type]
            "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [{self.token_str(i): lp for i, lp in s.top} for s in steps],
            "text_offset": [s.text_offset for s in steps],
        }
        e = self.echo
        if with_prompt and e is not None and e.logprobs:
            # Position 0 has no logprob; each later prompt token's entry holds its top alternatives and itself.
            tops: list[dict[str, float] | None] = [None]
            for tid, p in zip(e.ids[1:], self.scored, strict=False):
                tops.append({**{self.token_str(i): lp for i, lp in p.top}, self.token_str(tid): p.logprob})
            out = {
                "tokens": [self.token_str(i) for i in e.ids] + out["tokens"],
                "token_logprobs": [None, *(p.logprob for p in self.scored)] + out["token_logprobs"],
                "top_logprobs": tops + out["top_logprobs"],
                "text_offset": list(e.offsets) + out["text_offset"],
            }
        return out

    def prompt_logprobs_field(self) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}}
        holding the prompt token and its top alternatives."""
        if not self.prompt_logprobs:
            return None
        out: list[dict[str, Any] | None] = [None]
        for tid, p in zip(self.prompt_ids[1:], self.scored, strict=False):
            ranked = sorted(p.top, key=lambda t: (-t[1], t[0]))
            entry = {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": self.token_str(i)}
                     for r, (i, lp) in enumerate(ranked)}  # fmt: skip
            entry[str(tid)] = {"logprob": p.logprob, "rank": p.rank, "decoded_token": self.token_str(tid)}
            out.append(entry)
        return out

    # ---- streaming: one choice object per step -------------------------------------------------
    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The choice objects of this choice's stream chunks (`fanout.sse` frames them)."""
        first = True
        gen = self.steps()
        try:
            if self.kind == "chat" and self.echo is not None:  # vLLM: the echoed content in a chunk of its own
                yield {"index": self.index, "delta": {"role": "assistant", "content": self.echo.text},
                       "logprobs": None, "finish_reason": None}  # fmt: skip
                first = False
            async for s in gen:
                choice: dict[str, Any] = {"index": self.index}
                if self.kind == "chat":
                    delta: dict[str, Any] = {"role": "assistant"} if first else {}
                    if s.delta.reasoning:
                        delta["reasoning_content"] = s.delta.reasoning
                    if s.tool_calls:  # OpenAI: content null beside tool_calls, never ""
                        delta["content"] = s.delta.content or None
                        delta["tool_calls"] = s.tool_calls
                    elif s.delta.content or (s.token_id is not None and not (self.tools and self.tools.calls)):
                        delta["content"] = s.delta.content  # after the calls, an empty content key is left out
                    choice["delta"] = delta
                    choice["logprobs"] = self._chat_lp(s)
                    # A token whose text is held back (a stop string's or a tool call's possible start, a
                    # character's first bytes) sends nothing, unless the chunk carries its logprobs.
                    if not (s.delta.content or s.delta.reasoning or s.tool_calls or s.finish_reason
                            or choice["logprobs"]):  # fmt: skip
                        continue
                else:
                    echo = self.echo.text if first and self.echo else ""
                    choice["text"] = echo + s.delta.reasoning + s.delta.content
                    if first and len(self.scored) > OFF_LOOP_POSITIONS:  # the prompt's logprobs: off the loop
                        choice.update(await asyncio.to_thread(self._lps, s, first))
                    else:
                        choice.update(self._lps(s, first))
                choice["finish_reason"] = s.finish_reason
                if s.finish_reason:
                    choice["stop_reason"] = self.stop_reason
                first = False
                yield choice
        finally:
            await gen.aclose()  # runs steps()' cleanup now, even when the client went away

    # ---- one choice object -----------------------------------------------------------------------
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
        if len(self.scored) > OFF_LOOP_POSITIONS:  # 8,000 scored positions x 20 alternatives: 1 s of dicts
            return await asyncio.to_thread(self._choice, reasoning, content, steps)
        return self._choice(reasoning, content, steps)

    def _choice(self, reasoning: list[str], content: list[str], steps: list[Step]) -> dict[str, Any]:
        """The choice object of a finished generation (plain Python: runs on a worker thread when large)."""
        if self.kind == "chat":
            echo = self.echo.text if self.echo else ""
            msg: dict[str, Any] = {"role": "assistant", "content": echo + "".join(content)}
            calls = [{k: v for k, v in c.items() if k != "index"} for c in (self.tools.calls if self.tools else ())]
            if calls:
                msg["tool_calls"] = calls
                msg["content"] = msg["content"] or None
            if self.thinking:
                msg["reasoning_content"] = "".join(reasoning)
            lp = None
            if self.logprobs:
                lp = {"content": [c for s in steps if (x := self._chat_lp(s)) for c in x["content"]]}
            return {"index": self.index, "message": msg, "logprobs": lp, "finish_reason": self.finish_reason,
                    "stop_reason": self.stop_reason}  # fmt: skip
        text = "".join(r + c for r, c in zip(reasoning, content, strict=True))
        choice = {
            "index": self.index,
            "text": (self.echo.text if self.echo else "") + text,
            "logprobs": self._comp_lp(steps, with_prompt=True),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs_field()
        return choice


def request_id(kind: str) -> str:
    return new_id("chatcmpl" if kind == "chat" else "cmpl")
