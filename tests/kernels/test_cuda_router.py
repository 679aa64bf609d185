"""The CUDA router top-k kernel vs its plain-MLX reference on the GPU: the same expert set per row and the
same weight per expert (the k ids come in no set order), rows 1..8, V4-Flash's 256 experts and cuts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.router import moe_combine_rows_reference, router_topk_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def by_expert(idx: mx.array, w: mx.array) -> list[dict[int, float]]:
    return [dict(zip(map(int, i), map(float, v), strict=True)) for i, v in zip(np.array(idx), np.array(w), strict=True)]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("experts,k", [(256, 6), (32, 6), (8, 8), (1000, 16)])
@pytest.mark.parametrize("bias_dtype", [mx.float32, mx.bfloat16])
def test_router_topk_matches_reference(rows: int, experts: int, k: int, bias_dtype: mx.Dtype) -> None:
    from dsv4_serve.kernels.cuda.router import router_topk_cuda

    logits = 2 * mx.random.normal((rows, experts))
    bias = (0.3 * mx.random.normal((experts,))).astype(bias_dtype)
    got = by_expert(*router_topk_cuda(logits, bias, k=k, route_scale=1.5))
    want = by_expert(*router_topk_reference(logits, bias, k=k, route_scale=1.5))
    for g, t in zip(got, want, strict=True):
        assert g.keys() == t.keys()
        np.testing.assert_allclose([g[e] for e in t], list(t.values()), rtol=1e-5, atol=1e-7)


def test_more_experts_than_the_kernel_takes_run_the_reference() -> None:
    from dsv4_serve.kernels.cuda.router import MAX_EXPERTS, router_topk_cuda

    logits, bias = mx.random.normal((2, MAX_EXPERTS + 1)), mx.zeros((MAX_EXPERTS + 1,))
    got, want = router_topk_cuda(logits, bias, k=4, route_scale=1.0), router_topk_reference(logits, bias, k=4,
                                                                                             route_scale=1.0)
    assert by_expert(*got) == by_expert(*want)


def test_bad_arguments_are_named() -> None:
    from dsv4_serve.kernels.cuda.router import router_topk_cuda

    with pytest.raises(ValueError, match="^router_topk: k: "):
        router_topk_cuda(mx.zeros((2, 8)), mx.zeros((8,)), k=0, route_scale=1.0)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("k,hidden", [(6, 4096), (1, 100), (8, 64)])
@pytest.mark.parametrize("out_dtype", [mx.bfloat16, mx.float32])
def test_moe_combine_rows_matches_reference(rows: int, k: int, hidden: int, out_dtype: mx.Dtype) -> None:
    from dsv4_serve.kernels.cuda.router import moe_combine_rows_cuda

    pairs = mx.random.normal((rows, k, hidden)).astype(mx.bfloat16)
    w, shared = mx.random.uniform(0, 1, (rows, k)), mx.random.normal((rows, hidden)).astype(mx.bfloat16)
    got = moe_combine_rows_cuda(pairs, w, shared, out_dtype=out_dtype)
    want = moe_combine_rows_reference(pairs, w, shared, out_dtype=out_dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if out_dtype == mx.float32 else 8e-3  # f32 sums in another order; one bf16 rounding each
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=tol,
                               atol=tol)  # fmt: skip
