"""Limits checked before any work: the body cap (an ASGI middleware: 413 before the body is read),
strict JSON (no NaN / Infinity literals), caps on list fields, prompt text that could never fit the
context rejected before tokenizing, and tokenization off the event loop and the engine thread."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.responses import StreamingResponse

from dsv4_serve.service.api.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    APIError,
    error_body,
    validation_to_api_error,
)

log = logging.getLogger("dsv4.api")
MiB = 2**20
MIN_BODY_BYTES = 4 * MiB  # the default body cap never goes below this
BODY_BYTES_PER_TOKEN = 32  # default cap: 32 bytes of body per context token (JSON escapes, chat framing)
MAX_STOP_CHARS = 1024  # one stop string (matching costs its length per generated token)
MAX_TOOLS_BYTES = 256 * 1024  # the tools list as JSON
INLINE_ENCODE_CHARS = 4096  # shorter text is tokenized on the event loop (a thread hop costs more)


def body_limit_bytes(max_body_mb: float | None, max_model_len: int) -> int:
    """--max-body-mb, else sized from the context length: a full-context prompt fits with room to spare."""
    if max_body_mb is not None:
        return int(max_body_mb * MiB)
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


async def send_error(send: Callable[..., Any], status: int, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> None:  # fmt: skip
    """An OpenAI error body straight from ASGI middleware (no routing, no body read)."""
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


def _too_large(limit: int) -> dict[str, Any]:
    msg = f"The request body is larger than this server's limit of {limit} bytes (--max-body-mb)"
    return error_body(msg, "invalid_request_error", None, "request_too_large")


class BodyLimit:
    """413 for a body over `limit()` bytes: at once from Content-Length, else while it streams in (the
    part read so far is dropped). Nothing over the cap is ever held. The rest of the body is left to
    uvicorn, which drops what arrives after a finished response and keeps the connection: closing it
    while the client still writes would reset the connection, and the client would miss the 413."""

    def __init__(self, app: Any, limit: Callable[[], int], exempt: tuple[str, ...] = ()) -> None:
        self.app, self.limit, self.exempt = app, limit, exempt  # exempt: paths that cap their own bodies

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH") or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await send_error(send, 413, _too_large(limit))
            return
        seen = 0

        async def capped() -> dict[str, Any]:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise APIError(413, _too_large(limit)["error"]["message"], code="request_too_large")
            return msg

        await self.app(scope, capped, send)


class BodyPace:
    """408 (and the connection closed) for a request body that pauses longer than `timeout` seconds or, once
    `timeout` seconds have passed, averages less than `min_rate` bytes/s: a body trickled in (1 byte every 5 s
    held POST /v1/state for 69 s) holds its connection no longer. Only while the body is still coming:
    afterwards `receive` waits for the client's disconnect, as long as that takes."""

    def __init__(self, app: Any, timeout: float, min_rate: float) -> None:
        self.app, self.timeout, self.min_rate = app, timeout, min_rate

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        t0, got, done = loop.time(), 0, False

        async def paced() -> dict[str, Any]:
            nonlocal got, done
            if done:
                return await receive()
            try:
                async with asyncio.timeout(self.timeout):
                    msg = await receive()
            except TimeoutError:
                raise _slow_body(f"no part of the request body came for {self.timeout:g} s") from None
            if msg["type"] == "http.request":
                got += len(msg.get("body", b""))
                done = not msg.get("more_body", False)
                late = loop.time() - t0 - self.timeout
                if not done and late > 0 and got < self.min_rate * late:
                    raise _slow_body(f"the request body came at under {self.min_rate / 1024:g} KiB/s")
            else:
                done = True
            return msg

        await self.app(scope, paced, send)


def _slow_body(why: str) -> APIError:
    return APIError(408, f"Request body too slow: {why} (--body-timeout, --body-min-rate)", code="request_timeout",
                    headers={"Connection": "close"})  # fmt: skip


