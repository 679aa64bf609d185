"""sparse_attention_rows on CUDA: flash decoding with tensor cores (1 launch; 2 for long rows).

Heads-as-rows: a block holds 16 heads' q rows [16, D] in shared memory and walks 64-key chunks of
its row's key list (window ring rows `0..W-1`, then the selected ids; invalid ones are never read,
their keys are zero and masked). Per chunk: keys gathered through the slot id / block table into
shared memory (cp.async), S = Q K^T (wmma bf16/f16, f32 accumulation), an online softmax update,
O += P V (wmma).
- Rows of at most DSPLIT_CHUNKS chunks (sliding, CSA with its top-k, HCA up to ~100K context):
  `dsplit`, grid (D slices, head groups, q rows). Every block walks all the row's chunks (next
  chunk in flight) and keeps O for its D / DS columns only, normalizing with the sink itself:
  1 launch, no partial buffers. DS is picked so that the grid has about TARGET_DSPLIT blocks.
- Rows of up to WIDE_MAX_BLOCKS chunk-blocks (CSA, HCA to ~128K; D a multiple of 128): `wide`,
  split-K with one 64-key chunk and all 64 heads per block (each chunk gathered once; mma.sync with
  ldmatrix fragments, no wmma), then `combine`.
- Longer rows: split-K over head groups of 16. `partial`: grid (splits, head groups, rows) writes
  O [16, D] and (max, sum) per head and split (with one chunk per block, `ONE`, there is no O
  buffer and two blocks fit on a multiprocessor).
- `combine` (after `wide` / `partial`): one block per (q-buffer row, head) merges the splits with
  the sink in the denominator, writes `q.dtype`; rows no batch row names get 0.
Fast path: q, window, pool of one 16-bit dtype, heads multiple of 16, D multiple of 32; else the reference.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda import common
from dsv4_serve.kernels.cuda.attention_dsplit_src import DSPLIT
from dsv4_serve.kernels.cuda.attention_src import ATTN_HELPERS, COMBINE, COMBINE_MAX_SPLITS, WIDE
from dsv4_serve.kernels.cuda.attention_wmma_src import PARTIAL
from dsv4_serve.kernels.cuda.common import arange_rows, f32_params, i32_dummy, kernel, plan_cached
from dsv4_serve.kernels.cuda.scratch_ring import scratch_ring_cuda
from dsv4_serve.kernels.rows import RowBatch, check_after, checked
from dsv4_serve.kernels.sparse_attention import check_sparse_attention, sparse_attention_rows_reference

HG, CK, THREADS = 16, 64, 256
TARGET_BLOCKS = 264  # about two blocks per multiprocessor on the H200 (132 SMs)
DSPLIT_CHUNKS = 3  # up to this many 64-key chunks per row: `dsplit` (1 launch), else split-K + combine
WIDE_HG = 64  # heads per `wide` block; 32 (D a multiple of 256) doubles the blocks of a short batch, and
# measured the same on the H200 (128K, 8 rows: 54.2 vs 55.2 us; bench/host_cost.py --wide-heads 64,32)
# threads per `wide` block. 512 (16 warps, half the QK / PV per warp) measured slower on the H200 (block
# 15.2 vs 13.6 us, bench/phases.py; chain43 3.78-3.88 vs 3.47-3.61 ms): the QK and PV phases did not
# shorten, the gather got longer. `bench/host_cost.py --wide-threads` A/Bs it.
WIDE_THREADS = 256
WIDE_MAX_BLOCKS = 3 * 132  # `wide` (one chunk per block, one block per multiprocessor) up to ~3 waves
SMEM_MAX = 227 * 1024  # dynamic shared memory per block on sm_90
TARGET_DSPLIT = 120  # dsplit blocks wanted (one wave: a dsplit block takes most of a multiprocessor)
# `after`: an in-place pool writer's token, unused by the kernel: its CUDA-graph edge orders the reads
PART_IN = ("slots", "positions", "q_rows", "table", "q", "window", "pool", "indices", "fparams", "sinks", "after")
COMB_IN = ("q_rows", "part", "sinks")


def smem_bytes(d: int, one: bool = False) -> int:
    """Split-K: Q, K chunk, P, S, softmax state, key offsets; + the O accumulator unless ONE."""
    t = 2 * (HG * (d + 8) + CK * (d + 8) + HG * (CK + 8))
    f = 4 * (2 * HG * CK + 3 * HG + (HG & 1)) + (0 if one else 4 * HG * (d + 4))
    return t + f + 8 * CK + 4 * CK


def dsplit_smem(d: int) -> int:
    """dsplit: Q, two K chunks, P, S, softmax state, two chunks' key offsets (O is in registers)."""
    t = 2 * (HG * (d + 8) + 2 * CK * (d + 8) + HG * (CK + 8))
    f = 4 * (2 * HG * CK + 3 * HG + (HG & 1))
    return t + f + 2 * (8 * CK + 4 * CK)


