"""copy_into (kernels/cuda/copy_into.py): the decode graphs' copy of a moved pool back into its home buffer, on
MLX's stream. The home keeps its buffer (the graphs' address) and ends up with the source's bytes, for sizes with
and without a 16-byte tail and every pool dtype; the source is never exported."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend

NEEDS_GPU = pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.reshape(-1).view(mx.uint8))


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32, mx.int32, mx.uint8])
@pytest.mark.parametrize("shape", [(1,), (7,), (16,), (33,), (4096,), (1_000_003,), (5, 3, 17), (24, 64, 512)])
def test_copy_into_writes_the_home_in_place(dtype: mx.Dtype, shape: tuple[int, ...]) -> None:
    from dsv4_serve.kernels.cuda.copy_into import copy_into
    from dsv4_serve.kernels.graph.record import address

    rng = np.random.default_rng(len(shape) * 1000 + shape[-1])
    home = mx.array(rng.integers(0, 255, size=shape), dtype=dtype) + 0
    src = mx.array(rng.integers(0, 255, size=shape), dtype=dtype) * 3 + 1  # a new buffer, as an MLX write leaves
    mx.eval(home, src)
    where = address(home)  # the graphs read the home here (exported once, as at capture)
    want = bits(src)  # read before the copy (an export of src, unlike the engine's path: only the test's)
    mx.eval(copy_into(home, src))
    mx.synchronize()
    assert address(home) == where
    assert np.array_equal(bits(home), want)


def test_copy_into_refuses_another_shape_or_dtype() -> None:  # before any launch: runs anywhere
    from dsv4_serve.kernels.cuda.copy_into import copy_into

    a = mx.zeros((4, 8), mx.float32)
    with pytest.raises(ValueError, match="copy_into"):
        copy_into(a, mx.zeros((8, 4), mx.float32))
    with pytest.raises(ValueError, match="copy_into"):
        copy_into(a, mx.zeros((4, 8), mx.bfloat16))
