"""A compressor's part of a prefill forward: every window that ends in a request's chunk emits its entry, and each
request's slot is left as its chunk's single decode steps would leave it; all the forward's requests at once.

Every row the compressor reads is a row of one matrix, ext = [each request's S state rows; the forward's T rows]
(a CSA row's two halves are rows 2 i and 2 i + 1 of its [2 (R S + T), d] view), so the windows' rows, the slots' new
state rows and the entries' destinations are index lists made on the host and uploaded once, and the kernels a
call launches do not grow with the requests: one concatenation, one gather each of the windows' values and gates,
one pooling, one pool write and one state update, where a call a request took ~25 MLX nodes each (on a GPU each
node costs ~20 us of host: a forward of 8 prompts of 32 tokens cost 5x one prompt's, docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels import pool_rows
from dsv4_serve.kernels.pool_rows import commit, renewed, write_rows
from dsv4_serve.model.attention import Compressor

# DSV4_PREFILL_STATE_INPLACE (kernels/pool_rows.py SLOT_ROWS_INPLACE, default on): a forward's slot-state writes (the
# compressors' windows here, the window rings in model/prefill.py) go through `write_rows`, in place on CUDA as the
# page pools' entries already are. With 0 each is MLX's scatter, which copies the whole array: on a graph server
# every 32-token prefill moved all 167 slot arrays and the next replay copied them home (a 5-11 ms refresh, H100
# and H200, 2026-12-07). Its ordering (a write after every read of the old rows) passed on an H100
# (tests/model/test_cuda_prefill.py, a40c3ad); the CPU's twin is the scatter.
STATE_INPLACE = pool_rows.SLOT_ROWS_INPLACE


class Chunk(NamedTuple):
    """One request's rows b0..b1 of the forward, at positions start.., in `slot`, with its block table."""

    slot: int
    table: Sequence[int]
    start: int
    b0: int
    b1: int


