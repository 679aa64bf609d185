"""Skinny matmuls for 1..8 rows on CUDA: the launch plans and the ops (the device code and its layout:
kernels/cuda/matmul_src.py; `kernels.matmul` has the plain twins). 9..64 rows (a short prompt's forward) run
as 8-row groups of one launch, each group's bits those of an 8-row launch of its rows (`GROUPED_ROWS`; with
`GROUP_LOOP` each block runs them in turn over its weight tile, read from DRAM once).

`geometry` sets a launch's shape by product kind: a warp's next loads wait for its last products, so the
warps in flight set the bytes in flight (`DENSE` / `EXPERTS`, timed by bench/matmuls.py). A `Plan` is one
(op, shapes, dtypes) combination's template values, grid and output, computed once (`plan_cached`); shapes
or dtypes the kernel does not take run the reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels import matmul as ref
from dsv4_serve.kernels.cuda import tiles_mm
from dsv4_serve.kernels.cuda.common import E2M1, arange_rows, dummy, f32_params, kernel, launch_bounds, plan_cached
from dsv4_serve.kernels.cuda.matmul_src import SOURCE

MAX_ROWS = 8  # the mma's n: a group's rows
GROUPED_ROWS = 64  # the most rows a launch takes as 8-row groups (kernels.matmul.MANY_ROWS: a short prompt's forward)
# DSV4_SKINNY_GROUP_LOOP=1: those groups run in turn by each block over its weight tile (`GR` 2: the weights read
# from DRAM once, not once a group). Off until its gpu test (tests/kernels/test_cuda_matmul.py, the groups against
# the 8-row launches bit for bit) has passed on a GPU; bench/prefill.py's arm `group_loop` measures it.
GROUP_LOOP = os.environ.get("DSV4_SKINNY_GROUP_LOOP", "0").strip() not in ("0", "")
INPUTS = ("x", "w", "s", "w2", "s2", "idx", "fparams")
CK = {0: 32, 1: 64, 2: 128}  # k values a chunk by weight format
# U by weight format: chunks whose loads a warp issues before using any (mxfp4 at 4: the routed experts at 8
# rows 120.5 + 81.1 -> 113.1 + 67.8 us, the same at 1 row; bench/matmuls.py, H200, 2026-12-03)
UNROLL = {0: 4, 1: 4, 2: 4}
# Warps a launch aims at (K split among warps until there are this many), the fewest iterations a warp keeps and
# the most warps splitting K. A warp's loads wait for its last iteration's products, so the bytes in flight
# are the warps': the dense products measured fastest at 4,096 warps and K split down to one iteration a
# warp (bench/matmuls.py, H200, 2026-12-03: wq_a + wkv 7.2 -> 4.9 us, the shared expert's gate + up 17.8 ->
# 9.8, wo_b 26.0 -> 17.8, the head 421 -> 351 at 1 row); the routed experts (a launch is every chosen
# expert's grid) at 1,024 a expert and two iterations (the dense form made them 1.5-1.7x slower).
DENSE = {"target_warps": 4096, "min_iters": 1, "max_wk": 32}
EXPERTS = {"target_warps": 1024, "min_iters": 2, "max_wk": 16}


def _const(name: str) -> mx.array:
    """The launches' unread inputs: `u8` absent scales, `u32` absent expert ids."""
    return dummy((4,), mx.uint8 if name == "u8" else mx.uint32)


