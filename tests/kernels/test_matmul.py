"""kernels.matmul's plain twins (what the CPU and prefill run): the products the model ran before the
fast path, and bad arguments named."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import matmul as km


def mxfp(shape: tuple[int, ...], bits: int):
    w = mx.random.normal(shape) * shape[-1] ** -0.5
    q, s = mx.quantize(w, group_size=32, bits=bits, mode=f"mxfp{bits}")[:2]
    return q, s, mx.dequantize(q, s, group_size=32, bits=bits, mode=f"mxfp{bits}")


def test_qlinear_rows_is_the_dequantized_product() -> None:
    q, s, w = mxfp((64, 128), 8)
    x = mx.random.normal((3, 128))
    np.testing.assert_allclose(np.array(km.qlinear_rows(x, q, s)), np.array(x @ w.T), rtol=1e-4, atol=1e-4)


def test_qlinear_cat_rows_is_each_dequantized_product() -> None:
    q1, s1, w1 = mxfp((64, 128), 8)
    q2, s2, w2 = mxfp((48, 128), 8)
    x = mx.random.normal((3, 128))
    a, b = km.qlinear_cat_rows(x, q1, s1, q2, s2)
    assert a.shape == (3, 64) and b.shape == (3, 48)
    for got, w in ((a, w1), (b, w2)):
        np.testing.assert_allclose(np.array(got), np.array(x @ w.T), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, km.SLICE_ROWS + 3, km.MANY_ROWS + 1])
def test_grouped_qlinear_rows_is_each_group_through_its_weight(rows: int) -> None:
    """wo_a's product: group g of x through mxfp8 weight g, as the einsum of the dequantized weights (the
    float model's), at decode's rows, a short prompt's (8-row slices on CUDA) and prefill's."""
    q, s, w = mxfp((3 * 64, 128), 8)
    x = mx.random.normal((rows, 3, 128))
    got = km.grouped_qlinear_rows(x, q.reshape(3, 64, -1), s.reshape(3, 64, -1))
    assert got.shape == (rows, 3, 64) and got.dtype == x.dtype
    want = mx.einsum("bgi,gri->bgr", x, w.reshape(3, 64, 128))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    for g in range(3):  # each group alone is the plain mxfp8 product
        np.testing.assert_allclose(np.array(got[:, g]), np.array(km.qlinear_rows_reference(
            x[:, g], q[64 * g: 64 * (g + 1)], s[64 * g: 64 * (g + 1)])), rtol=1e-4, atol=1e-4)  # fmt: skip


def test_f32_linear_rows_upcasts_the_weight() -> None:
    w = mx.random.normal((16, 32)).astype(mx.bfloat16)
    x = mx.random.normal((2, 32)).astype(mx.bfloat16)
    got = km.f32_linear_rows(x, w)
    assert got.dtype == mx.float32
    assert mx.array_equal(got, x.astype(mx.float32) @ w.astype(mx.float32).T).item()


def test_f32_linear_pair_rows_is_two_upcast_products() -> None:
    w1, w2 = (mx.random.normal((16, 32)).astype(mx.bfloat16) for _ in range(2))
    x = mx.random.normal((3, 32)).astype(mx.bfloat16)
    a, b = km.f32_linear_pair_rows(x, w1, w2)
    for got, w in ((a, w1), (b, w2)):
        assert got.dtype == mx.float32
        assert mx.array_equal(got, x.astype(mx.float32) @ w.astype(mx.float32).T).item()


def test_swiglu_rows_clamps_as_the_model() -> None:
    q1, s1, w1 = mxfp((32, 64), 8)
    q3, s3, w3 = mxfp((32, 64), 8)
    x = 8 * mx.random.normal((2, 64))
    g, u = x @ w1.T, x @ w3.T
    want = (mx.minimum(g, 1.0) * mx.sigmoid(mx.minimum(g, 1.0))) * mx.clip(u, -1.0, 1.0)
    np.testing.assert_allclose(np.array(km.swiglu_rows(x, q1, s1, q3, s3, limit=1.0)), np.array(want), rtol=1e-3,
                               atol=1e-3)  # fmt: skip


def test_experts_rows_route_each_pair_through_its_expert() -> None:
    e, hid, inter = 4, 64, 32
    q1, s1, w1 = mxfp((e, inter, hid), 4)
    q3, s3, w3 = mxfp((e, inter, hid), 4)
    q2, s2, w2 = mxfp((e, hid, inter), 4)
    idx = mx.array([[0, 2], [2, 3], [1, 0]], dtype=mx.uint32)
    x = mx.random.normal((3, hid))
    h = km.experts_gate_up_rows(x, idx, q1, s1, q3, s3, limit=None)
    y = km.experts_down_rows(h, idx, q2, s2)
    assert h.shape == (3, 2, inter) and y.shape == (3, 2, hid)
    for b in range(3):
        for j in range(2):
            ex = int(idx[b, j].item())
            g, u = x[b] @ w1[ex].T, x[b] @ w3[ex].T
            want_h = g * mx.sigmoid(g) * u
            np.testing.assert_allclose(np.array(h[b, j]), np.array(want_h), rtol=1e-3, atol=1e-3)
            np.testing.assert_allclose(np.array(y[b, j]), np.array(h[b, j] @ w2[ex].T), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("call,match", [
    (lambda: km.qlinear_rows(mx.zeros((2, 64)), mx.zeros((8, 16), mx.uint32), mx.zeros((8, 1), mx.uint8)),
     "^qlinear_rows: scales: "),
    (lambda: km.qlinear_rows(mx.zeros((2, 64)), mx.zeros((8, 8)), mx.zeros((8, 2), mx.uint8)), "^qlinear_rows: w: "),
    (lambda: km.f32_linear_rows(mx.zeros((2, 64)), mx.zeros((8, 32))), "^f32_linear_rows: w: "),
    (lambda: km.qlinear_cat_rows(mx.zeros((2, 64)), mx.zeros((8, 16), mx.uint32), mx.zeros((8, 2), mx.uint8),
                                 mx.zeros((8, 8), mx.uint32), mx.zeros((8, 2), mx.uint8)), "^qlinear_cat_rows: w: "),
    (lambda: km.f32_linear_rows([1.0], mx.zeros((8, 32))), "^f32_linear_rows: x: "),
    (lambda: km.f32_linear_pair_rows(mx.zeros((2, 32)), mx.zeros((8, 32)), mx.zeros((4, 32))),
     "^f32_linear_pair_rows: w2: "),
    (lambda: km.f32_linear_pair_rows(mx.zeros((2, 32)), mx.zeros((8, 16)), mx.zeros((8, 16))),
     "^f32_linear_pair_rows: w: "),
    (lambda: km.experts_down_rows(mx.zeros((2, 64)), mx.zeros((2, 3), mx.uint32), mx.zeros((4, 8, 8), mx.uint32),
                                  mx.zeros((4, 8, 2), mx.uint8)), "^experts_down_rows: x: "),
    (lambda: km.experts_gate_up_rows(mx.zeros((2, 64)), mx.zeros((2,), mx.uint32), mx.zeros((4, 8, 8), mx.uint32),
                                     mx.zeros((4, 8, 2), mx.uint8), mx.zeros((4, 8, 8), mx.uint32),
                                     mx.zeros((4, 8, 2), mx.uint8), limit=None), "^experts_gate_up_rows: idx: "),
    (lambda: km.grouped_qlinear_rows(mx.zeros((2, 64)), mx.zeros((2, 8, 16), mx.uint32),
                                     mx.zeros((2, 8, 2), mx.uint8)), "^grouped_qlinear_rows: x: "),
    (lambda: km.grouped_qlinear_rows(mx.zeros((2, 3, 64)), mx.zeros((2, 8, 16), mx.uint32),
                                     mx.zeros((2, 8, 2), mx.uint8)), "^grouped_qlinear_rows: w: "),
])  # fmt: skip
def test_bad_arguments_are_named(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def scaled_err(got: mx.array, want: np.ndarray) -> float:
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    return float(np.abs(g - want).max() / np.abs(want).max())


@pytest.mark.parametrize("rows", [km.MANY_ROWS + 1, 100, 300])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_prefill_rows_dequantize_then_multiply(rows: int, dtype: mx.Dtype) -> None:
    """Past MANY_ROWS the weight is dequantized once and multiplied plainly: within the output dtype's
    rounding of the exact product (float64 of the dequantized weights), and no further from it than MLX's
    quantized matmul (the reference; on the CPU it is the less exact of the two), dense and shared expert."""
    q1, s1, w1 = mxfp((96, 128), 8)
    q3, s3, w3 = mxfp((96, 128), 8)
    x = mx.random.normal((rows, 128)).astype(dtype)
    x64 = np.array(x.astype(mx.float32), dtype=np.float64)
    w1_64, w3_64 = (np.array(w.astype(mx.float32), dtype=np.float64) for w in (w1, w3))
    tol = 8e-3 if dtype == mx.bfloat16 else 1e-5
    got = km.qlinear_rows(x, q1, s1)
    assert got.dtype == dtype and got.shape == (rows, 96)
    exact = x64 @ w1_64.T
    assert scaled_err(got, exact) <= min(tol, scaled_err(km.qlinear_rows_reference(x, q1, s1), exact) + 1e-6)
    g = np.minimum(exact, 2.0)
    exact = g / (1 + np.exp(-g)) * np.clip(x64 @ w3_64.T, -2.0, 2.0)
    got = km.swiglu_rows(x, q1, s1, q3, s3, limit=2.0)
    assert got.dtype == dtype
    ref = km.swiglu_rows_reference(x, q1, s1, q3, s3, limit=2.0)
    assert scaled_err(got, exact) <= min(2 * tol, scaled_err(ref, exact) + 1e-6)


def test_prefill_rows_name_a_bad_weight() -> None:
    q, s, _ = mxfp((96, 128), 8)
    with pytest.raises(ValueError, match="qlinear_rows: scales"):
        km.qlinear_rows(mx.zeros((km.MANY_ROWS + 1, 128)), q, s[:, :2])
