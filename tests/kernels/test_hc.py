"""hc_pre_mix's plain-MLX reference against an independent float64 NumPy transcription of the spec's
mHC pre-mix (sigmoids, row softmax + eps, Sinkhorn with eps in the denominators, the weighted stream
sum), and its argument checks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve import kernels
from dsv4_serve.kernels.hc import hc_pre_mix_reference


def numpy_pre_mix(m, scale, base, h, iters, eps):
    m, scale, base, h = (np.asarray(a, np.float64) for a in (m, scale, base, h))
    b, nc, _ = h.shape
    z = m * np.concatenate([np.full(nc, scale[0]), np.full(nc, scale[1]), np.full(nc * nc, scale[2])]) + base
    pre = 1 / (1 + np.exp(-z[:, :nc])) + eps
    post = 2 / (1 + np.exp(-z[:, nc : 2 * nc]))
    c = z[:, 2 * nc :].reshape(b, nc, nc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    x = (pre[:, :, None] * h).sum(1)
    return x, post, c


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("nc,iters", [(1, 1), (2, 5), (4, 20)])
def test_reference_matches_numpy(rows: int, nc: int, iters: int) -> None:
    rng = np.random.default_rng(rows * 10 + nc)
    nm = nc * (2 + nc)
    m = rng.normal(size=(rows, nm)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    base = rng.normal(size=nm).astype(np.float32)
    h = rng.normal(size=(rows, nc, 48)).astype(np.float32)
    got = hc_pre_mix_reference(mx.array(m), mx.array(scale), mx.array(base), mx.array(h), iters=iters, eps=1e-6)
    want = numpy_pre_mix(m, scale, base, h, iters, 1e-6)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(g), w, rtol=2e-5, atol=2e-6)
    assert got[0].dtype == mx.float32 and got[1].shape == (rows, nc) and got[2].shape == (rows, nc, nc)


def test_stream_sum_keeps_the_stream_dtype() -> None:
    h = mx.ones((2, 4, 8), mx.bfloat16)
    x, post, comb = kernels.hc_pre_mix(mx.zeros((2, 24)), mx.ones((3,)), mx.zeros((24,)), h, iters=3, eps=0.0)
    assert x.dtype == mx.bfloat16 and post.dtype == mx.float32 and comb.dtype == mx.float32
    np.testing.assert_allclose(np.array(x.astype(mx.float32)), 2.0)  # 4 streams x sigmoid(0) = 0.5


@pytest.mark.parametrize(
    "kw,arg",
    [
        (dict(m=mx.zeros((2, 23))), "m"),
        (dict(m=mx.zeros((2, 24), mx.int32)), "m"),
        (dict(scale=mx.ones((2,))), "scale"),
        (dict(base=mx.zeros((23,))), "base"),
        (dict(h=mx.zeros((2, 4))), "h"),
        (dict(h=np.zeros((2, 4, 8))), "h"),
        (dict(iters=0), "iters"),
        (dict(iters=2.0), "iters"),
        (dict(eps=-1.0), "eps"),
        (dict(eps="x"), "eps"),
    ],
)
def test_bad_arguments_are_named(kw: dict, arg: str) -> None:
    args = dict(m=mx.zeros((2, 24)), scale=mx.ones((3,)), base=mx.zeros((24,)), h=mx.zeros((2, 4, 8)), iters=2,
                eps=1e-6) | kw  # fmt: skip
    with pytest.raises(ValueError, match=f"^hc_pre_mix: {arg}: "):
        kernels.hc_pre_mix(**args)


def test_hc_pre_rows_is_the_rms_the_logits_and_the_pre_mix() -> None:
    """Without a fast path, kernels.hc_pre_rows is its composition: the input RMS in f32, m = rms(h) @ fn.T
    and the pre-mix, checked against float64 NumPy for the logits' part (post)."""
    from dsv4_serve import kernels

    b, nc, hid = 3, 4, 16
    nm = nc * (2 + nc)
    h = mx.random.normal((b, nc, hid))
    fn = mx.random.normal((nm, nc * hid))
    scale, base = mx.random.uniform(0.5, 1.5, (3,)), mx.random.normal((nm,))
    x, post, comb = kernels.hc_pre_rows(h, fn, scale, base, iters=5, eps=1e-6, norm_eps=1e-6)
    hf = np.array(h, dtype=np.float64).reshape(b, -1)
    m = hf / np.sqrt((hf * hf).mean(-1, keepdims=True) + 1e-6) @ np.array(fn, dtype=np.float64).T
    z = m[:, nc : 2 * nc] * float(scale[1]) + np.array(base, dtype=np.float64)[nc : 2 * nc]
    np.testing.assert_allclose(np.array(post), 2 / (1 + np.exp(-z)), rtol=1e-5)
    assert x.shape == (b, hid) and comb.shape == (b, nc, nc)


def test_hc_pre_rows_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="^hc_pre_rows: fn: "):
        kernels.hc.check_hc_pre_rows(mx.zeros((2, 4, 8)), mx.zeros((24, 31)), mx.ones((3,)), mx.zeros((24,)),
                                     iters=2, eps=1e-6, norm_eps=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="^hc_pre_rows: norm_eps: "):
        kernels.hc.check_hc_pre_rows(mx.zeros((2, 4, 8)), mx.zeros((24, 32)), mx.ones((3,)), mx.zeros((24,)),
                                     iters=2, eps=1e-6, norm_eps=-1.0)  # fmt: skip
