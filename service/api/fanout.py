"""The choices of one request (n > 1, a list of prompts: one `Generation` each) framed as OpenAI bodies:
SSE chunks as each choice produces them, or one JSON body once all are done. Usage counts every prompt
once and every choice's tokens."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from dsv4_serve.service.api.protocol import APIError, now, usage
from dsv4_serve.service.api.streaming import OFF_LOOP_POSITIONS, Generation

_END = object()
log = logging.getLogger(__name__)
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_strict = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode  # JSONResponse's


@dataclass
class Reply:
    id: str
    kind: str  # "chat" | "completion"
    model: str
    prompt_tokens: int  # every prompt once (n choices of one prompt share it)
    gens: list[Generation]
    created: int = field(default_factory=now)
    _head: str | None = field(default=None, init=False, repr=False)  # 'data: {"id":...,"choices":['

    def _usage(self) -> dict[str, Any]:
        # Cached tokens once per prompt too: its n choices share one prompt list (and one prefill).
        cached = {id(g.prompt_ids): g.cached_tokens for g in self.gens}
        hit = None if None in cached.values() else sum(cached.values())  # type: ignore[arg-type]
        return usage(self.prompt_tokens, sum(g.completion_tokens for g in self.gens), hit)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        if not extra:  # a token's chunk: the constant head framed once, only the choices encoded (half the time)
            if self._head is None:
                head = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": []}
                self._head = f"data: {_dumps(head)}"[: -len("]}")]
            return self._head + ",".join(map(_dumps, choices)) + "]}\n\n"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        body.update(extra)
        return f"data: {_dumps(body)}\n\n"

    def _heavy(self, item: dict[str, Any], extra: dict[str, Any]) -> bool:
        """A large request's chunk that carries its prompt's logprobs (a choice's first)."""
        lp = item.get("logprobs") or {}
        return self.large and bool(extra or "prompt_logprobs" in item or len(lp.get("tokens") or ()) > 1)

    def _chunk_pieces(self, choices: list[dict[str, Any]], extra: dict[str, Any]) -> str:
        """`_chunk`'s text, written by `_pieces`."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        return "".join(["data: ", *_pieces({**body, **extra}, _dumps), "\n\n"])

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        """Every choice's chunks as they come (each chunk holds one choice, with its index)."""
        items = self._one() if len(self.gens) == 1 else self._merged()
        by_index = {g.index: g for g in self.gens}
        try:
            async for item in items:
                if isinstance(item, APIError):
                    yield f"data: {json.dumps(item.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                extra, g0 = {}, self.gens[0]
                first0 = item["index"] == g0.index and "role" in item.get("delta", {})
                if self.kind == "chat" and g0.prompt_logprobs and first0:  # vLLM: the prompt's, once
                    extra["prompt_logprobs"] = await self._off_loop(g0.prompt_logprobs_field)
                if self._heavy(item, extra):  # a prompt's logprobs: written off the loop, in pieces
                    yield await asyncio.to_thread(self._chunk_pieces, [item], extra)
                else:
                    yield self._chunk([item], **extra)
                by_index[item["index"]].sent()  # resumed once the response wrote it: the first byte's phase
        finally:
            await items.aclose()  # a client gone (or an error): every choice's row is aborted by its own cleanup
        if include_usage:
            yield self._chunk([], usage=self._usage())
        yield "data: [DONE]\n\n"

    async def _one(self) -> AsyncIterator[dict[str, Any] | APIError]:
        """One choice: its chunks straight through (no pump task, no queue: two task switches a token fewer)."""
        chunks = self.gens[0].chunks()
        try:
            async for c in chunks:
                yield c
        except APIError as e:
            yield e
        except Exception:  # as a pump's task ends on it: logged, the stream ends
            log.exception("a choice's stream failed")
        finally:
            await chunks.aclose()

    async def _merged(self) -> AsyncIterator[dict[str, Any] | APIError]:
        """Several choices: a pump task each into one queue, chunks in the order they come."""
        # Bounded: a client that stops reading stops the pumps, and each choice's worker queue then fills
        # up to its cap (--stream-queue), which aborts it.
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=8 * len(self.gens))

        async def pump(g: Generation) -> None:
            cancelled = False
            try:
                async for c in g.chunks():
                    await queue.put(c)
            except APIError as e:
                await queue.put(e)
            except asyncio.CancelledError:
                cancelled = True  # the reader is gone (the cleanup below): nobody waits, the queue may be full
                raise
            finally:
                if not cancelled:
                    await queue.put(_END)

        tasks = [asyncio.create_task(pump(g)) for g in self.gens]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is _END:
                    left -= 1
                else:
                    yield item
                    if isinstance(item, APIError):
                        return
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, is_disconnected: Callable[[], Any] | None = None) -> dict[str, Any]:
        tasks = [asyncio.create_task(g.collect(is_disconnected)) for g in self.gens]
        try:
            choices = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": self._usage(),
        }
        if self.kind == "chat" and self.gens[0].prompt_logprobs:
            body["prompt_logprobs"] = await self._off_loop(self.gens[0].prompt_logprobs_field)
        return body

    @property
    def large(self) -> bool:
        return sum(len(g.scored) for g in self.gens) > OFF_LOOP_POSITIONS

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args) if self.large else fn(*args)

    async def json(self, is_disconnected: Callable[[], Any] | None = None) -> Response:
        """The one JSON body (JSONResponse's bytes); a large one written on a worker thread, a list at a time."""
        body = await self.collect(is_disconnected)
        raw = await self._off_loop(lambda: "".join(_pieces(body)).encode())
        return Response(raw, media_type="application/json")


def _pieces(obj: Any, encode: Callable[[Any], str] = _strict) -> Iterator[str]:
    """`obj` as `encode` writes it (JSONResponse's form by default), in pieces: each piece is one C call, and
    between them the interpreter can hand the GIL on (one json.dumps of 16 MB held it for its whole run)."""
    if isinstance(obj, dict) and obj:
        sep = "{"
        for k, v in obj.items():
            yield sep + encode(str(k)) + ":"
            yield from _pieces(v, encode)
            sep = ","
        yield "}"
    elif isinstance(obj, list) and (len(obj) > 64 or any(isinstance(v, dict | list) for v in obj)):
        sep = "["
        for v in obj:
            yield sep
            yield from _pieces(v, encode)
            sep = ","
        yield "]"
    else:
        yield encode(obj)
