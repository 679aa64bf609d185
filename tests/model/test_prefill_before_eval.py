"""`Forward.advance(before_eval=...)` (model/prefill.py): the engine's decode graphs build a prefill slice while a
replay still runs and settle it in this callback (Engine.prefill_advance, DSV4_GRAPH_OVERLAP=1). The callback must
run once a slice, before anything of the slice is evaluated, and the forward must be the same forward: its state
and logits equal, bit for bit, to the one built without it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model import prefill
from dsv4_serve.model.prefill import Forward
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model

PAGE = 8


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


def test_the_callback_runs_once_a_slice_before_its_first_evaluation(tiny, monkeypatch) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=2, max_positions=96, page_size=PAGE)
    h = pools.alloc(64)
    events: list[str] = []
    real = mx.async_eval
    monkeypatch.setattr(prefill.mx, "async_eval", lambda *a: (events.append("eval"), real(*a))[1])
    monkeypatch.setattr(prefill, "EVAL_EVERY", 1)  # every layer queued: the callback must still come first, once
    fwd = Forward(model, pools, [(h, list(range(5, 45)), 0)], logits=False)
    slices = 0
    while True:
        before = len(events)
        done = fwd.advance(1e9, rows_layers=2 * 40, before_eval=lambda: events.append("settle"))
        slices += 1
        got = events[before:]
        assert got[0] == "settle" and got.count("settle") == 1 and "eval" in got, got
        if done:
            break
    assert slices == -(-args.num_hidden_layers // 2)


@pytest.mark.parametrize("seconds", [None, 0.0])
def test_the_forward_is_the_same_with_the_callback(tiny, seconds) -> None:
    model, args = tiny
    prompts = [[int(t) for t in np.random.default_rng(n).integers(0, args.vocab_size, n)] for n in (23, 41)]
    results = []
    for hook in (None, lambda: None):
        pools = StatePools(args, max_slots=2, max_positions=96, page_size=PAGE)
        work = [(pools.alloc(64), p, 0) for p in prompts]
        fwd = Forward(model, pools, work)
        while not fwd.advance(seconds, before_eval=hook):
            pass
        mx.eval(fwd.out, pools.arrays())
        results.append(([np.array(o) for o in fwd.out], [np.array(a) for a in pools.arrays()]))
    (la, sa), (lb, sb) = results
    assert all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(sa, sb, strict=True))
