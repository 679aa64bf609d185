"""X-Request-Id on every HTTP response (outermost ASGI middleware, so 401 / 413 carry it too): the client's own
id when it sends a usable one (visible ASCII, at most 128 characters: the value goes into logs and headers),
else a fresh `req_<hex>` as OpenAI's. The id is logged beside the request's method, path and status (logger
dsv4.api.request, debug as the access log) and is `current_id()` while the request runs, so a log line
about the request (an unhandled error) names it."""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

HEADER = b"x-request-id"
_OK = re.compile(rb"[\x21-\x7e]{1,128}")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("dsv4_request_id", default="")
log = logging.getLogger("dsv4.api.request")


def current_id() -> str:
    """The running request's id ("" outside a request)."""
    return _current.get()


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id if usable, else a new one."""
    given = next((v for k, v in headers if k.lower() == HEADER), b"")
    return given.decode("ascii") if _OK.fullmatch(given) else f"req_{uuid.uuid4().hex}"


class RequestId:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope["headers"])
        token = _current.set(rid)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode("ascii"))]}
                log.debug("%s %s %s -> %d", rid, scope["method"], scope["path"], message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
