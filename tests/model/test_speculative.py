"""Speculative decoding's rollback (model/speculative.py, issue 53 item 3): a verify forward of [last token, k
drafts] followed by the rollback of the rejected drafts leaves the state as if only the accepted positions had run,
for every accept pattern of k = 1, 2, 3 over several steps, across CSA (4) and HCA (128) window ends; the
reference is token-by-token decoding of the same tokens (the same math, f32 summation order apart)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.speculative import MAX_DRAFTS, rollback, snapshot, verify
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model

CAP, PAGE = 160, 4
TOL = 1e-4  # f32 summation order (seen: 3e-6); a rejected draft left in place is off by 1e-2 or more


@pytest.fixture(scope="module")
def setup():
    model, args, _ = tiny_model()
    toks = np.random.default_rng(3).integers(2, args.vocab_size, CAP).tolist()
    pools = StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE)
    h = pools.alloc(CAP)
    refs = []  # the slot's whole state after q + 1 positions, token by token
    for q in range(CAP - 8):
        model.decode(pools, [h], [toks[q]], [q])
        refs.append(state(pools, h))
    return model, args, toks, refs


def state(pools: StatePools, h) -> dict[str, np.ndarray]:
    """Every per-slot array of the slot and every page entry its tables hold (the pages' unwritten rows too)."""
    out = {n: np.array(a[h.slot]) for n, a in pools.slot_arrays().items()}
    for r in pools.ratios:
        for n, a in pools.read_entries(r, h.tables[r], len(h.tables[r]) * PAGE).items():
            out[n] = np.array(a)
    return out


def worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    m = 0.0
    for n in a:
        x, y = a[n], b[n]
        if (np.isfinite(x) != np.isfinite(y)).any():  # -inf scores only where the reference has them
            return float("inf")
        fin = np.isfinite(x)
        if fin.any():
            m = max(m, float(np.abs(x[fin] - y[fin]).max()))
    return m


def run(model, args, toks, start: int, k: int, pattern, undo: bool = True):
    """`start` positions token by token, then a verify step a pattern entry: [token, k drafts], the first
    `kept` drafts the right tokens and the rest wrong ones, rolled back to the kept ones. -> (state, positions)."""
    pools = StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE)
    h = pools.alloc(CAP)
    if start:
        model.prefill(pools, h, toks[:start], 0, logits=False)
    pos = start
    for kept in pattern:
        drafts = [toks[pos + 1 + i] if i < kept else (toks[pos + 1 + i] + 1) % args.vocab_size for i in range(k)]
        snap = snapshot(pools, h, pos + 1, pos + k)
        logits, hs = verify(model, pools, [(h, [toks[pos], *drafts], pos)])
        assert logits[0].shape == (k + 1, args.vocab_size) and hs.shape == (k + 1, args.hc_mult, args.hidden_size)
        mx.eval(logits, hs, pools.arrays())
        if undo:
            rollback(pools, snap, kept)
        pos += kept + 1
    mx.eval(pools.arrays())
    return state(pools, h), pos


@pytest.mark.parametrize("k, start, steps", [(1, 2, 4), (1, 125, 4), (2, 1, 3), (3, 3, 2), (3, 124, 2)])
def test_every_accept_pattern_leaves_the_token_by_token_state(setup, k, start, steps) -> None:
    model, args, toks, refs = setup
    for pattern in itertools.product(range(k + 1), repeat=steps):
        got, pos = run(model, args, toks, start, k, pattern)
        assert worst(got, refs[pos - 1]) < TOL, (k, start, pattern)


def test_without_the_rollback_a_rejected_draft_shows(setup) -> None:
    """The negative control: the same steps with the rejected positions left in place differ from the
    reference (ring rows, compressor rows, the CSA entry a rejected window end emitted)."""
    model, args, toks, refs = setup
    got, pos = run(model, args, toks, 2, 1, (0, 0, 0, 0), undo=False)
    assert worst(got, refs[pos - 1]) > 100 * TOL


def test_snapshot_refuses_more_drafts_than_it_can_undo(setup) -> None:
    model, args, _, _ = setup
    pools = StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE)
    h = pools.alloc(CAP)
    with pytest.raises(ValueError, match="draft positions"):
        snapshot(pools, h, 1, 1 + MAX_DRAFTS)
