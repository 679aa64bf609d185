"""The encode thread: MLX's `async_eval` of queued graphs on a thread of its own.

At <= 8 rows the decode step is host-bound: Python builds the step's lazy graph (~6 ms at 43 layers) and
MLX encodes it (~12 ms: each node's eval_gpu, the CUDA graphs' update and launch), one after the other on the
engine thread. MLX releases the GIL while it encodes, so with the encode on this thread the engine thread
builds step N + 1 while step N is encoded: a step costs the longer of the two, not their sum.

The contract (MLX >= 0.31's thread model; `docs`: ARCHITECTURE.md, "The encode thread"):
- Graphs handed to `submit` are built under `with mx.stream(enc.stream)`: a thread-unsafe stream (one
  command encoder shared by the threads) that only this thread encodes while it has work.
- The building thread evaluates nothing on that stream while work is queued (`drain()` first): two threads
  encoding one stream would race in MLX's encoder.
- A read-back waits for the submission's future first (then the arrays are scheduled and `mx.eval` only
  waits on their events), and reads arrays that no later submission takes as input (`readable`: the events
  of a later graph's inputs are touched by this thread while it encodes that graph).
"""

from __future__ import annotations

import queue
import sys
import threading
from concurrent.futures import Future
from typing import Any

import mlx.core as mx

# The engine thread holds the GIL while it builds; this thread needs it for a moment before and after each
# async_eval. Python hands the GIL over after the switch interval (5 ms by default): 0.2 ms keeps the hand-over
# short of a step's build (set once, for the process, when an encode thread starts).
SWITCH_INTERVAL = 0.0002


class EncodeThread:
    """Encodes submitted graphs in order on one daemon thread; each `submit` returns a Future that is done
    when its `mx.async_eval` returned (the work is on the device's queue, not finished)."""

    def __init__(self, device: mx.Device | None = None) -> None:
        self.stream = mx.new_thread_unsafe_stream(device or mx.default_device())
        self._q: queue.SimpleQueue[tuple[list[mx.array], Future[None]] | None] = queue.SimpleQueue()
        self._last: Future[None] | None = None
        self.seconds = 0.0  # time spent in async_eval (this thread's), since start
        if sys.getswitchinterval() > SWITCH_INTERVAL:
            sys.setswitchinterval(SWITCH_INTERVAL)
        self._thread = threading.Thread(target=self._run, name="dsv4-encode", daemon=True)
        self._thread.start()

    def submit(self, *arrays: Any) -> Future[None]:
        """Queue `mx.async_eval(*arrays)` (arrays or trees of them) after what is queued."""
        if not self._thread.is_alive():
            raise RuntimeError("EncodeThread.submit: the encode thread has stopped")
        fut: Future[None] = Future()
        flat: list[mx.array] = []
        for a in arrays:
            if isinstance(a, mx.array):
                flat.append(a)
            elif isinstance(a, dict):
                flat.extend(a.values())
            else:
                flat.extend(a)
        self._q.put((flat, fut))
        self._last = fut
        return fut

    def drain(self) -> None:
        """Wait until everything submitted is encoded (the stream is the caller's again); re-raises the
        last submission's error."""
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        import time

        while (item := self._q.get()) is not None:
            arrays, fut = item
            t0 = time.perf_counter()
            try:
                mx.async_eval(arrays)
            except BaseException as e:  # noqa: BLE001 - handed to the submitter
                fut.set_exception(e)
            else:
                fut.set_result(None)
            self.seconds += time.perf_counter() - t0


def readable(a: mx.array) -> mx.array:
    """A node of its own over `a` (no copy, no kernel) for the host to read back while later graphs take `a`
    as input: waiting on it touches only its own event."""
    return mx.stop_gradient(a)
