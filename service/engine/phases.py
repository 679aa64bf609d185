"""One engine iteration's host time by phase, for /metrics' per-phase histograms (an operator's view of the
same split bench/serve.py prints). The engine and the stepping code keep cumulative seconds
(`Engine.host_seconds`: build, encode, sample, wait; `Counters.prefill_seconds`, whole forwards as they end, and
the forward in flight's seconds so far); an iteration's share is the difference across it. No mlx, no
prometheus: the worker hands the result to its `on_phase_metrics` hook."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4_serve.service.engine.stepping import Counters

# "schedule": the rest of the iteration (inbox, admission, the scheduler's bookkeeping, publishing events).
PHASES = ("build", "encode", "sample", "wait", "prefill", "schedule", "loop")


class PhaseClock:
    """start() before an iteration, stop() after: that iteration's seconds by phase, or None if it ran no step
    and no prefill (an idle pass over the inbox tells an operator nothing about a step)."""

    def __init__(self, host: dict[str, float] | None, counters: Counters, in_flight: Callable[[], float]) -> None:
        self.host, self.c = host, counters
        self.in_flight = in_flight  # host seconds of the prefill forward built in slices so far (0: none)
        self._t0 = 0.0
        self._h0: dict[str, float] = {}
        self._steps = 0
        self._prefill = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._h0 = dict(self.host) if self.host is not None else {}
        # Written by this thread only. A sliced forward's seconds reach the counter when it ends: with its slices
        # so far added, each iteration's difference is its own slice.
        self._steps, self._prefill = self.c.steps, self.c.prefill_seconds + self.in_flight()

    def stop(self) -> dict[str, float] | None:
        loop = time.perf_counter() - self._t0
        prefill = self.c.prefill_seconds + self.in_flight() - self._prefill
        if self.c.steps == self._steps and not prefill:
            return None
        out = {k: v - self._h0.get(k, 0.0) for k, v in (self.host or {}).items()}
        out["prefill"] = prefill
        out["schedule"] = max(0.0, loop - sum(out.values()))
        out["loop"] = loop
        return out
