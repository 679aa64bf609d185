"""The routed experts for many rows (prefill) as one grouped GEMM per projection, and its plain twin.

`kernels.matmul`'s `experts_gate_up_rows` / `experts_down_rows` run each (row, k) pair as its own one-row
product (`mx.gather_qmm`, M = 1): on CUDA a batch of B * k one-row GEMMs, each reading its expert's whole
weight again. Past `GROUPED_ROWS` rows `grouped_experts` instead sorts the pairs by expert, gathers their
x rows, dequantizes the layer's mxfp4 experts to x's dtype (exact: an e2m1 value times a power of two fits
bf16) and runs each projection as one grouped product over tiles of one expert's pairs, two ways
(`DSV4_GROUPED_EXPERTS`):
- `tiles` (default): each expert's pairs padded to whole `TILE_ROWS`-row tiles (a bound on the tile
  count known without reading the counts back), one expert id per tile, gather_mm with M = TILE_ROWS.
  On CUDA the registered fast form (`OP`, kernels/cuda/experts_grouped.py) runs the same tiles on the
  mxfp4 weights as stored, in two kernels, and this is its plain twin (`DSV4_GROUPED_MMA=0` runs this).
- `qtiles`: the same tiles through `mx.gather_qmm` on the packed mxfp4 weights: no dequantized copy (at
  V4-Flash's 32 local experts the copies are ~1.6 GB written and read back a layer, every forward).
  Slower than `tiles` on the H200 (2,070 against 2,229 tokens/s at a 2,048-token forward, PART=accept,
  6f0bde6, 2026-12-02).
The products are unsorted and router-weighted exactly as `QuantizedExperts` does for 1..8 rows. (A third
form, M = 1 rows through gather_mm's `sorted_indices` grouped GEMM, gave wrong products on the H200 with MLX
0.32.4 at V4-Flash's dims, 2026-12-02, and was slower than `tiles` there: 891 against 1,232 tokens/s.)

Memory: the dequantized weights are a transient E x 3 x I x H x 2 bytes per layer at most in bf16 (V4-Flash,
32 local experts: 1.6 GB), freed once the layer's products are made.
On MLX's CPU backend gather_mm is f32-only, so there the products run in f32 (the rounding of the hidden
and of each pair's output to x.dtype is kept, as in the reference).
"""

from __future__ import annotations

import os

import mlx.core as mx

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.matmul import GROUP, _is, experts_down_rows_reference, experts_gate_up_rows_reference, swiglu

# Rows above which the experts run grouped. 1..8 rows are the decode step's (the CUDA skinny kernels,
# kernels/cuda/matmul.py MAX_ROWS, read each weight byte once). Estimate for V4-Flash on an H200: the
# per-pair path costs ~11 us a pair (137 ms for 2048 x 6 pairs), the grouped one a fixed ~1 ms per layer
# (dequantize 0.4 GB -> 1.6 GB and read it back) plus its GEMMs, so it wins from about 16 rows; 8 keeps
# one boundary for the decode path. To tune with bench/prefill.py on the GPU.
GROUPED_ROWS = 8
ENV = "DSV4_GROUPED_EXPERTS"
OP = "grouped_experts"  # kernels.backend's name of the fast form (kernels/cuda/experts_grouped.py)
# `tiles`: the rows of a tile (one expert's; its last tile zero-padded). MLX's CUDA gather_mm for M > 1 is a
# tensor-core (mma.sync) GEMM whatever MLX_ENABLE_TF32 says; each expert's weight is read once a tile, and
# the padding is at most E x (TILE_ROWS - 1) rows (2048 x 6 pairs, 32 experts: <= 16%).
TILE_ROWS = 64


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


def mode() -> str:
    """`DSV4_GROUPED_EXPERTS`: `tiles` (default), `qtiles`, or `off` (every row count per pair)."""
    m = os.environ.get(ENV, "tiles").strip().lower() or "tiles"
    if m not in ("tiles", "qtiles", "off"):
        raise ValueError(f"experts_grouped: {ENV}: must be tiles, qtiles or off, got {m!r}")
    return m


_tile_first: dict[int, mx.array] = {}  # nt -> each tile's first padded row (a constant per tile count)