def geometry(n: int, k: int, wf: int, pair: int, exp: int = 0) -> tuple[int, int, int, int] | None:
    """(MT, WK, WR, U): row tiles a warp, warps splitting K, warps over rows, chunks an iteration; None
    when the shape does not tile (n % 16, k % chunk)."""
    ck = CK[wf]
    if n % 16 or k % ck:
        return None
    g = EXPERTS if exp else DENSE
    tiles, chunks = n // 16, k // ck
    mt = 2 if tiles >= 2 * g["target_warps"] and not pair else 1
    wt = tiles // mt
    u = UNROLL[wf]
    while u > 1 and chunks % u:
        u //= 2
    wk = 1
    while (wt * wk < g["target_warps"] and wk < g["max_wk"] and chunks % (2 * wk * u) == 0
           and chunks // (2 * wk) >= g["min_iters"] * u):  # fmt: skip
        wk *= 2
    wr = max(1, 8 // wk)
    while wt % wr:
        wr //= 2
    return mt, wk, wr, u


class Plan:
    """Launch parameters of one (op, shapes, dtypes) combination, computed once."""

    __slots__ = ("dtype", "fast", "fparams", "grid", "kernel", "nt", "shape", "tmpl")

    def __init__(self, dtype: mx.Dtype, nb: int, k: int, n: int, wf: int, *, out: mx.Dtype, pair: int, exp: int,
                 topk: int, limit: float | None, n2: int = 0, dense: bool = False) -> None:  # fmt: skip
        geo = geometry(n + n2, k, wf, pair, 0 if dense else exp)  # dense: every group's weight is read
        most = MAX_ROWS if dense else GROUPED_ROWS  # dense: the pairs' blocks follow the first row's groups
        self.fast = dtype == mx.bfloat16 and 1 <= nb <= most and geo is not None
        if self.fast and n2:  # CAT: no warp's row tiles may straddle the two weights
            self.fast = n % (16 * geo[0]) == 0
        if not self.fast:
            return
        mt, wk, wr, u = geo
        loop = GROUP_LOOP and nb > MAX_ROWS
        # past 512 threads a block the registers a thread must fit 64K / threads: ptxas is told so
        bounds = launch_bounds(32 * wk * wr, 1) if 32 * wk * wr > 512 else ""
        self.kernel = kernel("skinny_mm", INPUTS, ("out",), SOURCE, header=E2M1 + bounds)
        self.tmpl = [("T", dtype), ("O", out), ("WF", wf), ("K", k), ("N", n), ("MT", mt), ("PAIR", pair),
                     ("WK", wk), ("WR", wr), ("U", u), ("EXP", exp), ("TOPK", max(topk, 1)), ("N2", n2),
                     ("GR", 0 if nb <= MAX_ROWS else 2 if loop else 1)]  # fmt: skip
        self.nt = 32 * wk * wr
        # dense (the grouped product): every row's pair j is group j, so the first row's pairs are all the blocks;
        # past 8 rows the 8-row groups are grid.y (grid.z for experts, whose grid.y is a group's pairs), or each
        # block runs them in turn (`loop`; experts: grid.y is every row's pairs)
        groups = 1 if loop else -(-nb // MAX_ROWS)
        x_blocks = (n + n2) // (16 * mt * wr) * self.nt
        if exp:
            self.grid = (x_blocks, topk if dense else (nb if loop else min(nb, MAX_ROWS)) * topk, groups)
        else:
            self.grid = (x_blocks, groups, 1)
        self.shape = (nb * topk, n) if exp else ((2, nb, n) if pair == 2 else ((nb * (n + n2),) if n2 else (nb, n)))
        self.dtype = out
        self.fparams = f32_params(float(limit or 0.0), float(nb))

    def __call__(self, x: mx.array, w: mx.array, s: mx.array, w2: mx.array, s2: mx.array, idx: mx.array) -> mx.array:
        return self.kernel(inputs=[x, w, s, w2, s2, idx, self.fparams], template=self.tmpl, grid=self.grid,
                           threadgroup=(self.nt, 1, 1), output_shapes=[self.shape],
                           output_dtypes=[self.dtype])[0]  # fmt: skip


def _plan(op: str, arrays: tuple[object, ...], check: Callable[[], object], **kw: Any) -> Plan | None:
    """The cached plan of `op` for these arrays (None: not arrays; the reference's check names the argument)."""
    if not all(isinstance(a, mx.array) for a in arrays):
        return None
    key = (op, *((a.shape, a.dtype) for a in arrays), tuple(sorted(kw.items())), GROUP_LOOP)

    def make() -> Plan:
        check()  # once per shape key
        return Plan(**kw)

    return plan_cached(key, make)


def qlinear_rows_cuda(x: mx.array, w: mx.array, scales: mx.array) -> mx.array:
    p = None
    if isinstance(x, mx.array) and x.ndim == 2 and isinstance(w, mx.array) and w.ndim == 2:
        p = _plan("qlinear", (x, w, scales), lambda: ref.check_linear("qlinear_rows", x, w, scales, 8),
                  dtype=x.dtype, nb=x.shape[0], k=x.shape[1], n=w.shape[0], wf=1, out=x.dtype, pair=0, exp=0,
                  topk=0, limit=None)  # fmt: skip
    if p is None or not p.fast:
        return ref.qlinear_rows_reference(x, w, scales)
    return p(x, w, scales, w, scales, _const("u32"))


def f32_linear_rows_cuda(x: mx.array, w: mx.array) -> mx.array:
    p = None
    if isinstance(x, mx.array) and x.ndim == 2 and isinstance(w, mx.array) and w.dtype == mx.bfloat16:
        p = _plan("f32_linear", (x, w), lambda: ref.check_linear("f32_linear_rows", x, w, None, None),
                  dtype=x.dtype, nb=x.shape[0],
                  k=x.shape[1], n=w.shape[0], wf=0, out=mx.float32, pair=0, exp=0, topk=0, limit=None)  # fmt: skip
    if p is None or not p.fast:
        many = tiles_mm.f32_linear_many(x, w) if tiles_mm.F32_MANY else None  # prefill's rows: tensor cores
        return ref.f32_linear_rows_reference(x, w) if many is None else many
    u8 = _const("u8")
    return p(x, w, u8, w, u8, _const("u32"))


def swiglu_rows_cuda(x: mx.array, w1: mx.array, s1: mx.array, w3: mx.array, s3: mx.array, *,
                     limit: float | None) -> mx.array:  # fmt: skip
    p = None
    if isinstance(x, mx.array) and x.ndim == 2 and isinstance(w1, mx.array) and w1.ndim == 2:
        p = _plan("swiglu", (x, w1, s1, w3, s3),
                  lambda: [ref.check_linear("swiglu_rows", x, a, s, 8) for a, s in ((w1, s1), (w3, s3))],
                  dtype=x.dtype, nb=x.shape[0], k=x.shape[1], n=w1.shape[0], wf=1, out=x.dtype, pair=1, exp=0,
                  topk=0, limit=limit)  # fmt: skip
    if p is None or not p.fast or w3.shape != w1.shape:
        return ref.swiglu_rows_reference(x, w1, s1, w3, s3, limit=limit)
    return p(x, w1, s1, w3, s3, _const("u32"))


def f32_linear_pair_rows_cuda(x: mx.array, w1: mx.array, w2: mx.array) -> tuple[mx.array, mx.array]:
    p = None
    if (isinstance(x, mx.array) and x.ndim == 2 and isinstance(w1, mx.array) and w1.dtype == mx.bfloat16
            and isinstance(w2, mx.array) and w2.dtype == w1.dtype and w2.shape == w1.shape):  # fmt: skip
        p = _plan("f32_linear_pair", (x, w1, w2), lambda: ref.check_pair("f32_linear_pair_rows", x, w1, w2),
                  dtype=x.dtype, nb=x.shape[0], k=x.shape[1], n=w1.shape[0], wf=0, out=mx.float32, pair=2, exp=0,
                  topk=0, limit=None)  # fmt: skip
    if p is None or not p.fast:
        many = tiles_mm.f32_linear_pair_many(x, w1, w2) if tiles_mm.F32_MANY else None
        return ref.f32_linear_pair_rows_reference(x, w1, w2) if many is None else many
    u8 = _const("u8")
    out = p(x, w1, u8, w2, u8, _const("u32"))
    b, n = out.shape[1:]  # views: an integer index (out[0]) would be a gather kernel each
    return _rows_view(out, b, n, 0), _rows_view(out, b, n, b * n)


def qlinear_cat_rows_cuda(x: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                          s2: mx.array) -> tuple[mx.array, mx.array]:  # fmt: skip
    p = None
    if (isinstance(x, mx.array) and x.ndim == 2 and isinstance(w1, mx.array) and w1.ndim == 2
            and isinstance(w2, mx.array) and w2.ndim == 2):  # fmt: skip
        p = _plan("qlinear_cat", (x, w1, s1, w2, s2),
                  lambda: [ref.check_linear("qlinear_cat_rows", x, a, s, 8) for a, s in ((w1, s1), (w2, s2))],
                  dtype=x.dtype, nb=x.shape[0], k=x.shape[1], n=w1.shape[0], wf=1, out=x.dtype, pair=3, exp=0,
                  topk=0, limit=None, n2=w2.shape[0])  # fmt: skip
    if p is None or not p.fast:  # each product its own launch (the checks name a bad argument)
        return qlinear_rows_cuda(x, w1, s1), qlinear_rows_cuda(x, w2, s2)
    out = p(x, w1, s1, w2, s2, _const("u32"))
    b, n1 = x.shape[0], w1.shape[0]
    return _rows_view(out, b, n1, 0), _rows_view(out, b, w2.shape[0], b * n1)


def _rows_view(out: mx.array, rows: int, cols: int, offset: int) -> mx.array:
    """The row-major [rows, cols] block of `out`'s buffer at element `offset`: one view node (AsStrided), where
    a slice and a reshape are two (each a node of the compiled segment's replay and of MLX's encode)."""
    return mx.as_strided(out, (rows, cols), (cols, 1), offset)


def grouped_qlinear_rows_cuda(x: mx.array, w: mx.array, scales: mx.array) -> mx.array:
    """attention's wo_a: group g of x [B, G, K] through mxfp8 weight g of [G, N, K / 4], one launch (EXP 2: the
    groups are the pairs' experts, x's groups their hidden rows; each weight read once for all rows)."""
    p = None
    if isinstance(x, mx.array) and x.ndim == 3 and isinstance(w, mx.array) and w.ndim == 3:
        p = _plan("grouped_qlinear", (x, w, scales), lambda: ref.check_grouped("grouped_qlinear_rows", x, w, scales),
                  dtype=x.dtype, nb=x.shape[0], k=x.shape[2], n=w.shape[1], wf=1, out=x.dtype, pair=0, exp=2,
                  topk=x.shape[1], limit=None, dense=True)  # fmt: skip
    if p is None or not p.fast:
        return ref.grouped_qlinear_rows_reference(x, w, scales)
    b, g, k = x.shape
    # every row's pair j is group j
    return p(x.reshape(b * g, k), w, scales, w, scales, arange_rows(b, g, mx.uint32)).reshape(b, g, w.shape[1])


def _experts_ok(x: object, idx: object, w: object, xdim: int) -> bool:
    return (isinstance(x, mx.array) and isinstance(idx, mx.array) and isinstance(w, mx.array) and x.ndim == xdim
            and idx.ndim == 2 and idx.dtype == mx.uint32 and w.ndim == 3)  # fmt: skip


def experts_gate_up_rows_cuda(x: mx.array, idx: mx.array, w1: mx.array, s1: mx.array, w3: mx.array, s3: mx.array,
                              *, limit: float | None) -> mx.array:  # fmt: skip
    p = None
    if _experts_ok(x, idx, w1, 2):
        p = _plan("experts_gate_up", (x, idx, w1, s1, w3, s3),
                  lambda: (ref.check_experts("experts_gate_up_rows", x, idx, w1, s1, per_pair=False),
                           ref.check_experts("experts_gate_up_rows", x, idx, w3, s3, per_pair=False)),
                  dtype=x.dtype, nb=idx.shape[0], k=x.shape[1], n=w1.shape[1], wf=2, out=x.dtype, pair=1, exp=1,
                  topk=idx.shape[1], limit=limit)  # fmt: skip
    if p is None or not p.fast or w3.shape != w1.shape:
        return ref.experts_gate_up_rows_reference(x, idx, w1, s1, w3, s3, limit=limit)
    b, k = idx.shape
    return p(x, w1, s1, w3, s3, idx).reshape(b, k, w1.shape[1])


def experts_down_rows_cuda(h: mx.array, idx: mx.array, w2: mx.array, s2: mx.array) -> mx.array:
    p = None
    if _experts_ok(h, idx, w2, 3):
        p = _plan("experts_down", (h, idx, w2, s2),
                  lambda: ref.check_experts("experts_down_rows", h, idx, w2, s2, per_pair=True),
                  dtype=h.dtype, nb=idx.shape[0], k=h.shape[2], n=w2.shape[1], wf=2, out=h.dtype, pair=0, exp=2,
                  topk=idx.shape[1], limit=None)  # fmt: skip
    if p is None or not p.fast:
        return ref.experts_down_rows_reference(h, idx, w2, s2)
    b, k = idx.shape
    return p(h, w2, s2, w2, s2, idx).reshape(b, k, w2.shape[1])


# 9..GROUPED_ROWS rows as 8-row groups of one launch (kernels.matmul.launch_rows); grouped_qlinear_rows stays at 8
for _fn in (qlinear_rows_cuda, f32_linear_rows_cuda, swiglu_rows_cuda, f32_linear_pair_rows_cuda,
            qlinear_cat_rows_cuda, experts_gate_up_rows_cuda, experts_down_rows_cuda):  # fmt: skip
    _fn.rows_per_launch = GROUPED_ROWS  # type: ignore[attr-defined]
