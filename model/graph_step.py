"""The decode step replayed as CUDA graphs: one graph per row count over the weights and state MLX owns.

Capture (`GraphStep.capture`, at warm-up, on the engine thread): a step of R rows runs once through MLX with
`kernels.graph.record.Recorder` keeping its launches (MLX's compile off, so every launch is seen:
model/graph_record.py's `record_step`); its plan (`kernels/graph/plan.py`) sorts every argument into weights,
pools and constants (their addresses as MLX keeps them), step inputs (a staging buffer the host fills), and
intermediates (one static arena). The step's logits, the last launch's output, go to a persistent MLX array the
sampler reads. The graph is then replayed once over the same inputs and must give MLX's logits bit for bit, or the
row count keeps the MLX step (its reason kept).

Replay (`GraphStep.replay`): the rows' ints packed into the staging buffer (one host-to-device copy), one graph
launch after MLX's queued work, a wait; no MLX node is built. A row count without a graph returns None: the
caller runs the MLX step and counts the reason.

Pools that move: an MLX write to the state (prefill, a slot reset, the prefix cache's copies, an import) puts a
pool in a new buffer unless MLX donates the old one, which on a GPU it almost never can (the encoder holds what a
queued kernel reads until it completes). The graphs keep each pool's first array as its home: the engine calls
`touched()` after such work, and the next replay copies each moved pool's bytes back into its home buffer (one
kernel on MLX's stream: kernels/cuda/copy_into.py) and hands the home array back to the pools; no graph is
captured again (docs/cuda_graphs.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.cuda.copy_into import copy_into
from dsv4_serve.kernels.graph import record
from dsv4_serve.kernels.graph.deps import dependencies
from dsv4_serve.kernels.graph.plan import StepPlan
from dsv4_serve.kernels.graph.record import RawLaunch, Recorder
from dsv4_serve.kernels.graph.staging import Staging, step_values
from dsv4_serve.kernels.rows import Row
from dsv4_serve.model import graph_plan_store
from dsv4_serve.model.graph_record import pool_arrays, record_step, set_pool

log = logging.getLogger("dsv4.graph")


@dataclass
class Graph:
    rows: int
    plan: StepPlan
    launches: list[RawLaunch]  # detached: shapes and dtypes, no arrays (a held pool could never be donated)
    logits_buffer: int  # the plan's buffer id the logits are
    logits: mx.array  # [rows, vocab] f32, written by every replay
    staging: Staging
    exec: Any = None
    pools: tuple[str, ...] = ()  # labels of the pools its launches touch
    deps: list[tuple[int, ...]] | None = None  # each launch's, for a graph of dependencies (GraphStep(dag=True))


class GraphStep:
    def __init__(self, model: Any, pools: Any, recorder: Recorder, cache_dir: Path | None = None,
                 dag: bool | None = None) -> None:  # fmt: skip
        """`dag`: each graph's launches wait only for those they depend on (kernels/graph/deps.py), not each for
        the one before; None: `DSV4_GRAPH_DAG=1` (off by default until measured against the chain)."""
        from dsv4_serve.kernels.graph.runtime import Runtime

        self.dag = os.environ.get("DSV4_GRAPH_DAG", "0").strip() == "1" if dag is None else dag
        self.model, self.pools, self.rec = model, pools, recorder
        self.rt = Runtime(cache_dir)
        self.plans = graph_plan_store.PlanStore(cache_dir / "plans") \
            if cache_dir is not None and graph_plan_store.enabled() else None  # fmt: skip
        self.widths = {r: pools.table_width(r) for r in pools.ratios}
        self.graphs: dict[int, Graph] = {}
        self.reasons: dict[int, str] = {}  # rows -> why that row count keeps the MLX step
        self.pool_addr: dict[str, int] = {}  # label -> its home buffer's address (what every graph reads)
        self.home: dict[str, mx.array] = {}  # label -> the pool's home array, held: its buffer never goes back
        self._arena, self._arena_bytes = 0, 0
        self._staging, self._staging_bytes = 0, 0
        self._dirty = False
        self.pending = False  # a replay launched and not yet waited for (`settle`)
        self.last_wait = 0.0  # seconds the last replay waited for the GPU
        self.stats: Counter[str] = Counter()  # replays, recaptures, refreshes; seconds as *_ms

    # ---- capture ------------------------------------------------------------------------------
    def capture(self, handles: Sequence[Any]) -> None:
        """One graph for each row count 1..len(handles) (the handles: admitted, their state scratch). Every row
        count is recorded first; then the kernels none of them has built yet are built at once, NVRTC in parallel
        threads (the 8 row counts of V4-Flash have 193 translation units, shapes baked in: 199 s on 16 cores of
        the H100, 301 s one row count after the other); then the shared arena and staging buffer are sized for the
        largest plan, so they never grow (a buffer that grows leaves every graph captured before it to be captured
        again at its first replay: 44 ms each at 43 layers on the H100, on a first request's tokens); then each
        graph is captured and checked."""
        t0, recorded, stored = time.perf_counter(), {}, set()
        for n in range(len(handles), 0, -1):  # a step at position 0 gives the same logits whatever the state
            try:
                got = self._stored(handles[:n])
                if got is not None:
                    recorded[n] = got
                    stored.add(n)
                    self.stats["plans_loaded"] += 1
                else:
                    recorded[n] = self._record(handles[:n])
            except Exception as e:  # noqa: BLE001 - that row count keeps the MLX step, with the reason
                log.exception("graph recording at %d rows failed", n)
                recorded[n] = f"recording failed: {type(e).__name__}: {e}"
        t1 = time.perf_counter()
        try:
            built = self.rt.prebuild([ln for got in recorded.values() if not isinstance(got, str) for ln in got[1]])
        except Exception:  # noqa: BLE001 - each capture builds what it lacks, and a failure there has its row count
            log.exception("decode graphs: building the kernels at once failed; each capture builds its own")
            built = 0
        t2 = time.perf_counter()
        for got in recorded.values():  # the arena and staging buffer as large as the largest plan's before any graph
            if not isinstance(got, str):
                self._grow(got[0])
        for n, got in recorded.items():
            t3 = time.perf_counter()
            try:
                why = got if isinstance(got, str) else self._capture(handles[:n], got)
                if why is not None and n in stored:  # a stored plan the check refused: dropped, recorded again
                    log.warning("decode graph %d rows: the stored plan gave %s; recording it again", n, why)
                    self.plans.drop(self._plan_key(n))  # type: ignore[union-attr]
                    got = self._record(handles[:n])
                    if not isinstance(got, str):
                        self._grow(got[0])
                    why = got if isinstance(got, str) else self._capture(handles[:n], got)
            except Exception as e:  # noqa: BLE001 - that row count keeps the MLX step, with the reason
                log.exception("graph capture at %d rows failed", n)
                why = f"capture failed: {type(e).__name__}: {e}"
            if why is not None:
                self.reasons[n] = why
            log.info("decode graph %d/%d rows: %s (%.2f s)", n, len(handles), "captured" if why is None else why,
                     time.perf_counter() - t3)  # fmt: skip
        scratch = [mx.zeros((16,), mx.uint8) + 0 for _ in range(2)]  # the copy home's kernel built now, not at the
        mx.eval(copy_into(*scratch))  # first request's refresh
        log.info("decode graphs: %d of %d row counts captured in %.2f s (recording %.2f s, %d plans from the store; "
                 "NVRTC: %d kernels built in %.2f s, %d from the cubin cache)", len(self.graphs), len(handles),
                 time.perf_counter() - t0, t1 - t0, len(stored), built, t2 - t1, self.rt.cubins.hits)  # fmt: skip

    def _plan_key(self, n: int) -> str:
        return graph_plan_store.key(self.model, self.pools, n, self.widths)

    def _record(self, handles: Sequence[Any]) -> tuple[StepPlan, list[RawLaunch], int, np.ndarray] | str:
        """`record_step`, its plan stored for the next start (unless `DSV4_GRAPH_PLAN_CACHE=0`)."""
        got = record_step(self.model, self.pools, self.rec, handles, self.widths)
        if self.plans is not None and not isinstance(got, str):
            self.plans.save(self._plan_key(len(handles)), got[0], got[1], got[2])
        return got

    def _stored(self, handles: Sequence[Any]) -> tuple[StepPlan, list[RawLaunch], int, np.ndarray] | None:
        """The row count's plan from the store (model/graph_plan_store.py), its weights' and constants' addresses
        read again and MLX's logits of the step it records, or None."""
        if self.plans is None:
            return None
        got = self.plans.load(self._plan_key(len(handles)))
        if got is None:
            return None
        plan, launches, logits_buffer = got
        expected, named = graph_plan_store.expected_logits(self.model, self.pools, handles, self.widths)
        why = graph_plan_store.resolve(plan, named)
        if why is not None:
            log.warning("decode graph %d rows: the stored plan does not fit (%s): recording it", len(handles), why)
            return None
        return plan, launches, logits_buffer, expected

    def _capture(self, handles: Sequence[Any], got: tuple[StepPlan, list[RawLaunch], int, np.ndarray]) -> str | None:
        n = len(handles)
        plan, launches, logits_buffer, expected = got
        g = Graph(n, plan, launches, logits_buffer, mx.array(np.zeros(expected.shape, np.float32)), Staging(plan))
        mx.eval(g.logits)
        g.pools = tuple(sorted({plan.buffers[r.buffer].label for ln in plan.launches for r in (*ln.inputs, *ln.outputs)
                                if plan.buffers[r.buffer].kind == "pool"}))  # fmt: skip
        current = pool_arrays(self.pools)
        for label in g.pools:  # the first graph to read a pool makes its buffer the home; later ones read it there
            if label not in self.home:
                self.home[label], self.pool_addr[label] = current[label], record.address(current[label])
        self._bring_home(current)
        self._grow(plan)
        self._build(g)
        self.rt.zero(record.address(g.logits), g.logits.nbytes)
        rows = [Row(slot=h.slot, position=0, q_row=i, tables=h.tables) for i, h in enumerate(handles)]
        self._launch(g, step_values(rows, [0] * n, self.widths))
        if not np.array_equal(np.array(g.logits + 0), expected, equal_nan=True):  # + 0: MLX reads the buffer
            return "the replayed step differs from MLX's"
        self.graphs[n] = g
        return None

    def _grow(self, plan: StepPlan) -> None:
        """The arena and the staging buffer: one each, as large as the largest plan's (graphs run one at a time)."""
        if plan.arena_bytes > self._arena_bytes:
            self._arena, self._arena_bytes = self.rt.allocate(plan.arena_bytes), plan.arena_bytes
            for g in self.graphs.values():
                g.exec = None  # they read the old arena: captured again before their next replay
        if plan.staging_bytes > self._staging_bytes:
            self._staging, self._staging_bytes = self.rt.allocate(plan.staging_bytes), plan.staging_bytes
            for g in self.graphs.values():
                g.exec = None

    def _build(self, g: Graph) -> None:
        """Capture `g`'s launches at the current addresses."""
        plan, logits_at = g.plan, record.address(g.logits)

        def at(ref: Any) -> int:
            b = plan.buffers[ref.buffer]
            if ref.buffer == g.logits_buffer:
                base = logits_at
            elif b.kind == "arena":
                base = self._arena + plan.arena[ref.buffer]
            elif b.kind == "step":
                base = self._staging + plan.staging[ref.buffer]
            elif b.kind == "pool":
                base = self.pool_addr[b.label]
            else:
                base = plan.addresses[ref.buffer]
            return base + ref.offset

        args = [[at(r) for r in (*ln.inputs, *ln.outputs)] for ln in plan.launches]
        if self.dag:
            if g.deps is None:
                g.deps = dependencies(plan, [ln.kernel for ln in g.launches])
            g.exec = self.rt.capture_dag(g.launches, args, g.deps)
        else:
            g.exec = self.rt.capture_at(g.launches, args)

    def _launch(self, g: Graph, values: dict[str, np.ndarray], wait: bool = True) -> None:
        self.settle()  # one replay in flight at a time: its logits are read before the next overwrites them
        host = g.staging.pack(values)
        mx.synchronize()  # MLX's queued work (state writes, the last step's sampler) before the graph
        self.rt.upload(self._staging, host)
        g.exec.launch(self.rt.stream)
        self.pending, self.last_wait = True, 0.0
        if wait:
            self.settle()

    def settle(self) -> float:
        """Wait for the replay in flight, if any (before MLX reads its logits or touches the state it writes);
        the seconds waited (`last_wait`: the GPU's share, for the host split)."""
        if not self.pending:
            return 0.0
        t0 = time.perf_counter()
        self.rt.wait()
        self.pending, self.last_wait = False, time.perf_counter() - t0
        return self.last_wait

    # ---- replay -------------------------------------------------------------------------------
    def touched(self, settle: bool = True) -> None:
        """MLX is about to write the state: the replay in flight ends first (it writes the same pools), and pools
        may move (read again before the next replay). `settle` False: the caller settles before MLX evaluates
        anything it builds (a prefill slice built while the replay runs: Engine.prefill_advance)."""
        if settle:
            self.settle()
        self._dirty = True

    def refresh(self) -> None:
        """Every pool MLX wrote to a new buffer since the last replay copied back into its home buffer."""
        t0 = time.perf_counter()
        self._dirty = False
        moved = self._bring_home(pool_arrays(self.pools))
        self.stats["pool_moves"] += moved
        self.stats["refreshes"] += 1
        self.stats["refresh_ms"] += round(1e3 * (time.perf_counter() - t0), 3)

    def _bring_home(self, current: dict[str, mx.array]) -> int:
        """Copy each pool that is not its home array into the home buffer and give the pools the home array back
        (the graphs read and write the home buffers only); how many moved. The copies run on MLX's stream after the
        writes that moved the pools (`copy_into`: the new buffers are never exported, which would move each into
        managed memory), and the next replay's `mx.synchronize()` orders the graph after them."""
        moved = [label for label, home in self.home.items() if current.get(label) is not home]
        if not moved:
            return 0
        tokens = []
        for label in moved:
            a, home = current.get(label), self.home[label]
            if a is None or a.shape != home.shape or a.dtype != home.dtype:
                raise RuntimeError(f"decode graphs: pool {label} is gone or resized")
            tokens.append(copy_into(home, a))
        mx.eval(tokens)
        for label in moved:
            set_pool(self.pools, label, self.home[label])
        return len(moved)

    def replay(self, rows: Sequence[Row], tokens: Sequence[int], wait: bool = True) -> mx.array | None:
        """The step's logits [rows, vocab] f32 (valid until the next replay), or None: no graph for this row
        count (`reasons`). `wait` False: the graph is left running (`settle` before MLX reads the logits)."""
        g = self.graphs.get(len(rows))
        if g is None:
            return None
        if self._dirty:
            self.refresh()
        if g.exec is None:
            t0 = time.perf_counter()
            self._build(g)
            self.stats["recaptures"] += 1
            self.stats["recapture_ms"] += round(1e3 * (time.perf_counter() - t0), 3)
        self._launch(g, step_values(rows, tokens, self.widths), wait)
        self.stats["replays"] += 1
        return g.logits
