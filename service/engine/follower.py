"""Lockstep serving over an mx.distributed group: rank 0 leads, the other ranks follow.

Rank 0 runs HTTP, the scheduler and the worker as usual, with a `LeaderEngine`. Before each step it
broadcasts ONE fixed-size int32 message, the step's plan: the admissions and releases since the last
one (in order), the prompt chunks to prefill first (slot, start, length + their token ids), then each
row's slot, token and position. The followers replay it in `follow()`: the same allocations (their
pools hand out the same slots and pages), the same parallel prefills (model/prefill.py), the same
sharded step; all_sums pair up in that order on every rank. Sampling is rank 0's: after the all_sums
the logits are identical everywhere.

Pipelined decode: a step queued before the previous one is read back (stepping.Ahead) takes its
tokens on the device. Its message says so and carries no tokens; rank 0's sampled tokens reach
the followers by an all_sum inside the step's graph (theirs adds zeros), so no rank waits for a
host read-back. Rank 0 builds that step's graph before it broadcasts the plan: the host work of step
N + 1 overlaps step N on the device. Followers queue their steps asynchronously too (nothing of theirs
is read back). A chunk of prompt tokens larger than a message holds goes in prefill-only messages
first; the leader runs exactly the pieces it sent, so every rank's state is computed alike.
A STOP message (sent by `close()`, when the worker thread ends) lets the followers exit; FAIL (the thread
ends on a failure: start-up after the engine was built, or its death) makes them exit non-zero too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.upload import upload
from dsv4_serve.model.deepseek_v4 import PREFILL_CHUNK
from dsv4_serve.model.distributed import broadcast_ints
from dsv4_serve.service.engine.engine import Engine, Handle

if TYPE_CHECKING:
    from dsv4_serve.kernels.rows import RowBatch
    from dsv4_serve.model.deepseek_v4 import DeepseekV4

log = logging.getLogger("dsv4.follower")

STEP, PLAN, STOP, FAIL = 1, 2, 3, 4  # PLAN: events and prefill chunks only, no step
ALLOC, FREE, COPY = 1, 2, 3
MAX_EVENTS = 16  # per message; more are flushed in PLAN messages first
HEADER = 5  # op, events, rows, chunks, tokens on the device (1) or in the message (0)

Chunk = tuple[Handle, list[int], int]  # (request, prompt tokens, start position)


def plan_size(max_rows: int, prefill_cap: int) -> int:
    """Ints in one message: header, events, rows, chunk descriptors (at most one a row), chunk tokens."""
    return HEADER + 3 * MAX_EVENTS + 3 * max_rows + 3 * max_rows + prefill_cap


class LeaderEngine(Engine):
    """Engine on rank 0: the same API, every state change mirrored to the followers."""

    def __init__(self, model: DeepseekV4, group: mx.distributed.Group, *, prefill_cap: int = PREFILL_CHUNK,
                 **kw: int | None):
        super().__init__(model, **kw)
        if prefill_cap < 1:
            raise ValueError(f"prefill_cap must be >= 1, got {prefill_cap}")
        self.group, self.prefill_cap = group, prefill_cap
        self._events: list[tuple[int, int, int]] = []
        self._chunks: list[Chunk] = []  # prefills to run before the next step, in order
        self._closed = False

    def admit(self, n_tokens: int) -> Handle:
        h = super().admit(n_tokens)
        self._events.append((ALLOC, n_tokens, h.slot))
        return h

    def release(self, handle: Handle) -> None:
        self._flush_chunks()  # its prefill (if queued) must run first, everywhere
        super().release(handle)
        self._events.append((FREE, handle.slot, 0))

    def copy_state(self, src: Handle, dst: Handle, positions: int) -> None:
        self._flush_chunks()  # the source's prefill (if queued) must run first, everywhere
        super().copy_state(src, dst, positions)
        self._events.append((COPY, src.slot << 8 | dst.slot, positions))

    def prefill(self, handle: Handle, token_ids: Sequence[int], start: int) -> None:
        """Queued: it runs, on every rank, right after the next plan is broadcast (before its step)."""
        if not token_ids:
            raise ValueError("prefill: token_ids must not be empty")
        if start < 0 or start + len(token_ids) > handle.capacity:
            raise ValueError(f"prefill: positions {start}..{start + len(token_ids) - 1} are outside the "
                             f"request's capacity {handle.capacity}")  # fmt: skip
        self._chunks.append((handle, [int(t) for t in token_ids], start))

    sliced_prefill = False  # a forward runs with the next plan on every rank, whole

    def prefill_batch(self, work: Sequence[tuple[Handle, Sequence[int], int]],
                      scores: Sequence[tuple[int, Sequence[int]] | None] | None = None) -> None:  # fmt: skip
        """Each request's chunk queued as `prefill` queues it (the plan then packs them into shared forwards).
        Prompt logprobs (`scores`) need the scored forward on rank 0 alone: not with --distributed."""
        if scores is not None and any(s is not None for s in scores):
            raise ValueError("prompt logprobs are not served with --distributed")
        for handle, token_ids, start in work:
            self.prefill(handle, token_ids, start)

    def step(self, feeds: Sequence[tuple[Handle, int | None, int]], tokens: mx.array | None = None) -> mx.array:
        try:  # validate on rank 0 before anything is sent: a bad batch must not reach the followers
            if not 1 <= len(feeds) <= self.max_rows:
                raise ValueError(f"step: rows must be 1..{self.max_rows}, got {len(feeds)}")
            if tokens is not None and tokens.shape != (len(feeds),):
                raise ValueError(f"step: tokens must have shape ({len(feeds)},), got {tokens.shape}")
            batch = self.model.make_batch(self.pools, [f[0] for f in feeds], [f[2] for f in feeds])
        except Exception:
            self._flush_chunks()  # the prefills were promised: every rank runs them
            raise
        device = tokens is not None
        rows = [(h.slot, 0 if device else int(t), int(p)) for h, t, p in feeds]
        if self._chunks:  # prefills first (the step reads the state they leave), then the graph
            self._flush(STEP, rows, device)
            logits = self._build(batch, feeds, tokens)
        else:  # build the graph, then broadcast: this host work overlaps the step still on the device
            logits = self._build(batch, feeds, tokens)
            self._flush(STEP, rows, device)
        mx.async_eval(logits, self.pools.arrays())
        return logits

    def _build(self, batch: RowBatch, feeds: Sequence[tuple[Handle, int | None, int]], tokens: mx.array | None):
        if tokens is None:
            tokens = upload([int(f[1]) for f in feeds])  # type: ignore[arg-type]
        else:  # rank 0's sampled tokens to every rank, inside the step (the followers add zeros)
            tokens = mx.distributed.all_sum(tokens.astype(mx.int32), group=self.group)
        return self.model.step(batch, tokens, self.pools)

    def _flush_chunks(self) -> None:
        if self._chunks:
            self._flush()

    def _flush(self, op: int = PLAN, rows: Sequence[tuple[int, int, int]] = (), device: bool = False) -> None:
        """Broadcast the queued events and prefills (as many messages as they need; the last one `op`) and
        run each message's prefills here right after it, as the followers do."""
        pieces: list[Chunk] = []
        for h, toks, start in self._chunks:
            for i in range(0, len(toks), self.prefill_cap):
                pieces.append((h, toks[i : i + self.prefill_cap], start + i))
        self._chunks = []
        while True:
            events = self._events[:MAX_EVENTS]
            self._events = self._events[MAX_EVENTS:]
            batch, room = [], self.prefill_cap
            while pieces and len(batch) < self.max_rows and len(pieces[0][1]) <= room:
                room -= len(pieces[0][1])
                batch.append(pieces.pop(0))
            last = not pieces and not self._events
            self._message(op if last else PLAN, events, batch, rows if last else (), device)
            for h, toks, start in batch:
                super().prefill(h, toks, start)
            if last:
                return

    def _message(self, op: int, events: Sequence[tuple[int, int, int]], chunks: Sequence[Chunk],
                 rows: Sequence[tuple[int, int, int]], device: bool) -> None:  # fmt: skip
        msg = np.zeros(plan_size(self.max_rows, self.prefill_cap), np.int32)
        msg[:HEADER] = (op, len(events), len(rows), len(chunks), int(device))
        at = HEADER
        for i, e in enumerate(events):
            msg[at + 3 * i : at + 3 * i + 3] = e
        at += 3 * MAX_EVENTS
        for i, r in enumerate(rows):
            msg[at + 3 * i : at + 3 * i + 3] = r
        at += 3 * self.max_rows
        off = at + 3 * self.max_rows
        for i, (h, toks, start) in enumerate(chunks):
            msg[at + 3 * i : at + 3 * i + 3] = (h.slot, start, len(toks))
            msg[off : off + len(toks)] = toks
            off += len(toks)
        broadcast_ints(msg, len(msg), self.group)

    def close(self, failed: bool = False) -> None:
        """Tell the followers to exit (once), non-zero if `failed`; called when the worker thread ends."""
        if not self._closed:
            self._closed = True
            self._chunks = []
            self._message(FAIL if failed else STOP, self._events[:MAX_EVENTS], [], [], False)


