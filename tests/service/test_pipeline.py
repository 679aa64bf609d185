"""Pipelined decode (stepping.Ahead): step N + 1 is queued with step N's sampled tokens still on the
device, before step N is read back. It must change nothing a client sees: every event (tokens,
logprobs, finish reasons, errors) is the same as with each step read back before the next is built.

The real Engine around the embedded tiny model, as in test_worker.py (its helpers and the
ControlledEngine are reused); expected outputs come from the same worker with pipelining off, or
from the model alone (`reference`), never hard-coded.
"""

from __future__ import annotations

import asyncio
import gc

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.service.engine.request import FinishReason, SamplingParams, TokenEvent
from tests.service.test_worker import GREEDY, ControlledEngine, collect, reference, run, tokens
from tests.service.test_worker import tiny as tiny  # noqa: F401 - the module-scoped model fixture


class RecordingEngine(ControlledEngine):
    """The real engine; notes which steps were queued ahead (fed device tokens, or left running with the host's:
    `host=True` makes it pipeline as the replayed graphs do, pipeline_host), and can fail those (`fail_ahead`)."""

    def __init__(self, model, *, fail_ahead: bool = False, host: bool = False, **kw) -> None:
        super().__init__(model, **kw)
        self.fail_ahead = fail_ahead
        self.ahead_steps = 0
        self.host_steps = 0
        self.settles = 0
        if host:
            self.pipeline_decode, self.pipeline_host = False, True

    def step(self, feeds, tokens=None, wait=True):
        if tokens is None and wait:
            self.host_steps += 1
        else:
            assert (tokens is None) is self.pipeline_host  # each form queues ahead its own way
            self.ahead_steps += 1
            if self.fail_ahead:
                raise RuntimeError("step ahead failed on purpose")
        return super().step(feeds, tokens, wait)

    def settle(self):
        self.settles += 1
        super().settle()


def recording(tiny, **kw) -> RecordingEngine:  # noqa: F811
    model = tiny[0]
    return RecordingEngine(model, max_rows=8, max_model_len=128, page_size=64, **kw)


MODES = ("device", "host")  # the MLX step's pipelining (device tokens) and the replayed graphs' (host tokens)


def shape(e: TokenEvent) -> tuple:
    """An event without its request id (random per submit) and logprob values (compared with a tolerance)."""
    return e.token_id, tuple(t for t, _ in e.top_logprobs), e.logprob is None, e.finish_reason, e.error


def mixed_requests(tiny) -> list[tuple[list[int], SamplingParams]]:  # noqa: F811
    """Eight requests that exercise every sampler path and every way a row leaves the batch."""
    greedy = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    stop_at = reference(tiny, [9, 10, 11], greedy)[0][2]  # a token this prompt's greedy stream reaches
    return [
        ([3, 4, 5], greedy),
        ([9, 10, 11], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))),
        ([7, 8], SamplingParams(max_tokens=6, temperature=0.9, top_k=5, top_p=0.9, seed=1)),
        ([7, 8, 9, 2], SamplingParams(max_tokens=5, temperature=0.7, min_p=0.05, seed=2, logprobs=2)),
        ([4, 4, 4], SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)),
        ([6], SamplingParams(max_tokens=1, temperature=0.0)),
        ([12, 13], SamplingParams(max_tokens=3, temperature=1.0, seed=3, frequency_penalty=0.4)),
        ([2, 3], SamplingParams(max_tokens=9, temperature=0.0, min_tokens=4, logprobs=0)),
    ]


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_equals_read_back_every_step(tiny, mode) -> None:  # noqa: F811
    reqs = mixed_requests(tiny)

    async def body(w, eng):
        # four at once, then four more while those stream: admission between pipelined steps
        first = [asyncio.ensure_future(collect(w, p, s)) for p, s in reqs[:4]]
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(collect(w, p, s)) for p, s in reqs[4:]]
        return await asyncio.gather(*first, *rest)

    runs = {}
    for pipeline in (True, False):
        eng = recording(tiny, host=mode == "host")
        runs[pipeline] = run(body, eng, pipeline=pipeline)
        assert (eng.ahead_steps > 0) is pipeline
    for on, off in zip(runs[True], runs[False], strict=True):
        assert [shape(e) for e in on] == [shape(e) for e in off]  # tokens, alternatives, finish reasons
        # logprobs: the same up to the float noise of other rows sharing a step (batches differ in time)
        lp_on, lp_off = ([e.logprob for e in run_ if e.logprob is not None] for run_ in (on, off))
        assert np.allclose(lp_on, lp_off, rtol=1e-4, atol=1e-5) and len(lp_on) == len(lp_off)
        assert on[-1].finish_reason is not None and on[-1].error is None
    stopped = runs[True][1]
    assert stopped[-1].finish_reason is FinishReason.STOP and len(tokens(stopped)) == 2


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_greedy_equals_the_model_alone(tiny, mode) -> None:  # noqa: F811
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [reference(tiny, p, params)[0] for p in ([3, 4, 5], [7, 8])]

    async def body(w, eng):
        return await asyncio.gather(collect(w, [3, 4, 5], params), collect(w, [7, 8], params))

    eng = recording(tiny, host=mode == "host")
    outs = run(body, eng)  # pipelining is the worker's default
    assert [tokens(o) for o in outs] == want
    # after the first (prefilled) step, the rest are queued ahead with device tokens
    assert eng.ahead_steps >= 6


