"""prefill_attention on CUDA: T queries through `HEADS` (below) or as T rows of the decode step's attention
kernel (kernels/cuda/attention.py).

The decode kernels read a row's window as ring rows 0..W-1 of its slot, valid while j < min(p, W - 1) + 1, and
its entries through a block table. A prefill query's window is the W positions before and at its own: with
the keys laid out in reverse position order (`rseq[i]` = position start + T - 1 - i: the chunk's kv reversed,
then the ring's rows by falling position), query t's window row j = position p - j is `rseq[T - 1 - t + j]`,
so the rows' windows are one strided view `[rows, W, D]` of rseq (MLX lays it out contiguous for the kernel:
rows x W x D elements). Row b of a block of queries t0..t1-1 is query t1 - 1 - b, in slot b; valid window rows
are then exactly j <= p, as in decode. CSA rows read their picked ids, HCA rows every emitted entry; both
through the request's table repeated per row. Same tensor-core math as decode (bf16/f16 q, keys and P, f32
logits and accumulation), one `dsplit` launch per ROWS_MAX queries instead of ~25 plain ops a block.

Where the heads are a multiple of 64 and D of 128 (V4: 64 x 512), the default is instead `HEADS`
(kernels/cuda/attention_prefill_src.py): one block a query with all of its heads, so each key is gathered
once for 64 heads; its window rows are read straight from the reversed keys (no [rows, W, D] copy) and an
HCA row stops after the entries it has emitted. `DSV4_PREFILL_ATTN=dsplit` (or `HEADS_ON = False`) keeps
the decode kernel's rows (bench/prefill.py's `dsplit_attn` arm).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.cuda import common
from dsv4_serve.kernels.cuda.attention import SMEM_MAX, Plan
from dsv4_serve.kernels.cuda.attention_prefill_src import HEADS, heads_smem
from dsv4_serve.kernels.cuda.attention_src import ATTN_HELPERS
from dsv4_serve.kernels.cuda.common import f32_params, i32_dummy, kernel, launch_bounds, plan_cached
from dsv4_serve.kernels.prefill_attention import check_prefill_attention, prefill_attention_reference

# Queries a launch: the grid's z dimension is the rows (< 65,536); on the `dsplit` path the window view is
# materialized at rows x W x D (4,096 x 128 x 512 bf16: 512 MiB), as is split-K's partial O (f32, about as much).
ROWS_MAX = 4096
# Every row through `dsplit` (one launch, O in registers, no partial buffer): the decode step's split-K forms
# exist to spread 1-8 long rows over the GPU, and their combine looks each q row up among all B rows (O(B^2)
# at B = 2,048: 5 ms a launch, 202 of a 2K forward's 841 ms on the H200, 5d133be + db48309).
DSPLIT_ALL = 1 << 30
HEADS_ON = os.environ.get("DSV4_PREFILL_ATTN", "heads").strip() != "dsplit"
HEADS_THREADS, HEADS_HG, CK = 512, 64, 64
HEADS_IN = ("slots", "positions", "q_rows", "table", "q", "keys", "pool", "indices", "fparams", "sinks")


def heads_fits(q: mx.array, kv: mx.array, pool: mx.array | None) -> bool:
    """`HEADS` takes 16-bit q and keys of one dtype, heads a multiple of 64, D a multiple of 128 (V4: 512)."""
    nh, d = q.shape[1], q.shape[2]
    same = kv.dtype == q.dtype and (pool is None or pool.dtype == q.dtype)
    return (HEADS_ON and q.dtype in (mx.bfloat16, mx.float16) and same and nh % HEADS_HG == 0 and d % 128 == 0
            and heads_smem(d) <= SMEM_MAX)  # fmt: skip


def heads_attention(q: mx.array, rseq: mx.array, w: int, start: int, pool: mx.array | None,
                    table: mx.array | None, indices: mx.array | None, sinks: mx.array, scale: float,
                    ratio: int | None) -> mx.array:  # fmt: skip
    """`HEADS` over the queries in launches of ROWS_MAX (rseq: reversed_keys; w: the window)."""
    t, nh, d = q.shape
    kern = kernel("attn_heads", HEADS_IN, ("out",), HEADS, heads_smem(d),
                  ATTN_HELPERS + launch_bounds(HEADS_THREADS, 1))  # fmt: skip
    tmpl = [("T", q.dtype), ("D", d), ("PAGE", 1 if pool is None else pool.shape[1]), ("RATIO", ratio or 0),
            ("WIN", w), ("ALL", ratio is not None and indices is None), ("HG", HEADS_HG), ("CK", CK),
            ("THREADS", HEADS_THREADS)]  # fmt: skip
    if pool is None:
        pool, table, ind = rseq, i32_dummy((1, 1)), i32_dummy((1, 1))
    else:
        ind = i32_dummy((1, table.shape[0] * pool.shape[1])) if indices is None else indices
    fparams = f32_params(scale)
    outs = []
    for t0 in range(0, t, ROWS_MAX):
        t1 = min(t, t0 + ROWS_MAX)
        _, slots, positions, q_rows = block_rows(rseq, t, start, t0, t1)
        (o,) = kern(
            inputs=[slots, positions, q_rows, table, q[t0:t1], rseq[t - t1 :], pool,
                    ind if indices is None else ind[t0:t1], fparams, sinks],  # fmt: skip
            template=tmpl,
            grid=(HEADS_THREADS, nh // HEADS_HG, t1 - t0),
            threadgroup=(HEADS_THREADS, 1, 1),
            output_shapes=[(t1 - t0, nh, d)],
            output_dtypes=[q.dtype],
        )
        outs.append(o)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def reversed_keys(ring: mx.array, kv: mx.array, start: int, dtype: mx.Dtype) -> mx.array:
    """rseq [T + W, D]: row i holds position start + T - 1 - i (the chunk's kv reversed, then the ring's rows
    for positions start - 1, start - 2, ..; those before position 0 are never valid rows). One gather of
    [kv; ring] through host-made rows (the index arithmetic as MLX ops was 5 more kernels a layer)."""
    t, wl = kv.shape[0], ring.shape[0]
    rows = np.concatenate([np.arange(t - 1, -1, -1), t + (start - 1 - np.arange(wl) + wl) % wl]).astype(np.int32)
    return mx.concatenate([kv, ring])[mx.array(rows)].astype(dtype)


def block_rows(rseq: mx.array, t: int, start: int, t0: int, t1: int) -> tuple[mx.array, ...]:
    """The decode kernel's rows for queries t0..t1-1: (window [r, W, D], slots, positions, q_rows). Row b is
    query t1 - 1 - b (q row r - 1 - b of q[t0:t1]) in slot b, whose window row j is position p - j."""
    wl, d, r = rseq.shape[0] - t, rseq.shape[1], t1 - t0
    window = mx.as_strided(rseq, (r, wl, d), (d, d, 1), (t - t1) * d)
    b = np.arange(r, dtype=np.int32)
    rows = mx.array(np.concatenate([b, (start + t1 - 1) - b, (r - 1) - b]))  # one upload, three views
    return window, rows[:r], rows[r : 2 * r], rows[2 * r :]


def prefill_attention_cuda(q: mx.array, ring: mx.array, kv: mx.array, start: int, pool: mx.array | None,
                           table: mx.array | None, indices: mx.array | None, sinks: mx.array, *, scale: float,
                           ratio: int | None = None) -> mx.array:  # fmt: skip
    check_prefill_attention(q, ring, kv, start, pool, table, indices, sinks, scale=scale, ratio=ratio)
    t = q.shape[0]
    n = (start + t) // ratio if ratio else 0
    if n == 0:  # no entry visible to any query yet: the window alone, as a sliding layer
        pool, table, indices, ratio = None, None, None, None
    rseq = reversed_keys(ring, kv, start, q.dtype)
    if heads_fits(q, kv, pool):
        return heads_attention(q, rseq, ring.shape[0], start, pool, table, indices, sinks, scale, ratio)
    outs = []
    for t0 in range(0, t, ROWS_MAX):
        t1 = min(t, t0 + ROWS_MAX)
        r = t1 - t0
        window, slots, positions, q_rows = block_rows(rseq, t, start, t0, t1)
        ind = None if indices is None else indices[t0:t1]
        qb = q[t0:t1]
        key = ("prefill_attention", float(scale), ratio, qb.shape, qb.dtype, window.shape, window.dtype,
               None if pool is None else (pool.shape, pool.dtype), None if ind is None else ind.shape,
               None if table is None else table.shape)  # fmt: skip
        page, width = (1, 0) if pool is None or table is None else (pool.shape[1], table.shape[0])
        plan: Plan = plan_cached(key, lambda: Plan(r, page, width, qb, window, pool, ind, scale, ratio,  # noqa: B023
                                                   DSPLIT_ALL))  # fmt: skip
        if not plan.fast:  # dtypes or dims the kernels do not take
            return prefill_attention_reference(q, ring, kv, start, pool, table, indices, sinks, scale=scale,
                                               ratio=ratio)  # fmt: skip
        if pool is None:
            tab, pool_in, ind = mx.zeros((r, 1), mx.int32), window, i32_dummy((1, 1))  # not cached per row count
        else:
            tab, pool_in = mx.broadcast_to(table[None, :], (r, table.shape[0])), pool
            if ind is None:  # HCA: every entry of the table (masked by each row's count); not cached per row
                # count as decode's arange_rows is (a prompt's last block has any of ROWS_MAX sizes)
                cap = table.shape[0] * pool.shape[1]
                ind = mx.broadcast_to(mx.arange(cap, dtype=mx.int32)[None, :], (r, cap))
        run = plan.compiled if common.COMPILE else plan.launch
        outs.append(run(slots, positions, q_rows, tab, qb, window, pool_in, ind, plan.fparams, sinks,
                        i32_dummy((1,))))  # fmt: skip
    return outs[0] if len(outs) == 1 else mx.concatenate(outs)