def _layout(ids: mx.array, count: mx.array, e: int) -> tuple[mx.array, mx.array]:
    """Sorted expert ids [P] and each expert's pair count [E] -> (slot [P] int32: each sorted pair's padded
    row, tile_expert [nt] uint32). Each expert's pairs start a tile (a sorted pair s of expert x sits at
    s + pstart[x] - start[x]), so a tile holds one expert's; nt bounds the tiles for any routing (no host
    read of the counts); tiles past the last are E - 1's, all padding."""
    p = ids.shape[0]
    padded = (count + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    pstart = mx.cumsum(padded, inclusive=False)  # each expert's first padded row
    nt = (p + e * (TILE_ROWS - 1)) // TILE_ROWS  # >= sum ceil(count / TILE_ROWS)
    slot = mx.arange(p, dtype=mx.int32) + (pstart - mx.cumsum(count, inclusive=False))[ids]
    if nt not in _tile_first:
        _tile_first[nt] = mx.arange(nt, dtype=mx.int32) * TILE_ROWS
        mx.eval(_tile_first[nt])
    pend = pstart + padded
    tile_expert = mx.minimum(mx.sum(pend[None, :] <= _tile_first[nt][:, None], axis=1), e - 1)
    return slot, tile_expert.astype(mx.uint32)


def tiles(ids: mx.array, e: int) -> tuple[mx.array, mx.array, mx.array]:
    """Sorted expert ids [P] -> (src [R]: the sorted pair a padded row holds, -1 for padding; tile_expert
    [R / TILE_ROWS] uint32; slot [P]: each sorted pair's padded row), R = TILE_ROWS x tile_expert's length."""
    slot, tile_expert = _layout(ids, mx.zeros((e,), mx.int32).at[ids].add(1), e)
    src = mx.full((tile_expert.shape[0] * TILE_ROWS,), -1, mx.int32)
    src[slot] = mx.arange(ids.shape[0], dtype=mx.int32)
    return src, tile_expert, slot


def tile_table(flat: mx.array, e: int) -> tuple[mx.array, mx.array]:
    """The B * k pairs' expert ids `flat` [P] -> (ptab [R] int32: the pair a padded row holds, -1 padding;
    tile_expert [R / TILE_ROWS] uint32): `tiles`' rows for the pairs in `argsort(flat)` order, written by one
    scatter (~20 kernels where `tiles` + the lookups of its sorted pairs took 33)."""
    order = mx.argsort(flat)
    slot, tile_expert = _layout(flat[order], mx.zeros((e,), mx.int32).at[flat].add(1), e)
    ptab = mx.full((tile_expert.shape[0] * TILE_ROWS,), -1, mx.int32)
    ptab[slot] = order.astype(mx.int32)
    return ptab, tile_expert


def grouped_experts(x: mx.array, idx: mx.array, weights: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                    s2: mx.array, w3: mx.array, s3: mx.array, *, limit: float | None,
                    how: str | None = None, pairs: bool = False) -> mx.array:  # fmt: skip
    """sum_j weights[b, j] * expert_{idx[b, j]}(x[b]) -> [B, H] f32, one grouped GEMM per projection;
    `pairs`: each pair's product before that sum, [B, k, H] in x.dtype (for a fused combine).
    `how`: `tiles` (the pairs padded to TILE_ROWS-row tiles of one expert each: gather_mm M = TILE_ROWS) or
    `qtiles` (those tiles through gather_qmm on the mxfp4 weights); None: `mode()`, where `tiles` is the
    registered fast form when there is one (CUDA: the same tiles on the mxfp4 weights in two kernels)."""
    check_grouped("grouped_experts", x, idx, weights, w1, s1, w2, s2, w3, s3)
    if how is None and mode() == "tiles":  # the fast form of `tiles` where one is registered (CUDA)
        fast = backend.pick(OP, None)
        if fast is not None:
            return fast(x, idx, weights, w1, s1, w2, s2, w3, s3, limit=limit, pairs=pairs)
    how = mode() if how is None else how
    if how not in ("tiles", "qtiles"):
        raise ValueError(f"grouped_experts: how: must be tiles or qtiles, got {how!r}")
    b, k = idx.shape
    ct = mx.float32 if mx.default_device() == mx.cpu else x.dtype
    flat = idx.reshape(-1).astype(mx.uint32)
    order = mx.argsort(flat)  # the B * k pairs grouped by expert (any order within an expert)
    ids = flat[order]
    xs = x[order // k].astype(ct)  # [P, H]
    src, tile_expert, slot = tiles(ids, w1.shape[0])
    xs = mx.where((src >= 0)[:, None], xs[mx.maximum(src, 0)], 0).reshape(-1, TILE_ROWS, xs.shape[-1])
    rhs = dict(rhs_indices=tile_expert)
    if how == "qtiles":  # the packed weights as they are: [E, N, K / 8] -> x @ W.T per tile's expert
        def prod(a: mx.array, wq: mx.array, sc: mx.array) -> mx.array:
            return mx.gather_qmm(a, wq, sc, None, transpose=True, group_size=GROUP, bits=4, mode="mxfp4", **rhs)
    else:
        def prod(a: mx.array, wq: mx.array, sc: mx.array) -> mx.array:
            return mx.gather_mm(a, _dequant(wq, sc, ct), **rhs)
    g, u = prod(xs, w1, s1), prod(xs, w3, s3)
    hdn = swiglu(g.astype(mx.float32), u.astype(mx.float32), limit).astype(x.dtype).astype(ct)
    out = prod(hdn, w2, s2)  # [tiles, TILE_ROWS, H]
    out = out.reshape(-1, out.shape[-1])[slot]  # back to the sorted pairs
    out = out.astype(x.dtype)[mx.argsort(order)].reshape(b, k, -1)  # back to [B, k, H]
    return out if pairs else mx.sum(out.astype(mx.float32) * weights[:, :, None], axis=1)


def experts_rows_reference(x: mx.array, idx: mx.array, weights: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                           s2: mx.array, w3: mx.array, s3: mx.array, *, limit: float | None) -> mx.array:  # fmt: skip
    """The plain twin: each (row, k) pair through its own expert (kernels.matmul's references), then the
    router-weighted sum in f32, as `QuantizedExperts` does for 1..GROUPED_ROWS rows."""
    check_grouped("grouped_experts", x, idx, weights, w1, s1, w2, s2, w3, s3)
    ri = idx.astype(mx.uint32)
    hdn = experts_gate_up_rows_reference(x, ri, w1, s1, w3, s3, limit=limit)
    out = experts_down_rows_reference(hdn, ri, w2, s2)
    return mx.sum(out.astype(mx.float32) * weights[:, :, None], axis=1)
