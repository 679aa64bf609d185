"""Controller: what the routes share (settings, metrics, the worker and the engine facts it publishes, the
draining flag, the live requests), readiness (requests wait for the model up to a bound) and the drain."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsv4_serve.service.api.metrics import Metrics
from dsv4_serve.service.api.protocol import APIError
from dsv4_serve.service.settings import Settings

log = logging.getLogger("dsv4.api")
READY_POLL_S = 0.02  # how often a request held for readiness looks again (no thread per waiting request)


@dataclass
class Controller:
    settings: Settings
    metrics: Metrics
    worker: Any = None
    engine: Any = None
    draining: bool = False
    active: dict[str, None] = field(default_factory=dict)  # live request ids (insertion order)
    loop: asyncio.AbstractEventLoop | None = None
    held: int = 0  # requests waiting for the model to be ready
    grammars: Any = None  # grammar_pool.GrammarPool: the bounded grammar compiles (create_app sets it)
    _drain_task: asyncio.Task[None] | None = None
    _after_drain: list[Callable[[], None]] = field(default_factory=list)
    # Set by `dsv4-serve serve`: stop the server, which then exits non-zero (an engine that cannot serve).
    on_fatal: Callable[[], None] | None = None

    # Engine facts the worker publishes before `ready` (plain ints / the tokenizer).
    @property
    def tokenizer(self) -> Any:
        return getattr(self.worker, "tokenizer", None)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.worker, "max_model_len", 0) or 0)

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.worker, "vocab_size", 0) or 0)

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.worker, "eos_token_id", None)

    @property
    def ready(self) -> bool:
        return bool(self.worker is not None and getattr(self.worker, "ready", False)) and not self.draining

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can never serve (its start-up failed or its thread died); None while it loads or serves."""
        return (getattr(self.worker, "start_error", None) or getattr(self.worker, "died", None)
                or getattr(self.worker, "canary_failure", None))  # fmt: skip

    def fail(self, e: BaseException) -> None:
        """On the event loop, once the engine can never serve: say why and stop the server (`on_fatal`); after a
        drain when the engine still runs (a canary mismatch: service/engine/canary.py)."""
        log.error("the engine cannot serve: %s", describe_failure(e))
        if self.on_fatal is None:
            return
        if getattr(self.worker, "canary_failure", None) is e:
            self.begin_drain(then=self.on_fatal)
        else:
            self.on_fatal()

    def fail_threadsafe(self, e: BaseException) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.fail, e)

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down", code="draining", headers={"Retry-After": "5"})
        if not self.ready:
            err = getattr(self.worker, "start_error", None)
            msg = f"The engine failed to start: {err!r}" if err else "The model is still loading"
            raise APIError(503, msg, code="not_ready", headers={"Retry-After": "1"})

    def check_room(self, requests: int = 1, param: str = "prompt") -> None:
        """429 + Retry-After before any work when the waiting queue cannot take `requests` more now; 400 when it
        never can (more than --max-queue: a retry would get 429 forever)."""
        if requests > self.settings.max_queue:
            raise APIError(400, f"'{param}' holds {requests} prompts, each a request of the waiting queue; this "
                           f"server queues at most {self.settings.max_queue} (--max-queue)", param=param,
                           code="invalid_value")  # fmt: skip
        room = getattr(self.worker, "queue_room", None)
        if room is not None and room() < requests:
            self.metrics.outcome("queue_full")
            raise APIError(429, "The server's waiting queue is full; retry shortly", code="queue_full",
                           headers={"Retry-After": "1"})  # fmt: skip

    async def wait_ready(self) -> None:
        """Hold a generation request while the model loads or warms up, up to `ready_timeout` seconds, then
        `check_ready`'s 503 + Retry-After; at once when draining or when start-up failed. At most `max_queue`
        requests are held (beyond: 429 + Retry-After, as a full queue)."""
        if self.ready:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.ready_timeout
        if self.held >= self.settings.max_queue and not self.draining:
            raise APIError(429, "The server is still loading and holds as many requests as its queue takes; "
                           "retry shortly", code="queue_full", headers={"Retry-After": "1"})  # fmt: skip
        self.held += 1
        try:
            while (not self.ready and not self.draining and getattr(self.worker, "start_error", None) is None
                   and loop.time() < deadline):  # fmt: skip
                await asyncio.sleep(min(READY_POLL_S, max(0.0, deadline - loop.time())))
        finally:
            self.held -= 1
        self.check_ready()

    def stats(self) -> dict[str, Any] | None:
        if self.worker is None:
            return None
        s = dict(self.worker.stats())
        if self.engine is not None:
            s["bytes_in_use"] = self.engine.bytes_in_use()
            s["bytes_budget"] = self.engine.bytes_budget()
            s.update(getattr(self.engine, "prefix_stats", dict)())
        return s

    def abort(self, request_id: str) -> None:
        if self.worker is not None:
            self.worker.abort(request_id)

    # ---- drain: stop admission, let streams finish within drain_timeout, then abort them -------
    def begin_drain_threadsafe(self, then: Callable[[], None] | None = None) -> None:
        """`then` runs on the event loop once the drain has ended (the server's shutdown)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.begin_drain, then)

    def begin_drain(self, then: Callable[[], None] | None = None) -> None:
        if then is not None:
            if self._drain_task is not None and self._drain_task.done():
                then()
            else:
                self._after_drain.append(then)
        if self._drain_task is None:
            self.draining = True
            n, t = len(self.active), self.settings.drain_timeout
            log.info("draining: %d request(s) in flight, up to %.0fs to finish", n, t)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self._drain_streams()
        finally:  # the server's shutdown (uvicorn's) runs whatever happened above
            log.info("drained")
            for then in self._after_drain:
                then()

    async def _drain_streams(self) -> None:
        loop, timeout = asyncio.get_running_loop(), self.settings.drain_timeout
        deadline = loop.time() + timeout
        drain = getattr(self.worker, "drain", None)
        if drain is not None:  # the worker stops admitting, runs accepted requests, then aborts the rest
            try:
                await asyncio.wait_for(call(drain, timeout), timeout + 10)
            except Exception:  # noqa: BLE001 - fall through to aborting each stream
                log.exception("worker drain failed")
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.active):  # each stream then ends with finish_reason "abort"
            self.abort(rid)
        while self.active and loop.time() < deadline + 5:
            await asyncio.sleep(0.05)

    async def wait_drained(self) -> None:
        self.begin_drain()
        assert self._drain_task is not None
        await self._drain_task


def describe_failure(e: BaseException) -> str:
    """`Type: message`, the form a log line or stderr names a failure in (a bare message may be empty)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def call(fn: Callable[..., Any] | None, *args: Any) -> None:
    if fn is None:
        return
    if inspect.iscoroutinefunction(fn):
        await fn(*args)
    else:
        await asyncio.to_thread(fn, *args)