def wide_smem(d: int, hg: int = 64) -> int:
    """wide: Q of hg heads, one K chunk, P, S, softmax state, key offsets."""
    t = 2 * (hg * (d + 8) + CK * (d + 8) + hg * (CK + 8))
    return t + 4 * (hg * (CK + 4) + 2 * hg) + 12 * CK


def wide_heads(nh: int, d: int) -> int:
    """Heads per `wide` block: WIDE_HG where the 8 warps' split fits (32 heads: 4 warps per head tile,
    128 dims each in O, so D a multiple of 256), else 64."""
    return WIDE_HG if WIDE_HG == 32 and nh % 32 == 0 and d % 256 == 0 else 64


def dsplit_slices(bq: int, groups: int, d: int) -> int:
    """D slices per (row, head group): the fewest (a power of two, slices of >= 32 columns) that give
    about TARGET_DSPLIT blocks."""
    ds = 1
    while bq * groups * ds < TARGET_DSPLIT and d % (2 * ds) == 0 and (d // (2 * ds)) % 16 == 0 and d // (2 * ds) >= 32:
        ds *= 2
    return ds


def supported(q: mx.array, window: mx.array, pool: mx.array | None) -> bool:
    nh, d = q.shape[1], q.shape[2]
    same = window.dtype == q.dtype and (pool is None or pool.dtype == q.dtype)
    return q.dtype in (mx.bfloat16, mx.float16) and same and nh % HG == 0 and d % 32 == 0 and smem_bytes(d) <= 200_000


def splits(b: int, groups: int, nchunk: int) -> int:
    """Key splits per (row, head group) of the split-K path (rows of more than DSPLIT_CHUNKS chunks):
    one chunk per block while that stays within ~2 blocks per multiprocessor; else about
    TARGET_BLOCKS blocks."""
    if b * groups * nchunk <= 2 * TARGET_BLOCKS:
        return nchunk
    want = max(1, math.ceil(TARGET_BLOCKS / (b * groups)))
    ns = min(nchunk, want)
    per = math.ceil(nchunk / ns)
    return math.ceil(nchunk / per)  # no empty split


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("comb", "comb_grid", "comb_tmpl", "compiled", "fast", "final", "fparams", "nt", "part", "part_grid",
                 "part_shapes", "part_tmpl", "ratio")  # fmt: skip

    def __init__(self, b: int, page: int, table_width: int, q: mx.array, window: mx.array, pool: mx.array | None,
                 indices: mx.array | None, scale: float, ratio: int | None,
                 dsplit_chunks: int = DSPLIT_CHUNKS) -> None:  # fmt: skip
        """b rows, `page` entries a page, `table_width` pages a row's table (HCA without indices reads them all).
        `dsplit_chunks`: the longest rows (in 64-key chunks) that `dsplit` takes; prefill's thousands of rows
        give it every row (no split-K, no combine)."""
        self.fast = supported(q, window, pool)
        if not self.fast:
            return
        bq, nh, d = q.shape
        if pool is None:
            self.ratio, ki = 0, 0
        else:
            assert ratio is not None
            self.ratio = ratio
            ki = indices.shape[1] if indices is not None else table_width * page
        groups = nh // HG
        nchunk = -(-(window.shape[1] + ki) // CK)
        ds = dsplit_slices(bq, groups, d)
        self.final = nchunk <= dsplit_chunks and dsplit_smem(d) <= SMEM_MAX
        hg = wide_heads(nh, d)
        self.fparams = f32_params(scale)
        self.nt = THREADS
        tmpl = [("T", q.dtype), ("D", d), ("PAGE", page), ("RATIO", self.ratio), ("CK", CK), ("THREADS", THREADS)]
        if self.final:  # grid z over the q rows, the normalized output straight from the kernel
            self.part = kernel("attn_dsplit", PART_IN, ("out",), DSPLIT, dsplit_smem(d), ATTN_HELPERS)
            self.part_tmpl = tmpl + [("HG", HG), ("DS", ds)]
            self.part_grid = (ds * THREADS, groups, bq)
            self.part_shapes = [q.shape]
        elif nh % 64 == 0 and d % 128 == 0 and wide_smem(d, hg) <= SMEM_MAX and \
                b * (nh // hg) * nchunk <= WIDE_MAX_BLOCKS:  # fmt: skip
            self.part = kernel("attn_wide", PART_IN, ("part",), WIDE, wide_smem(d, hg), ATTN_HELPERS)
            self.nt = WIDE_THREADS if hg == 64 else THREADS  # 32 heads: 8 warps already split them finest
            self.part_tmpl = tmpl[:-1] + [("THREADS", self.nt), ("HG", hg)]
            self.part_grid = (nchunk * self.nt, nh // hg, b)
            self.part_shapes = [(b, nchunk, nh, d + 2)]  # O and (m, l) planes
        else:
            ns = splits(b, groups, nchunk)
            one = ns == nchunk
            self.part = kernel("attn_partial", PART_IN, ("part",), PARTIAL, smem_bytes(d, one), ATTN_HELPERS)
            self.part_tmpl = tmpl + [("HG", HG), ("ONE", one)]
            self.part_grid = (ns * THREADS, groups, b)
            self.part_shapes = [(b, ns, nh, d + 2)]
        if not self.final:
            assert self.part_shapes[0][1] <= COMBINE_MAX_SPLITS, "attention: more splits than the combine takes"
            self.comb = kernel("attn_combine", COMB_IN, ("out",), COMBINE)
            self.comb_tmpl = [("T", q.dtype), ("D", d)]
            self.comb_grid = (bq * nh * 128, 1, 1)
        self.compiled = mx.compile(self.launch)

    def launch(self, slots: mx.array, positions: mx.array, q_rows: mx.array, table: mx.array, q: mx.array,
               window: mx.array, pool: mx.array, ind: mx.array, fparams: mx.array, sinks: mx.array,
               after: mx.array) -> mx.array:  # fmt: skip
        outs = self.part(
            inputs=[slots, positions, q_rows, table, q, window, pool, ind, fparams, sinks, after],
            template=self.part_tmpl,
            grid=self.part_grid,
            threadgroup=(self.nt, 1, 1),
            output_shapes=self.part_shapes,
            output_dtypes=[q.dtype] if self.final else [mx.float32],
        )
        if self.final:
            return outs[0]
        (out,) = self.comb(
            inputs=[q_rows, *outs, sinks],
            template=self.comb_tmpl,
            grid=self.comb_grid,
            threadgroup=(128, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )
        return out


def sparse_attention_rows_cuda(
    batch: RowBatch,
    q: mx.array,
    window: mx.array,
    pool: mx.array | None,
    indices: mx.array | None,
    sinks: mx.array,
    *,
    scale: float,
    ratio: int | None = None,
    after: mx.array | None = None,
    tail: mx.array | None = None,
) -> mx.array:
    """`tail` (a chained batch: kernels/sparse_attention.py): each row's ring with its slot's own keys up to its
    position put in, gathered into a scratch ring of a row each (one launch, kernels/cuda/scratch_ring.py), which
    the same kernels read as a batch of distinct slots (the keys and their order those of the single steps)."""
    chains = tail is not None

    def check() -> None:
        check_sparse_attention(batch, q, window, pool, indices, sinks, scale=scale, ratio=ratio, tail=tail,
                               chains=chains)  # fmt: skip

    check_after("sparse_attention_rows", after)
    ring = window
    if chains:
        check()
        window = scratch_ring_cuda(batch, window, tail)
        slots = arange_rows(1, batch.size).reshape(-1)
        check = lambda: None  # noqa: E731 - checked above, against the ring itself
    else:
        slots = batch.slots

    try:
        key: tuple[Any, ...] = (
            "sparse_attention_rows", chains, type(scale), scale, type(ratio), ratio, q.shape, q.dtype,
            window.shape, window.dtype, sinks.shape, sinks.dtype,
            None if pool is None else (pool.shape, pool.dtype),
            None if indices is None else (indices.shape, indices.dtype),
        )  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check()
        raise

    def make() -> Plan:
        tw = None if ratio is None or ratio not in batch.tables else batch.tables[ratio].shape
        pk = key + (batch.size, batch.page_size, tw, WIDE_HG, DSPLIT_CHUNKS, WIDE_THREADS)
        return plan_cached(pk, lambda: Plan(batch.size, batch.page_size, tw[1] if tw else 0, q, window, pool, indices,
                                            scale, ratio))  # fmt: skip

    plan: Plan = checked(batch, key, check, make)
    if not plan.fast:
        return sparse_attention_rows_reference(batch, q, ring, pool, indices, sinks, scale=scale, ratio=ratio,
                                               after=after, tail=tail)  # fmt: skip
    if pool is None:
        table, pool_in, ind = i32_dummy((batch.size, 1)), window, i32_dummy((1, 1))
    else:
        table, pool_in = batch.tables[plan.ratio], pool
        if indices is None:
            indices = arange_rows(q.shape[0], table.shape[1] * batch.page_size)
        ind = indices
    run = plan.compiled if common.COMPILE else plan.launch
    return run(slots, batch.positions, batch.q_rows, table, q, window, pool_in, ind, plan.fparams, sinks,
               i32_dummy((1,)) if after is None else after)  # fmt: skip
