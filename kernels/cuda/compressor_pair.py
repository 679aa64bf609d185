"""compressor_pair_rows_inplace on CUDA: a CSA layer's two compressors (the main one, head_dim, and the
lightning indexer's, index_head_dim) in ONE launch, written in place as compressor_inplace.py.

Grid (batch rows x NT, 2): grid row 0 runs the main compressor's row blocks, grid row 1 the indexer's,
each the `dsv4_compress_row` device function of compressor_inplace.py with its own head dim (D, D2) and
norm dtype (N, N2); both share the batch, the ratio-4 block table, the RoPE row and eps. One graph node
and one launch a CSA layer instead of two (the layer's compressor dispatch). Both halves pool a CSA
window of 8 rows in one block per row (NSPLIT 1: no ticket, no zeroed scratch); the token is the
halves' shared 4-int output. Other shapes (a long window, a head dim the row function does not take)
run the two single calls.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.compressor import (
    CompressorArgs,
    PairOut,
    check_compressor,
    check_pair,
    compressor_pair_rows_inplace_reference,
)
from dsv4_serve.kernels.cuda import common
from dsv4_serve.kernels.cuda import compressor_inplace as single
from dsv4_serve.kernels.cuda.common import f32_params, i32_dummy, kernel, plan_cached
from dsv4_serve.kernels.cuda.compressor import template
from dsv4_serve.kernels.rows import RowBatch, check_after, checked

PARTS = ("kv", "score", "ape", "norm", "kv_state", "score_state", "pool")
INPUTS = ("slots", "positions", "q_rows", "table", *PARTS, *(n + "2" for n in PARTS), "rcos", "rsin", "fparams",
          "after")  # fmt: skip
SOURCE = (
    "  if (blockIdx.y == 0)\n  "
    + single.call()
    + "  else\n  "
    + single.call(suffix="2", d="D2", n="N2")
)


class Plan:
    """Launch parameters of one (batch shape, both argument sets' shapes) combination, computed once."""

    __slots__ = ("compiled", "fast", "fparams", "grid", "kernel", "template")

    def __init__(self, b: int, first: CompressorArgs, second: CompressorArgs, ratio: int, half: int, page: int,
                 eps: float, chain_round: int = -1) -> None:  # fmt: skip
        nt = single.NT
        fits = [a.head_dim % 4 == 0 and a.head_dim <= 4 * nt and single.nsplit(ratio, a.head_dim) == 1
                for a in (first, second)]  # fmt: skip
        self.fast = all(fits) and half <= nt and first.pool.dtype == second.pool.dtype
        if not self.fast:
            return
        self.fparams = f32_params(eps)
        self.kernel = kernel("compressor_pair", INPUTS, ("token",), SOURCE, header=single.ROW)
        self.template = template(first.pool.dtype, first.norm.dtype, ratio, first.head_dim, half, page, False) + [
            ("D2", second.head_dim), ("N2", second.norm.dtype), ("NT", nt), ("NSPLIT", 1),
            ("ROUND", chain_round)]  # fmt: skip
        self.grid = (b * nt, 2, 1)
        self.compiled = mx.compile(self.launch)

    def launch(self, *inputs: mx.array) -> mx.array:
        # 4 ints, not 1: MLX puts outputs of <= 8 bytes in managed memory (kernels/upload.py)
        out = self.kernel(inputs=list(inputs), template=self.template, grid=self.grid, threadgroup=(single.NT, 1, 1),
                          output_shapes=[(4,)], output_dtypes=[mx.int32])  # fmt: skip
        return out[0]


def compressor_pair_rows_inplace_cuda(
    batch: RowBatch,
    first: CompressorArgs,
    second: CompressorArgs,
    *,
    ratio: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    after: mx.array | None = None,
    chain_round: int | None = None,
) -> PairOut:
    """`chain_round`: as compressor_inplace.py's (a chained batch's round j alone, the whole batch launched)."""
    check_after("compressor_rows", after)
    check_pair(first, second)
    chains = chain_round is not None

    def check() -> None:
        for a in (first, second):
            check_compressor(batch, *a[:7], ratio=ratio, head_dim=a.head_dim, eps=eps, cos=cos, sin=sin,
                             chains=chains)  # fmt: skip

    try:  # one flat key (the scalars with their types, every argument's shape and dtype), no per-set closures
        f, g = first, second
        key: tuple[Any, ...] = (
            "compressor_pair_rows_inplace", chain_round, type(ratio), ratio, type(eps), eps, cos.shape, cos.dtype,
            sin.shape, sin.dtype, type(f.head_dim), f.head_dim, f.kv.shape, f.kv.dtype, f.score.shape, f.score.dtype,
            f.ape.shape, f.ape.dtype, f.norm.shape, f.norm.dtype, f.kv_state.shape, f.kv_state.dtype,
            f.score_state.shape, f.score_state.dtype, f.pool.shape, f.pool.dtype, type(g.head_dim), g.head_dim,
            g.kv.shape, g.kv.dtype, g.score.shape, g.score.dtype, g.ape.shape, g.ape.dtype, g.norm.shape,
            g.norm.dtype, g.kv_state.shape, g.kv_state.dtype, g.score_state.shape, g.score_state.dtype, g.pool.shape,
            g.pool.dtype,
        )  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check()
        raise

    def make() -> Plan:
        pk: tuple[Any, ...] = key + (batch.size, batch.page_size, batch.tables[ratio].shape)
        return plan_cached(pk, lambda: Plan(batch.size, first, second, ratio, cos.shape[1], batch.page_size, eps,
                                            -1 if chain_round is None else chain_round))  # fmt: skip

    plan: Plan = checked(batch, key, check, make)
    if not plan.fast:  # the two single launches, the second after the first (each of the round's rows alone)
        two = functools.partial(single.compressor_rows_inplace_cuda, chain_round=chain_round)
        return compressor_pair_rows_inplace_reference(batch, first, second, ratio=ratio, eps=eps, cos=cos, sin=sin,
                                                      after=after, single=two)  # fmt: skip
    run = plan.compiled if common.COMPILE else plan.launch
    token = run(batch.slots, batch.positions, batch.q_rows, batch.tables[ratio], *first[:7], *second[:7], cos, sin,
                plan.fparams, i32_dummy((1,)) if after is None else after)  # fmt: skip
    return tuple(first[4:7]), tuple(second[4:7]), token
