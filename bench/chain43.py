"""The 43-layer chained emulation of the three row ops (bench/kernels.py --chain): one decode step's attention,
indexer and compressor dispatches linked as in the model, each arm (reference / CUDA, plain / compiled) on its
own state."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from bench.cases import DI, FAST, HALF, NH, NI, PAGE, REF, TOPK, D, W, _batch, _tables
from dsv4_serve.kernels.compressor import CompressorArgs
from dsv4_serve.kernels.compressor import new_workspace as new_comp_workspace
from dsv4_serve.kernels.indexer import new_workspace


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
