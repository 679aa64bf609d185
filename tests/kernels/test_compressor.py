"""compressor_rows vs the sequential float64 NumPy model, and batched vs one row per call."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import Row, RowBatch, compressor_rows
from tests.kernels.naive import CompressorNp, scatter_tables

EPS = 1e-6


@dataclass
class Setup:
    ratio: int
    d: int
    half: int
    page: int
    starts: list[int]
    steps: int
    slots: list[int]
    tables: list[list[int]]
    pages: int
    n_slots: int
    ape: np.ndarray
    norm: np.ndarray
    models: list[CompressorNp]


def _inputs(rng, bq, coff, d, half):
    kv = rng.normal(size=(bq, coff * d)).astype(np.float32)
    score = rng.normal(size=(bq, coff * d)).astype(np.float32)
    ang = rng.uniform(-math.pi, math.pi, size=(bq, half))
    return kv, score, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def make_setup(rng, ratio, d, half, page, starts, steps) -> Setup:
    """Rows at `starts`; each row's model is pre-run over a random prefix (numpy only)."""
    coff = 2 if ratio == 4 else 1
    n = len(starts)
    n_slots = n + 3
    slots = [int(s) for s in rng.permutation(n_slots)[:n]]
    needs = [-(-((st + steps) // ratio) // page) for st in starts]  # pages for the final entry count
    tables, pages = scatter_tables(rng, needs)
    ape = rng.normal(size=(ratio, coff * d)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, size=d).astype(np.float32)
    models = []
    for st in starts:
        model = CompressorNp(ratio, d)
        for p in range(st):
            kv, score, cos, sin = _inputs(rng, 1, coff, d, half)
            model.step(p, kv[0], score[0], ape, norm, EPS, cos[0], sin[0])
        models.append(model)
    return Setup(ratio, d, half, page, starts, steps, slots, tables, pages, n_slots, ape, norm, models)


def initial_state(su: Setup) -> tuple[np.ndarray, np.ndarray]:
    coff = 2 if su.ratio == 4 else 1
    shape = (su.n_slots, coff * su.ratio, coff * su.d)
    kv = np.zeros(shape, np.float32)
    sc = np.full(shape, -np.inf, np.float32)
    for slot, model in zip(su.slots, su.models, strict=True):
        kv[slot], sc[slot] = model.kv, model.s
    return kv, sc


def test_compressor_matches_numpy_sequence_csa_and_hca() -> None:
    rng = np.random.default_rng(0)
    cases = [
        # CSA: window 0 from scratch (-inf previous half), mid-window starts, overlap across windows.
        (4, 16, 4, 2, [0, 1, 2, 3, 5, 7, 10, 13], 9),
        (4, 8, 4, 3, [6], 7),  # head_dim == rope dims
        # HCA: from scratch and just before / at / after window ends.
        (128, 16, 4, 2, [0, 120, 126, 127, 250, 254, 383, 5], 6),
    ]
    for ratio, d, half, page, starts, steps in cases:
        coff = 2 if ratio == 4 else 1
        su = make_setup(rng, ratio, d, half, page, starts, steps)
        kv_np, sc_np = initial_state(su)
        pool_np = rng.normal(size=(su.pages, page, d)).astype(np.float32)
        expected = pool_np.astype(np.float64)
        kv_state, score_state, pool = mx.array(kv_np), mx.array(sc_np), mx.array(pool_np)
        width = max(len(t) for t in su.tables) + 1
        emitted = 0
        for t in range(steps):
            bq = len(starts) + 2  # spare q rows that no batch row reads
            q_rows = [int(x) for x in rng.permutation(bq)[: len(starts)]]
            kv, score, cos, sin = _inputs(rng, bq, coff, d, half)
            rows = [
                Row(slot=s, position=st + t, q_row=qr, tables={ratio: tuple(tb)})
                for s, st, qr, tb in zip(su.slots, starts, q_rows, su.tables, strict=True)
            ]
            batch = RowBatch.build(rows, page, table_width={ratio: width})
            kv_state, score_state, pool = compressor_rows(
                batch, mx.array(kv), mx.array(score), mx.array(su.ape), mx.array(su.norm),
                kv_state, score_state, pool,
                ratio=ratio, head_dim=d, eps=EPS, cos=mx.array(cos), sin=mx.array(sin),
            )  # fmt: skip
            mx.eval(kv_state, score_state, pool)
            for row, model in zip(rows, su.models, strict=True):
                qr = row.q_row
                out = model.step(row.position, kv[qr], score[qr], su.ape, su.norm, EPS, cos[qr], sin[qr])
                if out is not None:
                    w, c = out
                    expected[row.tables[ratio][w // page], w % page] = c
                    emitted += 1
        assert emitted >= 2  # the case really exercises emissions
        got_kv, got_sc = np.array(kv_state), np.array(score_state)
        for slot, model in zip(su.slots, su.models, strict=True):
            np.testing.assert_allclose(got_kv[slot], model.kv, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got_sc[slot], model.s, rtol=1e-6, atol=1e-6)  # -inf where unwritten
        others = [s for s in range(su.n_slots) if s not in su.slots]
        np.testing.assert_array_equal(got_kv[others], kv_np[others])
        np.testing.assert_array_equal(got_sc[others], sc_np[others])
        # Emitted entries match; every other real page is untouched (only trash page 0 may change).
        np.testing.assert_allclose(np.array(pool)[1:], expected[1:], rtol=1e-5, atol=1e-5)


def test_compressor_bf16_pool_close_to_numpy() -> None:
    rng = np.random.default_rng(1)
    su = make_setup(rng, 4, 16, 4, 2, [3, 7, 11], 1)  # every row emits on its one step
    kv_np, sc_np = initial_state(su)
    pool = mx.zeros((su.pages, 2, 16), mx.bfloat16)
    kv, score, cos, sin = _inputs(rng, 3, 2, 16, 4)
    triples = zip(su.slots, su.starts, su.tables, strict=True)
    rows = [Row(s, st, i, {4: tuple(tb)}) for i, (s, st, tb) in enumerate(triples)]
    _, _, pool = compressor_rows(
        RowBatch.build(rows, 2), mx.array(kv), mx.array(score), mx.array(su.ape), mx.array(su.norm),
        mx.array(kv_np), mx.array(sc_np), pool, ratio=4, head_dim=16, eps=EPS, cos=mx.array(cos), sin=mx.array(sin),
    )  # fmt: skip
    assert pool.dtype == mx.bfloat16
    got = np.array(pool.astype(mx.float32))
    for i, (row, model) in enumerate(zip(rows, su.models, strict=True)):
        w, c = model.step(row.position, kv[i], score[i], su.ape, su.norm, EPS, cos[i], sin[i])
        np.testing.assert_allclose(got[row.tables[4][w // 2], w % 2], c, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_batched_equals_single_rows(ratio: int) -> None:
    rng = np.random.default_rng(2 + ratio)
    d, half, page = 16, 4, 2
    starts = [0, 3, 6, 7, 11, 126, 127, 254] if ratio == 128 else [0, 2, 3, 5, 6, 7, 10, 15]
    su = make_setup(rng, ratio, d, half, page, starts, 3)
    coff = 2 if ratio == 4 else 1
    kv_np, sc_np = initial_state(su)
    pool_np = rng.normal(size=(su.pages, page, d)).astype(np.float32)
    width = max(len(t) for t in su.tables)
    together = (mx.array(kv_np), mx.array(sc_np), mx.array(pool_np))
    alone = together
    for t in range(3):
        q_rows = [int(x) for x in rng.permutation(8)]
        kv, score, cos, sin = (mx.array(a) for a in _inputs(rng, 8, coff, d, half))
        rows = [
            Row(s, st + t, qr, {ratio: tuple(tb)})
            for s, st, qr, tb in zip(su.slots, starts, q_rows, su.tables, strict=True)
        ]
        common = dict(ratio=ratio, head_dim=d, eps=EPS, cos=cos, sin=sin)
        ape, norm = mx.array(su.ape), mx.array(su.norm)
        batch = RowBatch.build(rows, page, {ratio: width})
        together = compressor_rows(batch, kv, score, ape, norm, *together, **common)
        for row in rows:
            one = RowBatch.build([row], page, {ratio: width})
            alone = compressor_rows(one, kv, score, ape, norm, *alone, **common)
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(np.array(a)[1:], np.array(b)[1:], rtol=1e-6, atol=1e-6)
    assert not np.array_equal(np.array(together[2])[1:], pool_np[1:])  # entries were emitted
