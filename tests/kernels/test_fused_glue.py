"""The fused glue ops' plain twins against NumPy (f64 arithmetic, the ops' roundings applied where they
round), and their bad arguments named: `rms_rope_rows` (an RMS norm then RoPE) and `moe_combine_post_rows`
(the MoE combine then the mHC post-mix)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve import kernels
from dsv4_serve.kernels import rope_tables


def bf16(a: np.ndarray) -> np.ndarray:
    return np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32), dtype=np.float64)


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def rope_np(y: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved RoPE of the last 2 * half dims: (a, b) -> (a c - b s, a s + b c), rows broadcast over heads."""
    half = cos.shape[-1]
    out = y.copy()
    a, b = y[..., -2 * half :: 2], y[..., -2 * half + 1 :: 2]
    shape = (cos.shape[0],) + (1,) * (y.ndim - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    out[..., -2 * half :: 2], out[..., -2 * half + 1 :: 2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("shape,weighted,norm", [((3, 4, 64), False, True), ((2, 64), True, True),
                                                 ((3, 4, 32), False, False), ((1, 64), False, True)])  # fmt: skip
def test_rms_rope_rows_is_the_norm_then_rope(shape: tuple[int, ...], weighted: bool, norm: bool) -> None:
    rng = np.random.default_rng(1)
    b, d, half = shape[0], shape[-1], 8
    x = mx.array(2 * rng.standard_normal(shape), dtype=mx.bfloat16)
    w = mx.array(1 + 0.3 * rng.standard_normal(d), dtype=mx.float32) if weighted else None
    cos, sin = (mx.array(f(rng.uniform(0, 6, (b, half))), dtype=mx.float32) for f in (np.cos, np.sin))
    c, s = rope_tables(cos, sin, d)
    got = kernels.rms_rope_rows(x, c, s, weight=w, eps=1e-6 if norm else None)
    y = f64(x)
    if norm:
        y = y / np.sqrt((y**2).mean(-1, keepdims=True) + 1e-6) * (f64(w) if weighted else 1.0)
        y = bf16(y)  # the norm's output, in x's dtype
    want = rope_np(y, f64(cos), f64(sin))
    assert got.dtype == mx.bfloat16 and got.shape == shape
    np.testing.assert_allclose(f64(got), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_rms_rope_rows_names_bad_arguments() -> None:
    c = s = mx.zeros((2, 16))
    with pytest.raises(ValueError, match="^rms_rope_rows: x: "):
        kernels.rms_rope_rows(mx.zeros((2, 15)), c, s)
    with pytest.raises(ValueError, match="^rms_rope_rows: s: "):
        kernels.rms_rope_rows(mx.zeros((2, 16)), c, mx.zeros((2, 8)))
    with pytest.raises(ValueError, match="^rms_rope_rows: weight: "):
        kernels.rms_rope_rows(mx.zeros((2, 16)), c, s, weight=mx.ones((16,)))
    with pytest.raises(ValueError, match="^rms_rope_rows: weight: "):
        kernels.rms_rope_rows(mx.zeros((2, 16)), c, s, weight=mx.ones((8,)), eps=1e-6)
    with pytest.raises(ValueError, match="^rms_rope_rows: eps: "):
        kernels.rms_rope_rows(mx.zeros((2, 16)), c, s, eps=-1.0)


def test_moe_combine_post_rows_is_the_combine_then_the_post_mix() -> None:
    rng = np.random.default_rng(2)
    b, k, nc, hid = 3, 6, 4, 64
    pairs = mx.array(rng.standard_normal((b, k, hid)), dtype=mx.bfloat16)
    w = mx.array(rng.uniform(0, 1, (b, k)), dtype=mx.float32)
    shared = mx.array(rng.standard_normal((b, hid)), dtype=mx.bfloat16)
    h = mx.array(rng.standard_normal((b, nc, hid)), dtype=mx.bfloat16)
    post, comb = mx.array(rng.uniform(0, 2, (b, nc))), mx.array(rng.uniform(0, 1, (b, nc, nc)))
    got = kernels.moe_combine_post_rows(pairs, w, shared, h, post, comb)
    y = bf16((f64(pairs) * f64(w)[:, :, None]).sum(1) + f64(shared))  # the combine, in h's dtype
    want = f64(post)[:, :, None] * y[:, None, :] + np.einsum("bjk,bjd->bkd", f64(comb), f64(h))
    assert got.dtype == mx.bfloat16 and got.shape == (b, nc, hid)
    np.testing.assert_allclose(f64(got), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_moe_combine_post_rows_names_bad_arguments() -> None:
    pairs, w, shared = mx.zeros((2, 6, 8)), mx.zeros((2, 6)), mx.zeros((2, 8))
    h, post, comb = mx.zeros((2, 4, 8)), mx.zeros((2, 4)), mx.zeros((2, 4, 4))
    with pytest.raises(ValueError, match="^moe_combine_post_rows: w: "):
        kernels.moe_combine_post_rows(pairs, mx.zeros((2, 5)), shared, h, post, comb)
    with pytest.raises(ValueError, match="^moe_combine_post_rows: shared: "):
        kernels.moe_combine_post_rows(pairs, w, mx.zeros((2, 7)), h, post, comb)
    with pytest.raises(ValueError, match="^moe_combine_post_rows: comb: "):
        kernels.moe_combine_post_rows(pairs, w, shared, h, post, mx.zeros((2, 4, 3)))
    with pytest.raises(ValueError, match="^moe_combine_post_rows: h: "):
        kernels.moe_combine_post_rows(pairs, w, shared, mx.zeros((2, 8)), post, comb)


def test_hc_pre_norm_rows_is_the_pre_mix_then_the_units_norm() -> None:
    rng = np.random.default_rng(3)
    b, nc, hid = 3, 4, 64
    nm = nc * (2 + nc)
    h = mx.array(rng.standard_normal((b, nc, hid)), dtype=mx.bfloat16)
    fn = mx.array(rng.standard_normal((nm, nc * hid)) / np.sqrt(nc * hid), dtype=mx.float32)
    scale, base = mx.array(rng.uniform(0.2, 2.0, 3), dtype=mx.float32), mx.array(rng.standard_normal(nm), mx.float32)
    w = mx.array(1 + 0.3 * rng.standard_normal(hid), dtype=mx.float32)
    kw = dict(iters=20, eps=1e-6, norm_eps=1e-6)
    xn, post, comb = kernels.hc_pre_norm_rows(h, fn, scale, base, w, **kw, x_eps=1e-5)
    x, post0, comb0 = kernels.hc_pre_rows(h, fn, scale, base, **kw)
    assert mx.array_equal(post, post0).item() and mx.array_equal(comb, comb0).item()
    xf = f64(x)
    want = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-5) * f64(w)
    assert xn.dtype == mx.bfloat16 and xn.shape == (b, hid)
    np.testing.assert_allclose(f64(xn), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    with pytest.raises(ValueError, match="^hc_pre_norm_rows: weight: "):
        kernels.hc_pre_norm_rows(h, fn, scale, base, mx.ones((hid + 1,)), **kw, x_eps=1e-5)
    with pytest.raises(ValueError, match="^hc_pre_norm_rows: x_eps: "):
        kernels.hc_pre_norm_rows(h, fn, scale, base, w, **kw, x_eps=-1.0)
    with pytest.raises(ValueError, match="^hc_pre_norm_rows: h: "):
        kernels.hc_pre_norm_rows(h[0], fn, scale, base, w, **kw, x_eps=1e-5)
