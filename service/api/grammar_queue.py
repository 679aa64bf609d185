"""Fair shares of the grammar compile workers among API keys: `FairSlots` hands out `slots` workers, at most
`per_key` of them to one key at a time, and serves the keys that wait round robin (each key's own requests
FIFO). One key flooding compiles (issue 63: three 126 KB schemas kept in flight starved every other key's
structured output behind one first-come-first-served slot) then holds at most `per_key` workers, and another
key's compile starts as soon as a worker is free, however many the flooder queued. Event loop only."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, deque
from collections.abc import Callable


class FairSlots:
    def __init__(self, slots: int, per_key: int, ready: Callable[[int], bool] = lambda w: True) -> None:
        """`ready(worker)`: whether a worker's process is up. A key gets back first a worker of its own whose
        process is restarting (its last compile was killed), then one that is up: a key whose compiles keep
        being killed waits for its own restarts and never takes the live worker another key needs."""
        if slots < 1 or per_key < 1:
            raise ValueError(f"FairSlots: slots and per_key must be >= 1, got {slots}, {per_key}")
        self.per_key, self._ready = per_key, ready
        self._free: list[int] = list(range(slots))  # worker indexes not taken
        self._waiting: OrderedDict[str, deque[asyncio.Future[int]]] = OrderedDict()  # key -> waiters, RR order
        self.running: Counter[str] = Counter()  # key -> workers it holds
        self._last: dict[int, str] = {}  # worker -> the key it served last

    async def acquire(self, key: str) -> int:
        """A worker index for `key`, once one is free and `key` holds fewer than `per_key`. Cancelling (a
        timeout) leaves the queue as if it had never waited."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(fut)
        self._dispatch()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # a worker was handed over as the wait ended: give it back
                self.release(key, fut.result())
            else:
                q = self._waiting.get(key)
                if q is not None and fut in q:
                    q.remove(fut)
                    if not q:
                        del self._waiting[key]
            raise

    def release(self, key: str, worker: int) -> None:
        self.running[key] -= 1
        if self.running[key] <= 0:
            del self.running[key]
        self._free.append(worker)
        self._dispatch()

    def waiting(self, key: str) -> int:
        return len(self._waiting.get(key, ()))

    def _dispatch(self) -> None:
        """Hand free workers to the waiting keys under their quota, round robin: a served key goes to the back."""
        while self._free:
            key = next((k for k in self._waiting if self.running[k] < self.per_key), None)
            if key is None:
                return
            q = self._waiting[key]
            fut = q.popleft()
            if not q:
                del self._waiting[key]
            else:
                self._waiting.move_to_end(key)
            if fut.done():  # cancelled: its waiter is gone
                continue
            own = (w for w in self._free if self._last.get(w) == key and not self._ready(w))
            pick = next(own, None)
            if pick is None:
                pick = next((w for w in self._free if self._ready(w)), self._free[0])
            self._free.remove(pick)
            self._last[pick] = key
            self.running[key] += 1
            fut.set_result(pick)
