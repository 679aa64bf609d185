"""EngineWorker: the thread, the asyncio bridge, admission limits, abort, errors, drain.

Every test runs the real Engine (service/engine/engine.py) around the embedded tiny model, built
once per module. Two controls the real engine does not offer come from `ControlledEngine`, a
subclass that adds only them and otherwise runs the real model, pools and accounting:
  * `gate`: a threading.Event that step() waits on, to hold a step so requests stay waiting or
    outlive a drain deadline;
  * `fail_token`: step() (and prefill_batch()) raises when that token id is fed, to fail a step on demand.
One more: the real Engine always sizes its pools to hold a whole max_model_len request, so the
worker's "never fits the decode state" rejection can only be reached by giving a real engine real
pools (pools_for_budget) smaller than its context limit; test_never_fits_the_decode_state does that.

Expected tokens are never hard-coded: they come from the same model run independently, one token at
a time on fresh StatePools (`reference`), or from the same request submitted alone.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine.engine import Engine
from dsv4_serve.service.engine.request import FinishReason, SamplingParams, TokenEvent
from dsv4_serve.service.engine.sampler import sample
from dsv4_serve.service.engine.sizing import pools_for_budget
from dsv4_serve.service.engine.worker import EngineNotReady, EngineWorker, QueueFull

MAX_LEN = 128
PAGE = 64
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


class ControlledEngine(Engine):
    """The real Engine plus a gate on step() and an optional token id whose feeding fails the step."""

    def __init__(self, model, *, fail_token: int | None = None, **kw) -> None:
        super().__init__(model, **kw)
        self.fail_token = fail_token
        self.gate = threading.Event()
        self.gate.set()

    def step(self, feeds, tokens=None, wait=True):
        self.gate.wait()
        if self.fail_token is not None and any(tok == self.fail_token for _, tok, _ in feeds):
            raise RuntimeError(f"step fed token {self.fail_token}")
        return super().step(feeds, tokens, wait)

    def prefill_batch(self, work, **kw):  # prompts reach the model here first
        self.gate.wait()
        if self.fail_token is not None and any(self.fail_token in toks for _, toks, _ in work):
            raise RuntimeError(f"step fed token {self.fail_token}")
        return super().prefill_batch(work, **kw)


def make_engine(tiny, max_rows: int = 8, max_model_len: int = MAX_LEN, **kw) -> ControlledEngine:
    return ControlledEngine(tiny[0], max_rows=max_rows, max_model_len=max_model_len, page_size=PAGE, **kw)


_refs: dict[tuple, tuple[list[int], FinishReason]] = {}


def reference(tiny, prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], FinishReason]:
    """The model alone: token-serial prefill + decode of one request on fresh pools, sampled with the
    real sampler (greedy: plain argmax). Run on the calling thread, before any worker starts."""
    key = (tuple(prompt), params)
    if key in _refs:
        return _refs[key]
    model, args = tiny
    pools = StatePools(args, max_slots=1, max_positions=MAX_LEN, page_size=PAGE, dtype=model.dtype)
    h = pools.alloc(len(prompt) + params.max_tokens)
    for i, t in enumerate(prompt):  # token by token: independent of the parallel prefill under test
        logits = model.decode(pools, [h], [t], [i])
    out: list[int] = []
    reason = FinishReason.LENGTH
    for i in range(params.max_tokens):
        if i:
            logits = model.decode(pools, [h], [out[-1]], [len(prompt) + i - 1])
        if params.greedy:
            tok = int(mx.argmax(logits[0]).item())
        else:
            tok = sample(logits, [params], [[]], [i], eos_token_id=args.eos_token_id)[0][0]
        if tok == args.eos_token_id and not params.ignore_eos:
            reason = FinishReason.STOP
            break
        out.append(tok)
    pools.free(h)
    _refs[key] = (out, reason)
    return out, reason


def tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def run(coro_fn, engine: Engine, **kw):
    """Start a worker on `engine`, run coro_fn(worker, engine) in a fresh loop, always stop it."""
    w = EngineWorker(lambda: (engine, None), **kw)
    w.start()

    async def main():
        assert await w.wait_ready(30), w.start_error
        try:
            return await coro_fn(w, engine)
        finally:
            if isinstance(engine, ControlledEngine):
                engine.gate.set()
            await w.drain(0)

    return asyncio.run(main())


async def collect(w: EngineWorker, prompt: list[int], params: SamplingParams = GREEDY) -> list[TokenEvent]:
    return [ev async for ev in await w.submit(prompt, params)]


async def wait_for(cond, tries: int = 400) -> bool:
    for _ in range(tries):
        if cond():
            return True
        await asyncio.sleep(0.005)
    return cond()


def test_greedy_stream_and_final_event(tiny) -> None:
    want, _ = reference(tiny, [5, 6, 7], GREEDY)

    async def body(w, eng):
        return await collect(w, [5, 6, 7])

    events = run(body, make_engine(tiny))
    assert [e.token_id for e in events] == want + [None]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert len({e.request_id for e in events}) == 1


def test_eight_concurrent_requests_share_steps(tiny) -> None:
    want = [reference(tiny, [i + 2], GREEDY)[0] for i in range(8)]
    rows_seen: list[int] = []

    async def body(w, eng):
        res = await asyncio.gather(*[collect(w, [i + 2]) for i in range(8)])
        return res, w.stats(), eng.bytes_in_use()

    res, stats, in_use = run(body, make_engine(tiny), on_step_metrics=lambda rows, dt: rows_seen.append(rows))
    for i, events in enumerate(res):
        assert tokens(events) == want[i] and events[-1].finish_reason is FinishReason.LENGTH
    assert max(rows_seen) == 8 and stats["rows_per_step"][8] >= 1
    assert stats["steps_total"] == len(rows_seen) and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["tokens_total"] == 8 * GREEDY.max_tokens and in_use == 0


def test_queue_full_and_validation(tiny) -> None:
    first_params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want_first, _ = reference(tiny, [3], first_params)
    want, _ = reference(tiny, [3], GREEDY)

    async def body(w, eng):
        assert w.max_model_len == 100 and w.max_fit_tokens == 100  # the real pools hold a full request
        eng.gate.clear()  # hold the first step so the next requests stay waiting
        first = await w.submit([3], first_params)
        assert await wait_for(lambda: w.stats()["running"] == 1)
        waiting = [await w.submit([3], GREEDY) for _ in range(2)]
        assert w.stats()["waiting"] == 2
        with pytest.raises(QueueFull):
            await w.submit([3], GREEDY)
        with pytest.raises(ValueError, match="max_model_len 100"):
            await w.submit([3] * 90, SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="max_model_len 100"):
            await w.submit([3] * 101, SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="empty"):
            await w.submit([], GREEDY)
        with pytest.raises(ValueError, match="max_tokens"):
            await w.submit([3], SamplingParams(max_tokens=0))
        eng.gate.set()
        return [[e async for e in it] for it in [first, *waiting]], eng.bytes_in_use()

    res, in_use = run(body, make_engine(tiny, max_rows=1, max_model_len=100), max_rows=1, max_queue=2)
    assert [r[-1].finish_reason for r in res] == [FinishReason.LENGTH] * 3
    assert [tokens(r) for r in res] == [want_first, want, want] and in_use == 0


def test_never_fits_the_decode_state(tiny) -> None:
    model, args = tiny
    eng = make_engine(tiny, max_rows=1, max_model_len=100)
    # Real pools for 60 positions, page size 4: 4 pages of ratio 4 (16 positions each) fit 67 positions.
    eng.pools = pools_for_budget(args, max_rows=1, max_model_len=60, budget_bytes=None, dtype=model.dtype,
                                 page_size=4)
    want, _ = reference(tiny, [3, 4], GREEDY)

    async def body(w, eng):
        assert w.max_model_len == 100 and w.max_fit_tokens == 67
        with pytest.raises(ValueError, match="decode state"):
            await w.submit([3] * 50, SamplingParams(max_tokens=35))
        return await collect(w, [3, 4])  # what fits still runs on the smaller pools

    events = run(body, eng, max_rows=1)
    assert tokens(events) == want and events[-1].finish_reason is FinishReason.LENGTH


def test_engine_not_ready_before_start(tiny) -> None:
    w = EngineWorker(lambda: (make_engine(tiny), None))

    async def main():
        with pytest.raises(EngineNotReady, match="not ready"):
            await w.submit([3], GREEDY)

    asyncio.run(main())


def test_warmup_steps_every_width_and_prefills_twice(tiny) -> None:
    """Warm-up builds every path a request takes (GPU: MLX JIT-compiles on first use) and gives all
    state back: a step at each batch size, one prefill long enough for every compressor to emit, then one
    forward of two 32-token prompts (the products' short-forward path, a batch of arrivals)."""
    fed: list[tuple[str, object]] = []

    class Recording(ControlledEngine):
        def step(self, feeds):
            fed.append(("step", len(feeds)))
            return super().step(feeds)

        def prefill(self, handle, token_ids, start):
            fed.append(("prefill", len(token_ids)))
            return super().prefill(handle, token_ids, start)

        def prefill_batch(self, work, **kw):
            fed.append(("prefill_batch", [(len(t), s) for _, t, s in work]))
            return super().prefill_batch(work, **kw)

    eng = Recording(tiny[0], max_rows=4, max_model_len=MAX_LEN, page_size=PAGE)
    eng.warmup()
    want_len = min(MAX_LEN, 1 + max(tiny[1].compress_ratios))
    assert fed == [("step", w) for w in range(1, 5)] + [("prefill", want_len), ("prefill_batch", [(32, 0), (32, 0)])]
    assert eng.bytes_in_use() == 0 and eng.can_admit(MAX_LEN)
    one_row = Recording(tiny[0], max_rows=1, max_model_len=MAX_LEN, page_size=PAGE)  # two prompts never fit
    fed.clear()
    one_row.warmup()
    assert fed == [("step", 1), ("prefill", want_len)] and one_row.bytes_in_use() == 0


def test_abort_running_request_frees_its_row(tiny) -> None:
    long = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    want_long, _ = reference(tiny, [3], long)
    want_after, _ = reference(tiny, [4], GREEDY)

    async def body(w, eng):
        it = await w.submit([3], long)
        events, in_use = [], []
        async for ev in it:
            events.append(ev)
            in_use.append(eng.bytes_in_use())
            if len(events) == 2:
                w.abort(ev.request_id)
        # the freed row is reusable at once
        after = await collect(w, [4])
        return events, in_use, after, eng.bytes_in_use()

    events, in_use, after, in_use_end = run(body, make_engine(tiny, max_rows=1), max_rows=1)
    assert events[-1].finish_reason is FinishReason.ABORT and len(events) < 10
    assert tokens(events) == want_long[: len(events) - 1]
    assert in_use[0] > 0 and in_use[-1] == 0  # released by the time the ABORT event arrives
    assert tokens(after) == want_after and after[-1].finish_reason is FinishReason.LENGTH and in_use_end == 0


def test_closing_the_stream_aborts(tiny) -> None:
    long = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)

    async def body(w, eng):
        it = await w.submit([3], long)
        await it.__anext__()
        held = eng.bytes_in_use()
        await it.aclose()  # what a disconnected client does
        assert await wait_for(lambda: eng.bytes_in_use() == 0 and w.stats()["running"] == 0)
        return held, w.stats()

    held, stats = run(body, make_engine(tiny))
    assert held > 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["tokens_total"] < long.max_tokens


