"""Parallel prefill: T prompt tokens of one or several requests through every layer at once.

The same math as T decode steps (`DeepseekV4.step` one token at a time): it leaves the same state
(window ring, compressor windows, compressed KV, indexer keys) and the same last-token logits, up
to f32 summation order. Each layer runs its projections and MoE for the T tokens together and
attends through `kernels.prefill_attention` (causal masks in plain MLX; T rows of the decode
kernel on CUDA): the window (W keys before the chunk + the chunk), the entries each token's
indexer picks (CSA) or every emitted entry (HCA), sinks in the denominator.
Entries a window emits inside the chunk are pooled together (model/prefill_compress.py) before anything reads
them, and each token only sees those emitted at or before its position. Several requests' chunks share one
forward (`prefill_batch`): the row-wise parts over all their tokens, the window rings' writes and each compressor
in one call for every request (its kernels do not grow with the requests), the indexer's picks in one call too
where the scores stay small (model/prefill_indexer.py), the attention per request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels import matmul as kmatmul
from dsv4_serve.kernels import prefill_attention
from dsv4_serve.kernels.pool_rows import renewed, write_rows
from dsv4_serve.kernels.upload import upload
from dsv4_serve.model import prefill_compress
from dsv4_serve.model.attention import Attention
from dsv4_serve.model.layers import rope_angles
from dsv4_serve.model.mtp import prompt_ring
from dsv4_serve.model.prefill_compress import Chunk, compress_chunks
from dsv4_serve.model.prefill_indexer import compiled, entry_rows, every_visible, pooled, select, select_all
from dsv4_serve.model.state import StateHandle, StatePools

# Layers a forward builds before it starts evaluating them (mx.async_eval of the residual stream): the GPU runs
# the first layers while Python builds the next (one eval at the end left the whole build, ~40 ms of host a
# V4-Flash forward, before any kernel). 0: build all, then evaluate (bench/prefill.py --arms sync_build).
EVAL_EVERY = int(os.environ.get("DSV4_PREFILL_EVAL_EVERY", "4"))


def _carry(parts: Sequence[np.ndarray], empty: bool = True) -> tuple[mx.array | None, list[int]]:
    """Each request's int32 array as one (all empty and not `empty`: None) and where each starts in it (a slice of
    it is a view)."""
    offs = np.cumsum([0, *map(len, parts)]).tolist()
    return (mx.array(np.concatenate(parts).astype(np.int32)) if offs[-1] or empty else None), offs


def _ring_rows(chunks: Sequence[Chunk], wl: int) -> tuple[mx.array, mx.array, slice | mx.array, mx.array | None]:
    """The window rings' write for every request (the last W positions of each chunk): their slots and ring rows,
    their rows of kv as a slice where they are one run (a request alone), else a gather's indices, and the ring
    rows as rows of the [slots * W, D] view where they are written in place (`write_rows`)."""
    tails = [range(max(c.start, c.b1 - c.b0 + c.start - wl), c.start + c.b1 - c.b0) for c in chunks]
    slot_ids = [c.slot for c, tail in zip(chunks, tails, strict=True) for _ in tail]
    ring = [p % wl for tail in tails for p in tail]
    slots, at = mx.array(slot_ids, dtype=mx.int32), mx.array(ring, dtype=mx.int32)
    flat = mx.array([s * wl + p for s, p in zip(slot_ids, ring, strict=True)], dtype=mx.int32) \
        if prefill_compress.STATE_INPLACE else None  # fmt: skip
    rows = [c.b0 + p - c.start for c, tail in zip(chunks, tails, strict=True) for p in tail]
    run = rows == list(range(rows[0], rows[-1] + 1))
    return slots, at, slice(rows[0], rows[-1] + 1) if run else mx.array(rows, dtype=mx.int32), flat


def _tables(chunks: Sequence[Chunk], r: int, page: int) -> tuple[Any, ...]:
    """The block tables as one int32 array (and where each request's starts), the entries emitted up to each
    chunk's last token, and (CSA) the indexer's key rows as one array (and where each request's start)."""
    ns = [(c.start + c.b1 - c.b0) // r if r else 0 for c in chunks]
    table, t_offs = _carry([np.asarray(c.table, np.int32) for c in chunks]) if r else (None, [])
    key_rows, k_offs = None, []
    if r == 4:
        key_rows, k_offs = _carry([entry_rows(c.table, n, page) if n else np.zeros(0, np.int32)
                                   for c, n in zip(chunks, ns, strict=True)], empty=False)  # fmt: skip
    return ns, table, t_offs, key_rows, k_offs


def _memo(memo: dict[Any, Any] | None, key: Any, make: Callable[[], Any]) -> Any:
    """make() once a forward (`memo`: the forward's; None: every call)."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _ring_in_place(pools: StatePools, layer: int, flat: mx.array | None, values: mx.array,
                   written: list[mx.array]) -> None:  # fmt: skip
    """With the slot rows in place, the window rings' rows `flat` of the [slots * W, D] view set to `values`
    (`write_rows`); its token joins `written`. Nothing otherwise (the scatter into a renewed ring is `_attend`'s)."""
    if prefill_compress.STATE_INPLACE:
        pools.window[layer], token = write_rows(pools.window[layer], flat, values)
        written += [] if token is None else [token]


def _attend(attn: Attention, proj: Sequence[mx.array], pools: StatePools, chunks: Sequence[Chunk],
            seen: mx.array | None = None, memo: dict[Any, Any] | None = None,
            roots: list[mx.array] | None = None) -> mx.array | None:  # fmt: skip
    """`Attention.attend`'s kernel part for the forward's requests (`chunks`: each one's rows of proj): the window
    rings' update, the compressors' entries (every request in one call each: model/prefill_compress.py), the
    indexer's picks (CSA; `seen`: every entry each query sees, where that is what the top-k keeps:
    prefill_indexer.every_visible), then `prefill_attention` for each request on its rows; o [T, nh, D] in the
    pool dtype. `memo`: the forward's, holding the host-made index arrays every layer of a ratio shares (made and
    uploaded once a forward). `roots` (a layer whose output nothing reads: the last of a forward without a head):
    the state writes alone, no picks and no attention; the tokens of its in-place writes go to `roots` (on CUDA a
    write whose token nothing evaluates never runs) and None is returned."""
    a, layer, r = attn.args, attn.layer, attn.ratio
    q, kv = proj[0].astype(pools.dtype), proj[1].astype(pools.dtype)
    wl, page, one = a.sliding_window, pools.page_size, len(chunks) == 1
    win = pools.window[layer]  # the rings as they were before the chunks (the write below makes a new array); each
    rings = [win[c.slot : c.slot + 1].reshape(win.shape[1:]) for c in chunks]  # a slice view, not a gather kernel
    # one scatter for every request's ring rows (in place: after the attention, which reads the old ring)
    slots, at, rows, flat = _memo(memo, "ring", lambda: _ring_rows(chunks, wl))
    if not prefill_compress.STATE_INPLACE:  # a new array (`renewed`): the pool's own keeps its buffer
        ring = renewed(pools.window[layer])
        ring[slots, at] = kv[rows]
        pools.window[layer] = ring
    # What reads the entries the compressors write (in place on CUDA) goes through the int32 array each write
    # hands back: the attention's block tables, the indexer's key rows (they share the ratio-4 table).
    ns, table, t_offs, key_rows, k_offs = _memo(memo, ("tables", r), lambda: _tables(chunks, r, page))
    eps = a.rms_norm_eps
    written: list[mx.array] = []  # the in-place slot rows' write tokens: the layer's output waits for them
    if r:
        pools.comp_kv[layer], pools.comp_score[layer], pools.ckv[layer], table = compress_chunks(
            attn.compressor, proj[4:8], pools.comp_kv[layer], pools.comp_score[layer], pools.ckv[layer], chunks,
            page, eps, table, pooled(eps, pools.ckv[layer].dtype), memo, written,
        )  # fmt: skip
    if r == 4:
        pools.idx_kv[layer], pools.idx_score[layer], pools.ikeys[layer], key_rows = compress_chunks(
            attn.indexer.compressor, proj[10:14], pools.idx_kv[layer], pools.idx_score[layer], pools.ikeys[layer],
            chunks, page, eps, key_rows, pooled(eps, pools.ikeys[layer].dtype), memo, written,
        )  # fmt: skip
    if roots is not None:  # nothing reads the old ring nor the entries here: the writes alone
        _ring_in_place(pools, layer, flat, kv[rows], written)
        roots += [t for t in (*written, table, key_rows) if t is not None]
        return None
    picks, ikeys = None, pools.ikeys[layer].reshape(-1, pools.ikeys[layer].shape[2]) if r == 4 else None
    if r == 4 and seen is not None:
        picks = seen
    elif r == 4 and key_rows is not None and not one:  # the keys every request's queries read, side by side
        picks = select_all(proj[8].astype(pools.dtype), proj[9], ikeys[key_rows], chunks, k_offs, r, attn.indexer.topk)
    outs = []
    for i, c in enumerate(chunks):
        rows_i = slice(c.b0, c.b1)
        qi, kvi = (q, kv) if one else (q[rows_i], kv[rows_i])
        ids = None
        if picks is not None and ns[i]:
            ids = picks if one else picks[rows_i]
        elif r == 4 and ns[i]:
            vis = mx.arange(c.start + 1, c.start + c.b1 - c.b0 + 1, dtype=mx.int32) // r  # entries each token sees
            keys = ikeys[key_rows[k_offs[i] : k_offs[i + 1]]]
            iq, iw = (proj[8], proj[9]) if one else (proj[8][rows_i], proj[9][rows_i])
            ids = select(iq.astype(pools.dtype), iw, keys, vis, attn.indexer.topk)  # [T, topk]
        tab = table[t_offs[i] : t_offs[i + 1]] if r else None
        outs.append(prefill_attention(qi, rings[i], kvi, c.start, pools.ckv[layer] if r else None, tab, ids,
                                      attn.attn_sink, scale=a.head_dim**-0.5, ratio=r or None))  # fmt: skip
    _ring_in_place(pools, layer, flat, mx.depends([kv[rows]], outs)[0], written)  # after every read of the old ring
    o = outs[0] if one else mx.concatenate(outs)
    if written:  # evaluated with the layer, not mid-build (a `commit` each was an evaluation of what came before)
        o = mx.depends([o], written)[0]
    if picks is seen and key_rows is not None:
        # Nothing here read the keys, so nothing would evaluate the token of their write: on CUDA (written in place)
        # the keys were then never written (a later chunk, or decode past 512 entries, scored stale rows; the CPU's
        # functional write made a new pool, so only a GPU test saw it). The layer's output now waits for it.
        o = mx.depends([o], [key_rows])[0]
    return o


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
            every: list[bool], mtp_next: Sequence[int] | None = None, roots: list[mx.array] | None = None,
            ) -> Generator[mx.array, None, list[mx.array | None] | None]:  # fmt: skip
    """`prefill_batch`'s forward, yielding the residual stream after each layer (the driver decides when to
    evaluate); returns what `prefill_batch` returns. With `mtp_next` (speculative decoding: the token after each
    chunk), the MTP block's ring over every position from the final streams (model/mtp.py: prompt_ring).
    Without a head, an MTP ring or scores, nothing reads the last layer's output: that layer makes its state
    writes alone (`_attend`'s `roots`, which the driver must evaluate: the tokens of its in-place writes)."""
    a = model.args
    dead = len(model.layers) - 1 if roots is not None and not logits and not any(every) and mtp_next is None else -1
    ids = mx.array([int(x) for _, toks, _ in work for x in toks], dtype=mx.int32)
    lens = [len(toks) for _, toks, _ in work]
    bounds = [sum(lens[:i]) for i in range(len(lens) + 1)]
    pos = mx.array([p for (_, toks, s) in work for p in range(s, s + len(toks))], dtype=mx.int32)
    t = ids.shape[0]
    x = model.embed(ids)
    hs = mx.broadcast_to(x[:, None, :], (t, a.hc_mult, x.shape[1]))
    angles: dict[int, tuple[mx.array, ...]] = {}  # a layer kind's RoPE inputs and its de-rotation (-S), once
    # the CSA layers' picks where every query keeps every entry it sees (short contexts): once a forward, no scores
    seen = every_visible([(s, len(toks)) for _, toks, s in work], 4, a.index_topk) if 4 in a.compress_ratios else None
    seen = upload(seen) if seen is not None else None
    memo: dict[Any, Any] = {}  # the index arrays every layer of a ratio shares: made and uploaded once a forward
    for i, block in enumerate(model.layers):
        r = a.layer_ratio(i)
        if r not in angles:
            ang = rope_angles(model._freqs[r != 0], pos, r, a)
            angles[r] = (*ang, -ang[1])
        # with compiled(), the layer's compiled segments as decode runs them (traced once per row count T: a new
        # T costs about what building the uncompiled graph does, and its elementwise chains run fused)
        before, after = block._segments() if compiled() else (block.before, block.after)
        post, comb, *proj = before(hs, *angles[r][:-1])
        chunks = [Chunk(h.slot, h.tables[r] if r else (), start, b0, b1)
                  for (h, _, start), b0, b1 in zip(work, bounds[:-1], bounds[1:], strict=True)]  # fmt: skip
        if i == dead:  # its state writes alone (no attention, no MoE: nothing reads them)
            _attend(block.attn, proj, pools, chunks, None, memo, roots)
            yield hs
            break
        o = _attend(block.attn, proj, pools, chunks, seen if r == 4 else None, memo)
        assert o is not None
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
        self.roots: list[mx.array] = []  # the last layer's write tokens when nothing reads its output (`_layers`)
        self._gen = _layers(model, pools, work, logits, every, mtp_next, self.roots)

    def advance(self, seconds: float | None = None, rows_layers: int = 0,
                before_eval: Callable[[], None] | None = None) -> bool:  # fmt: skip
        """Build the next slice: layers until `seconds` of host time (None: to the end) or, with `rows_layers`,
        until layers x rows reach it (the host time does not see the GPU's: a 2,048-row V4-Flash layer is ~7 ms
        of H200 time for ~3 ms of host), queued every EVAL_EVERY layers and at the slice's end; True when the
        forward is built (evaluate `out` and the pools as `prefill_batch` says). `before_eval`: called once before
        the first of them (the layers before it are only built: no kernel has run, nothing read or written)."""
        t0, hs, built = time.perf_counter(), None, 0

        def queue(x: object) -> None:
            nonlocal before_eval
            if before_eval is not None:
                before_eval()
                before_eval = None
            mx.async_eval(x)

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
                queue(hs)
            full = built >= cap or time.perf_counter() - t0 >= seconds if seconds is not None else False
            if full and (self.built < self.layers or self._head_alone):
                break  # (the last layer's slice goes on to a one-row head: no empty slice at the end)
        if hs is not None and seconds is not None:  # after the last layer (an every-row head next, alone): its
            queue(hs if self.built < self.layers else self._pools.arrays())  # state; the MoE half: the head's
        if self.done and self.roots:  # the last layer's writes, which nothing the forward returns reads
            queue(self.roots)
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
    row-wise, each row at its own position and token id) run once over the T rows, and so do the window rings'
    writes and each compressor (`_attend`: index lists made per request on the host), and the indexer's picks
    for short contexts (each request's rows masked to its own keys); the attention runs per request on its rows,
    its slot and its block tables, so no request's keys, entries or masks ever meet another's. Work buffers scale
    with
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
