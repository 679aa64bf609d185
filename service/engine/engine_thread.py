"""The engine thread's side of `worker.EngineWorker` (a mixin): start-up, the loop (drain the inbox ->
`stepping.iterate` -> publish the events, one call_soon_threadsafe per step per event loop), failure reports,
the step and phase metrics. Everything here runs on the engine thread, the only thread that touches MLX."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsv4_serve.service.engine import canary, startup
from dsv4_serve.service.engine.engine_profile import EngineProfile
from dsv4_serve.service.engine.pacing import Pacer
from dsv4_serve.service.engine.phases import PhaseClock
from dsv4_serve.service.engine.request import TokenEvent
from dsv4_serve.service.engine.scheduler import QueueFull, Scheduler, needs_sample
from dsv4_serve.service.engine.stepping import Counters, iterate
from dsv4_serve.service.engine.streams import Stream, deliver, settle

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dsv4_serve.service.engine.engine import Engine
    from dsv4_serve.service.engine.sampler import Pending

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 2048  # prompt tokens per step through the parallel prefill (= model.deepseek_v4.PREFILL_CHUNK)


class EngineThread:
    """The engine thread's loop over the worker's state (set in `EngineWorker.__init__`)."""

    _factory: Callable[[], tuple[Engine, Tokenizer | None]]
    _engine: Engine
    _inbox: queue.Queue[tuple[str, Any]]
    _lock: threading.Lock
    _streams: dict[str, Stream]
    _c: Counters
    _ready: threading.Event
    _started: threading.Event
    _accepting: bool
    _stop_deadline: float | None
    _inflight: Any
    _ahead: Any
    _prefill_budget: int
    _fits_rows: Callable[[int, int], bool] | None
    on_failure: Callable[[BaseException], None] | None
    canary_interval: float
    canary_action: str
    _canary: canary.Canary | None
    canary_failure: BaseException | None
    on_step_metrics: Callable[[int, float], None] | None
    on_phase_metrics: Callable[[dict[str, float]], None] | None
    start_error: BaseException | None
    died: BaseException | None
    tokenizer: Any
    max_rows: int
    max_queue: int
    prefill_chunk: int | None
    prefill_slice_ms: float
    prefill_whole_tokens: int
    itl_target_ms: float | None
    _pacer: Pacer
    serial_prefill: bool
    pipeline: bool
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    max_fit_tokens: int
    bytes_budget: int
    abort: Callable[[str], None]  # EngineWorker's: the engine frees the row before its next step

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
        self._canary = canary.start(engine, self.canary_interval, self.canary_action)  # after warm-up, before ready
        # Slices paced by the ITL target where forwards are built in slices (a distributed leader's are whole).
        sliced = parallel and bool(getattr(engine, "sliced_prefill", False))
        self._pacer = Pacer(self.itl_target_ms if sliced else 0, self.prefill_slice_ms, self._prefill_budget)
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
            # A distributed LeaderEngine tells its follower ranks to exit (they wait on every step), non-zero
            # when this thread ends on a failure.
            close = getattr(getattr(self, "_engine", None), "close", None)
            if close is not None:
                try:
                    close(failed=self.start_error is not None or self.died is not None)
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
        prof = EngineProfile.start()  # DSV4_ENGINE_PROFILE: cProfile + slow iterations; else nothing
        clock = PhaseClock(getattr(engine, "host_seconds", None), self._c,
                           lambda: self._inflight.seconds if self._inflight is not None else 0.0)
        try:
            if self._canary is not None and not self._first_check(engine, sched, sample, clock, prof):
                with self._lock:
                    self.start_error = self.canary_failure
                self._started.set()  # never ready: the failure is reported (the server exits non-zero)
            else:
                self._ready.set()
                self._started.set()
            self._loop(engine, sched, sample, clock, prof)
        finally:
            prof.stop()

    def _loop(self, engine: Engine, sched: Scheduler, sample: Callable[..., Pending], clock: PhaseClock,
              prof: EngineProfile) -> None:  # fmt: skip
        while True:
            idle = not sched.has_work() and self._inflight is None and self._stop_deadline is None
            wait = self._canary.seconds_left() if self._canary is not None and idle else None
            events = self._drain_inbox(sched, block=idle, timeout=wait)  # blocks only when idle: no busy spin
            deadline = self._stop_deadline
            if deadline is not None and self._canary is not None:
                self._canary.cancel(sched)
            if deadline is not None and (not sched.has_work() or time.monotonic() >= deadline):
                break
            if self._canary is not None and deadline is None and self._inbox.empty():  # adds not drained go first
                self._canary.offer(sched, engine)
            self._iteration(engine, sched, sample, clock, prof, events)
        # Stopping: abort whatever is left, including adds that raced with the stop.
        events = self._drain_inbox(sched, block=False)
        for rid in sched.ids():
            events += sched.abort_group(rid)
        with self._lock:
            self._c.waiting = self._c.running = 0
        self._publish([e for e in events if e is not None])

    def _iteration(self, engine: Engine, sched: Scheduler, sample: Callable[..., Pending], clock: PhaseClock,
                   prof: EngineProfile, events: list[TokenEvent]) -> None:  # fmt: skip
        """One iteration (`stepping.iterate`), its canary events taken out, the rest (and `events`) published, its
        seconds by phase observed."""
        t0 = time.perf_counter()
        clock.start()
        try:
            events += self._step(engine, sched, sample)
        except Exception as e:  # noqa: BLE001 - never let one step kill the thread
            log.exception("engine iteration failed")
            events += sched.fail(sched.ids()[:1], f"engine error: {type(e).__name__}: {e}")
        if self._canary is not None:
            events = self._take_canary(self._canary, events, sched)
        self._sync_counts(sched)
        self._publish(events)
        with self._lock:
            self._c.loop_seconds += time.perf_counter() - t0
        phases = clock.stop()
        self._observe(phases)
        prof.iteration(phases, engine)

    def _first_check(self, engine: Engine, sched: Scheduler, sample: Callable[..., Pending], clock: PhaseClock,
                     prof: EngineProfile) -> bool:  # fmt: skip
        """The canary's first check, through the served path (the parallel prefill, the batched step or its graphs,
        sampling), before /ready: a path that gives other tokens than the start-up decode, or errs, never serves a
        request (under "fail"; "warn" logs it and serves). False: it failed under "fail". A check that cannot run
        (no room) waits for its interval."""
        c = self._canary
        assert c is not None
        t0 = time.perf_counter()
        c.due = c.clock()
        c.offer(sched, engine)
        if c.request is None:
            return True
        while c.request is not None and self.canary_failure is None:
            self._iteration(engine, sched, sample, clock, prof, [])  # the loop's, with nothing else admitted
        if c.error is not None and c.action == "fail" and self.canary_failure is None:  # the served path errs
            self._canary_failed(RuntimeError(f"canary's first check could not run through the served path: {c.error}"))
        failed = c.failures or c.error is not None
        canary.log.info("first check through the served path %s in %.2f s", "failed" if failed else "passed",
                        time.perf_counter() - t0)  # fmt: skip
        return self.canary_failure is None

    def _take_canary(self, c: canary.Canary, events: list[TokenEvent], sched: Scheduler) -> list[TokenEvent]:
        """The canary's events leave the iteration's (no client sees them); a failed check under "fail" stops
        admission and reports (the server drains, then exits non-zero)."""
        events, mismatch = c.take(events, sched)
        if mismatch is not None and c.tripped:
            self._canary_failed(mismatch)
        return events

    def _canary_failed(self, failure: BaseException) -> None:
        """Stop admitting and report (the server drains, then exits non-zero)."""
        with self._lock:
            self.canary_failure, self._accepting = failure, False
        self._report(failure)

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
            self._c.running = sched.num_running - (self._canary.rows() if self._canary is not None else 0)

    def _drain_inbox(self, sched: Scheduler, block: bool, timeout: float | None = None) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        while True:
            try:
                kind, arg = self._inbox.get(block=block, timeout=timeout if block else None)
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

    @staticmethod
    def _built(engine: Engine) -> tuple[int, int]:
        """The prefill the engine has built so far: (rows x layers, layers); a stand-in without them: none."""
        return getattr(engine, "prefill_rows_layers", 0), getattr(engine, "prefill_layers", 0)

    def _step(self, engine: Engine, sched: Scheduler, sample: Callable[..., Pending]) -> list[TokenEvent]:
        t0, built, layers = time.perf_counter(), *self._built(engine)
        rows = getattr(engine, "prefill_rows", None)  # the forward in flight's, if any (else a new one's first slice)
        pace = self._pacer.pace(streaming=any(needs_sample(r) for r in sched.running), rows=rows)
        out, self._ahead, self._inflight = iterate(
            engine, sched, sample, pace.budget, lambda: self._sync_counts(sched), self._ahead,
            self.pipeline, self._inflight, pace.slice_seconds, pace.rows_layers, self.prefill_whole_tokens,
        )  # fmt: skip
        now = self._built(engine)
        # a first slice: a forward begun here and still in flight (not one built whole)
        first = rows is None and getattr(engine, "prefill_rows", None) is not None
        self._pacer.observe(time.perf_counter() - t0, bool(out.rows), now[0] - built, now[1] - layers, first)
        with self._lock:
            self._c.record(out)
        if out.rows and self.on_step_metrics is not None:
            try:
                self.on_step_metrics(out.rows, out.seconds)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("on_step_metrics failed")
        return out.events
