"""Interleaved RoPE on the last `rd` dims (DeepSeek-V4 layout `[nope | rope]`, spec 2.3).

Pairs are `(x[D-rd+2i], x[D-rd+2i+1])`, rotated as `(a, b) -> (a cos - b sin, a sin + b cos)`.
Not NeoX half-split, not the first dims.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_signs: dict[int, mx.array] = {}


def _sine_signs(half: int) -> mx.array:
    """-1, +1, -1, ... over the rotated dims: (a, b) -> (a c + b (-s), b c + a s). A NumPy-made constant."""
    if half not in _signs:
        _signs[half] = mx.array(np.tile(np.array([-1.0, 1.0], np.float32), half))
    return _signs[half]


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the last `rd = 2 * cos.shape[-1]` dims of `x [B, ..., D]`.

    `cos`, `sin`: `[B, rd/2]`, one angle set per batch row, broadcast over the middle axes (heads).
    Computed in f32 (as REF's `apply_rotary_emb`), returned in `x.dtype`. Written as
    x * C + swap_pairs(x) * S with C, S the angles repeated per pair (S signed), so that it is one fused
    elementwise kernel and ~13 graph nodes instead of ~18 (pairs unstacked, rotated, restacked); the
    products and sums are the same, and so are the results.
    """
    half = cos.shape[-1]
    rd = 2 * half
    if x.shape[-1] < rd:
        raise ValueError(f"rope: x: last dim {x.shape[-1]} is smaller than the rope dims {rd}")
    # [B, rd/2] -> [B, 1, ..., 1, rd] (each angle twice) so the angles broadcast over the middle axes.
    bshape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (rd,)
    c = mx.broadcast_to(cos.astype(mx.float32)[..., None], (*cos.shape, 2)).reshape(bshape)
    s = mx.broadcast_to(sin.astype(mx.float32)[..., None], (*sin.shape, 2)).reshape(bshape)
    d = x.shape[-1]
    xr = x[..., d - rd :]
    swapped = xr.reshape(*x.shape[:-1], half, 2)[..., ::-1].reshape(*x.shape[:-1], rd)
    rot = xr.astype(mx.float32) * c + swapped.astype(mx.float32) * (s * _sine_signs(half))
    if rd == d:
        return rot.astype(x.dtype)
    return mx.concatenate([x[..., : d - rd], rot.astype(x.dtype)], axis=-1)
