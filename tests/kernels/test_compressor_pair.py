"""compressor_pair_rows_inplace (a CSA layer's main and indexer compressors as one dispatch) against the
sequential float64 NumPy model of each, and its argument checks. On the CPU the dispatch is the reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import CompressorArgs, Row, RowBatch, compressor_pair_rows_inplace
from tests.kernels.test_compressor import EPS, _inputs, initial_state, make_setup


def test_pair_matches_numpy_for_both_compressors() -> None:
    """Two head dims over one ragged batch (window starts, mid-window, overlap), 9 steps: each set's
    states and emitted entries are its own NumPy model's (a swapped or shared argument would fail)."""
    rng = np.random.default_rng(3)
    starts, steps, page, half = [0, 1, 2, 3, 5, 7, 10, 13], 9, 2, 4
    dims = (16, 8)
    sus = [make_setup(rng, 4, d, half, page, starts, steps) for d in dims]
    sus[1].slots, sus[1].tables = sus[0].slots, sus[0].tables  # one batch: the same slots and block table
    sus[1].pages, sus[1].n_slots = sus[0].pages, sus[0].n_slots
    state = []
    for su in sus:
        kv_np, sc_np = initial_state(su)
        pool_np = rng.normal(size=(su.pages, page, su.d)).astype(np.float32)
        state.append([mx.array(kv_np), mx.array(sc_np), mx.array(pool_np), pool_np.astype(np.float64)])
    width = max(len(t) for t in sus[0].tables) + 1
    emitted = 0
    for t in range(steps):
        bq = len(starts) + 2
        q_rows = [int(x) for x in rng.permutation(bq)[: len(starts)]]
        rows = [Row(slot=s, position=st + t, q_row=qr, tables={4: tuple(tb)})
                for s, st, qr, tb in zip(sus[0].slots, starts, q_rows, sus[0].tables, strict=True)]  # fmt: skip
        batch = RowBatch.build(rows, page, table_width={4: width})
        xs = [_inputs(rng, bq, 2, su.d, half) for su in sus]
        cos, sin = xs[0][2], xs[0][3]  # one RoPE row per q row, shared by both compressors
        args = [CompressorArgs(mx.array(x[0]), mx.array(x[1]), mx.array(su.ape), mx.array(su.norm), *st[:3], su.d)
                for x, su, st in zip(xs, sus, state, strict=True)]  # fmt: skip
        first, second, token = compressor_pair_rows_inplace(batch, *args, ratio=4, eps=EPS, cos=mx.array(cos),
                                                            sin=mx.array(sin))  # fmt: skip
        assert token is None  # the reference: functional, no token
        for st, new in zip(state, (first, second), strict=True):
            st[:3] = new
        mx.eval([st[:3] for st in state])
        for su, st, x in zip(sus, state, xs, strict=True):
            for row, model in zip(rows, su.models, strict=True):
                qr = row.q_row
                out = model.step(row.position, x[0][qr], x[1][qr], su.ape, su.norm, EPS, cos[qr], sin[qr])
                if out is not None:
                    w, c = out
                    st[3][row.tables[4][w // page], w % page] = c
                    emitted += 1
    assert emitted >= 4
    for su, st in zip(sus, state, strict=True):
        got_kv, got_sc = np.array(st[0]), np.array(st[1])
        for slot, model in zip(su.slots, su.models, strict=True):
            np.testing.assert_allclose(got_kv[slot], model.kv, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got_sc[slot], model.s, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.array(st[2])[1:], st[3][1:], rtol=1e-5, atol=1e-5)


def _one_row_args(d: int, head_dim: int | None = None) -> CompressorArgs:
    return CompressorArgs(mx.zeros((1, 2 * d)), mx.zeros((1, 2 * d)), mx.zeros((4, 2 * d)), mx.ones((d,)),
                          mx.zeros((1, 8, 2 * d)), mx.zeros((1, 8, 2 * d)), mx.zeros((2, 4, d)),
                          d if head_dim is None else head_dim)  # fmt: skip


def test_pair_bad_arguments_name_them() -> None:
    batch = RowBatch.build([Row(0, 3, 0, {4: (1,)})], 4)
    kw = dict(ratio=4, eps=EPS, cos=mx.ones((1, 2)), sin=mx.zeros((1, 2)))
    with pytest.raises(ValueError, match="compressor_pair_rows_inplace: second: must be a CompressorArgs"):
        compressor_pair_rows_inplace(batch, _one_row_args(8), tuple(_one_row_args(8)), **kw)
    with pytest.raises(ValueError, match=r"compressor_rows: kv: shape must be \[\*, 32\]"):
        compressor_pair_rows_inplace(batch, _one_row_args(8), _one_row_args(8, head_dim=16), **kw)


def test_inplace_workspace_is_checked() -> None:
    """compressor_rows_inplace's `workspace` (the CUDA HCA form's scratch): a well-formed one leaves the
    reference's update alone; a wrong one is a ValueError naming it."""
    from dsv4_serve.kernels import compressor_rows_inplace
    from dsv4_serve.kernels.compressor import new_workspace, workspace_words

    batch = RowBatch.build([Row(0, 127, 0, {128: (1,)})], 4)
    d = 8
    args = (batch, mx.ones((1, d)), mx.zeros((1, d)), mx.zeros((128, d)), mx.ones((d,)), mx.zeros((1, 128, d)),
            mx.zeros((1, 128, d)), mx.zeros((2, 4, d)))  # fmt: skip
    kw = dict(ratio=128, head_dim=d, eps=EPS, cos=mx.ones((1, 2)), sin=mx.zeros((1, 2)))
    base = compressor_rows_inplace(*args, **kw)
    with_ws = compressor_rows_inplace(*args, **kw, workspace=new_workspace(1, d))
    for a, b in zip(base[:3], with_ws[:3], strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert workspace_words(1, d) == d + 1
    with pytest.raises(ValueError, match=r"compressor_rows: workspace: must be uint32 \[>= 9\]"):
        compressor_rows_inplace(*args, **kw, workspace=mx.zeros((9,), mx.float32))
