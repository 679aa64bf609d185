"""The engine thread and its bridge to asyncio: submit()/abort() in, TokenEvents out.

One thread owns the Engine (every MLX call); its loop is `engine_thread.EngineThread`'s: drain the inbox ->
scheduler.plan() -> the planned prompts' parallel prefill and engine.step(feeds) + sampling (`stepping.py`) ->
scheduler.on_step() -> publish events with loop.call_soon_threadsafe (one call per step per event loop). It
blocks on the inbox when idle. This module imports no mlx at import time, so the API side may import it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dsv4_serve.service.engine.engine_thread import DEFAULT_PREFILL_CHUNK, EngineThread
from dsv4_serve.service.engine.request import (
    SHARED,
    FinishReason,
    Namespace,
    Request,
    SamplingParams,
    TokenEvent,
    check_admissible,
)
from dsv4_serve.service.engine.scheduler import QueueFull
from dsv4_serve.service.engine.stepping import Counters
from dsv4_serve.service.engine.streams import Stream

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dsv4_serve.service.engine.engine import Engine

T = TypeVar("T")

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PREFILL_CHUNK", "EngineNotReady", "EngineWorker", "QueueFull"]


DEFAULT_PREFILL_SLICE_MS = 10.0  # host ms of a prefill forward built between two decode steps while rows stream


class EngineNotReady(RuntimeError):
    """Not started yet, failed to start, draining or stopped; the API answers 503."""


class EngineWorker(EngineThread):
    """The event-loop side: lifecycle, submit / abort / call, stats; the engine thread's loop is EngineThread's."""

    def __init__(
        self,
        engine_factory: Callable[[], tuple[Engine, Tokenizer | None]],
        *,
        max_rows: int = 8,
        max_queue: int = 64,
        prefill_chunk: int | None = None,
        prefill_slice_ms: float = DEFAULT_PREFILL_SLICE_MS,
        prefill_whole_tokens: int = 0,
        itl_target_ms: float | None = 0.0,
        serial_prefill: bool = False,
        pipeline: bool = True,
        on_step_metrics: Callable[[int, float], None] | None = None,
        on_phase_metrics: Callable[[dict[str, float]], None] | None = None,
        stream_queue: int = 1024,
        on_failure: Callable[[BaseException], None] | None = None,
        canary_interval: float = 0.0,
        canary_action: str = "fail",
    ) -> None:
        self._factory = engine_factory
        # The correctness canary (canary.py): every `canary_interval` s (0: off) a fixed prompt as an ordinary row,
        # compared with its start-up decode; a mismatch under "fail" ends serving (on_failure), "warn" logs it.
        self.canary_interval, self.canary_action = canary_interval, canary_action
        self._canary: Any = None
        self.canary_failure: BaseException | None = None
        # Called on the engine thread when the engine can never serve: start-up failed or the thread died.
        self.on_failure = on_failure
        self.stream_queue = stream_queue  # the most token events one stream may have waiting
        self.max_rows = max_rows
        self.max_queue = max_queue
        # Prompt tokens per step through the engine's parallel prefill (None: PREFILL_CHUNK). An engine
        # without one (parallel_prefill False, or serial_prefill) feeds prompts token by token and this caps
        # the prefilling rows.
        self.prefill_chunk = prefill_chunk
        # While rows stream, a prefill forward is built this many ms of host time at a time (whole layers), a
        # decode step after each slice (prefilling.py); 0: whole forwards, the streams waiting for each.
        if prefill_slice_ms < 0:
            raise ValueError(f"prefill_slice_ms must be >= 0, got {prefill_slice_ms}")
        self.prefill_slice_ms = prefill_slice_ms
        # A forward of at most this many prompt tokens is built whole even while rows stream (0: none; the
        # server's default is 256: settings.py).
        if prefill_whole_tokens < 0:
            raise ValueError(f"prefill_whole_tokens must be >= 0, got {prefill_whole_tokens}")
        self.prefill_whole_tokens = prefill_whole_tokens
        # While rows stream, prefill slices and chunks sized to keep their inter-token latency under this many
        # ms (pacing.py; None: 2x the measured step; 0: off, fixed slices as above). The server's default is None.
        if itl_target_ms is not None and itl_target_ms < 0:
            raise ValueError(f"itl_target_ms must be >= 0 or None, got {itl_target_ms}")
        self.itl_target_ms = itl_target_ms
        self._inflight: Any = None
        self.serial_prefill = serial_prefill  # token by token even when the engine has a parallel prefill
        # Pure decode: queue step N + 1 (fed step N's tokens on the device) before reading step N back, so
        # the host builds one step while the GPU runs the other (stepping.Ahead); engines that need the
        # token ids on the host (engine.pipeline_decode False) never do.
        self.pipeline = pipeline
        self._ahead: Any = None
        self._prefill_budget = 0
        # Called on the engine thread after every step: (rows in the step, step seconds).
        self.on_step_metrics = on_step_metrics
        # Called on the engine thread after every iteration that stepped or prefilled: its seconds by phase.
        self.on_phase_metrics = on_phase_metrics
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._started = threading.Event()  # set once start-up ended, well or not
        self._accepting = True
        self._stop_deadline: float | None = None
        self.start_error: BaseException | None = None
        self.died: BaseException | None = None  # what killed the engine thread after start-up
        # Engine facts, set on the engine thread before `ready`; plain ints, safe to read anywhere.
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_id: int | None = None
        self.bytes_budget = 0
        self.max_fit_tokens = 0  # the most positions one request's decode state can ever have
        self._fits_rows: Callable[[int, int], bool] | None = None
        # Queue and step accounting shared by both threads (under _lock).
        self._c = Counters()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineWorker already started")
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._accepting

    @property
    def starting(self) -> bool:
        """The engine thread is still loading or warming up."""
        return self._thread is not None and self._thread.is_alive() and not self._started.is_set()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for start-up to end; True if the engine is serving."""
        await asyncio.to_thread(self._started.wait, timeout)
        return self.ready

    def _begin_stop(self, deadline: float) -> None:
        with self._lock:
            self._accepting = False
        self._inbox.put(("stop", deadline))

    async def drain(self, timeout: float) -> None:
        """Stop accepting; let accepted requests run up to `timeout` s, abort the rest, stop."""
        self._begin_stop(time.monotonic() + timeout)
        if self.starting:
            # still loading or warming up: nothing accepted to finish, and the warm-up (minutes on a cold GPU
            # start) reads no inbox; the thread is a daemon and ends with the process
            log.info("stopped during start-up: not waiting for the warm-up")
            return
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout + 30.0)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything at once and stop the thread (blocking)."""
        self._begin_stop(time.monotonic())
        if self.starting:  # a warm-up reads no inbox (drain): the daemon thread ends with the process
            return
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the event-loop side -----------------------------------------------------------------------
    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        namespace: Namespace = SHARED,
    ) -> AsyncIterator[TokenEvent]:
        """Queue a request; returns its event stream. Raises before any iteration: QueueFull,
        ValueError (never fits), EngineNotReady. The stream ends after an event with
        finish_reason or error set; closing it early aborts the request."""
        return (await self.submit_n(prompt_ids, [params], [request_id or uuid.uuid4().hex], namespace))[0]

    async def submit_n(
        self, prompt_ids: list[int], params: list[SamplingParams], request_ids: list[str],
        namespace: Namespace = SHARED,
    ) -> list[AsyncIterator[TokenEvent]]:
        """`submit` for n rows of one prompt (n > 1 sampling): admitted together, one prefill, the state
        copied to the other rows; one event stream per row. `namespace`: the prefix cache's (tenant, salt)."""
        if not self._ready.is_set():
            raise EngineNotReady(
                f"engine failed to start: {self.start_error!r}" if self.start_error else "engine is not ready"
            )
        if not 1 <= len(params) <= self.max_rows or len(params) != len(request_ids):
            raise ValueError(f"n = {len(params)} rows: at most max_rows = {self.max_rows}, one id each")
        for p in params:
            check_admissible(prompt_ids, p, self.max_model_len, self.max_fit_tokens, self.bytes_budget)
        n_pos = len(prompt_ids) + max(p.max_tokens for p in params)
        if len(params) > 1 and self._fits_rows is not None and not self._fits_rows(n_pos, len(params)):
            raise ValueError(f"n = {len(params)} rows of {n_pos} positions each never fit the decode state together")
        loop = asyncio.get_running_loop()
        streams = [Stream(loop, asyncio.Queue(), cap=self.stream_queue) for _ in request_ids]
        reqs = [Request(rid, list(prompt_ids), p, namespace=namespace)
                for rid, p in zip(request_ids, params, strict=True)]
        reqs[0].followers = reqs[1:]
        with self._lock:
            if not self._accepting:
                raise EngineNotReady("engine is draining")
            for rid in request_ids:
                if rid in self._streams or request_ids.count(rid) > 1:
                    raise ValueError(f"request id {rid!r} is already in flight")
            if self._c.undrained + self._c.waiting >= self.max_queue:
                raise QueueFull(f"waiting queue full ({self.max_queue} requests)")
            self._c.undrained += 1
            self._streams.update(zip(request_ids, streams, strict=True))
            # Under the lock: a stop() can't slip between the check above and this put.
            self._inbox.put(("add", reqs[0]))
        return [self._iterate(rid, st) for rid, st in zip(request_ids, streams, strict=True)]

    async def _iterate(self, rid: str, stream: Stream) -> AsyncIterator[TokenEvent]:
        done = False
        try:
            while True:
                if stream.overflowed and stream.queue.empty():
                    done = True  # the engine was told to abort it when the queue overflowed
                    yield TokenEvent(rid, finish_reason=FinishReason.ABORT)
                    return
                ev = await stream.queue.get()
                done = ev.finish_reason is not None or ev.error is not None
                yield ev
                if done:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not done:
                self.abort(rid)  # consumer went away (client disconnect): free the row

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine frees the row before its next step. Unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread between steps (state export / import); its result, or
        its exception raised here."""
        if not self.ready:
            raise EngineNotReady("engine is not ready")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(("call", (fn, loop, fut)))
        return await fut

    def queue_room(self) -> int:
        """How many more requests the waiting queue takes now (the API's 429 before any work; submit_n checks
        again under the same lock)."""
        with self._lock:
            return self.max_queue - self._c.undrained - self._c.waiting

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self._c.snapshot(self.ready)
            streams = list(self._streams.values())
        s["stream_events_queued"] = sum(st.queue.qsize() for st in streams)
        host = getattr(getattr(self, "_engine", None), "host_seconds", None)  # Engine.host_seconds
        if host:
            s["host_seconds_total"] = dict(host)
        split = getattr(getattr(self, "_engine", None), "prefill_ms", None)  # Engine.prefill_ms: plain floats
        if split:
            s["prefill_host_ms"] = dict(split)
        if self._canary is not None:  # plain ints and a float, written by the engine thread
            s.update(self._canary.stats())
        pacer = getattr(self, "_pacer", None)  # pacing.py, once the engine started
        if pacer is not None:
            s.update(pacer.stats())
        spec = getattr(getattr(self, "_engine", None), "speculator", None)  # speculation.Speculator: plain ints
        if spec is not None:
            s.update(spec.stats())
        graphs = getattr(getattr(self, "_engine", None), "graphs", None)  # engine.graphs.DecodeGraphs
        if graphs is not None:
            s.update(graphs.stats())
        noter = getattr(getattr(self, "_engine", None), "kernel_noter", None)  # on CUDA unless DSV4_KERNEL_CACHE=0
        if noter is not None:
            s["kernels_late_total"] = noter.late
        return s
