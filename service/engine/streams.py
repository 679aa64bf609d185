"""A request's event stream between the engine thread and the asyncio loop that reads it: the bounded queue
its consumer reads, the delivery of a step's events on that loop (a reader `cap` events behind is aborted),
and an engine call's result handed back to the loop that asked. No mlx here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from dsv4_serve.service.engine.request import TokenEvent

if TYPE_CHECKING:
    from dsv4_serve.service.engine.engine import Engine

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent]
    # A consumer `cap` events behind (a client that stopped reading) is aborted: its request's row is
    # freed, later events are dropped, and its iterator ends with finish_reason "abort".
    cap: int = 1 << 30
    overflowed: bool = False


def deliver(items: list[tuple[Stream, TokenEvent]], abort: Callable[[str], None]) -> None:
    """On the streams' event loop. A full queue means its reader stopped: abort, drop the rest."""
    for s, ev in items:
        if s.overflowed:
            continue
        if s.queue.qsize() >= s.cap:
            s.overflowed = True
            log.warning("request %s: %d token events unread, aborted (--stream-queue)", ev.request_id, s.cap)
            abort(ev.request_id)
            continue
        s.queue.put_nowait(ev)


def settle(fn: Callable[[Engine], T], loop: asyncio.AbstractEventLoop, fut: asyncio.Future[T], engine: Engine) -> None:
    """On the engine thread: run fn(engine), hand its result or exception to `fut` on its loop."""
    try:
        result, err = fn(engine), None
    except Exception as e:  # noqa: BLE001 - handed to the caller
        result, err = None, e

    def done() -> None:
        if not fut.cancelled():
            fut.set_result(result) if err is None else fut.set_exception(err)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:  # that loop is closed: nobody is waiting
        pass
