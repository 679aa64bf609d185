"""The decode step's weight products for a few rows: plain-MLX references and their checks.

Each op dispatches through `kernels.backend` like the row-batched ops: on CUDA, `kernels/cuda/matmul.py`
runs 1..8 rows in one skinny tensor-core kernel that reads every weight byte once (larger row counts,
as in prefill, and shapes it does not take run the reference). The references are what the model ran
before the fast path existed, so the CPU path is unchanged:
- `qlinear_rows`: x @ W.T for an mxfp8 weight (nn.QuantizedLinear's product), out x.dtype;
- `f32_linear_rows`: x @ W.T in f32 for a weight stored in its own dtype (REF upcasts the weight);
- `qlinear_cat_rows`: two mxfp8 products of one input, weights of any row counts (wq_a and wkv of x, the
  attention's and the indexer's wq_b of qr: one launch on CUDA);
- `f32_linear_pair_rows`: two such products of one input by two weights of one shape (a compressor's kv and
  gate: one launch on CUDA);
- `swiglu_rows`: SwiGLU(x @ W1.T, x @ W3.T) of two mxfp8 weights (the shared expert's first half);
- `experts_gate_up_rows` / `experts_down_rows`: the routed experts' two halves for mxfp4 weights
  stacked [E, N, K / 8], each (row, k) pair through its own expert.

From 9 to MANY_ROWS rows (a short prompt's forward), where a fast path is registered, each op runs through it
with every row as it would run in an 8-row launch (`fast_sliced`): one launch of 8-row groups where the fast op
says it takes them (`rows_per_launch`: the CUDA skinny kernels, `GROUPED`), else 8-row slices, one launch each.
Past MANY_ROWS rows (prefill), `qlinear_rows` and `swiglu_rows` dequantize the mxfp8 weight once to x's dtype
(exact: an e4m3 code times a power of two) and run a plain GEMM, cuBLAS's tensor-core kernels on CUDA: MLX's
quantized GEMM there (qmm_sm80) ran an 8-row call in ~100 us against ~7 us of weight bytes on the H200, and its
tiles stay that slow per FLOP at prefill's row counts, while the dequantized copy costs 3 bytes a weight (well under
the GEMM's time from 64 rows on).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.rows import MAX_ROWS

GROUP = 32  # mxfp8 / mxfp4 scale group
# The CUDA skinny kernels are on by default (their gpu tests and the full-depth A/B ran on an H200,
# docs/performance.md); DSV4_SKINNY=0 keeps MLX's own matmuls for the weight products.
SKINNY = os.environ.get("DSV4_SKINNY", "1").strip() != "0"


def weights_as_stored() -> bool:
    """Whether the f32-multiplied weights stay in their stored dtype in memory: the skinny kernels read bf16
    and multiply exactly in f32. Without them MLX would upcast the weight every step (a node and an f32
    copy: ~2 GB for the head), so they are kept f32 then."""
    return SKINNY and backend.name() == "cuda"


def _is(x: object, op: str, name: str) -> mx.array:
    if not isinstance(x, mx.array):
        raise ValueError(f"{op}: {name}: expected an mx.array, got {type(x).__name__}")
    return x


def check_linear(op: str, x: mx.array, w: mx.array, scales: mx.array | None, bits: int | None) -> None:
    """x [..., K]; w [N, K] float (bits None) or packed uint32 [(E,) N, K * bits / 32] with uint8 scales
    [(E,) N, K / 32]."""
    _is(x, op, "x")
    _is(w, op, "w")
    if x.ndim < 1:
        raise ValueError(f"{op}: x: expected [..., K], got shape {tuple(x.shape)}")
    k = x.shape[-1]
    if bits is None:
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"{op}: w: expected [N, {k}], got shape {tuple(w.shape)}")
        if not mx.issubdtype(w.dtype, mx.floating):
            raise ValueError(f"{op}: w: expected a float dtype, got {w.dtype}")
        return
    _is(scales, op, "scales")
    if w.dtype != mx.uint32 or w.ndim < 2 or w.shape[-1] * 32 != k * bits:
        raise ValueError(f"{op}: w: expected packed uint32 [..., N, {k * bits // 32}], got {w.dtype} "
                         f"{tuple(w.shape)}")  # fmt: skip
    if scales.dtype != mx.uint8 or tuple(scales.shape) != (*w.shape[:-1], k // GROUP):
        raise ValueError(f"{op}: scales: expected uint8 {(*w.shape[:-1], k // GROUP)}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")  # fmt: skip


def check_experts(op: str, x: mx.array, idx: mx.array, w: mx.array, scales: mx.array, *, per_pair: bool) -> None:
    """x [B, K] (or, `per_pair`, [B, k, K]); idx [B, k] expert ids; w / scales stacked mxfp4 experts."""
    _is(idx, op, "idx")
    if idx.ndim != 2 or not mx.issubdtype(idx.dtype, mx.integer):
        raise ValueError(f"{op}: idx: expected integer [B, k], got {idx.dtype} {tuple(idx.shape)}")
    want = (*idx.shape, x.shape[-1]) if per_pair else (idx.shape[0], x.shape[-1])
    if _is(x, op, "x").ndim != len(want) or tuple(x.shape[:-1]) != want[:-1]:
        raise ValueError(f"{op}: x: expected {'[B, k, K]' if per_pair else '[B, K]'} matching idx "
                         f"{tuple(idx.shape)}, got {tuple(x.shape)}")  # fmt: skip
    check_linear(op, x, w, scales, 4)
    if w.ndim != 3:
        raise ValueError(f"{op}: w: expected stacked experts [E, N, K / 8], got shape {tuple(w.shape)}")


def swiglu(gate: mx.array, up: mx.array, limit: float | None) -> mx.array:
    """silu(min(gate, limit)) * clip(up, -limit, limit) (no clamp for a falsy limit), as model.layers."""
    if limit:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    return nn.silu(gate) * up


MANY_ROWS = 64  # more rows than this: dequantize + GEMM (prefill chunks; decode stays at <= 8)


def _many(x: object) -> bool:
    return isinstance(x, mx.array) and x.ndim >= 2 and x.size // max(x.shape[-1], 1) > MANY_ROWS


SLICE_ROWS = MAX_ROWS  # the row contract's most rows, the skinny kernels' (kernels/cuda/matmul.py) too
# 9..MANY_ROWS rows in one launch of 8-row groups where the fast op takes them (the same bits as 8-row slices:
# each group is computed as an 8-row launch of its rows); DSV4_SKINNY_GROUPS=0 keeps a launch a slice (A/B).
GROUPED = os.environ.get("DSV4_SKINNY_GROUPS", "1").strip() != "0"


def launch_rows(fast: Any) -> int:
    """The most rows `fast` takes in one launch (`rows_per_launch`, 8-row groups), else SLICE_ROWS."""
    return getattr(fast, "rows_per_launch", SLICE_ROWS) if GROUPED else SLICE_ROWS


def fast_sliced(op: str, x: object) -> Any:
    """The registered fast `op` when x [B, K] has SLICE_ROWS < B <= MANY_ROWS rows (a short prompt's forward),
    else None: such x runs as 8-row groups of one launch or 8-row slices (`_by_slices`), each reading the weight
    once, and each row as it would alone (batch invariance). In its place MLX's quantized GEMM (~100 us a call
    on the H200) or, for the routed experts, the grouped GEMM's dequantized copy of every expert (~3 ms a layer)
    would run."""
    if not (isinstance(x, mx.array) and x.ndim == 2 and SLICE_ROWS < x.shape[0] <= MANY_ROWS):
        return None
    return backend.pick(op, None)


def slices(rows: int) -> list[tuple[int, int]]:
    return [(a, min(rows, a + SLICE_ROWS)) for a in range(0, rows, SLICE_ROWS)]


def _by_slices(fn: Any, x: mx.array, *rest: Any, **kw: Any) -> Any:
    if x.shape[0] <= launch_rows(fn):  # one launch, its 8-row groups computed as the slices would be
        return fn(x, *rest, **kw)
    outs = [fn(x[a:b], *rest, **kw) for a, b in slices(x.shape[0])]
    if isinstance(outs[0], tuple):  # a pair's products, each concatenated
        return tuple(mx.concatenate(parts) for parts in zip(*outs, strict=True))
    return mx.concatenate(outs)


def dequantize_mxfp8_reference(w: mx.array, s: mx.array, dtype: mx.Dtype) -> mx.array:
    return mx.dequantize(w, s, group_size=GROUP, bits=8, mode="mxfp8", dtype=dtype)


def _dq8(w: mx.array, s: mx.array, dtype: mx.Dtype) -> mx.array:
    """The dequantized copy of prefill's dense products (on CUDA kernels/cuda/dequant.py: one vectorized pass)."""
    return backend.pick("dequantize_mxfp8", dequantize_mxfp8_reference)(w, s, dtype)


