"""compressor_rows: one decode step of the KV compressor for 1..8 rows (spec 2.5), plain MLX.

Per row at position p (slot s, block table t for `ratio`):
  1. state row `(coff-1)*m + p%m` of slot s <- (kv[q_row], score[q_row] + ape[p%m]),
  2. if `(p+1) % m == 0`: pool the window (softmax over tokens per feature, f32), cast to the
     pool dtype, RMSNorm * norm, RoPE at `p+1-m` (cos/sin from the caller) and store entry
     `w = p//m` at `pool[t[w // page], w % page]`; CSA then rolls the current half into "previous".
Every row takes the same ops; rows that do not emit write their entry to the trash page 0, so the
op count does not depend on the rows. A chained batch (a slot's consecutive positions as rows) is applied
round by round (`rows.rounds`: every slot's j-th row), so a slot's rows see each other's writes in position
order, as single steps would. Returns new arrays (inputs are not mutated): drop the old
references before `mx.eval` so MLX can donate their buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx

from dsv4_serve.kernels.rope import rope
from dsv4_serve.kernels.rows import (
    FLOATS,
    RowBatch,
    check_after,
    check_array,
    check_batch,
    check_positive,
    check_rows_fit,
    check_tables,
    check_width,
    fail,
    ordered,
    rounds,
    row_entries,
    zeroed_workspace,
)
from dsv4_serve.kernels.rows import check_workspace as check_ws

OP = "compressor_rows"
RATIOS = (4, 128)


class CompressorArgs(NamedTuple):
    """One compressor's per-call arrays (as compressor_rows takes them) and its head dim: an argument set
    of compressor_pair_rows_inplace."""

    kv: mx.array
    score: mx.array
    ape: mx.array
    norm: mx.array
    kv_state: mx.array
    score_state: mx.array
    pool: mx.array
    head_dim: int


# compressor_pair_rows_inplace's result: (kv_state, score_state, pool) of each compressor, then the token
PairOut = tuple[tuple[mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array], mx.array | None]


def check_compressor(
    batch: RowBatch,
    kv: mx.array,
    score: mx.array,
    ape: mx.array,
    norm: mx.array,
    kv_state: mx.array,
    score_state: mx.array,
    pool: mx.array,
    *,
    ratio: int,
    head_dim: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    chains: bool = False,
) -> None:
    """The row contract for the compressor; raises ValueError('compressor_rows: <arg>: why'). `chains`: the
    caller applies a slot's rows in position order (the plain twin)."""
    pair = f"(ratio, head_dim) = ({ratio!r}, {head_dim!r})"
    if not isinstance(ratio, int) or ratio not in RATIOS:
        raise fail(OP, "ratio", f"{pair} is unsupported: ratio must be one of {RATIOS}")
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise fail(OP, "head_dim", f"{pair} is unsupported (ratio): head_dim must be even and positive")
    check_positive(OP, "eps", eps)
    check_batch(OP, batch, chains=chains)
    check_array(OP, "cos", cos, mx.float32, (None, None))
    check_width(OP, "cos", cos.shape[1])
    check_array(OP, "sin", sin, mx.float32, cos.shape)
    if 2 * cos.shape[1] > head_dim:
        raise fail(OP, "head_dim", f"{pair} is unsupported (ratio): head_dim < rope dims {2 * cos.shape[1]}")
    coff = 2 if ratio == 4 else 1
    m, d = ratio, head_dim
    check_array(OP, "kv", kv, mx.float32, (None, coff * d))
    check_array(OP, "score", score, mx.float32, (None, coff * d))
    check_array(OP, "ape", ape, mx.float32, (m, coff * d))
    check_array(OP, "norm", norm, FLOATS, (d,))
    check_array(OP, "kv_state", kv_state, mx.float32, (None, coff * m, coff * d))
    check_array(OP, "score_state", score_state, mx.float32, kv_state.shape)
    check_array(OP, "pool", pool, FLOATS, (None, batch.page_size, d))
    for name, a in (("kv", kv), ("score", score), ("cos", cos), ("sin", sin)):
        check_rows_fit(OP, name, a, batch)
    check_batch(OP, batch, slots=kv_state.shape[0], chains=chains)
    # The table must hold entry p//m of an emitting row (and every earlier one).
    check_tables(OP, batch, ratio, pool.shape[0], row_entries(batch, ratio))


def pooled_entry(vals: mx.array, gates: mx.array, norm: mx.array, eps: float, cos: mx.array, sin: mx.array,
                 dtype: mx.Dtype) -> mx.array:  # fmt: skip
    """Entries from windows' rows `vals`, `gates [E, rows, d]` f32: softmax over the rows per feature,
    then (REF) cast to the pool dtype, RMSNorm * norm in f32, back to the pool dtype, RoPE."""
    c = (mx.softmax(gates, axis=1, precise=True) * vals).sum(axis=1)  # [E, d] f32
    x = c.astype(dtype).astype(mx.float32)
    x = x * mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps) * norm.astype(mx.float32)
    return rope(x.astype(dtype), cos, sin)


