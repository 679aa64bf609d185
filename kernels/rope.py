"""Interleaved RoPE on the last `rd` dims (DeepSeek-V4 layout `[nope | rope]`, spec 2.3).

Pairs are `(x[D-rd+2i], x[D-rd+2i+1])`, rotated as `(a, b) -> (a cos - b sin, a sin + b cos)`.
Not NeoX half-split, not the first dims.

`rope(x, cos, sin)` is the op. The decode step applies it 3-4 times per layer to the same angles, so
the model builds full-width tables once per step (`rope_tables`) and applies them with `rope_apply`:
the same products and sums on the rope dims, x * 1 + y * 0 on the others (x itself for finite x), and
~5 graph nodes per application instead of 13 (no per-call angle layout, no slice + concatenate).

`rms_rope_rows(x, c, s, *, weight=None, eps=None)` is `rope_apply` after an optional RMS norm of each vector
(q's heads unweighted, the window kv with kv_norm's weight), the norm rounded to x.dtype first as the two ops
in turn: in plain MLX the pair swap's reshape of a strided view is a copy kernel, the product a second
and the norm a third; on CUDA the whole is one kernel (kernels/cuda/rope.py), 3.5 applications a layer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.norms import check_rms_norm_rows, rms_norm_rows_reference

_signs: dict[int, mx.array] = {}


def _sine_signs(half: int) -> mx.array:
    """-1, +1, -1, ... over the rotated dims: (a, b) -> (a c + b (-s), b c + a s). A NumPy-made constant."""
    if half not in _signs:
        _signs[half] = mx.array(np.tile(np.array([-1.0, 1.0], np.float32), half))
    return _signs[half]


def _pair_tables(cos: mx.array, sin: mx.array, shape: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """`[B, rd/2]` angles -> f32 `shape` (`[B, ..., rd]`): each cos twice, and (-sin, +sin) per pair (the
    signs applied after the reshape, so that a compiled caller fuses them with its own product)."""
    b, half = cos.shape
    c = mx.broadcast_to(cos.astype(mx.float32)[..., None], (b, half, 2)).reshape(shape)
    s = mx.broadcast_to(sin.astype(mx.float32)[..., None], (b, half, 2)).reshape(shape) * _sine_signs(half)
    return c, s


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
    # [B, rd] (each angle twice, S signed) -> [B, 1, ..., 1, rd]: broadcast over the middle axes.
    bshape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (rd,)
    c, s = _pair_tables(cos, sin, bshape)
    d = x.shape[-1]
    xr = x[..., d - rd :]
    swapped = xr.reshape(*x.shape[:-1], half, 2)[..., ::-1].reshape(*x.shape[:-1], rd)
    rot = xr.astype(mx.float32) * c + swapped.astype(mx.float32) * s
    if rd == d:
        return rot.astype(x.dtype)
    return mx.concatenate([x[..., : d - rd], rot.astype(x.dtype)], axis=-1)


def rope_tables(cos: mx.array, sin: mx.array, d: int) -> tuple[mx.array, mx.array]:
    """`(C, S)`, `[B, d]` f32, for `rope_apply` on vectors of `d` dims: each angle's cos twice and
    (-sin, +sin) per pair on the last `rd = 2 * cos.shape[-1]` dims, 1 and 0 on the first `d - rd`."""
    b, half = cos.shape
    rd = 2 * half
    if d < rd or d % 2:
        raise ValueError(f"rope_tables: d: {d} must be even and at least the rope dims {rd}")
    c, s = _pair_tables(cos, sin, (b, rd))
    if d == rd:
        return c, s
    return (mx.concatenate([mx.ones((b, d - rd), mx.float32), c], axis=-1),
            mx.concatenate([mx.zeros((b, d - rd), mx.float32), s], axis=-1))  # fmt: skip


def rope_apply(x: mx.array, c: mx.array, s: mx.array) -> mx.array:
    """`x [B, ..., d]` rotated with `rope_tables(cos, sin, d)` (`-S` rotates back): x * C + swap_pairs(x) * S
    in f32 over the whole width, one fused elementwise kernel, returned in `x.dtype`."""
    d = x.shape[-1]
    if c.shape != (x.shape[0], d) or s.shape != c.shape:
        raise ValueError(f"rope_apply: c, s: shapes {c.shape}, {s.shape}; want ({x.shape[0]}, {d}) for x {x.shape}")
    bshape = (x.shape[0],) + (1,) * (x.ndim - 2) + (d,)
    swapped = x.reshape(*x.shape[:-1], d // 2, 2)[..., ::-1].reshape(x.shape)
    return (x.astype(mx.float32) * c.reshape(bshape) + swapped.astype(mx.float32) * s.reshape(bshape)).astype(x.dtype)


def check_rms_rope_rows(x: mx.array, c: mx.array, s: mx.array, weight: mx.array | None, eps: float | None) -> None:
    if not isinstance(x, mx.array) or x.ndim < 2 or x.shape[-1] % 2:
        got = tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__
        raise ValueError(f"rms_rope_rows: x: must be [rows, ..., d] with d even, got {got}")
    for name, t in (("c", c), ("s", s)):
        if not isinstance(t, mx.array) or tuple(t.shape) != (x.shape[0], x.shape[-1]):
            got = tuple(t.shape) if isinstance(t, mx.array) else type(t).__name__
            raise ValueError(f"rms_rope_rows: {name}: must be [{x.shape[0]}, {x.shape[-1]}] (rope_tables), got {got}")
    if eps is None:
        if weight is not None:
            raise ValueError("rms_rope_rows: weight: given without eps (no norm to weight)")
        return
    try:
        check_rms_norm_rows(x, weight, eps, None)
    except ValueError as e:
        raise ValueError(str(e).replace("rms_norm_rows:", "rms_rope_rows:")) from None


def rms_rope_rows_reference(x: mx.array, c: mx.array, s: mx.array, *, weight: mx.array | None = None,
                            eps: float | None = None) -> mx.array:  # fmt: skip
    """The model's ops in turn: the norm (MLX's fused one without a weight, rms_norm_rows with one), then
    rope_apply."""
    check_rms_rope_rows(x, c, s, weight, eps)
    if eps is not None:
        x = mx.fast.rms_norm(x, None, eps) if weight is None else rms_norm_rows_reference(x, weight, eps=eps)
    return rope_apply(x, c, s)