def _qmm(x: mx.array, w: mx.array, s: mx.array) -> mx.array:
    return mx.quantized_matmul(x, w, s, transpose=True, group_size=GROUP, bits=8, mode="mxfp8")


def qlinear_rows_reference(x: mx.array, w: mx.array, scales: mx.array) -> mx.array:
    check_linear("qlinear_rows", x, w, scales, 8)
    return _qmm(x, w, scales)


def qlinear_cat_rows_reference(x: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                               s2: mx.array) -> tuple[mx.array, mx.array]:  # fmt: skip
    check_linear("qlinear_cat_rows", x, w1, s1, 8)
    check_linear("qlinear_cat_rows", x, w2, s2, 8)
    return _qmm(x, w1, s1), _qmm(x, w2, s2)


def f32_linear_rows_reference(x: mx.array, w: mx.array) -> mx.array:
    check_linear("f32_linear_rows", x, w, None, None)
    return x.astype(mx.float32) @ w.astype(mx.float32).T


def check_pair(op: str, x: mx.array, w1: mx.array, w2: mx.array) -> None:
    check_linear(op, x, w1, None, None)
    check_linear(op, x, w2, None, None)
    if w2.shape != w1.shape:
        raise ValueError(f"{op}: w2: expected the shape of w1 {tuple(w1.shape)}, got {tuple(w2.shape)}")


