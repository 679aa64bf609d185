"""The fused glue kernels vs their plain-MLX twins on the GPU: `rms_rope_rows` (q's heads, the window kv,
the indexer's q, the output's de-rotation) and `moe_combine_post_rows`, rows 1..8 at V4-Flash's widths."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.kernels import backend, rope_tables
from dsv4_serve.kernels.norms import hc_post_rows_reference
from dsv4_serve.kernels.rope import rms_rope_rows_reference
from dsv4_serve.kernels.router import moe_combine_post_rows_reference, moe_combine_rows_reference
from tests.kernels.agreement import close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def tables(rows: int, d: int, sign: float = 1.0) -> tuple[mx.array, mx.array]:
    ang = mx.random.uniform(0, 100, (rows, 32))
    c, s = rope_tables(mx.cos(ang), mx.sin(ang), d)
    return c, sign * s


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("heads,d,norm,weight", [(64, 512, True, None), (0, 512, True, mx.bfloat16),
                                                 (0, 512, True, mx.float32), (64, 128, False, None),
                                                 (64, 512, False, None)])  # fmt: skip
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_rms_rope_rows(rows: int, heads: int, d: int, norm: bool, weight, dtype: mx.Dtype) -> None:
    from dsv4_serve.kernels.cuda.rope import rms_rope_rows_cuda

    x = (3 * mx.random.normal((rows, heads, d) if heads else (rows, d))).astype(dtype)
    w = (1 + 0.3 * mx.random.normal((d,))).astype(weight) if weight is not None else None
    c, s = tables(rows, d, -1.0 if not norm else 1.0)
    eps = 1e-6 if norm else None
    got = rms_rope_rows_cuda(x, c, s, weight=w, eps=eps)
    assert got.dtype == dtype and got.shape == x.shape
    close(got, rms_rope_rows_reference(x, c, s, weight=w, eps=eps), 1e-2 if dtype == mx.bfloat16 else 1e-5)


@pytest.mark.parametrize("shape,norm,weight", [((80, 64, 512), True, None), ((5000, 512), True, mx.bfloat16),
                                               ((4100, 512), True, mx.float32), ((80, 64, 128), False, None),
                                               ((97, 64, 512), False, None), ((70, 64, 1024), True, None)])  # fmt: skip
def test_rms_rope_rows_many_vectors(shape: tuple[int, ...], norm: bool, weight) -> None:
    """Prefill's vector counts (past MANY_VECTORS): a warp a vector, 16-byte loads; D 128 .. 1024."""
    import dsv4_serve.kernels.cuda.rope as kp

    x = (3 * mx.random.normal(shape)).astype(mx.bfloat16)
    assert x.size // shape[-1] > kp.MANY_VECTORS
    w = (1 + 0.3 * mx.random.normal((shape[-1],))).astype(weight) if weight is not None else None
    c, s = tables(shape[0], shape[-1], -1.0 if not norm else 1.0)
    eps = 1e-6 if norm else None
    got = kp.rms_rope_rows_cuda(x, c, s, weight=w, eps=eps)
    assert got.dtype == mx.bfloat16 and got.shape == x.shape
    close(got, rms_rope_rows_reference(x, c, s, weight=w, eps=eps), 1e-2)


def test_a_row_gives_what_it_gives_alone() -> None:
    from dsv4_serve.kernels.cuda.rope import rms_rope_rows_cuda

    x = mx.random.normal((8, 64, 512)).astype(mx.bfloat16)
    c, s = tables(8, 512)
    batched = rms_rope_rows_cuda(x, c, s, eps=1e-6)
    for r in (0, 5, 7):
        alone = rms_rope_rows_cuda(x[r : r + 1], c[r : r + 1], s[r : r + 1], eps=1e-6)
        assert mx.array_equal(batched[r : r + 1], alone).item()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("nc,hidden", [(4, 4096), (2, 100)])
def test_moe_combine_post_rows(rows: int, nc: int, hidden: int) -> None:
    from dsv4_serve.kernels.cuda.norms import hc_post_rows_cuda
    from dsv4_serve.kernels.cuda.router import moe_combine_post_rows_cuda, moe_combine_rows_cuda

    pairs = mx.random.normal((rows, 6, hidden)).astype(mx.bfloat16)
    w = mx.random.uniform(0, 1, (rows, 6))
    shared = mx.random.normal((rows, hidden)).astype(mx.bfloat16)
    h = mx.random.normal((rows, nc, hidden)).astype(mx.bfloat16)
    post, comb = mx.random.uniform(0, 2, (rows, nc)), mx.random.uniform(0, 1, (rows, nc, nc))
    got = moe_combine_post_rows_cuda(pairs, w, shared, h, post, comb)
    assert got.dtype == h.dtype and got.shape == h.shape
    close(got, moe_combine_post_rows_reference(pairs, w, shared, h, post, comb), 1e-2)
    # the two kernels it replaces, in turn: the same arithmetic
    y = moe_combine_rows_cuda(pairs, w, shared, out_dtype=h.dtype)
    close(got, hc_post_rows_cuda(y, h, post, comb), 1e-2)
    close(got, hc_post_rows_reference(moe_combine_rows_reference(pairs, w, shared, out_dtype=h.dtype), h, post,
                                      comb), 1e-2)  # fmt: skip
