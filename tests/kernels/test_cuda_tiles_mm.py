"""kernels/cuda/tiles_mm.py's f32 products of many rows (bf16 weights on the tensor cores, f32 out) against the
reference's f32 matmul, through the fast ops the model calls (f32_linear_rows / f32_linear_pair_rows), and the
indexer's scores summed in the epilogue (indexer_scores) against their plain twin."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels import matmul as kmatmul
from tests.kernels.agreement import close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def _xw(t: int, k: int, n: int) -> tuple[mx.array, mx.array, mx.array]:
    x = mx.random.normal((t, k)).astype(mx.bfloat16)
    w1 = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
    w2 = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
    return x, w1, w2


@pytest.mark.parametrize(("t", "k", "n"), [(65, 128, 128), (300, 256, 256), (2048, 4096, 1024), (777, 4096, 512)])
def test_f32_linear_rows_many_is_the_f32_matmul(t: int, k: int, n: int) -> None:
    from dsv4_serve.kernels.cuda.matmul import f32_linear_rows_cuda
    from dsv4_serve.kernels.cuda.tiles_mm import f32_linear_many

    x, w, _ = _xw(t, k, n)
    assert f32_linear_many(x, w) is not None  # the shape tiles: the kernel runs
    got = f32_linear_rows_cuda(x, w)
    assert got.dtype == mx.float32 and got.shape == (t, n)
    close(got, kmatmul.f32_linear_rows_reference(x, w), 1e-5)  # exact products, another order of the sum


@pytest.mark.parametrize(("t", "k", "n"), [(65, 128, 64), (300, 256, 192), (2048, 4096, 1024), (1000, 4096, 256)])
def test_f32_linear_pair_rows_many_is_each_f32_matmul(t: int, k: int, n: int) -> None:
    from dsv4_serve.kernels.cuda.matmul import f32_linear_pair_rows_cuda
    from dsv4_serve.kernels.cuda.tiles_mm import f32_linear_pair_many

    x, w1, w2 = _xw(t, k, n)
    assert f32_linear_pair_many(x, w1, w2) is not None
    a, b = f32_linear_pair_rows_cuda(x, w1, w2)
    ra, rb = kmatmul.f32_linear_pair_rows_reference(x, w1, w2)
    close(a, ra, 1e-5)
    close(b, rb, 1e-5)


@pytest.mark.parametrize(("t", "k", "n"), [(64, 256, 256), (100, 200, 256), (100, 256, 40)])
def test_shapes_that_do_not_tile_run_the_reference(t: int, k: int, n: int) -> None:
    """<= 64 rows (the skinny slices' range), K not a multiple of 128, N not of the block's rows."""
    from dsv4_serve.kernels.cuda.matmul import f32_linear_pair_rows_cuda, f32_linear_rows_cuda
    from dsv4_serve.kernels.cuda.tiles_mm import f32_linear_many

    x, w1, w2 = _xw(t, k, n)
    assert f32_linear_many(x, w1) is None
    close(f32_linear_rows_cuda(x, w1), kmatmul.f32_linear_rows_reference(x, w1), 1e-5)
    close(f32_linear_pair_rows_cuda(x, w1, w2)[1], kmatmul.f32_linear_pair_rows_reference(x, w1, w2)[1], 1e-5)


@pytest.mark.parametrize(("b", "n"), [(2, 128), (33, 512), (256, 4096), (3, 1024)])
def test_indexer_scores_is_the_weighted_relu_sum(b: int, n: int) -> None:
    """PAIR 3: a tile a query (64 heads), w * relu summed in the epilogue, against the products + MLX ops of the
    plain twin (the same exact products, another order of the sums)."""
    from dsv4_serve.kernels.cuda.tiles_mm import indexer_scores_cuda
    from dsv4_serve.kernels.indexer_scores import indexer_scores_reference

    q = mx.random.normal((b, 64, 128)).astype(mx.bfloat16)
    w = mx.random.normal((b, 64)) * 0.1
    keys = (mx.random.normal((n, 128)) * 128**-0.5).astype(mx.bfloat16)
    got = indexer_scores_cuda(q, w, keys)
    assert got.dtype == mx.float32 and got.shape == (b, n)
    close(got, indexer_scores_reference(q, w, keys), 1e-5)


def test_indexer_scores_other_heads_take_the_plain_twin() -> None:
    """32 heads (not a tile's 64 rows): the plain twin's values exactly."""
    from dsv4_serve.kernels.cuda.tiles_mm import indexer_scores_cuda
    from dsv4_serve.kernels.indexer_scores import indexer_scores_reference

    q = mx.random.normal((5, 32, 128)).astype(mx.bfloat16)
    w, keys = mx.random.normal((5, 32)), mx.random.normal((256, 128)).astype(mx.bfloat16)
    assert mx.array_equal(indexer_scores_cuda(q, w, keys), indexer_scores_reference(q, w, keys)).item()
