"""indexer_scores: the lightning indexer's scores of a block of prefill queries over a request's entries,
score[b, n] = sum over heads h of w[b, h] * relu(q[b, h] . keys[n]) in f32 (the decode step's indexer_rows
computes the same per row, with its top-k).

The plain twin multiplies through `kernels.matmul.f32_linear_rows` (bf16 x bf16 in an f32 sum, the reference's
cast f32 matmul; on CUDA the tile GEMM past MANY_ROWS rows), then weights, clamps and sums the [b, heads, n]
products as MLX ops. On CUDA (kernels/cuda/tiles_mm.py `indexer_scores_cuda`) one tile GEMM whose epilogue sums
a query's 64 heads in registers, so the [b, heads, n] f32 products (256 MiB a block) are never written.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels import backend
from dsv4_serve.kernels import matmul as kmatmul


def check_indexer_scores(q: mx.array, w: mx.array, keys: mx.array) -> None:
    if not isinstance(q, mx.array) or q.ndim != 3:
        raise ValueError(f"indexer_scores: q: expected [queries, heads, dim], got {getattr(q, 'shape', q)}")
    b, nh, d = q.shape
    if not isinstance(w, mx.array) or w.shape != (b, nh):
        raise ValueError(f"indexer_scores: w: expected shape {(b, nh)}, got {getattr(w, 'shape', w)}")
    if not isinstance(keys, mx.array) or keys.ndim != 2 or keys.shape[1] != d:
        raise ValueError(f"indexer_scores: keys: expected [entries, {d}], got {getattr(keys, 'shape', keys)}")


SCORE_BYTES = 1 << 28  # the plain twin's [queries, heads, entries] f32 products are built in blocks of this size


def _block(q: mx.array, w: mx.array, keys: mx.array) -> mx.array:
    b, nh, d = q.shape
    # (fewer rows would go through the skinny kernels' 8-row slices: the plain product instead)
    product = kmatmul.f32_linear_rows if b * nh > kmatmul.MANY_ROWS else kmatmul.f32_linear_rows_reference
    dots = product(q.reshape(b * nh, d), keys).reshape(b, nh, keys.shape[0])
    return (w[:, :, None] * mx.maximum(dots, 0.0)).sum(axis=1)


def indexer_scores_reference(q: mx.array, w: mx.array, keys: mx.array) -> mx.array:
    """q [b, heads, d], w [b, heads] f32, keys [n, d] -> [b, n] f32, in blocks of queries whose products stay
    within SCORE_BYTES (a long context's entries)."""
    check_indexer_scores(q, w, keys)
    b, nh, _ = q.shape
    step = max(1, SCORE_BYTES // (nh * keys.shape[0] * 4))
    parts = [_block(q[i : i + step], w[i : i + step], keys) for i in range(0, b, step)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def indexer_scores(q: mx.array, w: mx.array, keys: mx.array) -> mx.array:
    return backend.pick("indexer_scores", indexer_scores_reference)(q, w, keys)
