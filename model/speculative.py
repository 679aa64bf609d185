"""Speculative decoding's model side (issue 53; docs/mtp.md): the verify forward, the rollback of rejected draft
positions, and the MTP block over accepted positions.

- `verify`: every request's [last token, drafts...] chunk through ONE decode step with its positions as chained
  rows (kernels/rows.py: the single steps' bits; where the kernels take chains and the rows fit a step) or ONE
  forward of the parallel prefill (model/prefill.py: causal order within a chunk, the same state as
  token-by-token decoding), every position's logits and the final mHC streams (the MTP block's input) kept.
- `snapshot` / `rollback`: what the draft positions q = first..last can write, copied before the forward, and
  written back for the positions a rejection undoes. A position q writes its window ring row q % W, its
  compressors' state row (coff - 1) m + q % m, at a window's end (q + 1) % m == 0 the entry q // m of its pages
  and (CSA, coff 2) the roll of the current half into the previous one (rows 0..m-1). With k + 1 <= 4 positions
  (k <= 3 drafts; m >= 4, W >= 4) no two positions of a chunk share a ring row or a state row, at most one ends
  a window, and a kept position never needs a row an undone one wrote: so the state after the kept positions
  is the forward's with those rows put back (the first half only when an undone position rolled it).
- `draft_rows`: one MTP step (model/mtp.py's draft_step) for pairs (streams at q, the token at q + 1) of
  distinct requests; a request's accepted positions go through it in order, one call each (rounds). Chained
  drafts (k > 1) feed it the block's own output streams and draft; the ring rows they write are taken before
  (`mtp_rows`) and put back after (`restore_mtp_rows`), so the ring never holds a draft's position.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from dsv4_serve import kernels
from dsv4_serve.kernels.pool_rows import commit, write_rows
from dsv4_serve.kernels.rows import MAX_ROWS
from dsv4_serve.kernels.upload import upload
from dsv4_serve.model.mtp import draft_streams
from dsv4_serve.model.prefill import _layers, check_work
from dsv4_serve.model.state import StateHandle, StatePools

MAX_DRAFTS = 3  # k + 1 positions must fit the smallest compress ratio (4): see the module docstring
# The verify's form (`verify`): None picks (a chained step where the kernels take chains and the rows fit), True a
# chained step, False the prefill forward; DSV4_SPEC_VERIFY=auto / rows / forward sets it (bench arms)
VERIFY_ROWS: bool | None = {"rows": True, "forward": False}.get(os.environ.get("DSV4_SPEC_VERIFY", "auto"))


def verify(model, pools: StatePools, work: Sequence[tuple[StateHandle, Sequence[int], int]],
           rows: bool | None = None) -> tuple[list[mx.array], mx.array]:  # fmt: skip
    """work[i] = (handle, token_ids, start): every chunk in ONE pass, causal within each; -> each chunk's logits
    [len_i, vocab] f32 (row t predicts the token after token t) and the streams after the last layer [T, nc, H]
    (the chunks' rows in work order). Writes every position's state; lazy (evaluate with pools.arrays()).

    The pass is ONE decode step with a chunk's positions as chained rows (`rows`; the default where the kernels
    take chains and the chunks fit a step's rows: the single steps' bits), else the parallel prefill's forward
    (the same math in another summation order)."""
    check_work(work)
    if rows is None:
        rows = VERIFY_ROWS
    if rows is None:
        rows = kernels.chains_supported() and sum(len(t) for _, t, _ in work) <= MAX_ROWS
    if rows:
        return _verify_rows(model, pools, work)
    gen = _layers(model, pools, work, True, [True] * len(work))
    hs = None
    while True:
        try:
            hs = next(gen)
        except StopIteration as stop:
            return list(stop.value), hs  # type: ignore[arg-type]


def _verify_rows(model, pools: StatePools, work: Sequence[tuple[StateHandle, Sequence[int], int]],
                 ) -> tuple[list[mx.array], mx.array]:  # fmt: skip
    """`verify` as one chained decode step: chunk i's tokens at positions start_i.. as adjacent rows."""
    handles, positions, ids = [], [], []
    for h, toks, start in work:
        handles += [h] * len(toks)
        positions += range(start, start + len(toks))
        ids += [int(t) for t in toks]
    hs = model.streams(model.make_batch(pools, handles, positions), upload(ids), pools)
    logits, out, at = model.logits(hs), [], 0
    for _, toks, _ in work:
        out.append(logits[at : at + len(toks)])
        at += len(toks)
    return out, hs


def _compressors(pools: StatePools) -> list[tuple[str, dict[int, mx.array], int, int]]:
    """(name, pools, layer, ratio) of every compressor state array: comp_* at the layer's ratio, idx_* at 4."""
    ratios = pools.args.compress_ratios
    out = [(n, getattr(pools, n), layer, ratios[layer]) for n in ("comp_kv", "comp_score") for layer in pools.comp_kv]
    return out + [(n, getattr(pools, n), layer, 4) for n in ("idx_kv", "idx_score") for layer in pools.idx_kv]


@dataclass
class Snapshot:
    """What positions first..last of one request can write, as it was before they ran."""

    handle: StateHandle
    first: int
    last: int
    ring: dict[int, mx.array] = field(default_factory=dict)  # main layer -> its ring rows [n, D]
    comp: dict[tuple[str, int], mx.array] = field(default_factory=dict)  # (array, layer) -> the slot's rows
    entries: list[tuple[dict[int, mx.array], int, int, int, int, mx.array]] = field(default_factory=list)

    def arrays(self) -> list[mx.array]:
        return [*self.ring.values(), *self.comp.values(), *(e[-1] for e in self.entries)]


