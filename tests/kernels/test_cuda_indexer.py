"""CUDA indexer_rows (scores + top-k) vs its plain-MLX reference on the GPU: the one-launch kernel, segments +
merge, dense segments; random scores (top-k sets compared by score) and small-integer scores (ids exact)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import Row, RowBatch, backend
from dsv4_serve.kernels.indexer import indexer_rows_reference
from tests.kernels.test_cuda import PAGE, fast, rows_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def scores_f64(q, w, keys, row: Row) -> np.ndarray:
    n = (row.position + 1) // 4
    tb = np.array(row.tables[4])
    ids = np.arange(n)
    k = np.array(keys.astype(mx.float32))[tb[ids // PAGE], ids % PAGE].astype(np.float64)
    qq = np.array(q[row.q_row].astype(mx.float32)).astype(np.float64)
    ww = np.array(w[row.q_row]).astype(np.float64)
    return (np.maximum(k @ qq.T, 0.0) * ww[None, :]).sum(axis=1)


def assert_topk_equal(got: np.ndarray, want: np.ndarray, rows, q, w, keys, exact: bool) -> None:
    named = {r.q_row for r in rows}
    for i in range(got.shape[0]):
        if i not in named:
            assert (got[i] == -1).all()
    for r in rows:
        g, t = got[r.q_row], want[r.q_row]
        if exact or (g == t).all():
            np.testing.assert_array_equal(g, t)
            continue
        # fp32 summation order may swap entries whose scores agree to rounding: compare the scores
        s = scores_f64(q, w, keys, r)
        gv, tv = g[g >= 0], t[t >= 0]
        assert len(gv) == len(tv) and len(set(gv.tolist())) == len(gv)
        tol = 1e-5 * max(1.0, float(np.abs(s).max()))
        np.testing.assert_allclose(np.sort(s[gv]), np.sort(s[tv]), atol=tol, rtol=0)
        assert (np.diff(gv) > 0).all() and (g[len(gv):] == -1).all()  # ascending ids, then -1


def check_random_scores(batch: RowBatch, rows, bq: int, pages: int) -> None:
    """Normal q / w / keys (64 heads x 128): the fast top-k sets equal the reference's, topk 512 and 100."""
    q = mx.random.normal((bq, 64, 128)).astype(mx.bfloat16)
    w = mx.random.normal((bq, 64))
    keys = mx.random.normal((pages, PAGE, 128)).astype(mx.bfloat16)
    for topk in (512, 100):
        want = np.array(indexer_rows_reference(batch, q, w, keys, topk=topk))
        got = np.array(fast().indexer_rows_cuda(batch, q, w, keys, topk=topk))
        assert_topk_equal(got, want, rows, q, w, keys, exact=False)


def check_integer_scores(rng: np.random.Generator, batch: RowBatch, rows, bq: int, pages: int) -> tuple:
    """Small-integer q / w / keys (32 heads x 64): every score exact in any order, so the ids must equal
    the reference's exactly (ties to the lowest id). Returns (q, w, keys)."""
    q = mx.array(rng.integers(-1, 2, size=(bq, 32, 64)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.choice(np.array([-1.0, 0.0, 0.5, 1.0, 2.0], np.float32), size=(bq, 32)))
    keys = mx.array(rng.integers(-1, 3, size=(pages, PAGE, 64)).astype(np.float32)).astype(mx.bfloat16)
    want = np.array(indexer_rows_reference(batch, q, w, keys, topk=512))
    got = np.array(fast().indexer_rows_cuda(batch, q, w, keys, topk=512))
    assert_topk_equal(got, want, rows, q, w, keys, exact=True)
    return q, w, keys


@pytest.mark.parametrize("n_rows", range(1, 9))
def test_indexer_matches_reference(n_rows: int) -> None:
    rng = np.random.default_rng(7 + n_rows)
    choices = [0, 2, 3, 7, 130, 2047, 2051, 40_000, 131_071, 4 * 262_144 - 1]
    positions = [int(x) for x in rng.choice(choices, size=n_rows, replace=False)]
    if n_rows == 8:
        positions[3] = 4 * 262_144 - 1  # 262,144 entries
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    width = max(len(r.tables[4]) for r in rows) + 2
    batch = RowBatch.build(rows, PAGE, {4: width})
    check_random_scores(batch, rows, bq, pages[4])


@pytest.mark.parametrize("n_rows", [1, 4, 8])
def test_indexer_ties_exact(n_rows: int) -> None:
    """Small-integer data: every score is exact in any order, so ties must go to the lowest id."""
    rng = np.random.default_rng(50 + n_rows)
    positions = [int(x) for x in rng.choice([11, 999, 4099, 20_000, 70_001, 3, 517, 2600], n_rows, replace=False)]
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE)
    q, w, keys = check_integer_scores(rng, batch, rows, bq, pages[4])
    w0 = mx.zeros_like(w)  # all scores 0: ids 0, 1, 2, ...
    got0 = np.array(fast().indexer_rows_cuda(batch, q, w0, keys, topk=512))
    np.testing.assert_array_equal(got0, np.array(indexer_rows_reference(batch, q, w0, keys, topk=512)))


