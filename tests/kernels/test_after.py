"""The `after` token of the in-place compressor API on the plain-MLX paths (what the CPU and CI run):
compressor_rows_inplace equals compressor_rows, a token changes no reader's result, and a bad token is
a ValueError naming the op and `after`. (The CUDA path's in-place writes: tests/kernels/test_cuda_inplace.py.)"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import (
    Row,
    RowBatch,
    compressor_rows,
    compressor_rows_inplace,
    indexer_rows,
    sparse_attention_rows,
)
from tests.kernels.naive import scatter_tables

PAGE = 16


def layer(seed: int = 0):
    """A CSA layer's inputs for 3 rows (one emits this step)."""
    rng = np.random.default_rng(seed)
    positions = [3, 41, 66]
    needs = [max(1, -(-((p + 1) // 4) // PAGE)) for p in positions]
    tables, pages = scatter_tables(rng, needs)
    rows = [Row(i, p, i, {4: tuple(t)}) for i, (p, t) in enumerate(zip(positions, tables, strict=True))]
    batch = RowBatch.build(rows, PAGE)
    d = 32
    comp = dict(kv=mx.random.normal((3, 2 * d)), score=mx.random.normal((3, 2 * d)), ape=mx.random.normal((4, 2 * d)),
                norm=mx.ones((d,)), kv_state=mx.random.normal((3, 8, 2 * d)),
                score_state=mx.random.normal((3, 8, 2 * d)), pool=mx.random.normal((pages, PAGE, d)))  # fmt: skip
    ang = mx.random.uniform(-math.pi, math.pi, (3, 4))
    kw = dict(ratio=4, head_dim=d, eps=1e-6, cos=mx.cos(ang), sin=mx.sin(ang))
    return batch, comp, kw


def test_inplace_op_equals_the_functional_op_on_the_reference_path() -> None:
    batch, c, kw = layer()
    want = compressor_rows(batch, *c.values(), **kw)
    got = compressor_rows_inplace(batch, *c.values(), **kw)
    token_after = compressor_rows_inplace(batch, *c.values(), **kw, after=mx.array([7], dtype=mx.int32))
    assert got[3] is None and token_after[3] is None  # the functional update: no token
    for g, t, w in zip(got[:3], token_after[:3], want, strict=True):
        assert mx.array_equal(g, w, equal_nan=True) and mx.array_equal(t, w, equal_nan=True)


def test_readers_give_the_same_result_with_a_token() -> None:
    batch, c, kw = layer(1)
    token = mx.array([3], dtype=mx.int32)
    q, w = mx.random.normal((3, 4, 32)), mx.random.normal((3, 4))
    ids = indexer_rows(batch, q, w, c["pool"], topk=4)
    assert mx.array_equal(indexer_rows(batch, q, w, c["pool"], topk=4, after=token), ids)
    qa, win, sinks = mx.random.normal((3, 4, 32)), mx.random.normal((3, 8, 32)), mx.zeros((4,))
    o = sparse_attention_rows(batch, qa, win, c["pool"], ids, sinks, scale=0.2, ratio=4)
    assert mx.allclose(sparse_attention_rows(batch, qa, win, c["pool"], ids, sinks, scale=0.2, ratio=4, after=token), o)


@pytest.mark.parametrize("op", ["compressor_rows", "indexer_rows", "sparse_attention_rows"])
def test_a_bad_token_names_the_op_and_after(op: str) -> None:
    batch, c, kw = layer(2)
    calls = {
        "compressor_rows": lambda: compressor_rows_inplace(batch, *c.values(), **kw, after=[1]),
        "indexer_rows": lambda: indexer_rows(batch, mx.zeros((3, 4, 32)), mx.zeros((3, 4)), c["pool"], topk=4,
                                             after=np.zeros(1)),  # fmt: skip
        "sparse_attention_rows": lambda: sparse_attention_rows(batch, mx.zeros((3, 4, 32)), mx.zeros((3, 8, 32)),
                                                               c["pool"], None, mx.zeros((4,)), scale=0.2, ratio=4,
                                                               after="token"),  # fmt: skip
    }
    with pytest.raises(ValueError, match=rf"^{op}: after: must be an mx.array or None"):
        calls[op]()


def test_any_array_can_order_a_read() -> None:
    """`after` may be any array (bench chain43 passes a layer's bf16 output): the ordered table keeps its
    values and dtype, even when `after` holds inf / NaN (a `* 0` link would turn those into NaN)."""
    from dsv4_serve.kernels.rows import ordered

    table = mx.array([[3, 1, 4], [1, 5, 9]], mx.int32)
    for after in (mx.array([math.inf, 2.0], mx.bfloat16), mx.array([math.nan], mx.float32), mx.array([7], mx.int32)):
        got = ordered(table, after)
        assert got.dtype == mx.int32
        assert np.array_equal(np.array(got), np.array(table))
