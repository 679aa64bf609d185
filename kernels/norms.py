"""The step's RMS norms and the mHC post-mix: plain-MLX references and their checks.

- `rms_norm_rows(x, weight, *, eps, out_dtype=None)`: RMSNorm over the last axis with f32 statistics and
  f32 products, the weight (if any) applied in f32, one rounding to `out_dtype` (default x.dtype): REF's
  RMSNorm (a weight) and mHC's input RMS (none, f32 out). The reference is MLX's fused norm on an f32 copy
  of x, then the weight: 3 graph nodes and 3 kernels (cast, norm, weight + cast) at each of the 6 norms a
  layer; the CUDA fast path is one kernel.
- `hc_post_rows(y, h, post, comb)`: h'[k] = post[k] y + sum_j comb[j, k] h[j] in f32, rounded to h.dtype
  (REF's mHC post-mix; C used transposed). The reference is a cast, an f32 batched matmul and a fused
  tail (3 kernels, twice a layer); the CUDA fast path is one kernel.
"""

from __future__ import annotations

import mlx.core as mx

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def _float(op: str, name: str, a: object) -> mx.array:
    if not isinstance(a, mx.array):
        raise ValueError(f"{op}: {name}: must be an mx.array, got {type(a).__name__}")
    if a.dtype not in _FLOATS:
        raise ValueError(f"{op}: {name}: must be a float array, got {a.dtype}")
    return a


def check_rms_norm_rows(x: mx.array, weight: mx.array | None, eps: float, out_dtype: mx.Dtype | None) -> None:
    _float("rms_norm_rows", "x", x)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"rms_norm_rows: x: must have a non-empty last axis, got shape {tuple(x.shape)}")
    if weight is not None and tuple(_float("rms_norm_rows", "weight", weight).shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm_rows: weight: must be [{x.shape[-1]}], got shape {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"rms_norm_rows: eps: must be a float >= 0, got {eps!r}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"rms_norm_rows: out_dtype: must be a float dtype, got {out_dtype}")


def rms_norm_rows_reference(x: mx.array, weight: mx.array | None, *, eps: float,
                            out_dtype: mx.Dtype | None = None) -> mx.array:  # fmt: skip
    check_rms_norm_rows(x, weight, eps, out_dtype)
    y = mx.fast.rms_norm(x.astype(mx.float32), None, eps)  # f32 statistics, x * rsqrt(.) unrounded
    if weight is not None:
        y = weight.astype(mx.float32) * y
    return y.astype(out_dtype or x.dtype)


def check_hc_post_rows(y: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> None:
    for name, a in (("y", y), ("h", h), ("post", post), ("comb", comb)):
        _float("hc_post_rows", name, a)
    if h.ndim != 3:
        raise ValueError(f"hc_post_rows: h: must be [rows, nc, hidden], got shape {tuple(h.shape)}")
    b, nc, hid = h.shape
    for name, a, want in (("y", y, (b, hid)), ("post", post, (b, nc)), ("comb", comb, (b, nc, nc))):
        if tuple(a.shape) != want:
            raise ValueError(f"hc_post_rows: {name}: must be {list(want)}, got shape {tuple(a.shape)}")


@mx.compile
def _hc_post(y: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    mixed = comb.swapaxes(1, 2) @ h.astype(mx.float32)  # one batched matmul: fewer nodes than the einsum's
    return (post[:, :, None] * y.astype(mx.float32)[:, None, :] + mixed).astype(h.dtype)


def hc_post_rows_reference(y: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    check_hc_post_rows(y, h, post, comb)
    return _hc_post(y, h, post, comb)
