"""A prompt's prefill forward built in slices between a running stream's decode steps
(service/engine/prefilling.py), on the real Engine and tiny model.

Each test records the engine's calls (a subclass of the real Engine that only logs and, where a test
says, aborts or fails on demand): with a stream running, a decode step runs after every slice of the
forward and the prefilling request sits those steps out; with nothing streaming, the forward is built
whole. Outputs are the model's own, each request run alone (`reference`); an abort or a failure in the
middle of a forward ends that request only, and its slot is freed only once the forward is built.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine.engine import Engine
from dsv4_serve.service.engine.request import FinishReason, SamplingParams
from tests.service.test_worker import MAX_LEN, PAGE, reference, run, tokens, wait_for

STREAM = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


class Recording(Engine):
    """The real Engine, logging ("prefill", tokens), ("advance", 1 if a slice else 0), ("step", rows);
    `on_advance(n)` runs before the n-th slice (it may raise)."""

    def __init__(self, model, **kw) -> None:
        super().__init__(model, max_rows=8, max_model_len=MAX_LEN, page_size=PAGE, **kw)
        self.calls: list[tuple[str, int]] = []
        self.on_advance = lambda n: None

    def warmup(self):  # the log is of serving: the warm-up's own forwards and steps are not in it
        super().warmup()
        self.calls.clear()

    def step(self, feeds, tokens=None):
        self.calls.append(("step", len(feeds)))
        return super().step(feeds, tokens)

    def prefill_batch(self, work, **kw):
        self.calls.append(("prefill", sum(len(t) for _, t, _ in work)))
        return super().prefill_batch(work, **kw)

    def prefill_advance(self, slice_seconds=None, rows_layers=None):
        self.calls.append(("advance", int(slice_seconds is not None)))
        self.on_advance(sum(c[0] == "advance" for c in self.calls))
        return super().prefill_advance(slice_seconds, rows_layers)


def long_prompt(tiny) -> list[int]:
    return [int(t) for t in np.random.default_rng(9).integers(3, tiny[1].vocab_size, 70)]


async def stream_then_long(w, eng, long, request_id="long", on_advance=None, params=LONG):
    """A stream starts; once it has 2 tokens the long prompt arrives (`on_advance` set from then on).
    (stream events, long events)"""
    s = asyncio.ensure_future(_collect(await w.submit([5, 6], STREAM)))
    assert await wait_for(lambda: w.stats()["tokens_total"] >= 2)
    eng.calls.clear()
    if on_advance is not None:
        eng.on_advance = on_advance
    lg = await w.submit(long, params, request_id)
    return await s, await _collect(lg)


async def _collect(it):
    return [e async for e in it]


def test_a_stream_steps_after_every_slice_of_a_prompts_forward(tiny) -> None:
    long = long_prompt(tiny)
    want_s, want_l = reference(tiny, [5, 6], STREAM)[0], reference(tiny, long, LONG)[0]
    eng = Recording(tiny[0])
    s, lg = run(lambda w, e: stream_then_long(w, e, long), eng, prefill_chunk=32, prefill_slice_ms=1e-6)
    assert tokens(s) == want_s and tokens(lg) == want_l
    layers = tiny[1].num_hidden_layers
    # 70 prompt tokens: forwards of 32, 32 and the rest (less the one the step after a built forward feeds,
    # when that step is not one queued ahead), the last by the first sampled step; a layer a slice
    pieces = [n for k, n in eng.calls if k == "prefill"]
    assert pieces[:2] == [32, 32] and pieces[2] in (3, 4, 5) and len(pieces) == 3
    assert eng.calls.count(("advance", 1)) == 3 * layers  # prefill_batch builds the first slice through prefill_advance
    # between two slices at least one step; while a forward is in flight every step is the stream's row alone,
    # and steps are queued ahead (two engine.step calls in a row: the step read back and the next one)
    idx = [i for i, (k, _) in enumerate(eng.calls) if k in ("advance", "prefill")]
    for i, j in zip(idx, idx[1:], strict=False):
        if eng.calls[i][0] == eng.calls[j][0] == "advance":
            assert [k for k, _ in eng.calls[i + 1 : j]].count("step") >= 1, eng.calls
    last = max(i for i, (k, _) in enumerate(eng.calls) if k == "advance")
    held = [n for k, n in eng.calls[:last] if k == "step"]
    assert set(held) == {1}
    assert any(c == d == ("step", 1) for c, d in zip(eng.calls[:last], eng.calls[1:last], strict=False))
    assert max(n for k, n in eng.calls if k == "step") == 2  # then decodes beside the stream
    assert eng.bytes_in_use() == 0


def test_nothing_streaming_builds_the_forward_whole(tiny) -> None:
    long = long_prompt(tiny)
    eng = Recording(tiny[0])

    async def body(w, e):
        return await _collect(await w.submit(long, LONG))

    out = run(body, eng, prefill_chunk=32, prefill_slice_ms=1e-6)
    assert tokens(out) == reference(tiny, long, LONG)[0]
    assert [c for c in eng.calls if c[0] != "step"] == [("prefill", 32), ("advance", 0), ("prefill", 32),
                                                         ("advance", 0), ("prefill", 3), ("advance", 0)]


def test_an_abort_mid_forward_ends_that_request_and_frees_its_slot_after(tiny) -> None:
    long = long_prompt(tiny)
    want_s = reference(tiny, [5, 6], STREAM)[0]
    eng = Recording(tiny[0])
    freed_during: list[int] = []

    async def body(w, e):
        def on_advance(n):
            if n == 1:
                freed_during.append(e.pools.bytes_in_use())  # the stream's and the long prompt's
                w.abort("long")
            elif n == 3:  # the abort has been drained by now; the forward's slot must still be held
                freed_during.append(e.pools.bytes_in_use())

        return await stream_then_long(w, e, long, on_advance=on_advance)

    s, lg = run(body, eng, prefill_chunk=32, prefill_slice_ms=1e-6)
    assert tokens(s) == want_s
    assert lg[-1].finish_reason is FinishReason.ABORT and not tokens(lg)
    assert len(freed_during) == 2 and freed_during[1] == freed_during[0] > 0
    assert eng.bytes_in_use() == 0


def test_a_failing_slice_fails_its_request_only(tiny) -> None:
    long = long_prompt(tiny)
    want_s = reference(tiny, [5, 6], STREAM)[0]
    eng = Recording(tiny[0])

    def on_advance(n):
        if n == 2:
            raise RuntimeError("slice failed")

    s, lg = run(lambda w, e: stream_then_long(w, e, long, on_advance=on_advance), eng, prefill_chunk=32,
                prefill_slice_ms=1e-6)
    assert tokens(s) == want_s
    assert lg[-1].error is not None and "slice failed" in lg[-1].error
    assert not eng.prefilling and eng.bytes_in_use() == 0


def prompt_logprobs_alone(tiny, prompt: list[int]) -> np.ndarray:
    """[len - 1, V] float64 log-softmax after each prompt token but the last, the prompt fed token by token
    through the decode step (independent of the parallel prefill)."""
    model, args = tiny
    pools = StatePools(args, max_slots=1, max_positions=MAX_LEN, page_size=PAGE, dtype=model.dtype)
    h = pools.alloc(len(prompt))
    rows = [np.array(model.decode(pools, [h], [t], [i])[0], dtype=np.float64) for i, t in enumerate(prompt[:-1])]
    x = np.stack(rows)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_prompt_logprobs_go_through_the_slices_and_a_stream_steps_between(tiny) -> None:
    """A request with prompt logprobs joins the sliced forward (no whole forward of its own): the stream steps
    after every slice, and its prompt logprobs are the model's own, fed token by token."""
    long = long_prompt(tiny)
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    want_s, want_l = reference(tiny, [5, 6], STREAM)[0], reference(tiny, long, LONG)[0]
    want_lp = prompt_logprobs_alone(tiny, long)
    eng = Recording(tiny[0])
    s, lg = run(lambda w, e: stream_then_long(w, e, long, params=scored), eng, prefill_chunk=32,
                prefill_slice_ms=1e-6)  # fmt: skip
    assert tokens(s) == want_s and tokens(lg) == want_l
    layers = tiny[1].num_hidden_layers
    pieces = [n for k, n in eng.calls if k == "prefill"]
    assert pieces[:2] == [32, 32] and len(pieces) == 3
    # a layer a slice, then the every-row head alone: no whole forward
    assert eng.calls.count(("advance", 1)) == 3 * (layers + 1) and ("advance", 0) not in eng.calls
    idx = [i for i, (k, _) in enumerate(eng.calls) if k in ("advance", "prefill")]
    for i, j in zip(idx, idx[1:], strict=False):
        if eng.calls[i][0] == eng.calls[j][0] == "advance":
            assert [k for k, _ in eng.calls[i + 1 : j]].count("step") >= 1, eng.calls
    last = max(i for i, (k, _) in enumerate(eng.calls) if k == "advance")
    assert {n for k, n in eng.calls[:last] if k == "step"} == {1}  # the stream's row alone meanwhile
    # every prompt position but the first scored once, in order, before the first generated token
    got = [p for e in lg for p in e.prompt_logprobs]
    first = next(i for i, e in enumerate(lg) if e.token_id is not None)
    assert all(not e.prompt_logprobs for e in lg[first:])
    assert len(got) == len(long) - 1
    for t, p in enumerate(got):
        row, v = want_lp[t], want_lp[t][long[t + 1]]
        assert abs(p.logprob - v) < 1e-4, t
        assert 1 + (row > v + 1e-4).sum() <= p.rank <= 1 + (row > v - 1e-4).sum(), t  # ties within f32 tolerance
        assert [i for i, _ in p.top] == np.argsort(-row, kind="stable")[:3].tolist(), t
        np.testing.assert_allclose([v for _, v in p.top], np.sort(row)[::-1][:3], atol=1e-4, rtol=0)
    assert eng.bytes_in_use() == 0


