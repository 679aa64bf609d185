"""mHC pre-mix (the hyper-connection weights of one block unit), plain-MLX reference and its checks.

`hc_pre_mix(m, scale, base, h, *, iters, eps) -> (x, post, comb)` for every row, from the unit's
mixing logits `m = rms(h) @ fn.T` [B, nc*(2+nc)] (f32) and its nc streams `h` [B, nc, H]:
- pre = sigmoid(m[:, :nc] * scale[0] + base[:nc]) + eps, and the unit's input x = sum_k pre_k h_k
  [B, H] (f32 sum, `h.dtype` out);
- post = 2 sigmoid(m[:, nc:2nc] * scale[1] + base[nc:2nc]) [B, nc] f32;
- comb = Sinkhorn(softmax_rows(m[:, 2nc:] * scale[2] + base[2nc:]) + eps) [B, nc, nc] f32.
At the release's 20 Sinkhorn iterations this is ~100 small MLX ops (each a graph node, launched one
by one: a decode step is host-bound at <= 8 rows); the CUDA fast path is one kernel.

`hc_pre_norm_rows(h, fn, scale, base, weight, *, iters, eps, norm_eps, x_eps)` is `hc_pre_rows` with the
unit's RMSNorm (`kernels.rms_norm_rows(x, weight, eps=x_eps)`) applied to its x: what a block unit feeds its
attention or MoE (one launch on CUDA where the two take two).
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.norms import rms_norm_rows_reference

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def check_hc_pre_mix(m: mx.array, scale: mx.array, base: mx.array, h: mx.array, *, iters: int, eps: float) -> None:
    """Raise ValueError("hc_pre_mix: <arg>: why") for anything the op does not accept."""

    def bad(arg: str, why: str) -> ValueError:
        return ValueError(f"hc_pre_mix: {arg}: {why}")

    for name, a in (("m", m), ("scale", scale), ("base", base), ("h", h)):
        if not isinstance(a, mx.array):
            raise bad(name, f"must be an mx.array, got {type(a).__name__}")
        if a.dtype not in _FLOATS:
            raise bad(name, f"must be a float array, got {a.dtype}")
    if h.ndim != 3 or h.shape[1] < 1:
        raise bad("h", f"must be [rows, nc, hidden], got shape {tuple(h.shape)}")
    b, nc, _ = h.shape
    nm = nc * (2 + nc)
    if m.ndim != 2 or m.shape != (b, nm):
        raise bad("m", f"must be [rows, nc * (2 + nc)] = [{b}, {nm}], got shape {tuple(m.shape)}")
    if tuple(scale.shape) != (3,):
        raise bad("scale", f"must be [3], got shape {tuple(scale.shape)}")
    if tuple(base.shape) != (nm,):
        raise bad("base", f"must be [nc * (2 + nc)] = [{nm}], got shape {tuple(base.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise bad("iters", f"must be an int >= 1, got {iters!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise bad("eps", f"must be a float >= 0, got {eps!r}")


def sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Column normalisation, then iters-1 (row, column) rounds, each with +eps in the denominators.

    (Tried: the nc*nc entries as separate elementwise arrays so mx.compile fuses the loop; it does not
    (each divide stays a node), and on CUDA the fused kernel's NVRTC compile took minutes.)"""
    comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (mx.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


def hc_pre_mix_reference(
    m: mx.array, scale: mx.array, base: mx.array, h: mx.array, *, iters: int, eps: float
) -> tuple[mx.array, mx.array, mx.array]:
    check_hc_pre_mix(m, scale, base, h, iters=iters, eps=eps)
    b, nc = h.shape[0], h.shape[1]
    pre = mx.sigmoid(m[:, :nc] * scale[0] + base[:nc]) + eps
    post = 2 * mx.sigmoid(m[:, nc : 2 * nc] * scale[1] + base[nc : 2 * nc])
    comb = (m[:, 2 * nc :] * scale[2] + base[2 * nc :]).reshape(b, nc, nc)
    comb = mx.softmax(comb, axis=-1, precise=True) + eps
    x = mx.sum(pre[:, :, None] * h.astype(mx.float32), axis=1).astype(h.dtype)
    return x, post, sinkhorn(comb, iters, eps)


def check_hc_pre_rows(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, iters: int, eps: float,
                      norm_eps: float) -> None:  # fmt: skip
    """hc_pre_rows' arguments: h [B, nc, H]; fn [nc (2 + nc), nc H] (the unit's mixing weights); the rest as
    hc_pre_mix's; norm_eps the input RMS's epsilon."""
    for name, a in (("h", h), ("fn", fn)):
        if not isinstance(a, mx.array) or a.dtype not in _FLOATS:
            got = a.dtype if isinstance(a, mx.array) else type(a).__name__
            raise ValueError(f"hc_pre_rows: {name}: must be a float mx.array, got {got}")
    if h.ndim != 3 or h.shape[1] < 1:
        raise ValueError(f"hc_pre_rows: h: must be [rows, nc, hidden], got shape {tuple(h.shape)}")
    nc, hid = h.shape[1], h.shape[2]
    want = (nc * (2 + nc), nc * hid)
    if tuple(fn.shape) != want:
        raise ValueError(f"hc_pre_rows: fn: must be {list(want)}, got shape {tuple(fn.shape)}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not norm_eps >= 0:
        raise ValueError(f"hc_pre_rows: norm_eps: must be a float >= 0, got {norm_eps!r}")
    check_hc_pre_mix(mx.zeros((h.shape[0], want[0])), scale, base, h, iters=iters, eps=eps)


def hc_pre_composed(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, iters: int, eps: float,
                    norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """hc_pre_rows as its parts, each through its own dispatch (`kernels.backend`): the input RMS in f32
    (`rms_norm_rows`), the mixing logits m = rms(h) @ fn.T in f32, the pre-mix (`hc_pre_mix`)."""
    b = h.shape[0]
    f = backend.pick("rms_norm_rows", rms_norm_rows_reference)(h.reshape(b, -1), None, eps=norm_eps,
                                                                out_dtype=mx.float32)  # fmt: skip
    mix = backend.pick("hc_pre_mix", hc_pre_mix_reference)
    return mix(f @ fn.astype(mx.float32).T, scale, base, h, iters=iters, eps=eps)


def check_hc_pre_norm_rows(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, weight: mx.array, *,
                           iters: int, eps: float, norm_eps: float, x_eps: float) -> None:  # fmt: skip
    op = "hc_pre_norm_rows"
    try:
        check_hc_pre_rows(h, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)
    except ValueError as e:
        raise ValueError(str(e).replace("hc_pre_rows:", f"{op}:").replace("hc_pre_mix:", f"{op}:")) from None
    if not isinstance(weight, mx.array) or weight.dtype not in _FLOATS or tuple(weight.shape) != (h.shape[2],):
        got = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, mx.array) else type(weight).__name__
        raise ValueError(f"{op}: weight: must be a float [{h.shape[2]}], got {got}")
    if isinstance(x_eps, bool) or not isinstance(x_eps, (int, float)) or not x_eps >= 0:
        raise ValueError(f"{op}: x_eps: must be a float >= 0, got {x_eps!r}")


def hc_pre_norm_composed(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, weight: mx.array, *,
                         iters: int, eps: float, norm_eps: float,
                         x_eps: float) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """hc_pre_norm_rows as its two parts, each through its own dispatch: hc_pre_rows, then the RMSNorm."""
    check_hc_pre_norm_rows(h, fn, scale, base, weight, iters=iters, eps=eps, norm_eps=norm_eps, x_eps=x_eps)
    pre = backend.pick("hc_pre_rows", None) or hc_pre_composed
    x, post, comb = pre(h, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)
    return backend.pick("rms_norm_rows", rms_norm_rows_reference)(x, weight, eps=x_eps), post, comb
