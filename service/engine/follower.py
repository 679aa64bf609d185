"""Lockstep serving over an mx.distributed group: rank 0 leads, the other ranks follow.

Rank 0 runs HTTP, the scheduler and the worker as usual, with a `LeaderEngine`: admissions and releases are
queued as events, and every step first broadcasts one small int32 message (the events in order, then each
row's slot, token and position) to the other ranks, which replay it in `follow()`: the same allocations
(so their pools hand out the same slots/pages), the same batch, the same sharded step, whose all_sums pair
up with rank 0's. Sampling happens on rank 0 only: after the all_sums the logits are identical everywhere.
A STOP message (sent by `close()`, when the worker thread ends) lets the followers exit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from model.distributed import broadcast_ints
from service.engine.engine import Engine, Handle

log = logging.getLogger("dsv4.follower")

STEP, EVENTS, STOP = 1, 2, 3
ALLOC, FREE, COPY = 1, 2, 3
MAX_EVENTS = 16  # per message; more are flushed in EVENTS-only messages first
HEADER = 3  # op, events, rows


def _size(max_rows: int) -> int:
    return HEADER + 3 * MAX_EVENTS + 3 * max_rows


class LeaderEngine(Engine):
    """Engine on rank 0: the same API, every state change mirrored to the followers."""

    parallel_prefill = False  # the followers replay decode steps: prompts go token by token
    pipeline_decode = False  # ... with the token ids of each step, which must be on the host first

    def __init__(self, model: Any, group: Any, **kw: Any):
        super().__init__(model, **kw)
        self.group = group
        self._events: list[tuple[int, int, int]] = []
        self._closed = False

    def admit(self, n_tokens: int) -> Handle:
        h = super().admit(n_tokens)
        self._events.append((ALLOC, n_tokens, h.slot))
        return h

    def release(self, handle: Handle) -> None:
        super().release(handle)
        self._events.append((FREE, handle.slot, 0))

    def copy_state(self, src: Handle, dst: Handle, positions: int) -> None:
        super().copy_state(src, dst, positions)
        self._events.append((COPY, src.slot << 8 | dst.slot, positions))

    def _send(self, op: int, rows: Sequence[tuple[int, int, int]] = ()) -> None:
        while len(self._events) > MAX_EVENTS:
            head, self._events = self._events[:MAX_EVENTS], self._events[MAX_EVENTS:]
            self._message(EVENTS, head, ())
        events, self._events = self._events, []
        self._message(op, events, rows)

    def _message(self, op: int, events: Sequence[tuple[int, int, int]], rows: Sequence[tuple[int, int, int]]) -> None:
        msg = [op, len(events), len(rows), *(v for e in events for v in e)]
        msg += [0] * (HEADER + 3 * MAX_EVENTS - len(msg)) + [v for r in rows for v in r]
        broadcast_ints(np.array(msg, np.int32), _size(self.max_rows), self.group)

    def step(self, feeds: Sequence[tuple[Handle, int, int]]) -> mx.array:
        if not 1 <= len(feeds) <= self.max_rows:
            raise ValueError(f"step: rows must be 1..{self.max_rows}, got {len(feeds)}")
        # Validate on rank 0 before anything is sent: a bad batch must not reach the followers.
        self.model.make_batch(self.pools, [f[0] for f in feeds], [f[2] for f in feeds])
        self._send(STEP, [(h.slot, int(t), int(p)) for h, t, p in feeds])
        return super().step(feeds)

    def close(self) -> None:
        """Tell the followers to exit (once); called when the worker thread ends."""
        if not self._closed:
            self._closed = True
            self._send(STOP)


def follow(engine: Engine, group: Any) -> int:
    """A follower rank's loop: replay rank 0's messages until STOP. Returns the number of steps run."""
    handles: dict[int, Handle] = {}
    size, steps = _size(engine.max_rows), 0
    while True:
        msg = broadcast_ints(None, size, group)
        op, n_ev, n_rows = (int(v) for v in msg[:HEADER])
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
        if op == STOP:
            return steps
        if op != STEP:
            continue
        base = HEADER + 3 * MAX_EVENTS
        rows = [tuple(int(v) for v in msg[base + 3 * i : base + 3 * i + 3]) for i in range(n_rows)]
        try:
            batch = engine.model.make_batch(engine.pools, [handles[s] for s, _, _ in rows], [p for _, _, p in rows])
            y = engine.model.hidden(batch, mx.array([t for _, t, _ in rows], dtype=mx.int32), engine.pools)
            mx.eval(y, engine.pools.arrays())  # the head is rank 0's: logits are not needed here
        except Exception:  # noqa: BLE001 - rank 0 fails the same step the same way and goes on
            log.exception("follower step failed (%d rows)", n_rows)
        steps += 1