def f32_linear_pair_rows_reference(x: mx.array, w1: mx.array, w2: mx.array) -> tuple[mx.array, mx.array]:
    check_pair("f32_linear_pair_rows", x, w1, w2)
    xf = x.astype(mx.float32)
    return xf @ w1.astype(mx.float32).T, xf @ w2.astype(mx.float32).T


def swiglu_rows_reference(x: mx.array, w1: mx.array, s1: mx.array, w3: mx.array, s3: mx.array, *,
                          limit: float | None) -> mx.array:  # fmt: skip
    check_linear("swiglu_rows", x, w1, s1, 8)
    check_linear("swiglu_rows", x, w3, s3, 8)
    return swiglu(_qmm(x, w1, s1).astype(mx.float32), _qmm(x, w3, s3).astype(mx.float32), limit).astype(x.dtype)


_lhs: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}


def lhs_indices(b: int, k: int) -> tuple[mx.array, mx.array]:
    """gather_qmm's lhs indices for x [B, 1, 1, K] (row b) and for a per-pair [B, k, 1, K] (b * k + j),
    made once from NumPy (MLX's defaults are an arange + a cast node per call)."""
    if (b, k) not in _lhs:
        _lhs[(b, k)] = (mx.array(np.arange(b, dtype=np.uint32)[:, None]),
                        mx.array(np.arange(b * k, dtype=np.uint32).reshape(b, k)))  # fmt: skip
    return _lhs[(b, k)]


def _gqmm(x: mx.array, w: mx.array, s: mx.array, rows: mx.array, idx: mx.array) -> mx.array:
    return mx.gather_qmm(x, w, s, None, lhs_indices=rows, rhs_indices=idx, transpose=True, group_size=GROUP,
                         bits=4, mode="mxfp4")  # fmt: skip


