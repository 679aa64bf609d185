"""EngineWorker: the thread, the asyncio bridge, admission limits, abort, errors, drain.

Most tests drive the worker with ToyEngine, a ~30-line stand-in for the Engine interface whose
next greedy token is (token * 7 + 3) % V: the worker's job (threading, queues, event order, error
isolation) is independent of the model, and only a stand-in can fail a step on demand. The
last tests run the real tiny model through build_engine(None).
"""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import pytest

from service.engine.request import FinishReason, SamplingParams, TokenEvent
from service.engine.worker import EngineNotReady, EngineWorker, QueueFull

V = 64
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def nxt(t: int) -> int:
    return (t * 7 + 3) % V


class ToyEngine:
    def __init__(self, max_rows: int = 8, max_model_len: int = 100, fail_token: int = -1) -> None:
        self.max_rows, self.max_model_len, self.vocab_size, self.eos_token_id = max_rows, max_model_len, V, 1
        self.fail_token = fail_token
        self.live: set[int] = set()
        self.released: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self._next = 0

    def state_bytes_for(self, n: int) -> int:
        return 10 * n

    def bytes_in_use(self) -> int:
        return 0

    def bytes_budget(self) -> int:
        return 10 * 80  # at most 80 positions for one request

    def can_admit(self, n: int) -> bool:
        return len(self.live) < self.max_rows

    def admit(self, n: int) -> int:
        self._next += 1
        self.live.add(self._next)
        return self._next

    def release(self, h: int) -> None:
        self.live.remove(h)
        self.released.append(h)

    def step(self, feeds: list[tuple[int, int, int]]) -> mx.array:
        self.gate.wait()
        if any(tok == self.fail_token for _, tok, _ in feeds):
            raise RuntimeError("toy step failed")
        target = mx.array([nxt(tok) for _, tok, _ in feeds])[:, None]
        return -mx.abs(mx.arange(V)[None, :] - target).astype(mx.float32)

    def warmup(self) -> None:
        pass


def run(coro_fn, engine: ToyEngine | None = None, **kw):
    """Start a worker on `engine`, run coro_fn(worker, engine) in a fresh loop, always stop it."""
    engine = engine or ToyEngine()
    w = EngineWorker(lambda: (engine, None), **kw)
    w.start()

    async def main():
        assert await w.wait_ready(10)
        try:
            return await coro_fn(w, engine)
        finally:
            engine.gate.set()
            await w.drain(0)

    return asyncio.run(main())


async def collect(w: EngineWorker, prompt: list[int], params: SamplingParams = GREEDY) -> list[TokenEvent]:
    return [ev async for ev in await w.submit(prompt, params)]


def test_greedy_stream_and_final_event() -> None:
    async def body(w, eng):
        return await collect(w, [5, 6, 7])

    events = run(body)
    want = [nxt(7)]
    for _ in range(3):
        want.append(nxt(want[-1]))
    assert [e.token_id for e in events] == want + [None]
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_eight_concurrent_requests_share_steps() -> None:
    rows_seen: list[int] = []

    async def body(w, eng):
        res = await asyncio.gather(*[collect(w, [i + 2]) for i in range(8)])
        return res, w.stats()

    res, stats = run(body, on_step_metrics=lambda rows, dt: rows_seen.append(rows))
    for i, events in enumerate(res):
        assert events[0].token_id == nxt(i + 2) and events[-1].finish_reason is FinishReason.LENGTH
    assert max(rows_seen) == 8 and stats["rows_per_step"][8] >= 1
    assert stats["steps_total"] == len(rows_seen) and stats["running"] == 0 and stats["waiting"] == 0


def test_queue_full_and_validation() -> None:
    async def body(w, eng):
        eng.gate.clear()  # hold the first step so the next requests stay waiting
        first = await w.submit([3], SamplingParams(max_tokens=3))
        while w.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        waiting = [await w.submit([3], GREEDY) for _ in range(2)]
        with pytest.raises(QueueFull):
            await w.submit([3], GREEDY)
        with pytest.raises(ValueError, match="max_model_len 100"):
            await w.submit([3] * 90, SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="decode state"):
            await w.submit([3] * 50, SamplingParams(max_tokens=35))
        with pytest.raises(ValueError):
            await w.submit([], GREEDY)
        eng.gate.set()
        return [[e async for e in it] for it in [first, *waiting]]

    res = run(body, max_rows=1, max_queue=2)
    assert [r[-1].finish_reason for r in res] == [FinishReason.LENGTH] * 3


