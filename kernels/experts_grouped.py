"""The routed experts for many rows (prefill) as one grouped GEMM per projection, and its plain twin.

`kernels.matmul`'s `experts_gate_up_rows` / `experts_down_rows` run each (row, k) pair as its own one-row
product (`mx.gather_qmm`, M = 1): on CUDA a batch of B * k one-row GEMMs, each reading its expert's whole
weight again. Past `GROUPED_ROWS` rows `grouped_experts` instead sorts the pairs by expert, gathers their
x rows, dequantizes the layer's mxfp4 experts to x's dtype (exact: an e2m1 value times a power of two fits
bf16) and runs `mx.gather_mm(..., rhs_indices=sorted ids, sorted_indices=True)`, which MLX's CUDA backend
serves with one CUTLASS grouped GEMM (one problem of `count` rows per expert; `GatherMM::eval_gpu`, M == 1
and right-sorted). The products are unsorted and router-weighted exactly as `QuantizedExperts` does.

Memory: the dequantized weights are a transient E x 3 x I x H x 2 bytes per layer at most in bf16 (V4-Flash,
32 local experts: 1.6 GB), freed once the layer's products are made.
On MLX's CPU backend gather_mm is f32-only, so there the products run in f32 (the rounding of the hidden
and of each pair's output to x.dtype is kept, as in the reference).
"""

from __future__ import annotations

import mlx.core as mx

from kernels.matmul import GROUP, _is, experts_down_rows_reference, experts_gate_up_rows_reference, swiglu

# Rows above which the experts run grouped. 1..8 rows are the decode step's (the CUDA skinny kernels,
# kernels/cuda/matmul.py MAX_ROWS, read each weight byte once). Estimate for V4-Flash on an H200: the
# per-pair path costs ~11 us a pair (137 ms for 2048 x 6 pairs), the grouped one a fixed ~1 ms per layer
# (dequantize 0.4 GB -> 1.6 GB and read it back) plus its GEMMs, so it wins from about 16 rows; 8 keeps
# one boundary for the decode path. To tune with bench/prefill.py on the GPU.
GROUPED_ROWS = 8


