"""kernels.norms' plain twins against float64 NumPy, and bad arguments named."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve import kernels
from dsv4_serve.kernels.norms import hc_post_rows_reference, rms_norm_rows_reference


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("out_dtype", [None, mx.float32])
def test_rms_norm_rows_is_one_rounding_of_the_f32_product(dtype: mx.Dtype, weighted: bool, out_dtype) -> None:
    x = (3 * mx.random.normal((5, 2, 96))).astype(dtype)
    w = (1 + 0.5 * mx.random.normal((96,))).astype(dtype) if weighted else None
    got = kernels.rms_norm_rows(x, w, eps=1e-6, out_dtype=out_dtype)
    assert got.dtype == (out_dtype or dtype) and got.shape == x.shape
    xs = f64(x)
    want = xs / np.sqrt((xs * xs).mean(axis=-1, keepdims=True) + 1e-6) * (f64(w) if weighted else 1.0)
    # the exact value rounded once: within half an ulp of the output dtype (plus f32 arithmetic)
    ulp = 2.0**-8 if got.dtype == mx.bfloat16 else 2.0**-22
    np.testing.assert_array_less(np.abs(f64(got) - want), ulp * np.abs(want) + 1e-6)


def test_hc_post_rows_mixes_the_streams_in_f32() -> None:
    b, nc, hid = 3, 4, 64
    y = mx.random.normal((b, hid)).astype(mx.bfloat16)
    h = mx.random.normal((b, nc, hid)).astype(mx.bfloat16)
    post, comb = mx.random.uniform(0, 2, (b, nc)), mx.random.uniform(0, 1, (b, nc, nc))
    got = kernels.hc_post_rows(y, h, post, comb)
    assert got.dtype == mx.bfloat16 and got.shape == (b, nc, hid)
    want = f64(post)[:, :, None] * f64(y)[:, None, :] + np.einsum("bjk,bjd->bkd", f64(comb), f64(h))
    np.testing.assert_array_less(np.abs(f64(got) - want), 2.0**-8 * np.abs(want) + 1e-5)


def test_bad_arguments_are_named() -> None:
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError, match="^rms_norm_rows: weight: "):
        rms_norm_rows_reference(x, mx.ones((7,)), eps=1e-6)
    with pytest.raises(ValueError, match="^rms_norm_rows: x: "):
        rms_norm_rows_reference(x.astype(mx.int32), None, eps=1e-6)
    with pytest.raises(ValueError, match="^rms_norm_rows: eps: "):
        rms_norm_rows_reference(x, None, eps=-1.0)
    with pytest.raises(ValueError, match="^rms_norm_rows: out_dtype: "):
        rms_norm_rows_reference(x, None, eps=1e-6, out_dtype=mx.int32)
    h = mx.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="^hc_post_rows: comb: "):
        hc_post_rows_reference(x, h, mx.zeros((2, 4)), mx.zeros((2, 4, 3)))
    with pytest.raises(ValueError, match="^hc_post_rows: y: "):
        hc_post_rows_reference(mx.zeros((2, 9)), h, mx.zeros((2, 4)), mx.zeros((2, 4, 4)))
    with pytest.raises(ValueError, match="^hc_post_rows: h: "):
        hc_post_rows_reference(x, [0.0], mx.zeros((2, 4)), mx.zeros((2, 4, 4)))