def experts_gate_up_rows_reference(x: mx.array, idx: mx.array, w1: mx.array, s1: mx.array, w3: mx.array,
                                   s3: mx.array, *, limit: float | None) -> mx.array:  # fmt: skip
    """-> hidden [B, k, I] in x.dtype: SwiGLU of each pair's expert's gate and up products."""
    check_experts("experts_gate_up_rows", x, idx, w1, s1, per_pair=False)
    check_experts("experts_gate_up_rows", x, idx, w3, s3, per_pair=False)
    rows, _ = lhs_indices(*idx.shape)
    ri = idx.astype(mx.uint32)
    xe = x[:, None, None, :]
    g, u = _gqmm(xe, w1, s1, rows, ri), _gqmm(xe, w3, s3, rows, ri)
    return swiglu(g.astype(mx.float32), u.astype(mx.float32), limit).astype(x.dtype)[:, :, 0, :]


def experts_down_rows_reference(h: mx.array, idx: mx.array, w2: mx.array, s2: mx.array) -> mx.array:
    """h [B, k, I] (each pair's hidden) -> [B, k, H] in h.dtype through each pair's expert."""
    check_experts("experts_down_rows", h, idx, w2, s2, per_pair=True)
    _, pair_rows = lhs_indices(*idx.shape)
    return _gqmm(h[:, :, None, :], w2, s2, pair_rows, idx.astype(mx.uint32))[:, :, 0, :]


