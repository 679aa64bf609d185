"""The skinny CUDA matmuls (kernels/cuda/matmul.py) vs their plain-MLX twins on the GPU: random weights in
the release formats, 1..8 rows (9..64 as 8-row groups of one launch), V4-Flash shapes and small ones, experts
chosen with repeats across rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels import matmul as ref
from tests.kernels.agreement import close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def cuda():
    from dsv4_serve.kernels.cuda import matmul

    return matmul


def mxfp(shape: tuple[int, ...], bits: int) -> tuple[mx.array, mx.array]:
    w = mx.random.normal(shape) * shape[-1] ** -0.5
    return mx.quantize(w, group_size=32, bits=bits, mode=f"mxfp{bits}")[:2]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(1024, 4096), (512, 4096), (32768, 1024), (8192, 1024), (4096, 8192), (48, 64)])
def test_qlinear_rows(rows: int, n: int, k: int) -> None:
    w, s = mxfp((n, k), 8)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    got = cuda().qlinear_rows_cuda(x, w, s)
    assert got.dtype == mx.bfloat16
    close(got, ref.qlinear_rows_reference(x, w, s), 1e-2)


@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(1024, 4096), (256, 4096), (32, 4096), (129280, 4096), (64, 32)])
def test_f32_linear_rows_is_the_exact_f32_product(rows: int, n: int, k: int) -> None:
    w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    got = cuda().f32_linear_rows_cuda(x, w)
    assert got.dtype == mx.float32
    close(got, ref.f32_linear_rows_reference(x, w), 1e-5)  # exact products: f32 summation order only


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n1,n2,k", [(1024, 512, 4096), (32768, 8192, 1024), (4096, 8192, 1024), (48, 32, 64),
                                     (40, 24, 64)])  # fmt: skip
def test_qlinear_cat_rows_is_each_product(rows: int, n1: int, n2: int, k: int) -> None:
    """Two mxfp8 weights of one input in one launch (wq_a + wkv; the two wq_b): each product as the reference's
    (40 rows do not tile: each its own call)."""
    (w1, s1), (w2, s2) = mxfp((n1, k), 8), mxfp((n2, k), 8)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    a, b = cuda().qlinear_cat_rows_cuda(x, w1, s1, w2, s2)
    for got, w, s, n in ((a, w1, s1, n1), (b, w2, s2, n2)):
        assert got.dtype == mx.bfloat16 and got.shape == (rows, n)
        close(got, ref.qlinear_rows_reference(x, w, s), 1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(1024, 4096), (512, 4096), (256, 4096), (64, 32)])
def test_f32_linear_pair_rows_is_each_product_alone(rows: int, n: int, k: int) -> None:
    """One launch for a compressor's kv and gate: each product bit-identical to its own launch (the same
    chunks summed in the same order) and within f32 summation order of the reference."""
    w1, w2 = ((mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16) for _ in range(2))
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    a, b = cuda().f32_linear_pair_rows_cuda(x, w1, w2)
    for got, w in ((a, w1), (b, w2)):
        assert got.dtype == mx.float32 and got.shape == (rows, n)
        assert mx.array_equal(got, cuda().f32_linear_rows_cuda(x, w)).item()
        close(got, ref.f32_linear_rows_reference(x, w), 1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("g,n,k", [(8, 1024, 4096), (4, 1024, 4096), (3, 48, 64)])
def test_grouped_qlinear_rows(rows: int, g: int, n: int, k: int) -> None:
    """wo_a as released: group j of each row through mxfp8 weight j in one launch (V4-Flash: 8 groups of 1,024
    rows over 4,096; a rank's 4 of two), as the reference's dequantized einsum."""
    w, s = mxfp((g, n, k), 8)
    x = mx.random.normal((rows, g, k)).astype(mx.bfloat16)
    got = cuda().grouped_qlinear_rows_cuda(x, w, s)
    assert got.dtype == mx.bfloat16 and got.shape == (rows, g, n)
    close(got, ref.grouped_qlinear_rows_reference(x, w, s), 1e-2)
    if rows == 8:  # batch invariance: a row alone gives what it gives among 7 others, bit for bit
        assert mx.array_equal(got[5:6], cuda().grouped_qlinear_rows_cuda(x[5:6], w, s)).item()


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("limit", [None, 10.0, 0.5])
def test_swiglu_rows(rows: int, limit: float | None) -> None:
    (w1, s1), (w3, s3) = mxfp((2048, 4096), 8), mxfp((2048, 4096), 8)
    x = (4 * mx.random.normal((rows, 4096))).astype(mx.bfloat16)
    got = cuda().swiglu_rows_cuda(x, w1, s1, w3, s3, limit=limit)
    close(got, ref.swiglu_rows_reference(x, w1, s1, w3, s3, limit=limit), 2e-2)


def routes(rows: int, k: int, experts: int, seed: int) -> mx.array:
    """Each row's k distinct experts, drawn from few so that rows share some."""
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]).astype(np.uint32))


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("experts,hid,inter", [(8, 4096, 2048), (16, 256, 128)])
def test_experts_rows(rows: int, experts: int, hid: int, inter: int) -> None:
    k = 6
    (w1, s1), (w3, s3) = mxfp((experts, inter, hid), 4), mxfp((experts, inter, hid), 4)
    w2, s2 = mxfp((experts, hid, inter), 4)
    idx = routes(rows, k, experts, rows)
    x = (2 * mx.random.normal((rows, hid))).astype(mx.bfloat16)
    h = cuda().experts_gate_up_rows_cuda(x, idx, w1, s1, w3, s3, limit=10.0)
    want_h = ref.experts_gate_up_rows_reference(x, idx, w1, s1, w3, s3, limit=10.0)
    close(h, want_h, 2e-2)
    y = cuda().experts_down_rows_cuda(want_h, idx, w2, s2)  # the reference's hidden: the down half alone
    close(y, ref.experts_down_rows_reference(want_h, idx, w2, s2), 1e-2)