def follow(engine: Engine, group: mx.distributed.Group, prefill_cap: int = PREFILL_CHUNK) -> int:
    """A follower rank's loop: replay rank 0's messages until STOP. Returns the number of steps run; raises
    on FAIL."""
    handles: dict[int, Handle] = {}
    rows_cap, steps = engine.max_rows, 0
    size = plan_size(rows_cap, prefill_cap)
    while True:
        msg = broadcast_ints(None, size, group)
        op, n_ev, n_rows, n_chunks, device = (int(v) for v in msg[:HEADER])
        for i in range(n_ev):
            kind, a, b = (int(v) for v in msg[HEADER + 3 * i : HEADER + 3 * i + 3])
            if kind == ALLOC:
                h = engine.pools.alloc(a)
                if h.slot != b:
                    raise RuntimeError(f"follower: allocation diverged (slot {h.slot}, rank 0 has {b})")
                handles[h.slot] = h
            elif kind == COPY:
                engine.pools.copy_slot(handles[a >> 8], handles[a & 255], b)
            else:
                engine.pools.free(handles.pop(a))
        if op == FAIL:
            raise RuntimeError("rank 0 stopped on a failure (its log has the reason)")
        if op == STOP:
            return steps
        at = HEADER + 3 * MAX_EVENTS
        rows = [tuple(int(v) for v in msg[at + 3 * i : at + 3 * i + 3]) for i in range(n_rows)]
        at += 3 * rows_cap
        off = at + 3 * rows_cap
        try:
            for i in range(n_chunks):
                slot, start, n = (int(v) for v in msg[at + 3 * i : at + 3 * i + 3])
                engine.prefill(handles[slot], [int(t) for t in msg[off : off + n]], start)
                off += n
            if op != STEP:
                continue
            batch = engine.model.make_batch(engine.pools, [handles[s] for s, _, _ in rows], [p for _, _, p in rows])
            if device:  # rank 0's sampled tokens, summed with zeros in the step's graph
                tokens = mx.distributed.all_sum(mx.zeros((n_rows,), mx.int32), group=group)
            else:
                tokens = upload([t for _, t, _ in rows])
            y = engine.model.hidden(batch, tokens, engine.pools)
            mx.async_eval(y, engine.pools.arrays())  # the head is rank 0's: logits are not needed here
        except Exception:  # noqa: BLE001 - rank 0 fails the same work the same way and goes on
            log.exception("follower step failed (%d rows, %d prefill chunks)", n_rows, n_chunks)
        steps += op == STEP
