"""indexer_rows: the lightning indexer's top-k for 1..8 rows (spec 2.6), plain MLX.

Per row at position p: `n = (p+1) // 4` visible entries, `score_s = sum_h w_h relu(q_h . K[s])`
in f32 over the row's keys (read through its ratio-4 block table), the ids of the top `min(topk, n)`
entries (ties to the lowest id) in ascending id order, padded with -1. Ascending ids, not score
order: attention does not depend on the order, and the fast path's block top-k + merge produce
position order by ordered compaction with no sort at all.

Determinism: instead of trusting a sort's stability, each entry gets a unique 64-bit key
`(order-preserving bits of -score) << 32 | id`, so ascending key order is exactly "score
descending, then id ascending" on every backend, and the k smallest keys are exactly the top k.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.rows import (
    FLOATS,
    RowBatch,
    check_after,
    check_array,
    check_batch,
    check_rows_fit,
    check_tables,
    check_width,
    emitted,
    fail,
    ordered,
    row_entries,
    zeroed_workspace,
)
from dsv4_serve.kernels.rows import check_workspace as check_ws

OP = "indexer_rows"
RATIO = 4


def check_indexer(batch: RowBatch, q: mx.array, weights: mx.array, keys: mx.array, *, topk: int,
                  chains: bool = False) -> None:  # fmt: skip
    """The row contract for the indexer; raises ValueError('indexer_rows: <arg>: why'). `chains`: a slot's
    consecutive positions as rows (each row sees the entries its own position does: a later row's emission is
    past its count)."""
    check_batch(OP, batch, chains=chains)
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise fail(OP, "topk", f"must be an int, got {type(topk).__name__}")
    check_width(OP, "topk", topk)
    if topk > 2**31 - 1:
        raise fail(OP, "topk", f"{topk} does not fit int32")
    check_array(OP, "q", q, FLOATS, (None, None, None))
    check_width(OP, "q heads", q.shape[1])
    check_width(OP, "q dim", q.shape[2])
    check_array(OP, "weights", weights, mx.float32, (None, q.shape[1]))
    check_array(OP, "keys", keys, FLOATS, (None, batch.page_size, q.shape[2]))
    check_rows_fit(OP, "q", q, batch)
    check_rows_fit(OP, "weights", weights, batch)
    check_tables(OP, batch, RATIO, keys.shape[0], row_entries(batch, RATIO))


def order_key(score: mx.array, valid: mx.array) -> mx.array:
    """uint64 keys, ascending = (score descending, id ascending); invalid entries last."""
    cap = score.shape[-1]
    score = mx.where(score == 0, 0.0, score)  # -0.0 == +0.0: make them one key so the id decides
    bits = mx.view(score, mx.uint32)
    ordered = mx.where((bits >> 31) == 1, ~bits, bits | 0x80000000)  # monotone in the float value
    desc = mx.where(valid, ~ordered, 0xFFFFFFFF)  # ~: larger score -> smaller key
    ids = mx.arange(cap, dtype=mx.uint32).astype(mx.uint64)
    return (desc.astype(mx.uint64) << 32) | ids


def topk_ids(score: mx.array, n: mx.array, topk: int, lo: mx.array | None = None) -> mx.array:
    """Per row of `score [R, cap]`: the ids of the top `min(topk, n)` of its first `n [R, 1]` entries
    (ties to the lowest id) in ascending id order, -1 padded to `[R, topk]`. `lo [R, 1]`: a row's entries are
    columns lo .. lo + n - 1 instead (several requests' keys side by side), its ids counted from lo."""
    r, cap = score.shape
    col = mx.arange(cap)[None, :]
    key = order_key(score, col < n if lo is None else (col >= lo) & (col < lo + n))
    k = min(topk, cap)
    if k < cap:  # keys are unique, so the partition's first k are exactly the k smallest
        key = mx.partition(key, kth=k - 1, axis=-1)[:, :k]
    ids = (key & 0xFFFFFFFF).astype(mx.int32)  # the top k (and, when n < k, k - n masked entries)
    if lo is None:
        ids = mx.sort(mx.where(ids < n, ids, cap), axis=-1)  # ascending; masked ones last
    else:  # a masked entry's id, from lo, is outside 0 .. n - 1
        ids = ids - lo
        ids = mx.sort(mx.where((ids >= 0) & (ids < n), ids, cap), axis=-1)
    ids = mx.where(ids < n, ids, -1)
    if k < topk:
        ids = mx.concatenate([ids, mx.full((r, topk - k), -1, dtype=mx.int32)], axis=1)
    return ids


# An indexer workspace row (the CUDA one-launch kernel's, kernels/cuda/indexer_one_src.ONE_WS): its ticket
# (4 words: what follows stays 16-byte aligned), its 2048-bin histogram (both zero between launches), then,
# for tables of up to WS_KEYS_MAX entries (the one-launch kernel's rows, kernels/cuda/indexer.ONE_MAX), its
# scores' keys. One fixed place per row whatever the batch size: a launch's keys never land where a later
# launch expects zeroed counts.
WS_HEAD = 4 + 2048
WS_KEYS_MAX = 8192


def workspace_cols(cap: int) -> int:
    """uint32 words per workspace row for tables of `cap` entries (table width x page size)."""
    return WS_HEAD + (-(-cap // 4) * 4 if cap <= WS_KEYS_MAX else 0)


def new_workspace(rows: int, cap: int) -> mx.array:
    """A zeroed indexer workspace for up to `rows` batch rows of tables of up to `cap` entries."""
    return zeroed_workspace((rows, workspace_cols(cap)))


def check_workspace(workspace: Any, rows: int, cap: int) -> None:
    """`workspace=`: None, or uint32 [>= rows, >= workspace_cols(cap)]."""
    check_ws(OP, workspace, (rows, workspace_cols(cap)), f" (kernels.indexer.new_workspace({rows}, {cap}))")


def indexer_rows_reference(
    batch: RowBatch, q: mx.array, weights: mx.array, keys: mx.array, *, topk: int, after: mx.array | None = None,
    workspace: mx.array | None = None,
) -> mx.array:  # fmt: skip
    """`after`: the token of an in-place write of `keys` (compressor_rows_inplace); its reads wait for it.
    `workspace` (the fast path's scratch) is checked and otherwise unused."""
    check_indexer(batch, q, weights, keys, topk=topk, chains=True)
    check_after(OP, after)
    check_workspace(workspace, batch.size, batch.tables[RATIO].shape[1] * batch.page_size)
    b, page = batch.size, batch.page_size
    qr = batch.q_rows
    table = ordered(batch.tables[RATIO], after)  # [B, width]
    cap = table.shape[1] * page  # fixed capacity: the op count is independent of the rows' lengths
    k_all = keys[table].reshape(b, cap, keys.shape[-1]).astype(mx.float32)  # [B, cap, Di]
    qq = q[qr].astype(mx.float32)  # [B, nI, Di]
    dots = qq @ k_all.transpose(0, 2, 1)  # [B, nI, cap]
    score = (weights[qr][:, :, None] * mx.maximum(dots, 0.0)).sum(axis=1)  # ReLU before the weights

    ids = topk_ids(score, emitted(batch.positions, RATIO)[:, None], topk)
    out = mx.full((q.shape[0], topk), -1, dtype=mx.int32)
    return mx.put_along_axis(out, qr[:, None], ids, axis=0)