def test_abort_running_request_frees_its_row() -> None:
    async def body(w, eng):
        it = await w.submit([3], SamplingParams(max_tokens=70, temperature=0.0))
        events = []
        async for ev in it:
            events.append(ev)
            if len(events) == 2:
                w.abort(ev.request_id)
        # the freed row is reusable at once
        after = await collect(w, [4])
        return events, after, list(eng.released)

    events, after, released = run(body, max_rows=1)
    assert events[-1].finish_reason is FinishReason.ABORT and len(events) < 10
    assert after[-1].finish_reason is FinishReason.LENGTH and released == [1, 2]


def test_closing_the_stream_aborts() -> None:
    async def body(w, eng):
        it = await w.submit([3], SamplingParams(max_tokens=70))
        await it.__anext__()
        await it.aclose()  # what a disconnected client does
        for _ in range(200):
            if eng.released:
                break
            await asyncio.sleep(0.005)
        return list(eng.released), w.stats()

    released, stats = run(body)
    assert released == [1] and stats["running"] == 0


def test_step_error_fails_the_rows_and_serving_goes_on() -> None:
    async def body(w, eng):
        bad = await collect(w, [5, 13, 6])
        good = await collect(w, [5, 6])
        return bad, good

    bad, good = run(body, engine=ToyEngine(fail_token=13))
    assert len(bad) == 1 and "toy step failed" in bad[0].error
    assert good[-1].finish_reason is FinishReason.LENGTH and len(good) == 5


def test_drain_lets_in_flight_requests_finish() -> None:
    async def body(w, eng):
        it = await w.submit([3], SamplingParams(max_tokens=5, temperature=0.0))
        drain = asyncio.create_task(w.drain(5.0))
        await asyncio.sleep(0)
        with pytest.raises(EngineNotReady):
            await w.submit([3], GREEDY)
        events = [e async for e in it]
        t0 = asyncio.get_running_loop().time()
        await drain  # the thread stops as soon as nothing is left, not at the deadline
        return events, w.ready, asyncio.get_running_loop().time() - t0

    events, ready, dt = run(body)
    assert events[-1].finish_reason is FinishReason.LENGTH and len(events) == 6 and not ready
    assert dt < 2.0


def test_drain_aborts_what_outlives_the_timeout() -> None:
    async def body(w, eng):
        eng.gate.clear()  # the first step hangs past the drain deadline
        it = await w.submit([3], SamplingParams(max_tokens=70, temperature=0.0))
        drain = asyncio.create_task(w.drain(0.1))
        await asyncio.sleep(0.3)
        eng.gate.set()
        events = [e async for e in it]
        await drain
        return events, list(eng.released)

    events, released = run(body)
    assert events[-1].finish_reason is FinishReason.ABORT and len(events) <= 2 and released == [1]


def test_start_failure_is_reported() -> None:
    def factory():
        raise OSError("no weights here")

    w = EngineWorker(factory)
    w.start()

    async def main():
        assert not await w.wait_ready(10)
        with pytest.raises(EngineNotReady, match="no weights"):
            await w.submit([1], GREEDY)

    asyncio.run(main())
    assert isinstance(w.start_error, OSError)


# ---- the real tiny model ------------------------------------------------------------------------
def _tiny_factory():
    try:
        import model.loader  # noqa: F401  (build_engine(None) needs the tiny model builder)
        from service.engine.engine import build_engine
    except ImportError as e:
        pytest.skip(f"real engine not available yet: {e}")
    return lambda: build_engine(None, max_model_len=256)


def _run_real(body):
    w = EngineWorker(_tiny_factory())
    w.start()

    async def main():
        assert await w.wait_ready(300), w.start_error
        try:
            return await body(w)
        finally:
            await w.drain(0)

    return asyncio.run(main())


def test_real_engine_batched_equals_alone() -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=42)

    async def body(w):
        alone = [await collect(w, [3, 4, 5], greedy), await collect(w, [7, 8], seeded)]
        others = [collect(w, list(range(2, 2 + i)), SamplingParams(max_tokens=8)) for i in range(1, 7)]
        batched = await asyncio.gather(collect(w, [3, 4, 5], greedy), collect(w, [7, 8], seeded), *others)
        return alone, batched[:2]

    alone, batched = _run_real(body)
    assert [[e.token_id for e in r] for r in alone] == [[e.token_id for e in r] for r in batched]
    assert alone[0][-1].finish_reason is FinishReason.LENGTH
