"""sparse_attention_rows: attention over window + selected compressed entries, 1..8 rows, plain MLX.

Per row at position p (spec 2.4, 2.7): keys = the valid window ring rows `0..min(p+1, W)-1` of its
slot, plus the pool entries named by `indices[q_row]` (logical ids read through its block table
for `ratio`; -1 or ids >= `(p+1) // ratio` are masked and their keys zeroed, so stale or trash
values never reach the output). V = K. Logits `(q . k) * scale` in f32; the sink adds
`exp(sink - max)` to the denominator only. Output row `q_row`, dtype `q.dtype`; buffer rows no
batch row names are 0.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4_serve.kernels.rows import (
    FLOATS,
    RowBatch,
    chain_length,
    check_after,
    check_array,
    check_batch,
    check_positive,
    check_rows_fit,
    check_tables,
    check_width,
    emitted,
    fail,
    ordered,
    row_entries,
)

OP = "sparse_attention_rows"
RATIOS = (4, 128)


def check_sparse_attention(
    batch: RowBatch,
    q: mx.array,
    window: mx.array,
    pool: mx.array | None,
    indices: mx.array | None,
    sinks: mx.array,
    *,
    scale: float,
    ratio: int | None,
    tail: mx.array | None = None,
    chains: bool = False,
) -> None:
    """The row contract for sparse attention; raises ValueError('sparse_attention_rows: <arg>: why').
    `chains`: the caller orders a slot's rows causally (the plain twin, with `tail`)."""
    check_batch(OP, batch, chains=chains)
    check_positive(OP, "scale", scale)
    check_array(OP, "q", q, FLOATS, (None, None, None))
    nh, d = q.shape[1], q.shape[2]
    check_width(OP, "q heads", nh)
    check_width(OP, "q dim", d)
    check_rows_fit(OP, "q", q, batch)
    check_array(OP, "window", window, FLOATS, (None, None, d))
    check_width(OP, "window", window.shape[1])
    check_array(OP, "sinks", sinks, mx.float32, (nh,))
    check_batch(OP, batch, slots=window.shape[0], chains=chains)
    if tail is not None:
        check_array(OP, "tail", tail, window.dtype, (None, d))
        check_rows_fit(OP, "tail", tail, batch)
    elif batch.chained:
        raise fail(OP, "tail", "a slot's consecutive rows need the step's own keys: the ring is read before them")
    if batch.chained and chain_length(batch) > window.shape[1]:
        raise fail(OP, "rows", f"a slot's rows must fit its ring of {window.shape[1]}")
    if pool is None:
        if indices is not None:
            raise fail(OP, "indices", "must be None when pool is None (sliding layer)")
        return
    if not isinstance(ratio, int) or ratio not in RATIOS:
        raise fail(OP, "ratio", f"must be one of {RATIOS} with a pool, got {ratio!r}")
    check_array(OP, "pool", pool, FLOATS, (None, batch.page_size, d))
    if indices is not None:
        check_array(OP, "indices", indices, mx.int32, (None, None))
        check_width(OP, "indices", indices.shape[1])
        check_rows_fit(OP, "indices", indices, batch)
    check_tables(OP, batch, ratio, pool.shape[0], row_entries(batch, ratio))


def tail_overlay(batch: RowBatch, w_len: int) -> mx.array:
    """[B, W] int32: for row i and ring row j, the batch row whose key row i reads there (a row of its slot at a
    position <= its own with that position % W == j), else -1 (the ring's own)."""

    def make() -> mx.array:
        sel = [[-1] * w_len for _ in batch.rows]
        for i, r in enumerate(batch.rows):
            for j, o in enumerate(batch.rows):
                if o.slot == r.slot and o.position <= r.position:
                    sel[i][o.position % w_len] = j
        return mx.array(sel, dtype=mx.int32)

    return batch.once(("tail_overlay", w_len), make)


def scratch_ring(batch: RowBatch, window: mx.array, tail: mx.array) -> mx.array:
    """[B, W, D] in the ring's dtype: row i's ring as the single step at its position reads it (`tail_overlay`), for
    a fast path that takes a chained batch as one of distinct slots over it (kernels/cuda/attention.py; the CUDA
    form is kernels/cuda/scratch_ring.py)."""
    sel = tail_overlay(batch, window.shape[1])
    own = tail[batch.q_rows][mx.maximum(sel, 0)]
    return mx.where((sel >= 0)[:, :, None], own, window[batch.slots])


def sink_softmax(parts: list[tuple[mx.array, mx.array]], sinks: mx.array) -> mx.array:
    """Attention output over key sets given as (masked logits [.., nh, L_i] f32, values [.., L_i, D]):
    one softmax across all parts with each head's sink in the denominator only."""
    sink = sinks.astype(mx.float32)[None, :, None]
    top = sink
    for lg, _ in parts:
        top = mx.maximum(lg.max(axis=-1, keepdims=True), top)
    num, den = None, None
    for lg, v in parts:
        e = mx.exp(lg - top)
        num = e @ v if num is None else num + e @ v
        den = e.sum(axis=-1, keepdims=True) if den is None else den + e.sum(axis=-1, keepdims=True)
    assert num is not None and den is not None, "sink_softmax: no key set"
    return num / (den + mx.exp(sink - top))


def sparse_attention_rows_reference(
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
    """`indices=None` with a pool attends to every entry in the row's table (HCA needs no indexer).
    `after`: the token of an in-place write of `pool` (compressor_rows_inplace); its reads wait for it.
    `tail`: the step's own window keys (the module docstring)."""
    check_sparse_attention(batch, q, window, pool, indices, sinks, scale=scale, ratio=ratio, tail=tail, chains=True)
    check_after(OP, after)
    b, w_len = batch.size, window.shape[1]
    p, qr = batch.positions, batch.q_rows
    # [B, W, D]; with a tail, the step's own keys of each row's slot up to its position in their ring rows
    keys = (window[batch.slots] if tail is None else scratch_ring(batch, window, tail)).astype(mx.float32)
    n_win = mx.minimum(p, w_len - 1) + 1  # min(p+1, W) without overflowing int32
    valid = mx.arange(w_len)[None, :] < n_win[:, None]
    if pool is not None:
        assert ratio is not None
        page = batch.page_size
        table = ordered(batch.tables[ratio], after)  # [B, width]
        if indices is None:
            cap = table.shape[1] * page
            ids = mx.broadcast_to(mx.arange(cap, dtype=mx.int32)[None, :], (b, cap))
        else:
            ids = indices[qr]  # [B, K]
        ok = (ids >= 0) & (ids < emitted(p, ratio)[:, None])
        ids = mx.where(ok, ids, 0)  # in range: check_tables guarantees the table covers every valid id
        pages = mx.take_along_axis(table, ids // page, axis=1)
        comp = pool[pages, ids % page].astype(mx.float32)  # [B, K, D]
        keys = mx.concatenate([keys, comp], axis=1)
        valid = mx.concatenate([valid, ok], axis=1)
    keys = mx.where(valid[:, :, None], keys, 0.0)  # masked keys are also values: zero them

    logits = (q[qr].astype(mx.float32) @ keys.transpose(0, 2, 1)) * scale  # [B, nh, L]
    o = sink_softmax([(mx.where(valid[:, None, :], logits, -math.inf), keys)], sinks)  # [B, nh, D]

    out = mx.zeros((q.shape[0],) + tuple(q.shape[1:]), dtype=q.dtype)
    return mx.put_along_axis(out, qr[:, None, None], o.astype(q.dtype), axis=0)
