"""Connections under a hostile client: uvicorn's h11 protocol with a request-head deadline, an idle keep-alive
deadline that bytes do not extend, a connection cap under the file-descriptor limit (a new connection closes
the longest-idle one, or one stalled mid-body), request heads over MAX_HEAD_BYTES or MAX_HEADERS answered 431,
and the accept loop's "out of system resource" error logged at most once per ACCEPT_LOG_EVERY seconds.

uvicorn 0.55 (h11) alone: no timer runs before a connection's first request, any byte re-arms its keep-alive
timer, its connection cap answers 503 to every request while idle sockets hold the slots, and h11's size limit
applies to an incomplete head only (a 100 KB head in one packet passed). 1,100 silent sockets under
`ulimit -n 1024` made /health time out (issue 63)."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsv4_serve.service.api.protocol import error_body

log = logging.getLogger("dsv4.api")
MAX_HEAD_BYTES = 16 * 1024  # request line + headers (nginx's large_client_header_buffers: 4 x 8k)
MAX_HEADERS = 100  # header lines in one request
MIN_FD_RESERVE = 128  # descriptors kept for everything but client sockets (model files, pipes, logs)
ACCEPT_LOG_EVERY = 10.0  # seconds between two "out of system resource" log lines
STALLED_S = 1.0  # a request body paused this long counts as spare at the cap
REFUSED_LINGER_S = 1.0  # a refused connection's socket stays readable this long: the client reads its 431


def fd_connection_cap(requested: int | None) -> int:
    """The most client connections held at once: --max-connections, never more than the descriptor limit
    leaves after a reserve (a quarter of it, at least MIN_FD_RESERVE: accepts run in batches ahead of the
    cap). ValueError when the limit leaves too few or --max-connections asks for more than it allows."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft - max(MIN_FD_RESERVE, soft // 4) if soft != resource.RLIM_INFINITY else 1 << 20
    if room < 16:
        raise ValueError(f"the open-file limit ({soft}) leaves {room} connections; raise it (ulimit -n)")
    if requested is not None and requested > room:
        raise ValueError(f"--max-connections {requested} is more than the open-file limit ({soft}) allows: at "
                         f"most {room}; raise the limit (ulimit -n) or lower the cap")  # fmt: skip
    return requested if requested is not None else room


def guarded_protocol(cap: int, head_timeout: float, keep_alive: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with this server's connection limits (uvicorn.Config(http=...))."""

    class Guarded(_Guarded):
        pass

    Guarded.cap, Guarded.head_timeout, Guarded.keep_alive = cap, head_timeout, keep_alive
    return Guarded


class _Guarded(H11Protocol):
    cap: int
    head_timeout: float
    keep_alive: float
    _deadline: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = time.monotonic()
        self._arm(self.head_timeout)  # the first request's head must be in by then
        live = [c for c in self.connections if not c.transport.is_closing()] if len(self.connections) > self.cap else ()
        if len(live) > self.cap:
            now = time.monotonic()
            spare = [c for c in live if isinstance(c, _Guarded) and c is not self and c._spare(now)]
            victim = min(spare, key=lambda c: c._idle_since) if spare else self  # all busy: the newcomer goes
            victim.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """No request in the app's hands: before a head is complete, or after the last response."""
        return self.cycle is None or self.cycle.response_complete

    def _spare(self, now: float) -> bool:
        """Closed first when the cap is reached: idle, or stalled mid-body (its body paused STALLED_S or more:
        the app would answer it 408 later, and keys can hold sockets that way)."""
        if self._idle():
            return True
        stalled = self.conn.their_state is h11.SEND_BODY and now - self._idle_since >= STALLED_S
        return stalled and not self.cycle.response_started

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._idle() and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._idle():
            self._idle_since = time.monotonic()  # a request's body moving: the stall clock restarts
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            return
        super().data_received(data)

    def handle_events(self) -> None:
        if self._refused or (self.conn.their_state is h11.IDLE and self._head_too_large(b"")):
            return  # a head pipelined behind a request is held to the same caps when its turn comes
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's head is in: the app (and its body pace) has it now
            self._disarm()

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        self._arm(self.keep_alive)  # the next head by then, however slowly bytes trickle in
        super().on_response_complete()

    def _head_too_large(self, data: bytes) -> bool:
        head = self.conn.trailing_data[0] + data[: MAX_HEAD_BYTES + 4]
        end = head.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
        size = end + 4 if end >= 0 else len(head)
        lines = head.count(b"\r\n", 0, size) - 2 if end >= 0 else head.count(b"\r\n")
        if size <= MAX_HEAD_BYTES and lines <= MAX_HEADERS:
            return False
        msg = (f"The request head is larger than this server takes: at most {MAX_HEAD_BYTES} bytes and "
               f"{MAX_HEADERS} header lines")  # fmt: skip
        body = json.dumps(error_body(msg, "invalid_request_error", None, "request_header_fields_too_large")).encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        self._refused = True  # the rest is read and dropped: closing with unread bytes would reset the 431 away
        self._disarm()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
        return True


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's exception handler, with "socket.accept() out of system resource" (EMFILE, ENFILE) logged at
    most once per ACCEPT_LOG_EVERY seconds, with the count since the last line; anything else as before."""
    previous = loop.get_exception_handler()
    state = {"last": -ACCEPT_LOG_EVERY, "dropped": 0}

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            if previous is not None:
                previous(lp, context)
            else:
                lp.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - state["last"] < ACCEPT_LOG_EVERY:
            state["dropped"] += 1
            return
        log.error("cannot accept connections: %s (%d more since the last line; the open-file limit is too low for "
                  "--max-connections)", context.get("exception"), state["dropped"])  # fmt: skip
        state["last"], state["dropped"] = now, 0

    loop.set_exception_handler(handler)