def check_content_type(value: str | None) -> None:
    """415 for a body declared as something other than JSON (none declared: read as JSON)."""
    if value is None:
        return
    mime = value.split(";", 1)[0].strip().lower()
    if mime != "application/json" and not mime.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got '{mime}'",
                       code="unsupported_media_type")  # fmt: skip


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Strict JSON -> the request model, then the size caps. 400 for NaN / Infinity literals (Python's
    json and pydantic's parser take them by default); finite float fields are the models' job
    (allow_inf_nan=False catches 1e999)."""
    raw = raw or b"null"
    if b"NaN" in raw or b"Infinity" in raw:  # the full strict parse only when a literal may be there
        try:
            from_json(raw, allow_inf_nan=False)
        except ValueError as e:
            raise APIError(400, f"Malformed JSON body (NaN and Infinity are not JSON): {e}",
                           code="invalid_json") from None  # fmt: skip
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_to_api_error(e) from None
    check_caps(req)
    return req


def check_caps(req: Any) -> None:
    """Caps on the list fields whose cost grows with their size, by their OpenAI names."""
    for s in getattr(req, "stop_list", None) or ():
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"Each stop string may have at most {MAX_STOP_CHARS} characters",
                           param="stop", code="invalid_value")  # fmt: skip
    _cap(getattr(req, "stop_token_ids", None), MAX_STOP_TOKEN_IDS, "stop_token_ids")
    _cap(getattr(req, "logit_bias", None), MAX_LOGIT_BIAS, "logit_bias")
    tools = getattr(req, "tools", None)
    _cap(tools, MAX_TOOLS, "tools")
    if tools:
        size = len(json.dumps([t.model_dump() if isinstance(t, BaseModel) else t for t in tools], default=str))
        if size > MAX_TOOLS_BYTES:
            raise APIError(400, f"'tools' is {size} bytes as JSON; the limit is {MAX_TOOLS_BYTES}",
                           param="tools", code="invalid_value")  # fmt: skip


def _cap(items: Any, cap: int, name: str) -> None:
    if items is not None and len(items) > cap:
        raise APIError(400, f"'{name}' has {len(items)} entries; the limit is {cap}", param=name,
                       code="invalid_value")  # fmt: skip


_MAX_TOKEN_CHARS: dict[int, int] = {}  # id(tokenizer) -> the most characters one token can cover


def max_token_chars(tok: Any) -> int:
    """An upper bound of the text characters one token covers: its longest vocabulary string (byte-level
    and SentencePiece vocabularies spell each byte / character as one character or more), doubled when
    a normalizer could shrink the text."""
    key = id(tok)
    if key not in _MAX_TOKEN_CHARS:
        longest = max((len(s) for s in tok.get_vocab(with_added_tokens=True)), default=1)
        _MAX_TOKEN_CHARS[key] = longest * (2 if getattr(tok, "normalizer", None) is not None else 1)
    return _MAX_TOKEN_CHARS[key]


def check_text_fits(tok: Any, text: str, max_model_len: int, param: str) -> None:
    """400 before tokenizing for text that needs more than max_model_len tokens whatever they are."""
    cap = max_model_len * max_token_chars(tok)
    if len(text) > cap:
        raise APIError(
            400,
            f"The prompt has {len(text)} characters: more than {max_model_len} tokens whatever its text "
            f"(one token covers at most {cap // max_model_len}); this model's context length is "
            f"{max_model_len}",
            param=param,
            code="context_length_exceeded",
        )


async def encode(tok: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`. Long text goes through `encode_batch` in a worker thread: it releases the GIL
    while it tokenizes (`encode` holds it), so neither the event loop nor the engine thread waits for it
    (only for the id list's conversion at the end)."""
    if len(text) <= INLINE_ENCODE_CHARS:
        return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)
    return await asyncio.to_thread(lambda: tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


class StallGuardedStream(StreamingResponse):
    """An SSE response whose every write must complete within `stall_timeout` seconds. A client that
    stops reading blocks the write once the socket buffers are full; then the body iterator is closed
    (its cleanup aborts the request: the row is freed) and the response is left unfinished, so the
    server closes the connection."""

    def __init__(self, content: Any, *, stall_timeout: float, **kw: Any) -> None:
        super().__init__(content, **kw)
        self.stall_timeout = stall_timeout

    async def stream_response(self, send: Callable[..., Any]) -> None:
        stalled = False

        async def timed(message: dict[str, Any]) -> None:
            nonlocal stalled
            if stalled:
                return
            try:  # asyncio.timeout, not wait_for: no task a write (wait_for wraps each in one, ~20 us a token)
                async with asyncio.timeout(self.stall_timeout):
                    await send(message)
            except TimeoutError:
                stalled = True
                log.warning("a stream write blocked for %.0fs (--stream-stall-timeout): request aborted",
                            self.stall_timeout)  # fmt: skip
                await self.body_iterator.aclose()  # type: ignore[union-attr]

        try:
            await super().stream_response(timed)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
