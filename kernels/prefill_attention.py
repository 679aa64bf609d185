"""prefill_attention: the attention of T prompt tokens of one request, plain MLX (the CUDA path's twin).

Query t sits at position p = start + t. It sees the window positions max(0, p - W + 1)..p (the slot's ring
as it was before the chunk, ring row j holding the latest position = j mod W, then the chunk's own kv), plus
CSA's picked entries (`indices[t]`, -1 padded past the token's visible ones) or HCA's every entry emitted at
or before p ((p + 1) // ratio of them), read from `pool` through the request's block table `table`. V = K;
logits `(q . k) * scale` in f32, each head's sink in the denominator only (`sink_softmax`). The same keys and
masks as T decode steps' `sparse_attention_rows`. Work buffers are bounded by ATTN_BLOCK queries.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4_serve.kernels.rows import FLOATS, check_array, fail
from dsv4_serve.kernels.sparse_attention import RATIOS, sink_softmax

OP = "prefill_attention"
# Queries attended together. A query sees W window keys, but a block's window logits span its queries' keys
# and the W before them ([block, nh, block + W]): one block of T queries costs T + W keys a query (2,176
# at a 2,048-token chunk), blocks of 512 cost 640, for ~20 more graph nodes a block.
ATTN_BLOCK = 512


def check_prefill_attention(q: mx.array, ring: mx.array, kv: mx.array, start: int, pool: mx.array | None,
                            table: mx.array | None, indices: mx.array | None, sinks: mx.array, *, scale: float,
                            ratio: int | None) -> None:  # fmt: skip
    """ValueError('prefill_attention: <arg>: why') for arguments the op cannot take."""
    check_array(OP, "q", q, FLOATS, (None, None, None))
    t, nh, d = q.shape
    if t < 1:
        raise fail(OP, "q", "must hold at least one query")
    check_array(OP, "ring", ring, FLOATS, (None, d))
    check_array(OP, "kv", kv, FLOATS, (t, d))
    check_array(OP, "sinks", sinks, mx.float32, (nh,))
    if not isinstance(start, int) or start < 0:
        raise fail(OP, "start", f"must be an integer >= 0, got {start!r}")
    if not (isinstance(scale, float | int) and scale > 0):
        raise fail(OP, "scale", f"must be > 0, got {scale!r}")
    if pool is None:
        if table is not None or indices is not None or ratio is not None:
            raise fail(OP, "pool", "is None (a sliding layer): table, indices and ratio must be None too")
        return
    if ratio not in RATIOS:
        raise fail(OP, "ratio", f"must be one of {RATIOS} with a pool, got {ratio!r}")
    check_array(OP, "pool", pool, FLOATS, (None, None, d))
    if table is None:
        raise fail(OP, "table", "must be given with a pool")
    check_array(OP, "table", table, mx.int32, (None,))
    if table.shape[0] * pool.shape[1] < (start + t) // ratio:
        raise fail(OP, "table", f"covers {table.shape[0] * pool.shape[1]} entries, the chunk reaches "
                                f"{(start + t) // ratio}")  # fmt: skip
    if ratio == 4:
        if indices is None and (start + t) // ratio:
            raise fail(OP, "indices", "must be given for ratio 4 once an entry is emitted (CSA attends the "
                                      "indexer's picks)")  # fmt: skip
        if indices is not None:
            check_array(OP, "indices", indices, mx.int32, (t, None))
    elif indices is not None:
        raise fail(OP, "indices", f"must be None for ratio {ratio} (HCA attends every entry)")


def entries(pool: mx.array, table: mx.array, n: int) -> mx.array:
    """The first n compressed entries of a request, [n, d] f32."""
    page = pool.shape[1]
    ids = mx.arange(n, dtype=mx.int32)
    return pool[table[ids // page], ids % page].astype(mx.float32)


def prefill_attention_reference(q: mx.array, ring: mx.array, kv: mx.array, start: int, pool: mx.array | None,
                                table: mx.array | None, indices: mx.array | None, sinks: mx.array, *,
                                scale: float, ratio: int | None = None) -> mx.array:  # fmt: skip
    """[T, nh, D] in q.dtype: masked f32 logits over [ring; chunk] and the entries, ATTN_BLOCK queries at a time."""
    check_prefill_attention(q, ring, kv, start, pool, table, indices, sinks, scale=scale, ratio=ratio)
    t, wl = q.shape[0], ring.shape[0]
    pos = mx.arange(start, start + t, dtype=mx.int32)
    # Window keys: the ring before the chunk (ring row j holds the latest position = j mod W), then the chunk.
    ring_pos = mx.array([start - 1 - ((start - 1 - j) % wl) for j in range(wl)], dtype=mx.int32)
    keys_w = mx.concatenate([ring, kv]).astype(mx.float32)  # [W+T, D]
    kpos = mx.concatenate([ring_pos, pos])
    ok_w = (kpos[None, :] >= 0) & (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - wl)
    qf = q.astype(mx.float32)
    n = (start + t) // ratio if ratio else 0  # entries emitted up to the chunk's last token
    comp = entries(pool, table, n) if n and pool is not None and table is not None else None
    vis = (pos + 1) // ratio if ratio else None  # entries each token can see
    outs = []
    for b0 in range(0, t, ATTN_BLOCK):
        # Query rows b0..b1-1 see keys lo..b1-1+W of [ring; chunk]: chunk keys from b0 - W + 1 on, and ring
        # rows (in ring order, not position order: all of them) only while b0 < W.
        b1, lo = min(t, b0 + ATTN_BLOCK), 0 if b0 < wl else b0
        kw, qb = keys_w[lo : b1 + wl], qf[b0:b1]
        # (logits [Tb, nh, L_i], values): masked logits are -inf, so their (finite) values weigh exactly 0
        parts = [(mx.where(ok_w[b0:b1, None, lo : b1 + wl], (qb @ kw.T) * scale, -math.inf), kw)]
        if comp is not None and indices is not None:  # CSA: the entries each token's indexer picked
            ok = indices[b0:b1] >= 0  # the indexer leaves -1 past each token's visible entries
            keys_c = comp[mx.where(ok, indices[b0:b1], 0)]  # [Tb, topk, D]
            parts.append((mx.where(ok[:, None, :], (qb @ keys_c.transpose(0, 2, 1)) * scale, -math.inf), keys_c))
        elif comp is not None and vis is not None:  # HCA: every entry emitted at or before the token
            ok = mx.arange(n)[None, :] < vis[b0:b1, None]
            parts.append((mx.where(ok[:, None, :], (qb @ comp.T) * scale, -math.inf), comp))
        outs.append(sink_softmax(parts, sinks))
    return (outs[0] if len(outs) == 1 else mx.concatenate(outs)).astype(q.dtype)
