"""Inputs for bench/kernels.py: one op case (rows, context); the 43-layer chained emulation is bench/chain43.py."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

import dsv4_serve.kernels.cuda as kc
from dsv4_serve.kernels import Row, RowBatch
from dsv4_serve.kernels.compressor import (
    compressor_pair_rows_inplace_reference,
    compressor_rows_inplace_reference,
)
from dsv4_serve.kernels.compressor import new_workspace as new_comp_workspace
from dsv4_serve.kernels.indexer import indexer_rows_reference, new_workspace
from dsv4_serve.kernels.sparse_attention import sparse_attention_rows_reference

PAGE, NH, D, DI, NI, W, TOPK, HALF = 64, 64, 512, 128, 64, 128, 512, 32
# The compressor as the model runs it: in place on CUDA (state + pool written through their buffers, a
# token for the readers), the functional update in the reference. Both return (kv, score, pool, token).
# The op cases' indexer and compressor calls take a workspace as the model's do (bench/host_cost.py --ws-ab: off)
CASE_WS = True
REF = {"compressor_rows": compressor_rows_inplace_reference, "compressor_pair": compressor_pair_rows_inplace_reference,
       "indexer_rows": indexer_rows_reference, "sparse_attention_rows": sparse_attention_rows_reference}  # fmt: skip
FAST = {"compressor_rows": kc.compressor_rows_inplace_cuda, "compressor_pair": kc.compressor_pair_rows_inplace_cuda,
        "indexer_rows": kc.indexer_rows_cuda, "sparse_attention_rows": kc.sparse_attention_rows_cuda}  # fmt: skip


@dataclass
class Case:
    op: str
    bytes: int
    call: Callable[[Callable[..., Any], RowBatch, Any], Any]  # (impl, batch, prev) -> state/output
    batch: RowBatch
    singles: list[RowBatch]
    init: Any

    def ref(self, prev: Any = None) -> Any:
        return self.call(REF[self.op], self.batch, self.init if prev is None else prev)

    def fast(self, prev: Any = None) -> Any:
        return self.call(FAST[self.op], self.batch, self.init if prev is None else prev)

    def single(self, prev: Any = None) -> Any:
        x = self.init if prev is None else prev
        for b in self.singles:
            x = self.call(FAST[self.op], b, x)
        return x

    def chain(self, link: Callable[[Any], Any], n: int, compiled: bool = False) -> Callable[[], Any]:
        """n dependent calls of `link`; `compiled`: the whole chain under one `mx.compile` (traced once,
        then replayed: the Python and graph-building cost per call goes, the kernels' launches stay)."""

        def run() -> Any:
            x = None
            for _ in range(n):
                x = link(x)
            return x

        return mx.compile(run) if compiled else run


def _tables(rng: np.random.Generator, rows: int, entries: int, distinct: bool = True) -> tuple[list[list[int]], int]:
    need = max(1, -(-entries // PAGE))
    if not distinct:  # writers only: one page per row, repeated (a small pool keeps the scatters honest)
        return [[i + 1] * need for i in range(rows)], rows + 1
    perm = (rng.permutation(rows * need) + 1).tolist()
    return [perm[i * need : (i + 1) * need] for i in range(rows)], rows * need + 1


def _batch(tables: dict[int, list[list[int]]], rows: int, ctx: int) -> tuple[RowBatch, list[RowBatch]]:
    rs = [Row(i, ctx - 1, i, {r: tuple(t[i]) for r, t in tables.items()}) for i in range(rows)]
    widths = {r: max(len(x) for x in t) for r, t in tables.items()}
    b, singles = RowBatch.build(rs, PAGE, widths), [RowBatch.build([r], PAGE, widths) for r in rs]
    mx.eval([(x.slots, x.positions, x.q_rows, *x.tables.values()) for x in (b, *singles)])  # not inside a trace
    return b, singles


def indexer_inputs(rng: np.random.Generator, rows: int, ctx: int) -> tuple[RowBatch, list[RowBatch], mx.array,
                                                                          mx.array, mx.array]:  # fmt: skip
    """The indexer's batch (every row at `ctx`, its own pages), its single-row batches, q, weights, keys."""
    tables, pages = _tables(rng, rows, ctx // 4)
    batch, singles = _batch({4: tables}, rows, ctx)
    q = mx.random.normal((rows, NI, DI)).astype(mx.bfloat16)
    w = mx.random.normal((rows, NI)) * (DI**-0.5 * NI**-0.5)
    keys = mx.random.normal((pages, PAGE, DI)).astype(mx.bfloat16)
    mx.eval(q, w, keys)
    return batch, singles, q, w, keys


def attention_inputs(rng: np.random.Generator, rows: int, ctx: int, ratio: int) -> tuple[Any, ...]:
    """The attention's batch, single-row batches, q, window, pool, indices, sinks. ratio 4: CSA (TOPK
    selected ids), 128: HCA (indices None: every entry of the row's table), 0: sliding (no pool)."""
    n = ctx // ratio if ratio else 0
    tables, pages = _tables(rng, rows, max(n, 1))
    batch, singles = _batch({ratio or 4: tables}, rows, ctx)
    q = mx.random.normal((rows, NH, D)).astype(mx.bfloat16)
    window = mx.random.normal((rows, W, D)).astype(mx.bfloat16)
    pool = mx.random.normal((pages, PAGE, D)).astype(mx.bfloat16) if ratio else None
    ind = mx.array(np.stack([rng.choice(n, TOPK, replace=False) for _ in range(rows)]).astype(np.int32)) \
        if ratio == 4 else None  # fmt: skip
    sinks = mx.random.normal((NH,))
    mx.eval(q, window, sinks, *[x for x in (pool, ind) if x is not None])
    return batch, singles, q, window, pool, ind, sinks


LINKS = ("after", "data")  # how chained indexer / attention calls wait for the last (make_case)


def add_link_argument(ap: argparse.ArgumentParser) -> None:
    """The benches' `--link` option (make_case's `link`)."""
    ap.add_argument("--link", default=LINKS[0], choices=LINKS,
                    help="how chained indexer / attention calls wait for the last (bench.cases.make_case; data: "
                         "before c5999d3, the indexer's weights behind a `where` node)")  # fmt: skip


def make_case(op: str, rows: int, ctx: int, seed: int = 0, link: str = LINKS[0]) -> Case:
    """`op`: an op name, with `:128` for the HCA form of the compressor (ratio 128) or of the attention
    (the window + every entry of the row's table); the CSA form (ratio 4) otherwise. `link`: how a chained
    indexer or attention call waits for the last one. "after": the last output is also its `after` input
    (a CUDA-graph edge with no node, as the model's step links them); the references route their page
    tables through it, so mx.compile cannot share one call's key gather with the next (in the model every
    layer reads its own pools). "data" (before c5999d3): the attention's q only, and the indexer's weights
    behind a `where` on the last ids (one elementwise node per call: the bench's, not the op's); a compiled
    reference chain then gathers its keys once for all its calls (common subexpressions)."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {LINKS}, got {link!r}")
    rng = np.random.default_rng(seed)
    op, _, r = op.partition(":")
    ratio = int(r) if r else 4
    if op == "compressor_rows":
        d, coff = D, 2 if ratio == 4 else 1
        tables, pages = _tables(rng, rows, ctx // ratio, distinct=False)
        batch, singles = _batch({ratio: tables}, rows, ctx)
        c = coff * d
        kv, score = mx.random.normal((rows, c)), mx.random.normal((rows, c))
        ape, norm = mx.random.normal((ratio, c)), mx.ones((d,))
        ang = mx.random.uniform(-math.pi, math.pi, (rows, HALF))
        cos, sin = mx.cos(ang), mx.sin(ang)
        init = (mx.random.normal((rows, coff * ratio, c)), mx.random.normal((rows, coff * ratio, c)),
                mx.random.normal((pages, PAGE, d)).astype(mx.bfloat16))  # fmt: skip
        mx.eval(kv, score, ape, norm, cos, sin, init)

        # as the model's (StatePools.comp_ws): the chained calls share it, in order
        ws = new_comp_workspace(rows, d) if CASE_WS else None

        def call(impl: Callable[..., Any], b: RowBatch, st: Any) -> Any:
            # st: (kv_state, score_state, pool[, token]): a chained in-place call follows the last one's token
            kw = {"after": st[3]} if len(st) == 4 else {}
            # the functional op (bench/kernels.py's check) takes none
            if impl is not kc.compressor_rows_cuda and ws is not None:
                kw["workspace"] = ws
            return impl(b, kv, score, ape, norm, *st[:3], ratio=ratio, head_dim=d, eps=1e-6, cos=cos, sin=sin,
                        **kw)  # fmt: skip

        nbytes = rows * (2 * coff * ratio * c * 4 * 2 + 2 * c * 4 + d * 2)
        return Case(op, nbytes, call, batch, singles, init)
    if op == "indexer_rows":
        n = ctx // 4
        batch, singles, q, w, keys = indexer_inputs(rng, rows, ctx)

        # as the model's (StatePools.idx_ws): the chained calls share it, in order
        ws = new_workspace(rows, batch.tables[4].shape[1] * PAGE) if CASE_WS else None

        def call_i(impl: Callable[..., Any], b: RowBatch, prev: Any) -> Any:
            # an edge in MLX's CUDA graph either way, so the calls run one after another on the GPU
            # (mx.depends makes no edge there); "data": ids are >= -1, so the weights pass unchanged
            if prev is None:
                return impl(b, q, w, keys, topk=TOPK, workspace=ws)
            if link == "after":
                return impl(b, q, w, keys, topk=TOPK, after=prev, workspace=ws)
            return impl(b, q, mx.where(prev[:, :1] < -1, 0.0, w), keys, topk=TOPK, workspace=ws)

        return Case(op, rows * (n * DI * 2 + NI * DI * 2 + TOPK * 4), call_i, batch, singles, None)
    batch, singles, q, window, pool, ind, sinks = attention_inputs(rng, rows, ctx, ratio)
    keys = TOPK if ratio == 4 else ctx // ratio

    def call_a(impl: Callable[..., Any], b: RowBatch, prev: Any) -> Any:
        # the previous call's output (q's shape and dtype) is this call's q (and `after`): no extra op
        kw = {"after": prev} if prev is not None and link == "after" else {}
        return impl(b, q if prev is None else prev, window, pool, ind, sinks, scale=D**-0.5, ratio=ratio, **kw)

    return Case(op, rows * ((W + keys) * D * 2 + 2 * NH * D * 2), call_a, batch, singles, None)


def functional(*args: Any, after: None = None, workspace: Any = None, **kw: Any
               ) -> tuple[mx.array, mx.array, mx.array, None]:  # fmt: skip
    """The functional CUDA compressor (kernel + pool scatter, new arrays) in the in-place op's shape (its
    calls return no token, so `after` is always None; it has no scratch, so `workspace` goes unused)."""
    assert after is None, "functional: the functional op does not wait for an in-place write"
    return (*kc.compressor_rows_cuda(*args, **kw), None)