def snapshot(pools: StatePools, handle: StateHandle, first: int, last: int) -> Snapshot:
    """Copy what positions first..last (the drafts) can write, before the forward that writes them (queued now:
    the forward's writes run after it)."""
    n = last - first + 1
    w = pools.args.sliding_window
    if not 1 <= n <= MAX_DRAFTS or n > w:
        raise ValueError(f"snapshot: {n} draft positions; 1..{min(MAX_DRAFTS, w)} can be rolled back")
    snap, slot, ratios = Snapshot(handle, first, last), handle.slot, pools.args.compress_ratios
    rows = mx.array([q % w for q in range(first, last + 1)], dtype=mx.int32)
    for layer in range(len(ratios)):
        snap.ring[layer] = pools.window[layer][slot][rows]
    for name, arrays, layer, _ in _compressors(pools):
        snap.comp[(name, layer)] = arrays[layer][slot] * 1  # a buffer of its own, not a view
    page = pools.page_size
    for layer, r in enumerate(ratios):
        for q in range(first, last + 1) if r else ():
            e = q // r
            if (q + 1) % r or e // page >= len(handle.tables[r]):
                continue
            pg, off = handle.tables[r][e // page], e % page
            for arrays in (pools.ckv, pools.ikeys):
                if layer in arrays:
                    snap.entries.append((arrays, layer, q, pg, off, arrays[layer][pg, off] * 1))
    mx.async_eval(snap.arrays())
    return snap


def rollback(pools: StatePools, snap: Snapshot, kept: int) -> None:
    """Undo positions first + kept..last of `snap` (the rejected drafts): the state is as if only the positions
    before them had run. Lazy, like a step's updates (pools stay row-major buffers: mx.contiguous), but for the
    page entries' writes, queued at once."""
    undone = list(range(snap.first + kept, snap.last + 1))
    if not undone:
        return
    slot, w = snap.handle.slot, pools.args.sliding_window
    sel = mx.array([q - snap.first for q in undone], dtype=mx.int32)
    ring_rows = mx.array([q % w for q in undone], dtype=mx.int32)
    for layer, saved in snap.ring.items():
        pools.window[layer][slot, ring_rows] = saved[sel]
        pools.window[layer] = mx.contiguous(pools.window[layer])
    for name, arrays, layer, m in _compressors(pools):
        coff = 2 if m == 4 else 1
        rows = sorted({(coff - 1) * m + q % m for q in undone}
                      | (set(range(m)) if coff == 2 and any((q + 1) % m == 0 for q in undone) else set()))  # fmt: skip
        ix = mx.array(rows, dtype=mx.int32)
        arrays[layer][slot, ix] = snap.comp[(name, layer)][ix]
        arrays[layer] = mx.contiguous(arrays[layer])
    # the page pools' entries back, one write a pool (kernels.write_rows: in place on CUDA, where MLX's scatter
    # copied the whole pool each time; queued now)
    restore: dict[tuple[int, int], tuple[dict[int, mx.array], int, list[int], list[mx.array]]] = {}
    for arrays, layer, q, pg, off, value in snap.entries:
        if q in undone:
            _, _, rows, values = restore.setdefault((id(arrays), layer), (arrays, layer, [], []))
            rows.append(pg * pools.page_size + off)
            values.append(value)
    for arrays, layer, rows, values in restore.values():
        arrays[layer] = commit(*write_rows(arrays[layer], mx.array(rows, dtype=mx.int32), mx.stack(values)))


def draft_rows(model, pools: StatePools, handles: Sequence[StateHandle], positions: Sequence[int],
               streams: mx.array, token_ids: Sequence[int] | mx.array) -> tuple[mx.array, mx.array]:  # fmt: skip
    """One MTP step for distinct requests: row i pairs streams[i] (the main model's at positions[i], or the
    block's own for a chained draft) with token_ids[i] (the token at positions[i] + 1; a device array stays on
    the device); -> (draft logits [B, vocab] f32 for the token after it, the block's output streams [B, nc, H]).
    Writes each row's MTP window ring at its position; lazy."""
    batch = model.make_batch(pools, handles, positions)
    ids = token_ids if isinstance(token_ids, mx.array) else upload([int(t) for t in token_ids])
    return draft_streams(model, batch, streams, ids, pools)


def mtp_rows(pools: StatePools, slots: Sequence[int], positions: Sequence[int]) -> tuple[mx.array, mx.array, mx.array]:
    """The MTP ring rows of (slot, position) pairs as they are now (queued): what chained drafts overwrite."""
    w, layer = pools.args.sliding_window, pools.args.num_hidden_layers
    s, r = mx.array(list(slots), dtype=mx.int32), mx.array([p % w for p in positions], dtype=mx.int32)
    saved = pools.window[layer][s, r]
    mx.async_eval(saved)
    return s, r, saved


def restore_mtp_rows(pools: StatePools, saved: tuple[mx.array, mx.array, mx.array]) -> None:
    """Put back rows `mtp_rows` took (after the chained drafts read the ring): the ring again holds final
    positions only. Lazy."""
    layer = pools.args.num_hidden_layers
    pools.window[layer][saved[0], saved[1]] = saved[2]
    pools.window[layer] = mx.contiguous(pools.window[layer])
