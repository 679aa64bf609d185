"""Parallel prefill: T prompt tokens of one or several requests through every layer at once.

The same math as T decode steps (`DeepseekV4.step` one token at a time): it leaves the same state
(window ring, compressor windows, compressed KV, indexer keys) and the same last-token logits, up
to f32 summation order. Each layer runs its projections and MoE for the T tokens together and
attends through `kernels.prefill_attention` (causal masks in plain MLX; T rows of the decode
kernel on CUDA): the window (W keys before the chunk + the chunk), the entries each token's
indexer picks (CSA) or every emitted entry (HCA), sinks in the denominator.
Entries a window emits inside the chunk are pooled together (`_compress`) before anything reads
them, and each token only sees those emitted at or before its position. Several requests' chunks
share one forward (`prefill_batch`): the row-wise parts over all their tokens, attention per request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Sequence

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels import matmul as kmatmul
from dsv4_serve.kernels import prefill_attention
from dsv4_serve.kernels.compressor import pooled_entry
from dsv4_serve.kernels.indexer import topk_ids
from dsv4_serve.kernels.indexer_scores import indexer_scores
from dsv4_serve.kernels.pool_rows import commit, write_rows
from dsv4_serve.model.attention import Attention, Compressor
from dsv4_serve.model.layers import rope_angles
from dsv4_serve.model.mtp import prompt_ring
from dsv4_serve.model.state import StateHandle, StatePools

KEY_ROWS = 128  # the indexer's keys padded to a multiple of this (kernels/cuda/tiles_mm.py's rows a block)
# Layers a forward builds before it starts evaluating them (mx.async_eval of the residual stream): the GPU runs
# the first layers while Python builds the next (one eval at the end left the whole build, ~40 ms of host a
# V4-Flash forward, before any kernel). 0: build all, then evaluate (bench/prefill.py --arms sync_build).
EVAL_EVERY = int(os.environ.get("DSV4_PREFILL_EVAL_EVERY", "4"))


_compiled_fns: dict[tuple[object, ...], Callable[..., mx.array]] = {}


def compiled() -> bool:
    """`DSV4_PREFILL_COMPILE=1`: the forward's layers through their compiled segments (as decode runs them) and
    its per-request pure parts (pooled entries, the indexer's scores and top-k) compiled: 4,272 kernels a
    256-token V4-Flash forward instead of 6,083 by tools/prefill_count.py's count. Off by default: on the
    H200 its warm-up took 150 s (the fused kernels' NVRTC compiles; PART=check, 2f03c20, 2026-12-02)."""
    return os.environ.get("DSV4_PREFILL_COMPILE", "0").strip() == "1" and os.environ.get("DSV4_COMPILE", "1") != "0"


def _compiled(key: tuple[object, ...], fn: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """`fn` compiled once per key where `compiled()` (its elementwise ops and reductions fuse into a few
    kernels: prefill's per-request attention part is host-bound at a few hundred tokens), else as is."""
    if not compiled():
        return fn
    got = _compiled_fns.get(key)
    if got is None:
        got = _compiled_fns[key] = mx.compile(fn)
    return got


def _pooled(eps: float, dtype: mx.Dtype) -> Callable[..., mx.array]:
    """`pooled_entry` (vals, gates, norm, cos, sin), compiled per eps and pool dtype."""

    def fn(vals: mx.array, gates: mx.array, norm: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        return pooled_entry(vals, gates, norm, eps, cos, sin, dtype)

    return _compiled(("pooled_entry", eps, dtype), fn)


def _compress(comp: Compressor, proj: Sequence[mx.array], kv_state: mx.array, score_state: mx.array,
              pool: mx.array, slot: int, table: Sequence[int], start: int, page: int,
              eps: float, carry: mx.array | None) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:  # fmt: skip
    """`compressor_rows` for positions start..start+T-1 of one slot: every window that ends in the
    chunk emits its entry; the slot's state ends as T single steps would leave it (stale rows too).
    -> (kv_state, score_state, pool, carry): the entries go into the pool in place on CUDA (`write_rows`), and
    what reads them takes the returned `carry` (the int32 array it reads them through) in its place.

    Every row it reads is a row of ext = [the slot's S state rows; the chunk's T rows] (a CSA row's two
    halves are rows 2 i and 2 i + 1 of its [2 (S + T), d] view), so the windows' rows, the new state rows
    and the entries' destinations are index lists made on the host and uploaded once: 40 kernels a call
    where per-window gathers and concatenations took 52, 22 with `compiled()` (`tools/prefill_count.py`)."""
    kv, score, cos, sin = proj
    m, d, t, n_state = comp.ratio, comp.dim, kv.shape[0], kv_state.shape[1]
    coff = 2 if m == 4 else 1
    # seq index i <-> position base + i: the state rows still in use, then the chunk's rows (as rows of ext)
    base = (start // m) * m - (coff - 1) * m
    old = np.r_[np.arange(m), m + np.arange(start % m)] if coff == 2 else np.arange(start % m)
    ext = np.concatenate([old, n_state + np.arange(t)])
    pos = start + np.arange(t)
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
        state, later = np.arange(n_state), pos
    later = later[-m:]
    state[(coff - 1) * m + later % m] = ext[later - base]
    w = pos[ends] // m
    dest = np.asarray(table, dtype=np.int64)[w // page] * page + w % page
    ix = mx.array(np.concatenate([pos % m, state, ends, dest, gidx.reshape(-1)]).astype(np.int32))
    ends = ends.tolist()
    cut = [t, t + n_state, t + n_state + len(ends), t + n_state + 2 * len(ends)]
    ape_rows, state_rows, sel, dest_rows = ix[: cut[0]], ix[cut[0] : cut[1]], ix[cut[1] : cut[2]], ix[cut[2] : cut[3]]
    own = slice(slot, slot + 1)  # the slot's rows as a view (an integer index is a gather kernel)
    ext_kv = mx.concatenate([kv_state[own].reshape(n_state, -1), kv])
    ext_s = mx.concatenate([score_state[own].reshape(n_state, -1), score + comp.ape.astype(mx.float32)[ape_rows]])
    if ends:
        g = ix[cut[3] :].reshape(len(ends), coff * m)
        vals, gates = ext_kv.reshape(-1, d)[g], ext_s.reshape(-1, d)[g]  # [E, coff m, d]
        x = _pooled(eps, pool.dtype)(vals, gates, comp.norm.weight, cos[sel], sin[sel])
        pool, got = write_rows(pool, dest_rows, x, carry)
        if carry is None:  # nothing reads the entries in this forward: the write queued now
            commit(pool, got)
        else:
            carry = got
    kv_state[slot] = ext_kv[state_rows]
    score_state[slot] = ext_s[state_rows]
    return kv_state, score_state, pool, carry


def _entry_rows(table: Sequence[int], n: int, page: int) -> mx.array:
    """The pool rows ([pages x page, d] view) of the request's first n compressed entries, made on the host from
    its table, then the first entry's again up to a multiple of KEY_ROWS: [ceil(n / KEY_ROWS) x KEY_ROWS]. The
    top-k never picks those (each query sees its first vis <= n entries)."""
    rows = (np.asarray(table[: -(-n // page)], dtype=np.int32)[:, None] * page + np.arange(page, dtype=np.int32))
    rows = rows.reshape(-1)[:n]
    return mx.array(np.concatenate([rows, np.full(-n % KEY_ROWS, rows[0], np.int32)]))


def _select(q: mx.array, w: mx.array, keys: mx.array, vis: mx.array, topk: int) -> mx.array:
    """`indexer_rows` for T queries of one request over its n entries, query t seeing the first `vis[t]`:
    [T, topk] ids, -1 padded."""
    score = _compiled(("indexer_scores",), indexer_scores)(q, w, keys)  # [T, n] f32
    return _compiled(("topk_ids", topk), lambda s, v: topk_ids(s, v, topk))(score, vis[:, None])


def _attend(attn: Attention, proj: Sequence[mx.array], pools: StatePools, handle: StateHandle,
            start: int) -> mx.array:  # fmt: skip
    """`Attention.attend`'s kernel part for T tokens of one request: the window ring's update, the compressors'
    entries, the indexer's picks (CSA), then `prefill_attention`; o [T, nh, D] in the pool dtype."""
    a, layer, r = attn.args, attn.layer, attn.ratio
    q, kv = proj[0].astype(pools.dtype), proj[1].astype(pools.dtype)
    t, wl, slot, tables = q.shape[0], a.sliding_window, handle.slot, handle.tables
    win = pools.window[layer]  # the ring as it was before the chunk (the write below makes a new array); a slice
    ring = win[slot : slot + 1].reshape(win.shape[1:])  # view, where an integer index is a gather kernel
    tail = list(range(start, start + t))[-min(t, wl) :]
    pools.window[layer][slot, mx.array([p % wl for p in tail])] = kv[t - len(tail) :]
    n = (start + t) // r if r else 0  # entries emitted up to the chunk's last token
    # What reads the entries the compressors write (in place on CUDA) goes through the int32 array each write
    # hands back: the attention's block table, the indexer's key rows (they share the ratio-4 table).
    table = mx.array(list(tables[r]), dtype=mx.int32) if r else None
    key_rows = _entry_rows(tables[4], n, pools.page_size) if r == 4 and n else None
    if r:
        pools.comp_kv[layer], pools.comp_score[layer], pools.ckv[layer], table = _compress(
            attn.compressor, proj[4:8], pools.comp_kv[layer], pools.comp_score[layer], pools.ckv[layer], slot,
            tables[r], start, pools.page_size, a.rms_norm_eps, table,
        )  # fmt: skip
    if r == 4:
        ix = attn.indexer
        pools.idx_kv[layer], pools.idx_score[layer], pools.ikeys[layer], key_rows = _compress(
            ix.compressor, proj[10:14], pools.idx_kv[layer], pools.idx_score[layer], pools.ikeys[layer],
            slot, tables[4], start, pools.page_size, a.rms_norm_eps, key_rows,
        )  # fmt: skip
    ids = None
    if r == 4 and n:
        vis = mx.arange(start + 1, start + t + 1, dtype=mx.int32) // r  # entries each token can see
        ikeys = pools.ikeys[layer].reshape(-1, pools.ikeys[layer].shape[2])[key_rows]
        ids = _select(proj[8].astype(pools.dtype), proj[9], ikeys, vis, attn.indexer.topk)  # [T, topk]
    return prefill_attention(q, ring, kv, start, pools.ckv[layer] if r else None, table, ids, attn.attn_sink,
                             scale=a.head_dim**-0.5, ratio=r or None)  # fmt: skip


def check_work(work: Sequence[tuple[StateHandle, Sequence[int], int]]) -> None:
    """ValueError naming the argument for a batch `prefill_batch` cannot run: empty, an empty chunk,
    positions outside a request's capacity, a state slot twice (two chunks of one request in one
    forward would read each other's state before it is written)."""
    if not work:
        raise ValueError("prefill: work must not be empty")
    slots = set()
    for handle, token_ids, start in work:
        if not len(token_ids):
            raise ValueError("prefill: token_ids must not be empty")
        if start < 0 or start + len(token_ids) > handle.capacity:
            raise ValueError(f"prefill: positions {start}..{start + len(token_ids) - 1} are outside the "
                             f"request's capacity {handle.capacity}")  # fmt: skip
        if handle.slot in slots:
            raise ValueError(f"prefill: work holds state slot {handle.slot} twice (one chunk per request)")
        slots.add(handle.slot)


def _layers(model, pools: StatePools, work: Sequence[tuple[StateHandle, Sequence[int], int]], logits: bool,
            every: list[bool], mtp_next: Sequence[int] | None = None,
            ) -> Generator[mx.array, None, list[mx.array | None] | None]:  # fmt: skip
    """`prefill_batch`'s forward, yielding the residual stream after each layer (the driver decides when to
    evaluate); returns what `prefill_batch` returns. With `mtp_next` (speculative decoding: the token after each
    chunk), the MTP block's ring over every position from the final streams (model/mtp.py: prompt_ring)."""
    a = model.args
    ids = mx.array([int(x) for _, toks, _ in work for x in toks], dtype=mx.int32)
    lens = [len(toks) for _, toks, _ in work]
    bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
    pos = mx.array([p for (_, toks, s) in work for p in range(s, s + len(toks))], dtype=mx.int32)
    t = ids.shape[0]
    x = model.embed(ids)
    hs = mx.broadcast_to(x[:, None, :], (t, a.hc_mult, x.shape[1]))
    angles: dict[int, tuple[mx.array, ...]] = {}  # a layer kind's RoPE inputs and its de-rotation (-S), once
    for i, block in enumerate(model.layers):
        r = a.layer_ratio(i)
        if r not in angles:
            ang = rope_angles(model._freqs[r != 0], pos, r, a)
            angles[r] = (*ang, -ang[1])
        # with compiled(), the layer's compiled segments as decode runs them (traced once per row count T: a new
        # T costs about what building the uncompiled graph does, and its elementwise chains run fused)
        before, after = block._segments() if compiled() else (block.before, block.after)
        post, comb, *proj = before(hs, *angles[r][:-1])
        if len(work) == 1:
            o = _attend(block.attn, proj, pools, work[0][0], work[0][2])
        else:
            o = mx.concatenate([
                _attend(block.attn, [p[b0:b1] for p in proj], pools, handle, start)
                for (handle, _, start), b0, b1 in zip(work, bounds[:-1], bounds[1:], strict=True)
            ])  # fmt: skip
        hs = after(o, hs, post, comb, proj[2], angles[r][-1], ids)
        yield hs
    if mtp_next is not None:
        prompt_ring(model, pools, work, hs, mtp_next, pos)
    if not logits and not any(every):
        return None
    # the head's rows: a request's every row (`every`), else its last one (`logits`), else none
    sel = [range(b0, b1) if e else [b1 - 1] if logits else []
           for e, b0, b1 in zip(every, bounds[:-1], bounds[1:], strict=True)]  # fmt: skip
    idx = [i for s in sel for i in s]
    rows = hs if len(idx) == t else hs[mx.array(idx, dtype=mx.int32)]
    y = model.collapse(rows)
    out = kmatmul.f32_linear_rows(y, model.head.weight)  # [rows, vocab] f32, as the decode step's head
    cuts = np.cumsum([0, *map(len, sel)]).tolist()
    return [out[c0:c1] if e else out[c0] if logits else None
            for e, c0, c1 in zip(every, cuts[:-1], cuts[1:], strict=True)]  # fmt: skip


class Forward:
    """One `prefill_batch` forward built a slice of layers at a time, so that the engine can run decode steps
    between slices (a running stream then waits a slice, not a whole forward). `advance(seconds)` builds
    layers until `seconds` of host time have passed (at least one), queues them (`mx.async_eval` of the
    residual stream) and returns True once the forward is built; `out` is then `prefill_batch`'s result.
    Between slices the layers still to come have not touched the state: a decode step of other slots may run
    (it reads and writes the same pools, each layer's arrays taken when that layer is built)."""

    def __init__(self, model, pools: StatePools, work: Sequence[tuple[StateHandle, Sequence[int], int]],
                 logits: bool = True, every: bool | Sequence[bool] = False,
                 mtp_next: Sequence[int] | None = None) -> None:  # fmt: skip
        check_work(work)
        every = [every] * len(work) if isinstance(every, bool) else [bool(e) for e in every]
        if len(every) != len(work):
            raise ValueError(f"prefill: every has {len(every)} entries for {len(work)} chunks")
        self.work = list(work)
        self.layers = len(model.layers)
        self.rows = sum(len(t) for _, t, _ in work)
        self.built = 0  # layers built so far
        self.done = False
        self.out: list[mx.array | None] | None = None
        self._head_alone = any(every)  # an every-row head ([T, V]: a layer's GPU time or more) is a slice alone
        self._pools = pools
        self._gen = _layers(model, pools, work, logits, every, mtp_next)

    def advance(self, seconds: float | None = None, rows_layers: int = 0) -> bool:
        """Build the next slice: layers until `seconds` of host time (None: to the end) or, with `rows_layers`,
        until layers x rows reach it (the host time does not see the GPU's: a 2,048-row V4-Flash layer is ~7 ms
        of H200 time for ~3 ms of host), queued every EVAL_EVERY layers and at the slice's end; True when the
        forward is built (evaluate `out` and the pools as `prefill_batch` says)."""
        t0, hs, built = time.perf_counter(), None, 0
        cap = max(1, rows_layers // self.rows) if rows_layers else self.layers  # layers x rows: the slice's GPU work
        while not self.done:
            try:
                hs = next(self._gen)
            except StopIteration as stop:
                self.done, self.out, hs = True, stop.value, None
                break
            self.built += 1
            built += 1
            if EVAL_EVERY > 0 and self.built % EVAL_EVERY == 0 and self.built < self.layers:
                mx.async_eval(hs)
            full = built >= cap or time.perf_counter() - t0 >= seconds if seconds is not None else False
            if full and (self.built < self.layers or self._head_alone):
                break  # (the last layer's slice goes on to a one-row head: no empty slice at the end)
        if hs is not None and seconds is not None:  # after the last layer (an every-row head next, alone): its
            mx.async_eval(hs if self.built < self.layers else self._pools.arrays())  # state; the MoE half: the head's
        return self.done


def prefill_batch(model, pools: StatePools, work: Sequence[tuple[StateHandle, Sequence[int], int]], logits: bool = True,
                  every: bool | Sequence[bool] = False,
                  mtp_next: Sequence[int] | None = None) -> list[mx.array | None] | None:  # fmt: skip
    """Feed several requests' chunks in ONE forward: work[i] = (handle, token_ids, start), request i's
    tokens at positions start.. . Returns each request's last-token logits [vocab] f32 (None with
    `logits=False`: the head is skipped); `every` (for all requests, or one flag a request): every token's,
    [len_i, vocab], for prompt logprobs: the head then costs those rows, paid only by requests that ask
    (with `logits=False` the others get None, or the whole result is None when none asks).

    The chunks are concatenated into T = sum(len) rows: hc / norms / projections / MoE (everything
    row-wise, each row at its own position and token id) run once over the T rows; the attention with
    its window ring, compressors and indexer (`_attend`) runs per request on its rows, its slot and its
    block tables, so no request's keys, entries or masks ever meet another's. Work buffers scale with
    the chunk (kernels/prefill_attention.py; the plain indexer scores in SCORE_BYTES blocks), never the whole
    prompt; the entries' views grow with the context (n = context / ratio). `Forward` builds it in slices.
    `mtp_next` (one token a chunk: the prompt's next one) runs the MTP block's ring over the chunks' positions.
    The state update is lazy: evaluate the logits and `pools.arrays()` together."""
    fwd = Forward(model, pools, work, logits, every, mtp_next)
    fwd.advance(None)
    return fwd.out


def prefill_chunk(model, pools: StatePools, handle: StateHandle, token_ids: Sequence[int], start: int,
                  logits: bool = True, every: bool = False) -> mx.array | None:  # fmt: skip
    """Feed `token_ids` at positions start.. of one request in one pass; logits of the last token [vocab] f32
    (None with `logits=False`; `every=True`: every token's [T, vocab]). `prefill_batch` with one request.

    The state update is lazy: evaluate the logits and `pools.arrays()` together."""
    out = prefill_batch(model, pools, [(handle, token_ids, start)], logits, every)
    return None if out is None else out[0]