def test_a_forward_of_few_tokens_is_built_whole_beside_a_stream(tiny) -> None:
    """`prefill_whole_tokens`: the 70-token prompt's forwards of 32 tokens go in slices beside the stream, its last
    piece (at most 8 tokens) is built whole though the stream runs; the tokens are the model's own either way."""
    long = long_prompt(tiny)
    want_s, want_l = reference(tiny, [5, 6], STREAM)[0], reference(tiny, long, LONG)[0]
    eng = Recording(tiny[0])
    s, lg = run(lambda w, e: stream_then_long(w, e, long), eng, prefill_chunk=32, prefill_slice_ms=1e-6,
                prefill_whole_tokens=8)  # fmt: skip
    assert tokens(s) == want_s and tokens(lg) == want_l
    layers = tiny[1].num_hidden_layers
    pieces = [(n, i) for i, (k, n) in enumerate(eng.calls) if k == "prefill"]
    assert [n for n, _ in pieces][:2] == [32, 32] and pieces[2][0] <= 8 and len(pieces) == 3
    assert eng.calls.count(("advance", 1)) == 2 * layers  # the two 32-token forwards, a layer a slice
    assert eng.calls[pieces[2][1] + 1] == ("advance", 0)  # the short one: whole, the stream's step after it
    assert eng.bytes_in_use() == 0


def test_the_server_builds_short_forwards_whole_by_default() -> None:
    from dsv4_serve.service.settings import Settings

    assert Settings().prefill_whole_tokens == 256
    with pytest.raises(ValueError):
        Settings(prefill_whole_tokens=-1)