@pytest.mark.parametrize("n_rows", [1, 2, 5, 8])
def test_indexer_single_segment(n_rows: int) -> None:
    """Short rows (<= 4,096 entries of capacity): one launch (the row's last block selects)."""
    rng = np.random.default_rng(90 + n_rows)
    positions = [int(x) for x in rng.choice([0, 3, 6, 2050, 4099, 9000, 16_383, 777], n_rows, replace=False)]
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE, {4: 64})  # 4,096 entries of capacity
    check_random_scores(batch, rows, bq, pages[4])
    check_integer_scores(rng, batch, rows, bq, pages[4])


@pytest.mark.parametrize("n_rows", range(1, 9))
def test_indexer_one_launch(n_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-launch kernel at 32,768 entries of capacity (whatever ONE_MAX is), ragged rows from 1 to
    32,768 entries (a full table), random and small-integer scores (ties exact)."""
    import dsv4_serve.kernels.cuda.indexer as ix

    monkeypatch.setattr(ix, "ONE_MAX", 1 << 15)  # part of the launch plan's key
    rng = np.random.default_rng(140 + n_rows)
    choices = [3, 130, 2047, 2051, 9000, 40_000, 99_999, 131_071]
    positions = [int(x) for x in rng.choice(choices, size=n_rows, replace=False)]
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE, {4: 32_768 // PAGE})
    check_random_scores(batch, rows, bq, pages[4])
    check_integer_scores(rng, batch, rows, bq, pages[4])


@pytest.mark.parametrize("n_rows", range(1, 9))
def test_indexer_dense_segments(n_rows: int) -> None:
    """128K context (32,768 entries of capacity): segments of at most 2 * topk entries hand the merge every
    key (DENSE; top-512 and top-1024). Ragged rows from 0 entries to a full table, a last segment of one
    entry; random and small-integer scores (ties exact), all-equal scores (the merge's whole-list path)."""
    import dsv4_serve.kernels.cuda.indexer as ix

    cap = 32_768
    for topk in (512, 1024):
        assert cap > ix.ONE_MAX and ix.dense_segments(ix.segment_size(cap, topk), topk)
    rng = np.random.default_rng(160 + n_rows)
    choices = [0, 3, 130, 4095, 4099, 9000, 40_000, 131_071]
    positions = [int(x) for x in rng.choice(choices, size=n_rows, replace=False)]
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE, {4: cap // PAGE})
    check_random_scores(batch, rows, bq, pages[4])
    q, w, keys = check_integer_scores(rng, batch, rows, bq, pages[4])
    w0 = mx.zeros_like(w)  # all scores 0: ids 0, 1, 2, ...
    got0 = np.array(fast().indexer_rows_cuda(batch, q, w0, keys, topk=512))
    np.testing.assert_array_equal(got0, np.array(indexer_rows_reference(batch, q, w0, keys, topk=512)))
    q = mx.random.normal((bq, 64, 128)).astype(mx.bfloat16)
    w = mx.random.normal((bq, 64))
    keys = mx.random.normal((pages[4], PAGE, 128)).astype(mx.bfloat16)
    want = np.array(indexer_rows_reference(batch, q, w, keys, topk=1024))
    got = np.array(fast().indexer_rows_cuda(batch, q, w, keys, topk=1024))
    assert_topk_equal(got, want, rows, q, w, keys, exact=False)


@pytest.mark.parametrize("n_rows", [1, 3])
def test_indexer_merge_without_bound(n_rows: int) -> None:
    """topk 2048 over 262,144 entries: 32 segments x 2048 candidates. All-equal scores (w = 0) make the
    segments' bound useless (every candidate passes it), so the merge takes its path over the whole
    list in global memory; random scores take the filtered path. Both exact: ids 0..2047 for ties."""
    rng = np.random.default_rng(120 + n_rows)
    positions = [4 * 262_144 - 1] + [int(x) for x in rng.choice([9000, 70_001, 300_000], n_rows - 1, replace=False)]
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE)
    q = mx.random.normal((bq, 16, 64)).astype(mx.bfloat16)
    keys = mx.random.normal((pages[4], PAGE, 64)).astype(mx.bfloat16)
    w = mx.random.normal((bq, 16))
    for weights, exact in ((mx.zeros_like(w), True), (w, False)):
        want = np.array(indexer_rows_reference(batch, q, weights, keys, topk=2048))
        got = np.array(fast().indexer_rows_cuda(batch, q, weights, keys, topk=2048))
        assert_topk_equal(got, want, rows, q, weights, keys, exact=exact)
        if exact:  # every score is 0: the lowest ids, in order
            np.testing.assert_array_equal(got[rows[0].q_row], np.arange(2048))
