"""Inputs for bench/kernels.py: one op case (rows, context) and the 43-layer chained emulation."""

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
    CompressorArgs,
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


@dataclass
class Chain:
    ref: Callable[[], Any]
    fast: Callable[[], Any]
    ref_c: Callable[[], Any]  # the step under mx.compile
    fast_c: Callable[[], Any]
    fast_c_dep: Callable[[], Any]  # fast_c with the layers linked by mx.depends (the emulation before 107803a)


class _Runner:
    """Runs a functional step `(state) -> (h, state)` on its own state, one call per step."""

    def __init__(self, step: Callable[..., Any], consts: dict[str, Any], state: list[dict[str, mx.array]]) -> None:
        self.step, self.consts, self.state = step, consts, state

    def __call__(self) -> Any:
        # inputs, not captured constants (mx.compile rejects depends() between the two);
        # the old state is dropped before the eval: donatable
        h, self.state = self.step(self.consts, self.state)
        return [h] + [v for s in self.state for v in s.values()]


def chain43(rows: int, ctx: int, kinds: list[int] | None = None, link: str = "after",
            drop: frozenset[str] = frozenset()) -> Chain:  # fmt: skip
    """43 layers (2 sliding, 21 CSA, 20 HCA) of the three ops, chained through q, one eval per step.

    `link`: how a layer's compressors (and through their tokens its indexer) wait for the previous
    layer's output h. "after" (the emulation): h is both compressors' `after` input, a CUDA-graph edge
    with no node of its own, as in the model, where they read projections of h. "depends" (before
    107803a): one `mx.depends` per layer on their inputs, which MLX's CUDA graph does not see, so every
    layer's compressors and indexer could run at once, off the step's critical path. `drop`
    (host-cost probes): "icomp" leaves out the indexer's compressor, "pair" runs a CSA layer's two
    compressors as two dispatches (as before compressor_pair_rows_inplace), "ws" runs the indexer and the
    HCA compressor without their workspaces (their scratch zeroed by init_value fill nodes, as before),
    "indexer" the indexer (the attention then reads fixed ids)."""
    rng = np.random.default_rng(1)
    kinds = kinds or [0, 0] + [4, 128] * 20 + [4]
    t4, p4 = _tables(rng, rows, ctx // 4)
    t128, p128 = _tables(rng, rows, ctx // 128)
    batch, _ = _batch({4: t4, 128: t128}, rows, ctx)
    q = mx.random.normal((rows, NH, D)).astype(mx.bfloat16)
    qi = mx.random.normal((rows, NI, DI)).astype(mx.bfloat16)
    wi = mx.random.normal((rows, NI)) * (DI**-0.5 * NI**-0.5)
    sinks = mx.random.normal((NH,))
    ang = mx.random.uniform(-math.pi, math.pi, (rows, HALF))
    cos, sin = mx.cos(ang), mx.sin(ang)
    x = {c: (mx.random.normal((rows, c)), mx.random.normal((rows, c))) for c in (2 * D, 2 * DI, D)}
    apes = {(4, D): mx.random.normal((4, 2 * D)), (4, DI): mx.random.normal((4, 2 * DI)),
            (128, D): mx.random.normal((128, D))}  # fmt: skip
    norms = {d: mx.ones((d,)) for d in (D, DI)}
    cap = len(t128[0]) * PAGE
    ids = mx.arange(cap, dtype=mx.int32)[None, :]
    hca_ind = mx.where(ids < (ctx // 128), ids, -1) * mx.ones((rows, 1), mx.int32)
    consts = {"q": q, "qi": qi, "x": {str(c): v for c, v in x.items()}}
    mx.eval(q, qi, wi, sinks, cos, sin, x, apes, norms, hca_ind)

    def fresh() -> list[dict[str, mx.array]]:
        st = []
        for k in kinds:
            s = {"win": mx.random.normal((rows, W, D)).astype(mx.bfloat16)}
            if k == 4:
                s |= {"ckv": mx.random.normal((p4, PAGE, D)).astype(mx.bfloat16), "ck": mx.zeros((rows, 8, 2 * D)),
                      "cs": mx.zeros((rows, 8, 2 * D)), "ik": mx.random.normal((p4, PAGE, DI)).astype(mx.bfloat16),
                      "ikv": mx.zeros((rows, 8, 2 * DI)), "is": mx.zeros((rows, 8, 2 * DI)),
                      "ws": new_workspace(rows, len(t4[0]) * PAGE)}  # fmt: skip
            elif k == 128:
                s |= {"ckv": mx.random.normal((p128, PAGE, D)).astype(mx.bfloat16),
                      "ck": mx.zeros((rows, 128, D)), "cs": mx.zeros((rows, 128, D)),
                      "cws": new_comp_workspace(rows, D)}  # fmt: skip
            st.append(s)
        mx.eval(st)
        return st

    # the ids the attention reads when the indexer is dropped: TOPK distinct entries (-1 past the row's)
    fixed_ind = np.full((rows, TOPK), -1, np.int32)
    for r in range(rows):
        ids = rng.permutation(ctx // 4)[:TOPK]
        fixed_ind[r, : len(ids)] = ids

    def comp(impl: Any, xs: dict[str, mx.array], s: dict[str, mx.array], kk: str, ks: str, pk: str, ratio: int,
             d: int, after: Any = None, workspace: Any = None) -> mx.array | None:  # fmt: skip
        """The compressor as the model runs it; returns the pool readers' `after` token (None: functional)."""
        kv, sc = xs[str((2 if ratio == 4 else 1) * d)]
        kw = ({} if after is None else {"after": after}) | ({} if workspace is None else {"workspace": workspace})
        s[kk], s[ks], s[pk], token = impl(batch, kv, sc, apes[(ratio, d)], norms[d], s[kk], s[ks], s[pk],
                                          ratio=ratio, head_dim=d, eps=1e-6, cos=cos, sin=sin, **kw)  # fmt: skip
        return token

    def pair_args(xs: dict[str, mx.array], s: dict[str, mx.array], kk: str, ks: str, pk: str, d: int
                  ) -> CompressorArgs:  # fmt: skip
        kv, sc = xs[str(2 * d)]
        return CompressorArgs(kv, sc, apes[(4, d)], norms[d], s[kk], s[ks], s[pk], d)

    def step_with(ops: dict[str, Any], link: str = link) -> Callable[[Any], Any]:
        def step(cs: dict[str, Any], state: list[dict[str, mx.array]]) -> Any:
            # Links as in a real step: the attention output h is the next layer's q, and a layer's
            # other inputs (the compressors' kv / score, the indexer's q; projections of h in the
            # model) wait for h through one mx.depends per layer. Inside a layer the ops are linked
            # by their data: pools -> indexer / attention, top-k ids -> attention.
            h: Any = cs["q"]
            new = []
            for i, (k, s) in enumerate(zip(kinds, state, strict=True)):
                s = dict(s)
                attn = ops["sparse_attention_rows"]
                if k == 0:
                    h = attn(batch, h, s["win"], None, None, sinks, scale=D**-0.5)
                    new.append(s)
                    continue
                names = [str(c) for c in ((2 * D, 2 * DI) if k == 4 else (D,))]
                flat = [v for n in names for v in cs["x"][n]] + ([cs["qi"]] if k == 4 else [])
                if i > 0 and link == "depends":
                    flat = mx.depends(flat, [h])
                prev = h if i > 0 and link == "after" else None
                xs = {n: (flat[2 * j], flat[2 * j + 1]) for j, n in enumerate(names)}
                if k == 4 and "icomp" in drop:
                    after = ik_after = comp(ops["compressor_rows"], xs, s, "ck", "cs", "ckv", 4, D, prev)
                elif k == 4 and "pair" in drop:  # the two compressors as two dispatches (before the pair op)
                    after = comp(ops["compressor_rows"], xs, s, "ck", "cs", "ckv", 4, D, prev)
                    ik_after = comp(ops["compressor_rows"], xs, s, "ikv", "is", "ik", 4, DI, prev)
                elif k == 4:  # as the model: the main and the indexer's compressor in one dispatch
                    m, i, after = ops["compressor_pair"](
                        batch, pair_args(xs, s, "ck", "cs", "ckv", D), pair_args(xs, s, "ikv", "is", "ik", DI),
                        ratio=4, eps=1e-6, cos=cos, sin=sin, **({} if prev is None else {"after": prev}))  # fmt: skip
                    (s["ck"], s["cs"], s["ckv"]), (s["ikv"], s["is"], s["ik"]), ik_after = m, i, after
                if k == 4:
                    ind = mx.array(fixed_ind)
                    if "indexer" not in drop:
                        ind = ops["indexer_rows"](batch, flat[-1], wi, s["ik"], topk=TOPK, after=ik_after,
                                                  workspace=None if "ws" in drop else s["ws"])  # fmt: skip
                    h = attn(batch, h, s["win"], s["ckv"], ind, sinks, scale=D**-0.5, ratio=4, after=after)
                else:
                    after = comp(ops["compressor_rows"], xs, s, "ck", "cs", "ckv", 128, D, prev,
                                 None if "ws" in drop else s["cws"])  # fmt: skip
                    h = attn(batch, h, s["win"], s["ckv"], hca_ind, sinks, scale=D**-0.5, ratio=128, after=after)
                new.append(s)
            return h, new

        return step

    return Chain(ref=_Runner(step_with(REF), consts, fresh()), fast=_Runner(step_with(FAST), consts, fresh()),
                 ref_c=_Runner(mx.compile(step_with(REF)), consts, fresh()),
                 fast_c=_Runner(mx.compile(step_with(FAST)), consts, fresh()),
                 fast_c_dep=_Runner(mx.compile(step_with(FAST, "depends")), consts, fresh()))


def functional(*args: Any, after: None = None, workspace: Any = None, **kw: Any
               ) -> tuple[mx.array, mx.array, mx.array, None]:  # fmt: skip
    """The functional CUDA compressor (kernel + pool scatter, new arrays) in the in-place op's shape (its
    calls return no token, so `after` is always None; it has no scratch, so `workspace` goes unused)."""
    assert after is None, "functional: the functional op does not wait for an in-place write"
    return (*kc.compressor_rows_cuda(*args, **kw), None)
