"""The correctness canary's parts (service/engine/canary.py): the comparison on hand-made results, the start-up
reference against the model decoded token by token on its own pools, and on a real EngineWorker: the canary
takes a free row only (never while the rows are full) and its request leaves other requests' tokens alone."""

from __future__ import annotations

import asyncio
import math

import mlx.core as mx

from dsv4_serve.model.state import StatePools
from dsv4_serve.service.engine import canary
from dsv4_serve.service.engine.canary import Decoded, compare
from dsv4_serve.service.engine.request import SamplingParams
from tests.service.test_worker import PAGE, make_engine, reference, run, tiny, tokens  # noqa: F401 - tiny: fixture

TOP = ((7, -0.1), (3, -2.5), (9, -3.0))


def decoded(tokens: list[int], lps: list[float], tops: list[tuple[tuple[int, float], ...]]) -> Decoded:
    return Decoded(tuple(tokens), tuple(lps), tuple(tops))


def test_compare_agrees_within_tolerance_and_ignores_swapped_alternatives() -> None:
    ref = decoded([7, 7], [-0.1, -0.1], [TOP, ((7, -0.1), (3, -2.5), (9, -2.5))])
    got = decoded([7, 7], [-0.1005, -0.1], [((7, -0.1005), (3, -2.5), (9, -3.0)), ((7, -0.1), (9, -2.5), (3, -2.5))])
    ok, worst, n = compare(ref, got, 1e-3)
    assert ok and n == 2 and math.isclose(worst, 5e-4, rel_tol=1e-6)


def test_compare_fails_on_a_logprob_past_tolerance_on_a_nan_and_on_a_clear_id() -> None:
    ref = decoded([7], [-0.1], [TOP])
    ok, worst, _ = compare(ref, decoded([7], [-0.1], [((7, -0.1), (3, -2.6), (9, -3.0))]), 1e-3)
    assert not ok and math.isclose(worst, 0.1, rel_tol=1e-6)
    assert not compare(ref, decoded([7], [float("nan")], [TOP]), 1e-3)[0]
    assert not compare(ref, decoded([3], [-0.1], [((3, -0.1), (7, -2.5), (9, -3.0))]), 1e-3)[0]  # margin 2.4
    assert not compare(ref, decoded([], [], []), 1e-3)[0]  # fewer tokens than the reference


def test_compare_lets_a_near_tie_go_either_way_and_stops_there() -> None:
    tie = ((7, -0.6930), (3, -0.6935), (9, -5.0))  # top-2 margin 5e-4 < 2 * 1e-3
    ref = decoded([7, 1, 1], [-0.6930, -0.2, -0.2], [tie, TOP, TOP])
    got = decoded([3, 2, 2], [-0.6931, -0.9, -0.9], [((3, -0.6931), (7, -0.6932), (9, -5.0)), TOP, TOP])
    assert compare(ref, got, 1e-3) == (True, 0.0, 0)
    assert not compare(ref, got, 1e-5)[0]  # the same margin is no tie at a tighter tolerance


def test_reference_is_the_model_decoded_token_by_token(tiny) -> None:  # noqa: F811
    """The canary's start-up decode (through Engine.step, one row) against model.decode on fresh pools."""
    model, args = tiny
    prompt = canary.canary_prompt(args.vocab_size)
    n = len(prompt) + canary.TOKENS
    pools = StatePools(args, max_slots=1, max_positions=n, page_size=PAGE, dtype=model.dtype)
    h = pools.alloc(n)
    seq, want, want_lp = list(prompt), [], []
    for pos in range(n - 1):
        logits = model.decode(pools, [h], [seq[pos]], [pos])
        if pos + 1 >= len(prompt):
            lp = logits[0] - mx.logsumexp(logits[0])
            want.append(int(mx.argmax(logits[0]).item()))
            want_lp.append(float(lp[want[-1]].item()))
            seq.append(want[-1])
    got = canary.reference(make_engine(tiny, max_model_len=n), prompt)
    assert list(got.tokens) == want
    assert max(abs(a - b) for a, b in zip(got.logprobs, want_lp, strict=True)) <= 1e-5
    assert all(len(t) == canary.TOP_K and t[0][0] == tok for t, tok in zip(got.tops, got.tokens, strict=True))


def test_canary_takes_a_free_row_only_and_leaves_requests_alone(tiny) -> None:  # noqa: F811
    """One row: while a request holds it no check starts; once it is free the canary runs; a request sent while
    the canary runs waits at most its 16 tokens and gets the tokens the model gives it alone."""
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = reference(tiny, [3, 4, 5], long)[0]

    async def body(w, eng):
        c = w._canary
        assert c is not None
        before = c.checks
        events = [ev async for ev in await w.submit([3, 4, 5], long)]
        during = c.checks - before  # one check may have been running when it came, none starts beside it
        for _ in range(400):
            if c.checks >= before + during + 2:
                break
            await asyncio.sleep(0.01)
        after = [ev async for ev in await w.submit([3, 4, 5], long)]
        return events, during, c.checks - before - during, c.failures, after

    events, during, later, failures, after = run(body, make_engine(tiny, max_rows=1), canary_interval=0.05)
    assert tokens(events) == tokens(after) == want
    assert during <= 1 and later >= 2 and failures == 0
    assert all(not e.request_id.startswith("canary-") for e in events + after)
