"""kernels.router's plain twin against float64 NumPy, and bad arguments named."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve import kernels
from dsv4_serve.kernels.router import moe_combine_rows_reference, router_topk_reference


def numpy_router(logits: np.ndarray, bias: np.ndarray, k: int, scale: float) -> list[dict[int, float]]:
    s = np.sqrt(np.logaddexp(logits, 0.0))
    out = []
    for row, b in zip(s, s + bias, strict=True):
        top = np.argsort(-b, kind="stable")[:k]
        out.append({int(e): float(row[e] / row[top].sum() * scale) for e in top})
    return out


def as_sets(idx: mx.array, w: mx.array) -> list[dict[int, float]]:
    return [dict(zip(map(int, i), map(float, v), strict=True)) for i, v in zip(np.array(idx), np.array(w), strict=True)]


@pytest.mark.parametrize("rows,experts,k", [(1, 16, 6), (8, 256, 6), (3, 32, 1), (5, 8, 8)])
def test_router_topk_picks_the_biased_top_k_and_weighs_them(rows: int, experts: int, k: int) -> None:
    rng = np.random.default_rng(rows * experts + k)
    logits = rng.normal(size=(rows, experts)).astype(np.float32)
    bias = (0.3 * rng.normal(size=experts)).astype(np.float32)
    idx, w = kernels.router_topk(mx.array(logits), mx.array(bias), k=k, route_scale=1.5)
    assert idx.dtype == mx.uint32 and w.dtype == mx.float32 and idx.shape == w.shape == (rows, k)
    got, want = as_sets(idx, w), numpy_router(logits, bias, k, 1.5)
    for g, t in zip(got, want, strict=True):
        assert g.keys() == t.keys()
        np.testing.assert_allclose([g[e] for e in t], list(t.values()), rtol=1e-5)


def test_bad_arguments_are_named() -> None:
    lg, b = mx.zeros((2, 8)), mx.zeros((8,))
    with pytest.raises(ValueError, match="^router_topk: logits: "):
        router_topk_reference(lg.astype(mx.bfloat16), b, k=2, route_scale=1.0)
    with pytest.raises(ValueError, match="^router_topk: bias: "):
        router_topk_reference(lg, mx.zeros((7,)), k=2, route_scale=1.0)
    with pytest.raises(ValueError, match="^router_topk: k: "):
        router_topk_reference(lg, b, k=9, route_scale=1.0)
    with pytest.raises(ValueError, match="^router_topk: route_scale: "):
        router_topk_reference(lg, b, k=2, route_scale="1")


@pytest.mark.parametrize("out_dtype", [mx.float32, mx.bfloat16])
def test_moe_combine_rows_weighs_the_pairs_and_adds_the_shared_output(out_dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(0)
    pairs, shared = (mx.array(rng.normal(size=s).astype(np.float32)).astype(mx.bfloat16) for s in ((3, 6, 40), (3, 40)))
    w = mx.array(rng.random((3, 6)).astype(np.float32))
    got = kernels.moe_combine_rows(pairs, w, shared, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (3, 40)
    f64 = [np.array(a.astype(mx.float32), dtype=np.float64) for a in (pairs, w, shared)]
    want = np.einsum("bkh,bk->bh", f64[0], f64[1]) + f64[2]
    ulp = 2.0**-8 if out_dtype == mx.bfloat16 else 1e-5
    np.testing.assert_array_less(np.abs(np.array(got.astype(mx.float32)) - want), ulp * np.abs(want) + 1e-5)


def test_moe_combine_rows_bad_arguments_are_named() -> None:
    p, w, s = mx.zeros((2, 6, 8)), mx.zeros((2, 6)), mx.zeros((2, 8))
    with pytest.raises(ValueError, match="^moe_combine_rows: w: "):
        moe_combine_rows_reference(p, mx.zeros((2, 5)), s, out_dtype=mx.float32)
    with pytest.raises(ValueError, match="^moe_combine_rows: shared: "):
        moe_combine_rows_reference(p, w, mx.zeros((2, 9)), out_dtype=mx.float32)
    with pytest.raises(ValueError, match="^moe_combine_rows: pairs: "):
        moe_combine_rows_reference(mx.zeros((2, 8)), w, s, out_dtype=mx.float32)
    with pytest.raises(ValueError, match="^moe_combine_rows: out_dtype: "):
        moe_combine_rows_reference(p, w, s, out_dtype=mx.int32)
