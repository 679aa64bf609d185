"""`DSV4_ENGINE_PROFILE=<dir>`: where the engine thread's serving time goes, for a measurement run. The serving loop
(after /ready) runs under cProfile (this thread only up to Python 3.11; from 3.12, the GPU machine's, cProfile
runs on PEP 669's monitoring, which sees every thread: the event loop's and the kernel-cache filler's functions then
show beside the engine's, and a function's cumulative time can take in another thread's; the event loop alone is
`tools/serve_profile.py --profile`'s),
written to `<dir>/engine.pstats` when the thread ends, and every iteration of `SLOW_S` or more is logged with its
phases (phases.py) and what the engine's counters did in it (the decode graphs' replays, refreshes, pool moves,
recaptures; the prefill layers built) and the memory then (MLX's and the device's): which iterations are slow and
what they did. Unset: nothing is done."""

from __future__ import annotations

import cProfile
import logging
import os
from typing import Any

log = logging.getLogger("dsv4.profile")


def memory() -> dict[str, float]:
    """MLX's active, cached and peak bytes and, on CUDA, the device's free bytes and its memory pool's reserved
    bytes, in GB: a graph server's weights
    and pool homes are managed memory, which the driver evicts to the host when device allocations need the room
    (docs/cuda_graphs.md#serving-at-full-depth)."""
    import mlx.core as mx

    out = {"active": mx.get_active_memory() / 1e9, "cache": mx.get_cache_memory() / 1e9,
           "peak": mx.get_peak_memory() / 1e9}  # fmt: skip
    try:
        from cuda.bindings import runtime  # the `cuda` extra (decode graphs); absent: no device figure

        err, free, _total = runtime.cudaMemGetInfo()
        if int(err) == 0:
            out["free"] = free / 1e9
        from dsv4_serve.kernels.graph.runtime import pool_bytes

        pool = pool_bytes()  # MLX's cudaMallocAsync pool (and cuda.core's): reserved from the driver, in use
        out["pool"], out["pool_used"] = pool["reserved"] / 1e9, pool["used"] / 1e9
    except Exception:  # no CUDA runtime bindings here (the CPU)
        pass
    return out


class EngineProfile:
    SLOW_S = 0.05

    def __init__(self, where: str | None) -> None:
        self.where = where
        self.prof = cProfile.Profile() if where else None
        self.seen: dict[str, float] = {}

    @classmethod
    def start(cls) -> EngineProfile:
        p = cls(os.environ.get("DSV4_ENGINE_PROFILE") or None)
        if p.prof is not None:
            p.prof.enable()  # profiles the calling thread only
        return p

    def counters(self, engine: Any) -> dict[str, float]:
        graphs = getattr(getattr(engine, "graphs", None), "graphs", None)  # model.graph_step.GraphStep
        out = {k: float(v) for k, v in getattr(graphs, "stats", {}).items()}
        out["prefill_layers"] = float(getattr(engine, "prefill_layers", 0))
        out["prefill_rows_layers"] = float(getattr(engine, "prefill_rows_layers", 0))
        out.update(getattr(engine, "prefill_ms", {}))  # the prefill's host ms: built, evaluated, snapshotted
        return out

    def iteration(self, phases: dict[str, float] | None, engine: Any) -> str | None:
        """Note an iteration (its phases from PhaseClock.stop); the line logged if it was slow."""
        if self.prof is None or phases is None:
            return None
        now = self.counters(engine)
        delta = {k: v - self.seen.get(k, 0.0) for k, v in now.items()}
        self.seen = now
        if phases.get("loop", 0.0) < self.SLOW_S:
            return None
        line = "slow iteration (ms): " + " ".join(f"{k} {1e3 * v:.1f}" for k, v in phases.items())
        line += " | " + " ".join(f"{k} +{v:g}" for k, v in delta.items() if v)
        line += " | GB " + " ".join(f"{k} {v:.2f}" for k, v in memory().items())
        log.info("%s", line)
        return line

    def stop(self) -> None:
        if self.prof is None or self.where is None:
            return
        self.prof.disable()
        os.makedirs(self.where, exist_ok=True)
        self.prof.dump_stats(os.path.join(self.where, "engine.pstats"))
        log.info("engine profile written to %s", os.path.join(self.where, "engine.pstats"))