def test_a_row_gives_what_it_gives_alone() -> None:
    """Batch invariance: row 0 of an 8-row call equals the 1-row call bit for bit (the kernel computes every
    column of its tile the same way whatever else is in it)."""
    w, s = mxfp((4096, 4096), 8)
    x = mx.random.normal((8, 4096)).astype(mx.bfloat16)
    m = cuda()
    assert mx.array_equal(m.qlinear_rows_cuda(x, w, s)[:1], m.qlinear_rows_cuda(x[:1], w, s)).item()
    (w1, s1), (w3, s3) = mxfp((8, 512, 4096), 4), mxfp((8, 512, 4096), 4)
    idx = routes(8, 6, 8, 0)
    full = m.experts_gate_up_rows_cuda(x, idx, w1, s1, w3, s3, limit=10.0)
    one = m.experts_gate_up_rows_cuda(x[3:4], idx[3:4], w1, s1, w3, s3, limit=10.0)
    assert mx.array_equal(full[3:4], one).item()


def by_slices(fn, x: mx.array, *rest, **kw):
    """fn over x's 8-row slices, one launch each, joined: what 9..64 rows ran as before the grouped launch."""
    outs = [fn(x[a:a + 8], *rest, **kw) for a in range(0, x.shape[0], 8)]
    if isinstance(outs[0], tuple):
        return tuple(mx.concatenate(o) for o in zip(*outs, strict=True))
    return mx.concatenate(outs)


def same(got, want) -> None:
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):  # fmt: skip
        assert g.shape == w.shape and g.dtype == w.dtype
        assert mx.array_equal(g, w).item()


@pytest.mark.parametrize("loop", [False, True], ids=["group_a_block", "group_loop"])
@pytest.mark.parametrize("rows", [9, 13, 16, 40, 64])
def test_grouped_rows_are_the_8_row_launches_bit_for_bit(monkeypatch, rows: int, loop: bool) -> None:
    """9..64 rows in one launch of 8-row groups (a group a block, or each block running them in turn:
    DSV4_SKINNY_GROUP_LOOP): every product (dense, CAT, the compressor pair, SwiGLU, both routed-expert halves)
    equals its 8-row launches joined, bit for bit, and stays within the reference's bound."""
    m = cuda()
    monkeypatch.setattr(m, "GROUP_LOOP", loop)
    x = (2 * mx.random.normal((rows, 1024))).astype(mx.bfloat16)
    (w1, s1), (w2, s2), (w3, s3) = mxfp((512, 1024), 8), mxfp((256, 1024), 8), mxfp((512, 1024), 8)
    wb1, wb2 = ((mx.random.normal((256, 1024)) * 1024**-0.5).astype(mx.bfloat16) for _ in range(2))
    same(m.qlinear_rows_cuda(x, w1, s1), by_slices(m.qlinear_rows_cuda, x, w1, s1))
    close(m.qlinear_rows_cuda(x, w1, s1), ref.qlinear_rows_reference(x, w1, s1), 1e-2)
    same(m.f32_linear_rows_cuda(x, wb1), by_slices(m.f32_linear_rows_cuda, x, wb1))
    same(m.qlinear_cat_rows_cuda(x, w1, s1, w2, s2), by_slices(m.qlinear_cat_rows_cuda, x, w1, s1, w2, s2))
    same(m.f32_linear_pair_rows_cuda(x, wb1, wb2), by_slices(m.f32_linear_pair_rows_cuda, x, wb1, wb2))
    same(m.swiglu_rows_cuda(x, w1, s1, w3, s3, limit=10.0),
         by_slices(m.swiglu_rows_cuda, x, w1, s1, w3, s3, limit=10.0))  # fmt: skip
    k, e = 6, 16
    (q1, t1), (q3, t3) = mxfp((e, 256, 1024), 4), mxfp((e, 256, 1024), 4)
    q2, t2 = mxfp((e, 1024, 256), 4)
    idx = routes(rows, k, e, rows)
    h = m.experts_gate_up_rows_cuda(x, idx, q1, t1, q3, t3, limit=10.0)
    hs = mx.concatenate([m.experts_gate_up_rows_cuda(x[a:a + 8], idx[a:a + 8], q1, t1, q3, t3, limit=10.0)
                         for a in range(0, rows, 8)])  # fmt: skip
    same(h, hs)
    close(h, ref.experts_gate_up_rows_reference(x, idx, q1, t1, q3, t3, limit=10.0), 2e-2)
    y = m.experts_down_rows_cuda(hs, idx, q2, t2)
    same(y, mx.concatenate([m.experts_down_rows_cuda(hs[a:a + 8], idx[a:a + 8], q2, t2) for a in range(0, rows, 8)]))


def test_more_rows_and_other_dtypes_run_the_reference() -> None:
    w, s = mxfp((1024, 4096), 8)
    for x in (mx.random.normal((65, 4096)).astype(mx.bfloat16), mx.random.normal((2, 4096))):
        assert mx.array_equal(cuda().qlinear_rows_cuda(x, w, s), ref.qlinear_rows_reference(x, w, s)).item()