def test_step_error_fails_the_rows_and_serving_goes_on(tiny) -> None:
    want, _ = reference(tiny, [5, 6], GREEDY)
    # A token id nobody else feeds: not warm-up's 0, not the good request's prompt or outputs.
    fail = next(t for t in range(tiny[1].vocab_size) if t not in {0, 5, 6, *want})

    async def body(w, eng):
        bad = await collect(w, [5, fail, 6])
        in_use = eng.bytes_in_use()
        good = await collect(w, [5, 6])
        return bad, in_use, good, w.stats()

    bad, in_use, good, stats = run(body, make_engine(tiny, fail_token=fail))
    assert len(bad) == 1 and f"step fed token {fail}" in bad[0].error and in_use == 0
    assert tokens(good) == want and good[-1].finish_reason is FinishReason.LENGTH and len(good) == 5
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_drain_lets_in_flight_requests_finish(tiny) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want, _ = reference(tiny, [3], params)

    async def body(w, eng):
        it = await w.submit([3], params)
        drain = asyncio.create_task(w.drain(5.0))
        await asyncio.sleep(0)
        with pytest.raises(EngineNotReady):
            await w.submit([3], GREEDY)
        events = [e async for e in it]
        t0 = asyncio.get_running_loop().time()
        await drain  # the thread stops as soon as nothing is left, not at the deadline
        return events, w.ready, asyncio.get_running_loop().time() - t0

    events, ready, dt = run(body, make_engine(tiny))
    assert events[-1].finish_reason is FinishReason.LENGTH and tokens(events) == want and not ready
    assert dt < 2.0