def check_grouped(op: str, x: mx.array, w: mx.array, scales: mx.array) -> None:
    """x [B, G, K]; w packed mxfp8 [G, N, K / 4] uint32 with uint8 scales [G, N, K / 32]: group g of x through
    its own weight (attention's wo_a: each group of heads through its rows)."""
    if _is(x, op, "x").ndim != 3:
        raise ValueError(f"{op}: x: expected [B, G, K], got shape {tuple(x.shape)}")
    check_linear(op, x, w, scales, 8)
    if w.ndim != 3 or w.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: w: expected [{x.shape[1]}, N, {x.shape[2] // 4}] (a weight a group of x), got "
                         f"{tuple(w.shape)}")  # fmt: skip


def grouped_qlinear_rows_reference(x: mx.array, w: mx.array, scales: mx.array) -> mx.array:
    """z[b, g] = x[b, g] @ W_g.T in x.dtype: the weight dequantized (exact), then MLX's batched matmul."""
    check_grouped("grouped_qlinear_rows", x, w, scales)
    return mx.einsum("bgi,gri->bgr", x, _dq8(w, scales, x.dtype))


def grouped_qlinear_rows(x: mx.array, w: mx.array, scales: mx.array) -> mx.array:
    """x [B, G, K] with one mxfp8 weight [N, K] a group (stacked [G, N, K / 4]) -> [B, G, N] in x.dtype."""
    rows = x.shape[0] if isinstance(x, mx.array) and x.ndim == 3 else 0
    fast = None if rows > MANY_ROWS else backend.pick("grouped_qlinear_rows", None)  # prefill: the reference
    if fast is not None and rows > SLICE_ROWS:
        return _by_slices(fast, x, w, scales)
    return (fast or grouped_qlinear_rows_reference)(x, w, scales)


def qlinear_many_rows(x: mx.array, w: mx.array, scales: mx.array) -> mx.array:
    """qlinear_rows for prefill's row counts: the weight dequantized to x.dtype, then x @ W.T."""
    check_linear("qlinear_rows", x, w, scales, 8)
    return x @ _dq8(w, scales, x.dtype).T


def swiglu_many_rows(x: mx.array, w1: mx.array, s1: mx.array, w3: mx.array, s3: mx.array, *,
                     limit: float | None) -> mx.array:  # fmt: skip
    """swiglu_rows for prefill's row counts, as the reference: products in x.dtype, SwiGLU in f32."""
    g, u = qlinear_many_rows(x, w1, s1), qlinear_many_rows(x, w3, s3)
    return swiglu(g.astype(mx.float32), u.astype(mx.float32), limit).astype(x.dtype)


def qlinear_rows(x: mx.array, w: mx.array, scales: mx.array) -> mx.array:
    """x [..., K] @ mxfp8 W [N, K].T -> [..., N] in x.dtype."""
    if _many(x):
        return qlinear_many_rows(x, w, scales)
    if (fast := fast_sliced("qlinear_rows", x)) is not None:
        return _by_slices(fast, x, w, scales)
    return backend.pick("qlinear_rows", qlinear_rows_reference)(x, w, scales)


def f32_linear_rows(x: mx.array, w: mx.array) -> mx.array:
    """x [..., K] @ W [N, K].T in f32 -> f32 (the fast path: bf16 x and W, exact products, f32 sums)."""
    if (fast := fast_sliced("f32_linear_rows", x)) is not None:
        return _by_slices(fast, x, w)
    return backend.pick("f32_linear_rows", f32_linear_rows_reference)(x, w)


def qlinear_cat_rows(x: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                     s2: mx.array) -> tuple[mx.array, mx.array]:  # fmt: skip
    """(x @ W1.T, x @ W2.T) for two mxfp8 weights of x's width -> ([..., N1], [..., N2]) in x.dtype."""
    if (sliced := fast_sliced("qlinear_cat_rows", x)) is not None:
        return _by_slices(sliced, x, w1, s1, w2, s2)
    fast = None if _many(x) else backend.pick("qlinear_cat_rows", None)
    if fast is None:  # each product through its own dispatch (prefill's GEMM, the skinny kernel, MLX's)
        check_linear("qlinear_cat_rows", x, w1, s1, 8)
        check_linear("qlinear_cat_rows", x, w2, s2, 8)
        return qlinear_rows(x, w1, s1), qlinear_rows(x, w2, s2)
    return fast(x, w1, s1, w2, s2)


def f32_linear_pair_rows(x: mx.array, w1: mx.array, w2: mx.array) -> tuple[mx.array, mx.array]:
    """(x @ W1.T, x @ W2.T) in f32 for two weights of one shape [N, K] (a compressor's kv and gate)."""
    if (fast := fast_sliced("f32_linear_pair_rows", x)) is not None:
        return _by_slices(fast, x, w1, w2)
    return backend.pick("f32_linear_pair_rows", f32_linear_pair_rows_reference)(x, w1, w2)


def swiglu_rows(x: mx.array, w1: mx.array, s1: mx.array, w3: mx.array, s3: mx.array, *,
                limit: float | None) -> mx.array:  # fmt: skip
    """SwiGLU(x @ W1.T, x @ W3.T) for two mxfp8 weights -> [..., I] in x.dtype."""
    if _many(x):
        return swiglu_many_rows(x, w1, s1, w3, s3, limit=limit)
    if (fast := fast_sliced("swiglu_rows", x)) is not None:
        return _by_slices(fast, x, w1, s1, w3, s3, limit=limit)
    return backend.pick("swiglu_rows", swiglu_rows_reference)(x, w1, s1, w3, s3, limit=limit)


def experts_gate_up_rows(x: mx.array, idx: mx.array, w1: mx.array, s1: mx.array, w3: mx.array, s3: mx.array, *,
                         limit: float | None) -> mx.array:  # fmt: skip
    """Routed experts' first half: x [B, K], idx [B, k] -> hidden [B, k, I]."""
    fn = backend.pick("experts_gate_up_rows", experts_gate_up_rows_reference)
    return fn(x, idx, w1, s1, w3, s3, limit=limit)


def experts_down_rows(h: mx.array, idx: mx.array, w2: mx.array, s2: mx.array) -> mx.array:
    """Routed experts' second half: hidden [B, k, I] -> [B, k, H], each pair through its expert."""
    return backend.pick("experts_down_rows", experts_down_rows_reference)(h, idx, w2, s2)
