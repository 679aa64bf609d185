"""The engine thread and its bridge to asyncio: submit()/abort() in, TokenEvents out.

One thread owns the Engine (every MLX call). Its loop: drain the inbox -> scheduler.plan() ->
the planned prompts' parallel prefill and engine.step(feeds) + sampling (`stepping.py`) ->
scheduler.on_step() -> publish events with loop.call_soon_threadsafe (one call per step per event
loop). It blocks on the inbox when
idle. This module imports no mlx at import time, so the API side may import it.
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

from dsv4_serve.service.engine import startup
from dsv4_serve.service.engine.phases import PhaseClock
from dsv4_serve.service.engine.request import (
    SHARED,
    FinishReason,
    Namespace,
    Request,
    SamplingParams,
    TokenEvent,
    check_admissible,
)
from dsv4_serve.service.engine.scheduler import QueueFull, Scheduler
from dsv4_serve.service.engine.stepping import Counters, iterate
from dsv4_serve.service.engine.streams import Stream, deliver, settle

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dsv4_serve.service.engine.engine import Engine
    from dsv4_serve.service.engine.sampler import Pending

T = TypeVar("T")

log = logging.getLogger(__name__)

__all__ = ["EngineNotReady", "EngineWorker", "QueueFull"]


DEFAULT_PREFILL_CHUNK = 2048  # prompt tokens per step through the parallel prefill (= model.deepseek_v4.PREFILL_CHUNK)
DEFAULT_PREFILL_SLICE_MS = 10.0  # host ms of a prefill forward built between two decode steps while rows stream


class EngineNotReady(RuntimeError):
    """Not started yet, failed to start, draining or stopped; the API answers 503."""


class EngineWorker:
    def __init__(
        self,
        engine_factory: Callable[[], tuple[Engine, Tokenizer | None]],
        *,
        max_rows: int = 8,
        max_queue: int = 64,
        prefill_chunk: int | None = None,
        prefill_slice_ms: float = DEFAULT_PREFILL_SLICE_MS,
        serial_prefill: bool = False,
        pipeline: bool = True,
        on_step_metrics: Callable[[int, float], None] | None = None,
        on_phase_metrics: Callable[[dict[str, float]], None] | None = None,
        stream_queue: int = 1024,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._factory = engine_factory
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
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout + 30.0)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything at once and stop the thread (blocking)."""
        self._begin_stop(time.monotonic())
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
        spec = getattr(getattr(self, "_engine", None), "speculator", None)  # speculation.Speculator: plain ints
        if spec is not None:
            s.update(spec.stats())
        return s

    # -- the engine thread ----------------------------------------------------------------------
    def _publish(self, events: list[TokenEvent]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, TokenEvent]]] = {}
        with self._lock:
            for ev in events:
                s = self._streams.get(ev.request_id)
                if s is not None:
                    by_loop.setdefault(s.loop, []).append((s, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items, self.abort)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _start_engine(self) -> tuple[Engine, Scheduler]:
        engine, self.tokenizer = self._factory()
        self._engine = engine  # for close() at thread exit
        startup.prepare(engine, self.tokenizer)
        engine.warmup()
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.eos_token_id = engine.eos_token_id
        self.bytes_budget = engine.bytes_budget()
        self._fits_rows = getattr(engine, "fits_ever", None)  # (positions, rows) -> bool; static arithmetic
        self.max_fit_tokens = startup.max_fit_tokens(engine)
        parallel = bool(getattr(engine, "parallel_prefill", False)) and not self.serial_prefill
        self._prefill_budget = (self.prefill_chunk or DEFAULT_PREFILL_CHUNK) if parallel else 0
        sched = Scheduler(
            engine,
            max_rows=min(self.max_rows, engine.max_rows),
            max_queue=self.max_queue,
            eos_token_id=engine.eos_token_id,
            max_model_len=engine.max_model_len,
            max_prefill_rows=None if parallel else self.prefill_chunk,
        )
        return engine, sched

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the thread is dying: no stream may hang on it
            log.exception("engine thread died")
            self.died = e
            with self._lock:
                self._accepting = False
                ids = list(self._streams)
            self._publish([TokenEvent(rid, error=f"engine thread died: {e!r}") for rid in ids])
            self._report(e)
            raise
        finally:
            # A distributed LeaderEngine tells its follower ranks to exit (they wait on every step).
            close = getattr(getattr(self, "_engine", None), "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001 - exiting anyway
                    log.exception("engine close failed")
            # MLX wants a thread's streams destroyed before it exits, else the process may abort at
            # exit ("terminate called without an active exception"); the engine is gone by now.
            import mlx.core as mx

            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            engine, sched = self._start_engine()
            from dsv4_serve.service.engine.sampler import sample_lazy as sample  # mlx is imported on this thread only
        except BaseException as e:  # noqa: BLE001 - reported through start_error / EngineNotReady
            log.exception("engine start-up failed")
            self.start_error = e
            with self._lock:
                self._accepting = False
            self._started.set()
            self._report(e)
            return
        self._ready.set()
        self._started.set()
        clock = PhaseClock(getattr(engine, "host_seconds", None), self._c,
                           lambda: self._inflight.seconds if self._inflight is not None else 0.0)
        while True:
            idle = not sched.has_work() and self._inflight is None and self._stop_deadline is None
            events = self._drain_inbox(sched, block=idle)  # blocks only when idle: no busy spin
            deadline = self._stop_deadline
            if deadline is not None and (not sched.has_work() or time.monotonic() >= deadline):
                break
            t0 = time.perf_counter()
            clock.start()
            try:
                events += self._step(engine, sched, sample)
            except Exception as e:  # noqa: BLE001 - never let one step kill the thread
                log.exception("engine iteration failed")
                events += sched.fail(sched.ids()[:1], f"engine error: {type(e).__name__}: {e}")
            self._sync_counts(sched)
            self._publish(events)
            with self._lock:
                self._c.loop_seconds += time.perf_counter() - t0
            self._observe(clock.stop())
        # Stopping: abort whatever is left, including adds that raced with the stop.
        events = self._drain_inbox(sched, block=False)
        for rid in sched.ids():
            events += sched.abort_group(rid)
        with self._lock:
            self._c.waiting = self._c.running = 0
        self._publish([e for e in events if e is not None])

    def _report(self, e: BaseException) -> None:
        if self.on_failure is not None:
            try:
                self.on_failure(e)
            except Exception:  # noqa: BLE001 - the failure itself is logged already
                log.exception("on_failure failed")

    def _observe(self, phases: dict[str, float] | None) -> None:
        if phases is not None and self.on_phase_metrics is not None:
            try:
                self.on_phase_metrics(phases)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("on_phase_metrics failed")

    def _sync_counts(self, sched: Scheduler) -> None:
        with self._lock:
            self._c.waiting = sched.num_waiting
            self._c.running = sched.num_running

    def _drain_inbox(self, sched: Scheduler, block: bool) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        while True:
            try:
                kind, arg = self._inbox.get(block=block)
            except queue.Empty:
                return events
            block = False
            if kind == "add":
                with self._lock:  # move it from "undrained" to "waiting" atomically for submit()
                    self._c.undrained -= 1
                    self._c.waiting += 1
                try:
                    sched.add(arg)
                except (QueueFull, ValueError) as e:
                    events += [TokenEvent(r.request_id, error=str(e)) for r in (arg, *arg.followers)]
            elif kind == "abort":
                events += sched.abort_group(arg)
            elif kind == "call":
                settle(*arg, self._engine)
            elif kind == "stop":
                self._stop_deadline = arg if self._stop_deadline is None else min(arg, self._stop_deadline)

    def _step(self, engine: Engine, sched: Scheduler, sample: Callable[..., Pending]) -> list[TokenEvent]:
        out, self._ahead, self._inflight = iterate(
            engine, sched, sample, self._prefill_budget, lambda: self._sync_counts(sched), self._ahead,
            self.pipeline, self._inflight, self.prefill_slice_ms / 1e3,
        )  # fmt: skip
        with self._lock:
            self._c.record(out)
        if out.rows and self.on_step_metrics is not None:
            try:
                self.on_step_metrics(out.rows, out.seconds)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("on_step_metrics failed")
        return out.events