def compressor_rows_reference(
    batch: RowBatch,
    kv: mx.array,
    score: mx.array,
    ape: mx.array,
    norm: mx.array,
    kv_state: mx.array,
    score_state: mx.array,
    pool: mx.array,
    *,
    ratio: int,
    head_dim: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    check_compressor(
        batch, kv, score, ape, norm, kv_state, score_state, pool,
        ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin, chains=True,
    )
    for part in rounds(batch):  # one round unless chained: a slot's rows in position order
        kv_state, score_state, pool = _round(part, kv, score, ape, norm, kv_state, score_state, pool,
                                             ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin)  # fmt: skip
    return kv_state, score_state, pool


def _round(batch: RowBatch, kv: mx.array, score: mx.array, ape: mx.array, norm: mx.array, kv_state: mx.array,
           score_state: mx.array, pool: mx.array, *, ratio: int, head_dim: int, eps: float, cos: mx.array,
           sin: mx.array) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """One compressor step of rows of distinct slots (checked by the caller)."""
    coff = 2 if ratio == 4 else 1
    m, d = ratio, head_dim
    p, slots, qr = batch.positions, batch.slots, batch.q_rows
    pm = p % m
    emit = pm == m - 1  # [B]

    # 1. write the token's row into a gathered copy of each row's state.
    a = kv[qr]  # [B, coff*d]
    s = score[qr] + ape[pm]  # APE by absolute position
    hit = (mx.arange(coff * m)[None, :] == ((coff - 1) * m + pm)[:, None])[:, :, None]
    st_kv = mx.where(hit, a[:, None, :], kv_state[slots])  # [B, coff*m, coff*d]
    st_s = mx.where(hit, s[:, None, :], score_state[slots])

    # 2. pool every row (cheap; non-emitting rows' results go to the trash page).
    if coff == 1:
        vals, gates = st_kv, st_s
    else:  # CSA: previous window's first half (Ca) + this window's second half (Cb), 2m rows
        vals = mx.concatenate([st_kv[:, :m, :d], st_kv[:, m:, d:]], axis=1)
        gates = mx.concatenate([st_s[:, :m, :d], st_s[:, m:, d:]], axis=1)
    x = pooled_entry(vals, gates, norm, eps, cos[qr], sin[qr], pool.dtype)

    page = batch.page_size
    table = batch.tables[ratio]  # [B, width], padded with the trash page 0
    w = p // m
    col = mx.minimum(w // page, table.shape[1] - 1)  # a non-emitting row may point past its table
    pg = mx.where(emit, mx.take_along_axis(table, col[:, None], axis=1)[:, 0], 0)
    dest = pg * page + mx.where(emit, w % page, 0)
    flat = pool.reshape(pool.shape[0] * page, d)
    new_pool = mx.put_along_axis(flat, dest[:, None], x, axis=0).reshape(pool.shape)

    # 3. CSA: after an emission the current window becomes "previous" (rows m..2m-1 stay stale).
    if coff == 2:
        roll = emit[:, None, None]
        st_kv = mx.where(roll, mx.concatenate([st_kv[:, m:], st_kv[:, m:]], axis=1), st_kv)
        st_s = mx.where(roll, mx.concatenate([st_s[:, m:], st_s[:, m:]], axis=1), st_s)
    where = slots[:, None, None]
    new_kv = mx.put_along_axis(kv_state, where, st_kv, axis=0)
    new_s = mx.put_along_axis(score_state, where, st_s, axis=0)
    return new_kv, new_s, new_pool


def workspace_words(rows: int, head_dim: int) -> int:
    """uint32 words of an in-place compressor workspace for up to `rows` batch rows: their pooled features
    (f32) and, at its end, a ticket each (the CUDA split-window form's scratch, kernels/cuda/compressor_inplace)."""
    return rows * head_dim + rows


def new_workspace(rows: int, head_dim: int) -> mx.array:
    """A zeroed in-place compressor workspace for up to `rows` batch rows of `head_dim` features."""
    return zeroed_workspace(workspace_words(rows, head_dim))


def check_workspace(workspace: mx.array | None, words: int) -> None:
    check_ws(OP, workspace, words)


def compressor_rows_inplace_reference(
    batch: RowBatch,
    kv: mx.array,
    score: mx.array,
    ape: mx.array,
    norm: mx.array,
    kv_state: mx.array,
    score_state: mx.array,
    pool: mx.array,
    *,
    ratio: int,
    head_dim: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    after: mx.array | None = None,
    workspace: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """compressor_rows_inplace's plain twin: the functional update (new arrays) and no token. An `after`
    (a fast path's token; never on the CPU) orders its reads through a copy of the state arrays.
    `workspace` (the fast path's scratch) is checked and otherwise unused."""
    check_after(OP, after)
    check_workspace(workspace, workspace_words(batch.size, head_dim))
    kv_state, score_state, pool = (ordered(a, after) for a in (kv_state, score_state, pool))
    out = compressor_rows_reference(
        batch, kv, score, ape, norm, kv_state, score_state, pool,
        ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin,
    )  # fmt: skip
    return (*out, None)


def check_pair(first: Any, second: Any) -> None:
    for name, a in (("first", first), ("second", second)):
        if not isinstance(a, CompressorArgs):
            raise fail("compressor_pair_rows_inplace", name, f"must be a CompressorArgs, got {type(a).__name__}")


def compressor_pair_rows_inplace_reference(
    batch: RowBatch,
    first: CompressorArgs,
    second: CompressorArgs,
    *,
    ratio: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    after: mx.array | None = None,
    single: Callable[..., Any] = compressor_rows_inplace_reference,
) -> PairOut:
    """compressor_pair_rows_inplace's plain twin: `single` (compressor_rows_inplace) of each set. The second
    waits for the first's token, so its token covers both writes (None where `single` gives none)."""
    check_pair(first, second)
    outs, prev, token = [], after, None
    for a in (first, second):
        *out, token = single(batch, *a[:7], ratio=ratio, head_dim=a.head_dim, eps=eps, cos=cos, sin=sin, after=prev)
        prev = token if token is not None else prev
        outs.append(tuple(out))
    return outs[0], outs[1], token