@pytest.mark.parametrize("mode", MODES)
def test_pipelined_with_requests_waiting_for_a_row(tiny, mode) -> None:  # noqa: F811
    """Ten streams on eight rows: the two waiting ones cannot be admitted while every row is taken, so
    steps are still queued ahead; each waiting stream starts once a row frees, and every output is
    what the model gives the request alone."""
    prompts = [[3 + i, 4 + i] for i in range(10)]
    lens = [2, 3, 4, 5, 6, 7, 8, 9, 4, 5]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
    want = [reference(tiny, p, s)[0] for p, s in zip(prompts, params, strict=True)]

    async def body(w, eng):
        return await asyncio.gather(*(collect(w, p, s) for p, s in zip(prompts, params, strict=True)))

    eng = recording(tiny, host=mode == "host")
    outs = run(body, eng)
    assert [tokens(o) for o in outs] == want
    assert eng.ahead_steps > 0


@pytest.mark.parametrize("mode", MODES)
def test_no_step_ahead_past_max_tokens(tiny, mode) -> None:  # noqa: F811
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want, _ = reference(tiny, [3, 4, 5], params)

    async def body(w, eng):
        return await collect(w, [3, 4, 5], params)

    eng = recording(tiny, host=mode == "host")
    out = run(body, eng)
    # token 1 comes from the prefill's step and token 2 from the next, read back at once (a first token
    # waits for no step ahead); tokens 3..5 from steps queued ahead, none after
    assert tokens(out) == want and eng.ahead_steps == 3


@pytest.mark.parametrize("mode", MODES)
def test_failed_step_ahead_fails_its_rows_and_serving_goes_on(tiny, mode) -> None:  # noqa: F811
    want, _ = reference(tiny, [5, 6], GREEDY)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # never queues a step ahead

    async def body(w, eng):
        bad = await collect(w, [5, 6])
        in_use = eng.bytes_in_use()
        good = await collect(w, [5, 6], one)
        return bad, in_use, good

    bad, in_use, good = run(body, recording(tiny, fail_ahead=True, host=mode == "host"))
    # the first two tokens (the first is never pipelined; the second is read back before the failure of
    # the step queued with it is reported) arrive, then the error
    assert tokens(bad) == want[:2] and "step ahead failed on purpose" in bad[-1].error and in_use == 0
    assert tokens(good) == want[:1] and good[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("mode", MODES)
def test_abort_while_a_step_is_queued_ahead(tiny, mode) -> None:  # noqa: F811
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want, _ = reference(tiny, [5, 6], GREEDY)

    async def body(w, eng):
        stream = await w.submit([3, 4], long)
        got = [await anext(stream) for _ in range(3)]
        await stream.aclose()  # closing the stream aborts the request mid-pipeline
        ok = await collect(w, [5, 6])
        mx.synchronize()
        return got, ok, eng.bytes_in_use()

    eng = recording(tiny, host=mode == "host")
    got, ok, in_use = run(body, eng)
    assert len(tokens(got)) == 3 and tokens(ok) == want and in_use == 0 and eng.ahead_steps > 0


def test_a_step_queued_ahead_updates_the_pools_in_place() -> None:
    """Step i + 1 built on step i's pools while step i is still queued must still donate them. No pool is
    copied: the pipelined loop's peak memory is the synced loop's (within a quarter of the smallest pool
    a step writes a big entry to), and the synced one stays below the largest pool array (the step's own
    temporaries, the reference's gathers over the table width, are ~6.5 MiB on the CPU, a little more
    on CUDA). The tokens are those of reading back every step. The model directly, on big pools."""
    from dsv4_serve.model.config import ModelArgs
    from dsv4_serve.model.deepseek_v4 import DeepseekV4
    from dsv4_serve.model.state import StatePools

    a = ModelArgs.tiny()
    model = DeepseekV4(a)
    mx.eval(model.parameters())
    got, peak = {}, {}
    for pipelined in (False, True):
        pools = StatePools(a, max_slots=8, max_positions=60_000, page_size=64, dtype=mx.float32)
        handles = [pools.alloc(50_000) for _ in range(2)]
        mx.eval(pools.arrays())
        sizes = sorted(x.nbytes for x in pools.arrays())
        gc.collect()  # what earlier tests left in MLX's buffer cache must not shift this arm's peak
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        tok, pending, out = mx.array([5, 9], dtype=mx.int32), None, []
        for i in range(7 if pipelined else 6):  # the pipelined loop reads the last step back after it
            if i < 6:
                logits = model.step(model.make_batch(pools, handles, [3 + i, 3 + i]), tok, pools)
                tok = mx.argmax(logits, axis=-1).astype(mx.int32)
                mx.async_eval(tok, pools.arrays())
            done, pending = (pending, tok) if pipelined else (tok, None)
            if done is not None:
                out.append(done.tolist())
        got[pipelined], peak[pipelined] = out, mx.get_peak_memory() - base
        del pools, handles
    assert peak[False] < sizes[-1], (peak, sizes[-1])  # no copy of a largest pool when synced
    # and none more when pipelined: a copy of any of the four largest pools would add at least sizes[-4]; the
    # overlap of two steps' temporaries measured up to ~0.3 of it in a full-suite run
    assert peak[True] <= peak[False] + sizes[-4] / 2, (peak, sizes[-4])
    assert got[True] == got[False] and len(got[True]) == 6
