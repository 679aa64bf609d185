"""The engine's decode step as replayed CUDA graphs (`serve --decode-graphs {auto,on,off}`; model/graph_step.py).

- `prepare` (the engine's constructor, before any kernel object exists): whether graphs run here. `auto` turns
  them on where MLX runs on a CUDA GPU and NVIDIA's cuda.core imports (the `cuda` extra); `on` makes anything
  else a start-up error; `off` keeps the MLX step. On, the recorder stands in for `mx.fast.cuda_kernel` and the
  step's glue runs as its own kernels (`DSV4_GRAPH_GLUE`), which a gapless plan needs.
- `DecodeGraphs.capture` (the engine's warm-up, after the MLX step is built): one graph per row count.
- `DecodeGraphs.step`: the replayed step's logits, or None where a step cannot replay (the engine then runs the
  MLX step); each such step counts its reason (`dsv4_graph_fallback_total{reason}`). A step may be left running
  (`wait=False`: the worker's next step, queued with the host's tokens before this one's events go out) until
  `settle`, which the engine calls before MLX reads its logits or touches the state.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx

    from dsv4_serve.kernels.graph.record import Recorder

log = logging.getLogger("dsv4.graph")
MODES = ("auto", "on", "off")


def prepare(mode: str, speculative: int = 0) -> Recorder | None:
    """The recorder when graphs are to be captured (None: the MLX step only). `on` where they cannot run:
    ValueError with the reason."""
    if mode not in MODES:
        raise ValueError(f"decode graphs: mode must be one of {MODES}, got {mode!r}")
    if mode == "off":
        return None
    import mlx.core as mx

    if not mx.cuda.is_available():  # before importing the runtime: it imports the CUDA kernels' package
        why: str | None = "MLX's default device is not a CUDA GPU"
    else:
        from dsv4_serve.kernels.graph.runtime import unavailable

        why = unavailable()
    if why is None and speculative:
        why = "speculative decoding verifies drafts through the MLX forward (docs/mtp.md)"
    if why is not None:
        if mode == "on":
            raise ValueError(f"--decode-graphs on: {why}")
        log.info("decode graphs off: %s", why)
        return None
    from dsv4_serve.kernels.cuda import common, set_graph_glue
    from dsv4_serve.kernels.graph.record import Recorder

    rec = Recorder()
    rec.install()
    common.forget_kernels()  # kernel objects made before the recorder stood in would launch unseen
    set_graph_glue(True)
    return rec


class DecodeGraphs:
    """The engine's graphs and their counters; every method runs on the engine thread."""

    def __init__(self, engine: Any, recorder: Recorder, mode: str, cache_dir: Path | None) -> None:
        self.engine, self.rec, self.mode, self.cache_dir = engine, recorder, mode, cache_dir
        self.graphs: Any = None  # model.graph_step.GraphStep once captured
        self.fallbacks: Counter[str] = Counter()
        self.place()

    def place(self) -> None:
        """The weights, state pools and constants (the RoPE tables) into managed memory before the warm-up allocates
        anything (kernels/graph/runtime.py `to_managed`: the graphs read them there, and moved now the device pool
        gives their device copies back whole)."""
        import time

        from dsv4_serve.kernels.graph.runtime import to_managed
        from dsv4_serve.model.graph_record import persistent_arrays

        arrays = [a for kind in persistent_arrays(self.engine.model, self.engine.pools).values() for a in kind.values()]
        t0 = time.perf_counter()
        reserved = to_managed(arrays)
        gb = sum(a.nbytes for a in arrays) / 1e9
        log.info("decode graphs: %d arrays (%.2f GB) in managed memory in %.2f s; the device pool keeps %.2f GB",
                 len(arrays), gb, time.perf_counter() - t0, reserved / 1e9)  # fmt: skip

    def capture(self) -> None:
        """A graph for each row count 1..max_rows over scratch rows (admitted, then released)."""
        from dsv4_serve.model.graph_step import GraphStep

        eng = self.engine
        self.graphs = GraphStep(eng.model, eng.pools, self.rec, self.cache_dir)
        handles = [eng.admit(2) for _ in range(eng.max_rows)]
        try:
            self.graphs.capture(handles)
        finally:
            for h in handles:
                eng.release(h)
        if not self.graphs.graphs and self.mode == "on":
            first = next(iter(self.graphs.reasons.values()), "no reason recorded")
            raise RuntimeError(f"--decode-graphs on: no row count could be captured ({first})")

    def touched(self, settle: bool = True) -> None:
        if self.graphs is not None:
            self.graphs.touched(settle)

    def step(self, feeds: Sequence[tuple[Any, int | None, int]], tokens: mx.array | None,
             wait: bool = True) -> mx.array | None:  # fmt: skip
        """The replayed step's logits for `feeds` (handle, token, position), or None: run the MLX step. `wait`
        False: the graph is left running; `settle` before anything reads the logits or touches the state."""
        from dsv4_serve.kernels.rows import Row

        g = self.graphs
        if g is None:
            return None
        if tokens is not None:
            self.fallbacks["tokens on the device"] += 1
            return None
        for h, _, p in feeds:
            if not 0 <= p < h.capacity:
                raise ValueError(f"decode: position {p} is outside the request's capacity {h.capacity}")
        rows = [Row(slot=h.slot, position=int(p), q_row=i, tables=h.tables) for i, (h, _, p) in enumerate(feeds)]
        logits = g.replay(rows, [int(t) for _, t, _ in feeds], wait)  # type: ignore[arg-type]
        if logits is None:
            self.fallbacks[g.reasons.get(len(feeds), "no graph for this row count")] += 1
        return logits

    def settle(self) -> float:
        """Wait for a replay left running; the seconds waited."""
        return 0.0 if self.graphs is None else self.graphs.settle()

    @property
    def last_wait(self) -> float:
        """Seconds the last replay waited for the GPU (the engine counts them as `wait`, the rest as `encode`)."""
        return 0.0 if self.graphs is None else self.graphs.last_wait

    def stats(self) -> dict[str, Any]:
        """Plain numbers for /metrics: graphs captured, replays, recaptures, pool moves, fallbacks by reason."""
        g = self.graphs
        out: dict[str, Any] = {"graph_fallbacks": dict(self.fallbacks)}
        if g is not None:
            out.update({f"graph_{k}": v for k, v in g.stats.items()})
            out["graph_rows_captured"] = sorted(g.graphs)
        return out
