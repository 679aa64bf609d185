"""sparse_attention_rows vs the naive float64 NumPy attention (window + selected entries + sinks)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import Row, RowBatch, sparse_attention_rows
from tests.kernels.naive import attention_np, scatter_tables

W, NH, D, PAGE = 8, 3, 16, 2


def make_case(rng, positions, ratio, k, extra_q=2):
    """Scattered pages; NaN in the trash page and in unwritten window rows (must never be read)."""
    n = len(positions)
    needs = [-(-((p + 1) // ratio) // PAGE) for p in positions]
    tables, pages = scatter_tables(rng, needs)
    bq = n + extra_q
    q_rows = [int(x) for x in rng.permutation(bq)[:n]]
    slots = [int(x) for x in rng.permutation(n + 2)[:n]]
    q = rng.normal(size=(bq, NH, D)).astype(np.float32)
    window = rng.normal(size=(n + 2, W, D)).astype(np.float32)
    for s, p in zip(slots, positions, strict=True):
        window[s, p + 1 :] = np.nan
    pool = rng.normal(size=(pages, PAGE, D)).astype(np.float32)
    pool[0] = np.nan
    # ids: valid ones, -1, and ids >= the emitted count (both masked)
    indices = np.full((bq, k), -1, np.int32)
    for p, qr in zip(positions, q_rows, strict=True):
        cnt = (p + 1) // ratio
        cand = list(rng.permutation(cnt)[: k - 2]) + [cnt, cnt + 5]
        indices[qr, : len(cand)] = cand
        rng.shuffle(indices[qr])
    sinks = rng.normal(size=NH).astype(np.float32)
    rows = [Row(s, p, qr, {ratio: tuple(t)}) for s, p, qr, t in zip(slots, positions, q_rows, tables, strict=True)]
    return rows, q, window, pool, indices, sinks


def expected(rows, q, window, pool, indices, sinks, ratio, scale, all_entries=False):
    out = np.zeros(q.shape)
    for r in rows:
        if all_entries:
            ids = range((r.position + 1) // ratio)
        else:
            ids = [] if indices is None else indices[r.q_row].tolist()
        tb = r.tables.get(ratio, ())
        out[r.q_row] = attention_np(q[r.q_row], window[r.slot], pool, ids, tb, PAGE, r.position, ratio, sinks, scale)
    return out


def call(rows, q, window, pool, indices, sinks, ratio, scale, width=None):
    batch = RowBatch.build(rows, PAGE, {ratio: width} if width else None)
    pool = None if pool is None else mx.array(pool)
    indices = None if indices is None else mx.array(indices)
    return sparse_attention_rows(
        batch, mx.array(q), mx.array(window), pool, indices, mx.array(sinks), scale=scale, ratio=ratio
    )


@pytest.mark.parametrize("n_rows", range(1, 9))
@pytest.mark.parametrize("ratio", [4, 128])
def test_sparse_attention_matches_numpy(n_rows: int, ratio: int) -> None:
    rng = np.random.default_rng(100 * ratio + n_rows)
    # partial windows (p < W-1), full windows, rows with no entry yet, entry counts > k
    choices = [0, 2, 5, 7, 30, 127, 300, 520] if ratio == 128 else [0, 2, 3, 6, 7, 20, 45, 90]
    positions = [int(x) for x in rng.choice(choices, size=n_rows, replace=False)]
    rows, q, window, pool, indices, sinks = make_case(rng, positions, ratio, k=6)
    scale = 0.3
    got = call(rows, q, window, pool, indices, sinks, ratio, scale, width=30)
    assert got.dtype == mx.float32
    want = expected(rows, q, window, pool, indices, sinks, ratio, scale)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_sliding_layer_without_pool() -> None:
    rng = np.random.default_rng(7)
    rows, q, window, _, _, sinks = make_case(rng, [0, 3, 7, 50], 4, k=4)
    got = call(rows, q, window, None, None, sinks, None, 0.25)
    want = expected(rows, q, window, None, None, sinks, 4, 0.25)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_all_entries_when_indices_none() -> None:
    rng = np.random.default_rng(8)
    rows, q, window, pool, _, sinks = make_case(rng, [127, 300, 5, 1000], 128, k=4)
    got = call(rows, q, window, pool, None, sinks, 128, 0.2, width=6)
    want = expected(rows, q, window, pool, None, sinks, 128, 0.2, all_entries=True)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_bf16_output_dtype() -> None:
    rng = np.random.default_rng(9)
    rows, q, window, pool, indices, sinks = make_case(rng, [9, 30], 4, k=5)
    window = np.nan_to_num(window)
    pool = np.nan_to_num(pool)
    batch = RowBatch.build(rows, PAGE)
    got = sparse_attention_rows(
        batch, mx.array(q, dtype=mx.bfloat16), mx.array(window, dtype=mx.bfloat16), mx.array(pool, dtype=mx.bfloat16),
        mx.array(indices), mx.array(sinks), scale=0.3, ratio=4,
    )  # fmt: skip
    assert got.dtype == mx.bfloat16
    want = expected(rows, q, window, pool, indices, sinks, 4, 0.3)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=5e-2, atol=5e-2)


def test_sparse_attention_batched_equals_single_rows() -> None:
    rng = np.random.default_rng(11)
    positions = [0, 3, 7, 8, 19, 44, 63, 90]
    rows, q, window, pool, indices, sinks = make_case(rng, positions, 4, k=8, extra_q=0)
    together = np.array(call(rows, q, window, pool, indices, sinks, 4, 0.3, width=12))
    for r in rows:
        alone = np.array(call([r], q, window, pool, indices, sinks, 4, 0.3, width=12))
        np.testing.assert_allclose(together[r.q_row], alone[r.q_row], rtol=1e-6, atol=1e-6)
    assert np.isfinite(together).all()


def test_sparse_attention_position_int32_max_sliding() -> None:
    """p = INT32_MAX: min(p+1, W) must not overflow int32 (the whole ring is valid)."""
    rng = np.random.default_rng(12)
    rows = [Row(slot=1, position=2**31 - 1, q_row=0), Row(slot=0, position=4, q_row=1)]
    q = rng.normal(size=(2, NH, D)).astype(np.float32)
    window = rng.normal(size=(2, W, D)).astype(np.float32)
    window[0, 5:] = np.nan
    sinks = rng.normal(size=NH).astype(np.float32)
    got = call(rows, q, window, None, None, sinks, None, 0.3)
    want = expected(rows, q, window, None, None, sinks, 4, 0.3)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
