"""The CUDA norm and mHC post-mix kernels vs their plain-MLX references on the GPU (random data, rows 1..8,
the model's widths), their fallbacks, and the tiny model's decode with them vs without."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.norms import hc_post_rows_reference, rms_norm_rows_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def cuda():
    from dsv4_serve.kernels.cuda import norms

    return norms


def close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    tol = 1e-5 if dtype == mx.float32 else 8e-3  # one rounding each: at most an ulp apart in bf16
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 300])
@pytest.mark.parametrize("dim", [512, 1024, 4096, 16384, 100])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("weighted,out", [(True, None), (False, mx.float32), (False, None)])
def test_rms_norm_rows_matches_reference(rows: int, dim: int, dtype: mx.Dtype, weighted: bool, out) -> None:
    x = (2 * mx.random.normal((rows, dim))).astype(dtype)
    w = (1 + 0.3 * mx.random.normal((dim,))).astype(dtype) if weighted else None
    got = cuda().rms_norm_rows_cuda(x, w, eps=1e-6, out_dtype=out)
    close(got, rms_norm_rows_reference(x, w, eps=1e-6, out_dtype=out), out or dtype)


def test_rms_norm_rows_keeps_leading_axes_and_f32_weights() -> None:
    x = mx.random.normal((3, 4, 512)).astype(mx.bfloat16)
    w = mx.random.normal((512,))
    close(cuda().rms_norm_rows_cuda(x, w, eps=1e-6), rms_norm_rows_reference(x, w, eps=1e-6), mx.bfloat16)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 64])
@pytest.mark.parametrize("nc,hidden", [(4, 4096), (2, 64), (8, 100)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_hc_post_rows_matches_reference(rows: int, nc: int, hidden: int, dtype: mx.Dtype) -> None:
    y = mx.random.normal((rows, hidden)).astype(dtype)
    h = mx.random.normal((rows, nc, hidden)).astype(dtype)
    post, comb = mx.random.uniform(0, 2, (rows, nc)), mx.random.uniform(0, 1, (rows, nc, nc))
    close(cuda().hc_post_rows_cuda(y, h, post, comb), hc_post_rows_reference(y, h, post, comb), dtype)


def test_hc_post_rows_other_dtypes_run_the_reference() -> None:
    y, h = mx.zeros((2, 8)), mx.ones((2, 4, 8))
    post, comb = mx.ones((2, 4), dtype=mx.float16), mx.ones((2, 4, 4))
    got = cuda().hc_post_rows_cuda(y, h, post, comb)
    assert mx.array_equal(got, hc_post_rows_reference(y, h, post, comb)).item()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="^rms_norm_rows: weight: "):
        cuda().rms_norm_rows_cuda(mx.zeros((2, 8)), mx.ones((7,)), eps=1e-6)
    with pytest.raises(ValueError, match="^hc_post_rows: post: "):
        cuda().hc_post_rows_cuda(mx.zeros((2, 8)), mx.zeros((2, 4, 8)), mx.zeros((2, 3)), mx.zeros((2, 4, 4)))


def test_tiny_model_decode_with_the_glue_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decode of the tiny f32 model: the same logits with the glue kernels (norms, mHC pre- and
    post-mix, router, MoE combine) as with the references."""
    from dsv4_serve.kernels.cuda.hc_fused import hc_pre_rows_cuda
    from dsv4_serve.kernels.cuda.router import moe_combine_rows_cuda, router_topk_cuda
    from dsv4_serve.model.state import StatePools
    from dsv4_serve.model.tiny import tiny_model

    def run() -> np.ndarray:
        model, args, _ = tiny_model(seed=0)  # fresh: compiled segments trace the current op choice
        pools = StatePools(args, max_slots=2, max_positions=64, page_size=8)
        a, b = pools.alloc(64), pools.alloc(64)
        return np.stack([np.array(model.decode(pools, [a, b], [3 + i, 100 + 2 * i], [i, i])) for i in range(20)])

    for op in ("rms_norm_rows", "hc_post_rows", "router_topk", "hc_pre_rows", "moe_combine_rows"):
        monkeypatch.delitem(backend._fast, op, raising=False)
    want = run()
    monkeypatch.setitem(backend._fast, "rms_norm_rows", cuda().rms_norm_rows_cuda)
    monkeypatch.setitem(backend._fast, "hc_post_rows", cuda().hc_post_rows_cuda)
    monkeypatch.setitem(backend._fast, "router_topk", router_topk_cuda)
    monkeypatch.setitem(backend._fast, "hc_pre_rows", hc_pre_rows_cuda)
    monkeypatch.setitem(backend._fast, "moe_combine_rows", moe_combine_rows_cuda)
    got = run()
    assert np.max(np.abs(got - want)) <= 1e-4
