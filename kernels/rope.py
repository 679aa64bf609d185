"""Interleaved RoPE on the last `rd` dims (DeepSeek-V4 layout `[nope | rope]`, spec 2.3).

Pairs are `(x[D-rd+2i], x[D-rd+2i+1])`, rotated as `(a, b) -> (a cos - b sin, a sin + b cos)`.
Not NeoX half-split, not the first dims.
"""

from __future__ import annotations

import mlx.core as mx


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the last `rd = 2 * cos.shape[-1]` dims of `x [B, ..., D]`.

    `cos`, `sin`: `[B, rd/2]`, one angle set per batch row, broadcast over the middle axes (heads).
    Computed in f32 (as REF's `apply_rotary_emb`), returned in `x.dtype`.
    """
    half = cos.shape[-1]
    rd = 2 * half
    if x.shape[-1] < rd:
        raise ValueError(f"rope: x: last dim {x.shape[-1]} is smaller than the rope dims {rd}")
    # [B, rd/2] -> [B, 1, ..., 1, rd/2] so the angles broadcast over the middle axes.
    bshape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    c = cos.astype(mx.float32).reshape(bshape)
    s = sin.astype(mx.float32).reshape(bshape)
    d = x.shape[-1]
    pairs = x[..., d - rd :].astype(mx.float32).reshape(*x.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rot = mx.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(*x.shape[:-1], rd)
    if rd == d:
        return rot.astype(x.dtype)
    return mx.concatenate([x[..., : d - rd], rot.astype(x.dtype)], axis=-1)
