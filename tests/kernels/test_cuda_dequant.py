"""dequantize_mxfp8's CUDA kernel against mx.dequantize on the GPU, bit for bit: every finite e4m3 code
(normal and subnormal, both signs), scales around 1 and far from it, bf16 and f16 out, ragged row counts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def weight(n: int, k: int, seed: int, lo: int, hi: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # the NaN codes: never in a checkpoint (FP8 weights are finite)
    codes[0, : min(k, 128)] = np.arange(min(k, 128), dtype=np.uint8)  # every subnormal and normal magnitude
    w = mx.array(codes.view(np.uint32).reshape(n, k // 4))
    s = mx.array(rng.integers(lo, hi, (n, k // 32), dtype=np.uint8))
    return w, s


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n,k,lo,hi", [(1, 32, 120, 130), (7, 256, 100, 140), (1024, 4096, 110, 128),
                                       (333, 2048, 1, 254)])
def test_dequantize_mxfp8_is_mx_dequantize(dtype: mx.Dtype, n: int, k: int, lo: int, hi: int) -> None:
    from dsv4_serve.kernels.cuda.dequant import dequantize_mxfp8_cuda

    w, s = weight(n, k, seed=n + k, lo=lo, hi=hi)
    want = mx.dequantize(w, s, group_size=32, bits=8, mode="mxfp8", dtype=dtype)
    got = dequantize_mxfp8_cuda(w, s, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    np.testing.assert_array_equal(np.array(got.view(mx.uint16)), np.array(want.view(mx.uint16)))


def test_dequantize_mxfp8_other_forms_take_mx_dequantize() -> None:
    """f32 out (not a kernel form): the op answers with mx.dequantize's values."""
    from dsv4_serve.kernels.cuda.dequant import dequantize_mxfp8_cuda

    w, s = weight(16, 64, seed=1, lo=120, hi=130)
    want = mx.dequantize(w, s, group_size=32, bits=8, mode="mxfp8", dtype=mx.float32)
    np.testing.assert_array_equal(np.array(dequantize_mxfp8_cuda(w, s, mx.float32)), np.array(want))