def test_drain_aborts_what_outlives_the_timeout(tiny) -> None:
    long = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)

    async def body(w, eng):
        eng.gate.clear()  # the first step hangs past the drain deadline
        it = await w.submit([3], long)
        assert await wait_for(lambda: w.stats()["running"] == 1)
        held = eng.bytes_in_use()
        drain = asyncio.create_task(w.drain(0.1))
        await asyncio.sleep(0.3)
        eng.gate.set()
        events = [e async for e in it]
        await drain
        return events, held, eng.bytes_in_use()

    events, held, in_use = run(body, make_engine(tiny))
    assert events[-1].finish_reason is FinishReason.ABORT and len(events) <= 2
    assert held > 0 and in_use == 0


def test_start_failure_is_reported(tiny) -> None:
    # A real start-up failure: a state budget too small for one request of max_model_len.
    reported: list[BaseException] = []
    w = EngineWorker(lambda: (Engine(tiny[0], max_model_len=MAX_LEN, state_budget_bytes=1024), None),
                     on_failure=reported.append)  # fmt: skip
    w.start()

    async def main():
        assert not await w.wait_ready(30)
        with pytest.raises(EngineNotReady, match="state budget"):
            await w.submit([1], GREEDY)

    asyncio.run(main())
    assert isinstance(w.start_error, ValueError) and not w.ready
    assert reported == [w.start_error] and w.died is None  # the server's cue to exit (service/__main__.py)


