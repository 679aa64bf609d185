"""Prefill paced by an inter-token latency target (service/engine/pacing.py).

The Pacer's arithmetic on hand-made iterations, then the real worker, Engine and tiny model: three streams
decode while a 1,000-token prompt prefills beside them; with a target of 100 ms, their worst inter-token gap stays
under 5x the target (its median under 1.5x), and under half the worst gap of the same run with the target off
(there the forward of 1,024-token chunks goes in one slice of 10 ms host time and DSV4_PREFILL_SLICE_ROWS:
seconds on the CPU). The gaps are taken where the streams' events reach the event loop, between the long prompt's
submission and its first token.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine.engine import Engine
from dsv4_serve.service.engine.pacing import Pace, Pacer
from dsv4_serve.service.engine.request import SamplingParams
from tests.service.test_worker import run

STREAM = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
CHUNK = 1024
# A target the tiny model can meet on the CPU: one layer of its prefill costs about two decode steps even at 16 rows
# (the automatic target, 2x the step, is then missed by design: pacing.py), and the shared 2-core CPU's margin.
# The worst gap may reach BOUND x the target (a loaded shared CPU: 164 .. 209 ms seen, load average 5 .. 9); the
# median stays under 1.5x.
TARGET_MS = 100.0
BOUND = 5


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


async def gaps_beside_a_long_prompt(w, long: list[int]) -> tuple[list[float], float, list[int], float]:
    """Three streams; once each has 20 tokens the long prompt comes. (the streams' gaps that end between its
    submission and its first token, the seconds to that token, its tokens, the worker's ITL target then)."""
    stamps: list[list[float]] = [[], [], []]

    async def stream(i: int) -> None:
        async for _ in await w.submit([5 + i, 6], STREAM):
            stamps[i].append(time.perf_counter())

    tasks = [asyncio.ensure_future(stream(i)) for i in range(3)]
    while min(map(len, stamps)) < 20:
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    events = await w.submit(long, LONG)
    first = await anext(events)
    t1 = time.perf_counter()
    target = w.stats().get("itl_target_seconds", 0.0)
    tokens = [first.token_id] + [ev.token_id async for ev in events if ev.token_id is not None]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if t0 <= b <= t1]
    return gaps, t1 - t0, tokens, target


def test_off_keeps_the_fixed_slices_and_chunks() -> None:
    p = Pacer(0, 10.0, 2048)
    p.observe(0.010, True, 0)
    p.observe(0.050, True, 64, 4)
    assert not p.on and p.target() is None and p.step is None and p.layer == {}
    assert p.pace(True) == p.pace(False) == Pace(2048, 0.010, None)


def test_auto_target_is_twice_the_step_and_a_slice_holds_the_layers_that_fit() -> None:
    p = Pacer(None, 10.0, 2048)
    assert p.target() is None and p.pace(True) == Pace(2048, 0.010, None)  # nothing measured: as if off
    p.observe(0.010, True, 0)  # a step, no prefill: 10 ms
    assert p.target() == pytest.approx(0.020)
    # the layer's cost unknown: a layer a slice; the slice gets the target less the step; the chunk never changes
    assert p.pace(True) == Pace(2048, pytest.approx(0.010), 2048)
    assert p.pace(True, rows=300) == Pace(2048, pytest.approx(0.010), 300)
    assert p.pace(False) == Pace(2048, pytest.approx(0.010))
    p.observe(0.014, True, 2 * 256, 2)  # 4 ms past the step for 2 layers of 256 rows: 2 ms a layer
    assert p.layer == {256: pytest.approx(0.002)}
    assert p.pace(True, rows=300) == Pace(2048, pytest.approx(0.010), 300 * 5)  # 10 ms room / 2 ms: 5 layers
    # a larger forward, not measured yet: the 256-row layer scaled by the rows (1024 / 256 x 2 ms = 8 ms): 1 layer
    assert p.pace(True, rows=1024) == Pace(2048, pytest.approx(0.010), 1024)
    p.observe(0.016, True, 1024, 1)  # 6 ms a 1,024-row layer
    assert p.layer_cost(1024) == pytest.approx(0.006) and p.pace(True, rows=1500).rows_layers == 1500
    p.observe(0.030, False, 0)  # no step, no prefill (an idle pass): nothing learned
    assert p.step == pytest.approx(0.010)
    p.observe(0.012, True, 0)  # the step's EWMA: 10.5 ms
    assert p.step == pytest.approx(0.0105) and p.target() == pytest.approx(0.021)
    p.observe(0.050, False, 4096, 4)  # a forward built with no step beside it: not a slice
    # /metrics: the two slices beside a step above (2 layers, 1 layer), the step as measured
    assert p.stats() == {"prefill_slices_total": 2, "prefill_slice_layers_total": 3,
                         "pacer_step_seconds": pytest.approx(0.0105), "itl_target_seconds": pytest.approx(0.021)}


def test_a_target_no_layer_meets_still_gets_one_layer_a_slice() -> None:
    p = Pacer(15.0, 10.0, 2048)
    p.observe(0.010, True, 0)
    p.observe(0.018, True, 16, 1)  # 8 ms a 16-row layer: over the 5 ms the 15 ms target leaves
    assert p.pace(True, rows=16) == Pace(2048, pytest.approx(0.008), 16)  # that layer: the prompt progresses
    assert p.layer_cost(8) == pytest.approx(0.008)  # under the smallest size: its bucket's


def test_streams_beside_a_long_prompt_keep_under_the_target(tiny) -> None:
    long = [int(t) for t in np.random.default_rng(5).integers(3, tiny[1].vocab_size, 1000)]
    out = {}
    for target in (0.0, TARGET_MS):
        eng = Engine(tiny[0], max_rows=8, max_model_len=4096, page_size=64, prefix_cache_bytes=0)
        out[target] = run(lambda w, e: gaps_beside_a_long_prompt(w, long), eng, prefill_chunk=CHUNK,
                          itl_target_ms=target)  # fmt: skip
    (off, _, off_tokens, _), (paced, ttft, paced_tokens, target) = out[0.0], out[TARGET_MS]
    print(f"off: worst gap {max(off) * 1e3:.1f} ms; paced: worst {max(paced) * 1e3:.1f} ms, median "
          f"{np.median(paced) * 1e3:.1f} ms, target {target * 1e3:.1f} ms, the long prompt's first token {ttft:.2f} s")
    assert target == pytest.approx(TARGET_MS / 1e3) and paced_tokens == off_tokens  # pacing changes when, not what
    assert max(paced) <= BOUND * target and np.median(paced) <= 1.5 * target, (sorted(paced)[-6:], target)
    assert max(paced) < max(off) / 2, (max(paced), max(off))