def _check_mxfp4(op: str, name: str, wq: mx.array, s: mx.array, shape: tuple[int, int, int]) -> None:
    """wq packed uint32 [E, N, K / 8] and its uint8 scales [E, N, K / 32] for shape (E, N, K)."""
    e, n, k = shape
    if _is(wq, op, name).dtype != mx.uint32 or tuple(wq.shape) != (e, n, k // 8):
        raise ValueError(f"{op}: {name}: expected packed uint32 {(e, n, k // 8)}, got {wq.dtype} {tuple(wq.shape)}")
    if _is(s, op, f"{name}_scales").dtype != mx.uint8 or tuple(s.shape) != (e, n, k // GROUP):
        raise ValueError(f"{op}: {name}_scales: expected uint8 {(e, n, k // GROUP)}, got {s.dtype} "
                         f"{tuple(s.shape)}")  # fmt: skip


def check_grouped(op: str, x: mx.array, idx: mx.array, weights: mx.array, w1: mx.array, s1: mx.array,
                  w2: mx.array, s2: mx.array, w3: mx.array, s3: mx.array) -> None:  # fmt: skip
    """x [B, H]; idx [B, k] expert ids; weights [B, k] float router weights; w1 / w3 mxfp4 [E, I, H / 8]
    with uint8 scales [E, I, H / 32]; w2 mxfp4 [E, H, I / 8] with scales [E, H, I / 32]."""
    if _is(idx, op, "idx").ndim != 2 or not mx.issubdtype(idx.dtype, mx.integer):
        raise ValueError(f"{op}: idx: expected integer [B, k], got {idx.dtype} {tuple(idx.shape)}")
    if _is(x, op, "x").ndim != 2 or x.shape[0] != idx.shape[0] or not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(f"{op}: x: expected float [B, H] matching idx {tuple(idx.shape)}, got {x.dtype} "
                         f"{tuple(x.shape)}")  # fmt: skip
    if _is(weights, op, "weights").shape != idx.shape or not mx.issubdtype(weights.dtype, mx.floating):
        raise ValueError(f"{op}: weights: expected float {tuple(idx.shape)}, got {weights.dtype} "
                         f"{tuple(weights.shape)}")  # fmt: skip
    hid = x.shape[1]
    if _is(w1, op, "w1").ndim != 3 or hid % GROUP:
        raise ValueError(f"{op}: w1: expected stacked experts [E, I, {hid // 8}] (H a multiple of {GROUP}), "
                         f"got shape {tuple(w1.shape)}")  # fmt: skip
    e, inter = w1.shape[0], w1.shape[1]
    if inter % GROUP:
        raise ValueError(f"{op}: w1: I={inter} must be a multiple of {GROUP}")
    _check_mxfp4(op, "w1", w1, s1, (e, inter, hid))
    _check_mxfp4(op, "w3", w3, s3, (e, inter, hid))
    _check_mxfp4(op, "w2", w2, s2, (e, hid, inter))


def _dequant(wq: mx.array, s: mx.array, dtype: mx.Dtype) -> mx.array:
    """Stacked mxfp4 [E, N, K / 8] -> [E, K, N] in dtype (a transposed view of the dequantized [E, N, K])."""
    return mx.dequantize(wq, s, group_size=GROUP, bits=4, mode="mxfp4", dtype=dtype).swapaxes(-1, -2)


def grouped_experts(x: mx.array, idx: mx.array, weights: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                    s2: mx.array, w3: mx.array, s3: mx.array, *, limit: float | None) -> mx.array:  # fmt: skip
    """sum_j weights[b, j] * expert_{idx[b, j]}(x[b]) -> [B, H] f32, one grouped GEMM per projection."""
    check_grouped("grouped_experts", x, idx, weights, w1, s1, w2, s2, w3, s3)
    b, k = idx.shape
    ct = mx.float32 if mx.default_device() == mx.cpu else x.dtype
    flat = idx.reshape(-1).astype(mx.uint32)
    order = mx.argsort(flat)  # the B * k pairs grouped by expert (any order within an expert)
    ids = flat[order]
    xs = x[order // k][:, None, :].astype(ct)  # [P, 1, H]: M = 1 and no lhs_indices -> the grouped GEMM
    g = mx.gather_mm(xs, _dequant(w1, s1, ct), rhs_indices=ids, sorted_indices=True)
    u = mx.gather_mm(xs, _dequant(w3, s3, ct), rhs_indices=ids, sorted_indices=True)
    hdn = swiglu(g.astype(mx.float32), u.astype(mx.float32), limit).astype(x.dtype).astype(ct)  # [P, 1, I]
    out = mx.gather_mm(hdn, _dequant(w2, s2, ct), rhs_indices=ids, sorted_indices=True)  # [P, 1, H]
    out = out[:, 0, :].astype(x.dtype)[mx.argsort(order)].reshape(b, k, -1)  # back to [B, k, H]
    return mx.sum(out.astype(mx.float32) * weights[:, :, None], axis=1)


def experts_rows_reference(x: mx.array, idx: mx.array, weights: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                           s2: mx.array, w3: mx.array, s3: mx.array, *, limit: float | None) -> mx.array:  # fmt: skip
    """The plain twin: each (row, k) pair through its own expert (kernels.matmul's references), then the
    router-weighted sum in f32, as `QuantizedExperts` does for 1..GROUPED_ROWS rows."""
    check_grouped("grouped_experts", x, idx, weights, w1, s1, w2, s2, w3, s3)
    ri = idx.astype(mx.uint32)
    hdn = experts_gate_up_rows_reference(x, ri, w1, s1, w3, s3, limit=limit)
    out = experts_down_rows_reference(hdn, ri, w2, s2)
    return mx.sum(out.astype(mx.float32) * weights[:, :, None], axis=1)