def test_batched_equals_alone(tiny) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=42)
    want = [reference(tiny, [3, 4, 5], greedy), reference(tiny, [7, 8], seeded)]

    async def body(w, eng):
        alone = [await collect(w, [3, 4, 5], greedy), await collect(w, [7, 8], seeded)]
        others = [collect(w, list(range(2, 2 + i)), SamplingParams(max_tokens=8, seed=i)) for i in range(1, 7)]
        batched = await asyncio.gather(collect(w, [3, 4, 5], greedy), collect(w, [7, 8], seeded), *others)
        return alone, batched[:2]

    rows_seen: list[int] = []
    alone, batched = run(body, make_engine(tiny), on_step_metrics=lambda rows, dt: rows_seen.append(rows))
    assert max(rows_seen) == 8
    for a, b, (toks, reason) in zip(alone, batched, want, strict=True):
        assert tokens(a) == tokens(b) == toks
        assert a[-1].finish_reason is b[-1].finish_reason is reason


@pytest.mark.parametrize("serial_prefill", [False, True])
def test_long_prompts_prefill_in_chunks_beside_a_stream(tiny, serial_prefill) -> None:
    """Two 90-token prompts prefilled 16 tokens per step (parallel) or token by token (serial),
    while a short request streams: every output is what the model gives each request alone."""
    rng = np.random.default_rng(4)
    longs = [[int(t) for t in rng.integers(3, tiny[1].vocab_size, 90)] for _ in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [reference(tiny, p, params)[0] for p in longs]
    want_short, _ = reference(tiny, [5, 6], GREEDY)

    async def body(w, eng):
        return await asyncio.gather(collect(w, [5, 6]), *(collect(w, p, params) for p in longs))

    short, *outs = run(body, make_engine(tiny), prefill_chunk=16, serial_prefill=serial_prefill)
    assert tokens(short) == want_short
    assert [tokens(o) for o in outs] == want


def test_prompts_share_one_prefill_forward_within_the_budget(tiny) -> None:
    """Three prompts longer than the budget (13 tokens a step): each step's prompt chunks go through ONE
    forward, oldest first, several requests in some; no forward exceeds the budget; a decode step
    follows every forward; every output is what the model gives each request alone."""
    calls: list[tuple[str, list[int]]] = []

    class Recording(ControlledEngine):
        def step(self, feeds, tokens=None):
            calls.append(("step", [len(feeds)]))
            return super().step(feeds, tokens)

        def prefill_batch(self, work, **kw):
            calls.append(("prefill", [len(toks) for _, toks, _ in work]))
            return super().prefill_batch(work, **kw)

    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(3, tiny[1].vocab_size, n)] for n in (35, 29, 51)]  # 34 = 2 * 13 + 8
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [reference(tiny, p, params)[0] for p in prompts]

    async def body(w, eng):
        calls.clear()  # warm-up's
        return await asyncio.gather(*(collect(w, p, params) for p in prompts))

    eng = Recording(tiny[0], max_rows=8, max_model_len=MAX_LEN, page_size=PAGE)
    outs = run(body, eng, prefill_chunk=13)
    assert [tokens(o) for o in outs] == want
    forwards = [lens for kind, lens in calls if kind == "prefill"]
    assert all(sum(lens) <= 13 for lens in forwards) and any(len(lens) > 1 for lens in forwards)
    assert all(b[0] == "step" for a, b in zip(calls, [*calls[1:], ("end", [])], strict=True) if a[0] == "prefill")


