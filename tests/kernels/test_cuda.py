"""CUDA fast ops vs their plain-MLX references on the GPU (fresh random data, real dims, bf16)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import Row, RowBatch, backend
from kernels.compressor import compressor_rows_reference
from kernels.indexer import indexer_rows_reference
from kernels.sparse_attention import sparse_attention_rows_reference
from tests.kernels.naive import scatter_tables

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]

PAGE = 64


def fast():
    import kernels.cuda as kc

    return kc


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(((a - b) ** 2).sum()) / mx.maximum(mx.sqrt((b * b).sum()), 1e-30))


def rows_for(rng, positions, ratios, extra_q=2, spare=2):
    n = len(positions)
    tables, pages = {}, {}
    for r in ratios:
        needs = [max(1, -(-((p + 1) // r) // PAGE)) for p in positions]
        tables[r], pages[r] = scatter_tables(rng, needs, spare)
    bq = n + extra_q
    q_rows = [int(x) for x in rng.permutation(bq)[:n]]
    slots = [int(x) for x in rng.permutation(n + 2)[:n]]
    rows = [Row(slots[i], positions[i], q_rows[i], {r: tuple(tables[r][i]) for r in ratios}) for i in range(n)]
    return rows, pages, bq, n + 2


# ---- compressor ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("ratio,d", [(4, 512), (4, 128), (128, 512)])
@pytest.mark.parametrize("n_rows", [1, 2, 5, 8])
def test_compressor_matches_reference(ratio: int, d: int, n_rows: int, dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(100 * ratio + n_rows)
    coff = 2 if ratio == 4 else 1
    base = [int(x) for x in rng.integers(0, 3000, size=n_rows)]
    # half the rows end a window (emit), the others do not; one row at its very first window
    positions = [(b // ratio) * ratio + (ratio - 1 if i % 2 == 0 else int(rng.integers(0, ratio - 1)))
                 for i, b in enumerate(base)]  # fmt: skip
    positions[0] = ratio - 1
    rows, pages, bq, slots = rows_for(rng, positions, (ratio,))
    batch = RowBatch.build(rows, PAGE)
    half = 32
    kv = mx.random.normal((bq, coff * d))
    score = mx.random.normal((bq, coff * d))
    ape = mx.random.normal((ratio, coff * d))
    norm = mx.random.uniform(0.5, 1.5, (d,))
    kv_state = mx.random.normal((slots, coff * ratio, coff * d))
    score_state = mx.random.normal((slots, coff * ratio, coff * d))
    score_state[0, 0] = -math.inf
    pool = mx.random.normal((pages[ratio], PAGE, d)).astype(dtype)
    ang = mx.random.uniform(-math.pi, math.pi, (bq, half))
    cos, sin = mx.cos(ang), mx.sin(ang)
    kw = dict(ratio=ratio, head_dim=d, eps=1e-6, cos=cos, sin=sin)
    want = compressor_rows_reference(batch, kv, score, ape, norm, kv_state, score_state, pool, **kw)
    got = fast().compressor_rows_cuda(batch, kv, score, ape, norm, kv_state, score_state, pool, **kw)
    mx.eval(want, got)
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))  # -inf scores compare equal
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    tol = 1e-2 if dtype == mx.bfloat16 else 1e-5
    assert rel_err(got[2][1:], want[2][1:]) <= tol  # page 0 is the trash page
    assert got[2].dtype == dtype


# ---- indexer ------------------------------------------------------------------------------


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
    import kernels.cuda.indexer as ix

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
    import kernels.cuda.indexer as ix

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


# ---- sparse attention ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca", "hca_all", "hca_long"])
@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_sparse_attention_matches_reference(kind: str, n_rows: int) -> None:
    """Every launch plan: dsplit (sliding), wide (CSA, HCA; hca_long with 1-3 rows), split-K over head
    groups (hca_long with 8 rows: 8 x 130 chunks)."""
    check_attention(kind, n_rows)


@pytest.mark.parametrize("kind", ["csa", "hca", "hca_long"])
@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_sparse_attention_wide_32_heads(kind: str, n_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide kernel with 32 heads per block (twice the blocks: 4 warps per head tile)."""
    import kernels.cuda.attention as at

    monkeypatch.setattr(at, "WIDE_HG", 32)  # part of the launch plan's key
    check_attention(kind, n_rows)


def check_attention(kind: str, n_rows: int) -> None:
    rng = np.random.default_rng(300 + n_rows)
    ratio = {"sliding": 4, "csa": 4, "hca": 128, "hca_all": 128, "hca_long": 128}[kind]
    positions = [int(x) for x in rng.choice([0, 5, 127, 128, 1000, 20_000, 131_071, 70_000], n_rows, replace=False)]
    if kind == "hca_long":
        positions[0] = 4 * 262_144 - 1  # 8,192 HCA entries
    rows, pages, bq, slots = rows_for(rng, positions, (ratio,))
    batch = RowBatch.build(rows, PAGE)
    nh, d, w_len = 64, 512, 128
    q = mx.random.normal((bq, nh, d)).astype(mx.bfloat16)
    window = mx.random.normal((slots, w_len, d)).astype(mx.bfloat16)
    pool = mx.random.normal((pages[ratio], PAGE, d)).astype(mx.bfloat16)
    sinks = mx.random.normal((nh,))
    indices = None
    if kind == "csa":
        k = 512
        ind = np.full((bq, k), -1, np.int32)
        for r in rows:
            cnt = (r.position + 1) // ratio
            cand = list(rng.permutation(cnt)[: k - 2]) + [cnt, cnt + 5]  # ids >= n are masked
            ind[r.q_row, : len(cand)] = cand
            rng.shuffle(ind[r.q_row])
        indices = mx.array(ind)
    elif kind in ("hca", "hca_long"):
        cap = max(len(r.tables[ratio]) for r in rows) * PAGE
        ids = mx.arange(cap, dtype=mx.int32)[None, :]
        n = mx.array([0] * bq, dtype=mx.int32)
        for r in rows:
            n[r.q_row] = (r.position + 1) // ratio
        indices = mx.where(ids < n[:, None], ids, -1)
    args = (batch, q, window, None if kind == "sliding" else pool, indices, sinks)
    kw = dict(scale=d**-0.5, ratio=None if kind == "sliding" else ratio)
    want = sparse_attention_rows_reference(*args, **kw)
    got = fast().sparse_attention_rows_cuda(*args, **kw)
    assert got.dtype == mx.bfloat16 and got.shape == want.shape
    assert rel_err(got, want) <= 1e-2
    named = {r.q_row for r in rows}
    for i in range(bq):
        if i not in named:
            assert float(mx.abs(got[i].astype(mx.float32)).max()) == 0.0


def test_dispatch_uses_fast_path() -> None:
    kc = fast()
    assert backend.name() == "cuda"
    opt_out = set() if kc.HC_KERNEL else {"hc_pre_mix"}  # DSV4_HC_KERNEL=0 keeps the plain mHC pre-mix
    assert set(backend.registered()) == set(backend.OPS) - opt_out


@pytest.mark.parametrize("inplace", [False, True])
def test_precompile_tiny(inplace: bool) -> None:
    n = fast().precompile(dtype=mx.bfloat16, page_size=16, n_heads=16, head_dim=64, rope_dim=16,
                          index_heads=16, index_dim=32, topk=8, window=8, inplace_compressor=inplace)  # fmt: skip
    # 3 compressors (ratio 4 and 128 at D, 4 at the index dim: in place, or the functional op's); attention
    # sliding + ratio 4 + ratio 128; the indexer
    assert n == 7
