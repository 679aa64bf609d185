"""indexer_rows vs the naive NumPy top-k: the same ids (ties to the lowest id), in ascending id order."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import Row, RowBatch, indexer_rows
from tests.kernels.naive import indexer_np, scatter_tables


def make_case(rng, positions, page, n_heads, dim, integer=False, extra_q=2):
    """Rows at `positions`, scattered pages, q rows permuted; integer data gives exact score ties."""
    n = len(positions)
    needs = [-(-((p + 1) // 4) // page) for p in positions]
    tables, pages = scatter_tables(rng, needs)
    bq = n + extra_q
    q_rows = [int(x) for x in rng.permutation(bq)[:n]]
    slots = [int(x) for x in rng.permutation(n + 2)[:n]]
    if integer:  # small integers: every score is exact in f32 and f64, so ties are real ties
        keys = rng.integers(-1, 3, size=(pages, page, dim)).astype(np.float32)
        q = rng.integers(-1, 2, size=(bq, n_heads, dim)).astype(np.float32)
        w = rng.choice(np.array([-1.0, 0.0, 0.5, 1.0, 2.0], np.float32), size=(bq, n_heads))
    else:
        keys = rng.normal(size=(pages, page, dim)).astype(np.float32)
        q = rng.normal(size=(bq, n_heads, dim)).astype(np.float32)
        w = rng.normal(size=(bq, n_heads)).astype(np.float32)
    rows = [Row(s, p, qr, {4: tuple(t)}) for s, p, qr, t in zip(slots, positions, q_rows, tables, strict=True)]
    return rows, q, w, keys


def expected(rows, q, w, keys, page, topk):
    out = np.full((q.shape[0], topk), -1, np.int64)
    for r in rows:
        out[r.q_row] = indexer_np(q[r.q_row], w[r.q_row], keys, r.tables[4], page, r.position, topk)
    return out


def run(rows, q, w, keys, page, topk, width=None):
    batch = RowBatch.build(rows, page, {4: width} if width else None)
    out = indexer_rows(batch, mx.array(q), mx.array(w), mx.array(keys), topk=topk)
    assert out.dtype == mx.int32 and out.shape == (q.shape[0], topk)
    return np.array(out)


@pytest.mark.parametrize("n_rows", range(1, 9))
def test_indexer_matches_numpy_random(n_rows: int) -> None:
    rng = np.random.default_rng(10 + n_rows)
    # ragged: no entry yet (p < 3), exactly at a window end, fewer and more entries than topk
    pool_of = [0, 2, 3, 7, 18, 41, 66, 130, 203]
    positions = [int(x) for x in rng.choice(pool_of, size=n_rows, replace=False)]
    rows, q, w, keys = make_case(rng, positions, page=3, n_heads=4, dim=8)
    got = run(rows, q, w, keys, 3, topk=12, width=20)
    np.testing.assert_array_equal(got, expected(rows, q, w, keys, 3, 12))


def test_indexer_ties_break_to_lowest_id() -> None:
    rng = np.random.default_rng(3)
    positions = [27, 63, 99, 130, 3, 55, 80, 11]
    rows, q, w, keys = make_case(rng, positions, page=4, n_heads=3, dim=6, integer=True)
    want = expected(rows, q, w, keys, 4, 9)
    # the data really has ties at the cut (otherwise this test would not check the tie break)
    scores = [
        [sum(float(w[r.q_row, h]) * max(float(q[r.q_row, h] @ keys[r.tables[4][s // 4], s % 4]), 0.0)
             for h in range(3)) for s in range((r.position + 1) // 4)]
        for r in rows
    ]  # fmt: skip
    assert any(len(s) > 9 and sorted(s, reverse=True)[8] == sorted(s, reverse=True)[9] for s in scores)
    np.testing.assert_array_equal(run(rows, q, w, keys, 4, 9), want)


def test_indexer_all_equal_scores_give_first_ids() -> None:
    rng = np.random.default_rng(4)
    rows, q, w, keys = make_case(rng, [40, 9], page=2, n_heads=2, dim=4)
    w[:] = 0.0  # every score is exactly 0 (some may be -0.0): order = ids 0, 1, 2, ...
    got = run(rows, q, w, keys, 2, topk=6)
    assert got[rows[0].q_row].tolist() == [0, 1, 2, 3, 4, 5]
    assert got[rows[1].q_row].tolist() == [0, 1, -1, -1, -1, -1]  # n = 10 // 4 = 2
    w[:] = -1.0
    keys[:] = -np.abs(keys)  # q . k mixes signs -> relu 0 or positive -> scores -0.0 or negative
    np.testing.assert_array_equal(run(rows, q, w, keys, 2, 6), expected(rows, q, w, keys, 2, 6))


def test_indexer_topk_wider_than_capacity_pads() -> None:
    rng = np.random.default_rng(5)
    rows, q, w, keys = make_case(rng, [23], page=2, n_heads=2, dim=4)  # 6 entries, 3 pages
    got = run(rows, q, w, keys, 2, topk=10)
    np.testing.assert_array_equal(got, expected(rows, q, w, keys, 2, 10))
    assert (got[rows[0].q_row, 6:] == -1).all()


def test_indexer_batched_equals_single_rows() -> None:
    rng = np.random.default_rng(6)
    positions = [3, 15, 40, 77, 100, 2, 61, 128]
    rows, q, w, keys = make_case(rng, positions, page=4, n_heads=4, dim=8, extra_q=0)
    together = run(rows, q, w, keys, 4, topk=7, width=9)
    for r in rows:
        alone = run([r], q, w, keys, 4, topk=7, width=9)
        np.testing.assert_array_equal(together[r.q_row], alone[r.q_row])
    assert (together >= 0).sum() > 20


def test_indexer_order_key_signed_zero_and_infinities() -> None:
    """The sort key alone: -0.0 ties +0.0 (id decides), +-inf order, masked entries go last."""
    from dsv4_serve.kernels.indexer import order_key

    scores = np.array([0.0, -0.0, 1.0, -1.0, -0.0, np.inf, -np.inf, 1.0, 5.0, 0.0], np.float32)
    valid = np.array([True] * 8 + [False, True])
    key = order_key(mx.array(scores)[None], mx.array(valid)[None])
    ids = np.array((mx.sort(key, axis=-1) & 0xFFFFFFFF).astype(mx.int32))[0].tolist()
    want = sorted(range(10), key=lambda s: (not valid[s], -float(scores[s]), s))
    assert ids == want == [5, 2, 7, 0, 1, 4, 9, 3, 6, 8]


def test_indexer_workspace_is_checked_and_leaves_the_result_alone() -> None:
    """`workspace` (the CUDA path's scratch: a row per batch row, counts then keys): a well-formed one gives
    the NumPy model's ids (here the reference runs); a wrong one is a ValueError naming it."""
    from dsv4_serve.kernels.indexer import WS_HEAD, WS_KEYS_MAX, new_workspace, workspace_cols

    rng = np.random.default_rng(77)
    rows, q, w, keys = make_case(rng, [7, 130, 41], page=3, n_heads=4, dim=8)
    batch = RowBatch.build(rows, 3, {4: 20})
    cap = 20 * 3
    args = (batch, mx.array(q), mx.array(w), mx.array(keys))
    ws = new_workspace(3, cap)
    assert ws.dtype == mx.uint32 and ws.shape == (3, WS_HEAD + 60) and int(mx.sum(ws)) == 0
    assert workspace_cols(WS_KEYS_MAX + 1) == WS_HEAD  # longer tables keep no keys there (segment + merge)
    got = np.array(indexer_rows(*args, topk=12, workspace=ws))
    np.testing.assert_array_equal(got, expected(rows, q, w, keys, 3, 12))
    np.testing.assert_array_equal(np.array(indexer_rows(*args, topk=12, workspace=new_workspace(8, 4 * cap))), got)
    bad = {"must be uint32": mx.zeros((3, WS_HEAD + 60), mx.int32),
           "must be uint32 \\[>= 3, >= 2112\\]": new_workspace(2, cap),
           "must be uint32 \\[>= 3, >= 2112\\] \\(kernels.indexer.new_workspace\\(3, 60\\)\\)": new_workspace(3, 40),
           "got uint32 \\[6336\\]": mx.zeros((3 * (WS_HEAD + 60),), mx.uint32),
           "must be an mx.array": np.zeros((3, WS_HEAD + 60), np.uint32)}  # fmt: skip
    for why, wsb in bad.items():
        with pytest.raises(ValueError, match=f"indexer_rows: workspace: .*{why}" if why.startswith("got") else
                           f"indexer_rows: workspace: {why}"):  # fmt: skip
            indexer_rows(*args, topk=12, workspace=wsb)