def test_default_prefill_chunk_is_the_models() -> None:
    """The worker's default prefill budget a step is the model's (a distributed leader sizes its followers' plan
    messages by model.deepseek_v4.PREFILL_CHUNK): the two constants, kept apart so that the worker imports no
    mlx, must agree."""
    from dsv4_serve.model.deepseek_v4 import PREFILL_CHUNK
    from dsv4_serve.service.engine.worker import DEFAULT_PREFILL_CHUNK

    assert DEFAULT_PREFILL_CHUNK == PREFILL_CHUNK


def test_drain_during_start_up_returns_at_once(tiny) -> None:
    """SIGTERM while the engine still loads or warms up (minutes on a cold GPU): the warm-up reads no inbox, so the
    drain does not wait for it (it waited timeout + 30 s and then logged a failure)."""
    loading = threading.Event()
    release = threading.Event()

    def slow_start():
        loading.set()
        release.wait(30)  # the warm-up, still running
        return make_engine(tiny), None

    w = EngineWorker(slow_start)
    w.start()

    async def main() -> float:
        await asyncio.to_thread(loading.wait, 10)
        t0 = asyncio.get_running_loop().time()
        await w.drain(5.0)
        return asyncio.get_running_loop().time() - t0

    try:
        dt = asyncio.run(main())
        starting = w.starting
    finally:
        release.set()
        w._thread.join(30)  # the engine it then builds reads the stop and ends
    assert dt < 1.0 and starting and not w.ready