def _plan(m: int, coff: int, n_state: int, c: Chunk, r: int, n_req: int, page: int) -> tuple[np.ndarray, ...]:
    """Request r's indices: (each row's ape row, the slot's new state rows in ext, the forward rows that end a window,
    their entries' pool rows, the windows' rows in ext (CSA: of the halves' view))."""
    t = c.b1 - c.b0
    # seq index i <-> position base + i: the state rows still in use, then the chunk's rows (as rows of ext)
    base = (c.start // m) * m - (coff - 1) * m
    old = np.r_[np.arange(m), m + np.arange(c.start % m)] if coff == 2 else np.arange(c.start % m)
    ext = np.concatenate([r * n_state + old, n_req * n_state + c.b0 + np.arange(t)])
    pos = c.start + np.arange(t)
    ends = np.flatnonzero(pos % m == m - 1)  # chunk rows that end a window
    firsts = pos[ends] - (m - 1) - base  # seq index of each emitted window's first row
    win = firsts[:, None] + np.arange(m)
    # CSA: the previous window's first half + this window's second half
    gidx = np.concatenate([2 * ext[win - m], 2 * ext[win] + 1], axis=1) if coff == 2 else ext[win]
    # The slot's rows afterwards: after the last emission both CSA halves hold that window; then each later
    # position p overwrites row (coff - 1) m + p % m (the last write wins: only the last m positions matter).
    if coff == 2 and len(ends):
        state = ext[firsts[-1] + np.arange(n_state) % m]
        later = pos[ends[-1] + 1 :]
    else:
        state, later = r * n_state + np.arange(n_state), pos
    later = later[-m:]
    state[(coff - 1) * m + later % m] = ext[later - base]
    w = pos[ends] // m
    dest = np.asarray(c.table, dtype=np.int64)[w // page] * page + w % page
    return pos % m, state, c.b0 + ends, dest, gidx.reshape(-1)


Arrays4 = tuple[mx.array, mx.array, mx.array, mx.array | None]


def _indices(m: int, coff: int, n_state: int, chunks: Sequence[Chunk],
             page: int) -> tuple[mx.array, list[int], mx.array | slice]:  # fmt: skip
    """Every request's `_plan` as one uploaded int32 array, where each list starts in it, and the slots' rows (a
    request alone's as a view: an integer index or an index array is a gather kernel)."""
    n_req = len(chunks)
    plans = [_plan(m, coff, n_state, c, r, n_req, page) for r, c in enumerate(chunks)]
    ape, state, sel, dest, gidx = (np.concatenate(p) for p in zip(*plans, strict=True))
    own = np.concatenate([c.slot * n_state + np.arange(n_state) for c in chunks])  # the slots' rows, in `state`'s order
    ix = mx.array(np.concatenate([ape, state, sel, dest, own, gidx]).astype(np.int32))
    cut = np.cumsum([0, len(ape), len(state), len(sel), len(sel), len(own)]).tolist()
    slots = slice(chunks[0].slot, chunks[0].slot + 1) if n_req == 1 else mx.array([c.slot for c in chunks], mx.int32)
    return ix, cut, slots


def compress_chunks(comp: Compressor, proj: Sequence[mx.array], kv_state: mx.array, score_state: mx.array,
                    pool: mx.array, chunks: Sequence[Chunk], page: int, eps: float, carry: mx.array | None,
                    pooled: Callable[..., mx.array], memo: dict[Any, Any] | None = None,
                    written: list[mx.array] | None = None) -> Arrays4:  # fmt: skip
    """`compressor_rows` for every chunk of the forward (proj = kv, score, cos, sin over its T rows) ->
    (kv_state, score_state, pool, carry): the entries go into the pool in place on CUDA (`write_rows`), and what
    reads them takes the returned `carry` (the int32 array it reads them through) in its place. `pooled`: the
    entries' pooling (vals, gates, norm, cos, sin), compiled or not by the caller. `memo`: the forward's, where
    the index lists (the same for every layer of a ratio: the chunks' positions, slots and tables) are made and
    uploaded once a forward, not once a layer. `written` (DSV4_PREFILL_STATE_INPLACE): the slot rows' write tokens
    go there for the caller to make a dependency of what it evaluates (no evaluation mid-build), else are queued
    now (`commit`)."""
    kv, score, cos, sin = proj
    m, d, n_state, n_req = comp.ratio, comp.dim, kv_state.shape[1], len(chunks)
    coff = 2 if m == 4 else 1
    key = ("compress", m, coff, n_state)
    got = None if memo is None else memo.get(key)
    if got is None:
        got = _indices(m, coff, n_state, chunks, page)
        if memo is not None:
            memo[key] = got
    ix, cut, slots = got
    n_ent = cut[3] - cut[2]
    ape_rows, state_rows, sel_rows, dest_rows, own_rows = (ix[a:b] for a, b in zip(cut[:-1], cut[1:], strict=True))
    own_kv, own_s = kv_state[slots], score_state[slots]
    ext_kv = mx.concatenate([own_kv.reshape(n_req * n_state, -1), kv])
    ext_s = mx.concatenate([own_s.reshape(n_req * n_state, -1), score + comp.ape.astype(mx.float32)[ape_rows]])
    if n_ent:
        g = ix[cut[5] :].reshape(n_ent, coff * m)
        vals, gates = ext_kv.reshape(-1, d)[g], ext_s.reshape(-1, d)[g]  # [E, coff m, d]
        x = pooled(vals, gates, comp.norm.weight, cos[sel_rows], sin[sel_rows])
        pool, got = write_rows(pool, dest_rows, x, carry)
        if carry is None:  # nothing reads the entries in this forward: the write queued now
            commit(pool, got)
        else:
            carry = got
    if STATE_INPLACE:  # the rows written are made from the gathered old ones: the write runs after that read
        kv_state, t_kv = write_rows(kv_state, own_rows, ext_kv[state_rows].astype(kv_state.dtype))
        score_state, t_s = write_rows(score_state, own_rows, ext_s[state_rows].astype(score_state.dtype))
        if written is None:  # queued now
            kv_state, score_state = commit(kv_state, t_kv), commit(score_state, t_s)
        else:
            written += [t for t in (t_kv, t_s) if t is not None]
    else:  # new arrays (`renewed`): the caller's keep their buffers
        kv_state, score_state = renewed(kv_state), renewed(score_state)
        kv_state[slots] = ext_kv[state_rows].reshape(n_req, n_state, -1)
        score_state[slots] = ext_s[state_rows].reshape(n_req, n_state, -1)
    return kv_state, score_state, pool, carry
