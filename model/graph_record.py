"""The decode step's recording for its CUDA graphs (model/graph_step.py captures and replays them): the state
arrays by label, the step's arrays by kind, and `record_step`, one step recorded through MLX (compile off) and
planned. Runs on any machine (the CPU suite records the CUDA path with stand-in kernels)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dsv4_serve.kernels.graph import record
from dsv4_serve.kernels.graph.plan import StepPlan, fallback_reason
from dsv4_serve.kernels.graph.record import RawLaunch, Recorder
from dsv4_serve.kernels.rows import Row, RowBatch


def pool_arrays(pools: Any) -> dict[str, mx.array]:
    """Every state array by name (the pools, the kernels' workspaces)."""
    pool = {f"pool{i}": a for i, a in enumerate(pools.arrays())}
    pool.update({f"comp_ws{k}": v for k, v in pools.comp_ws.items()})
    pool.update({f"idx_ws{k}": v for k, v in pools.idx_ws.items()})
    from dsv4_serve.kernels.cuda import hc_fused

    if hc_fused.WORKSPACE is not None:  # the split pre-mix's tickets and partials: made once, reset by its launches
        pool["hc_ws"] = hc_fused.WORKSPACE
    return pool


def set_pool(pools: Any, label: str, a: mx.array) -> None:
    """Put `a` where `pool_arrays(pools)[label]` came from."""
    if label.startswith("pool"):
        pools.set_array(int(label[4:]), a)
    elif label.startswith("comp_ws"):
        pools.comp_ws[int(label[7:])] = a
    elif label.startswith("idx_ws"):
        pools.idx_ws[int(label[6:])] = a
    elif label == "hc_ws":
        from dsv4_serve.kernels.cuda import hc_fused

        hc_fused.WORKSPACE = a
    else:
        raise KeyError(f"set_pool: no state array {label!r}")


def persistent_arrays(model: Any, pools: Any) -> dict[str, dict[str, mx.array]]:
    """The arrays a graph reads where MLX keeps them, by kind and name: the weights, the state pools (as they are
    now) and the constants made so far (the RoPE frequencies, made at load, among them)."""
    from dsv4_serve.kernels.cuda import common

    weights = {k: v for k, v in tree_flatten(model.parameters()) if isinstance(v, mx.array)}
    consts = {str(k): v for k, v in common._consts.items() if isinstance(v, mx.array)}
    consts.update({f"freqs_{k}": f for k, f in model._freqs.items()})
    return {"weight": weights, "pool": pool_arrays(pools), "const": consts}


def named_arrays(model: Any, pools: Any, batch: RowBatch, tokens: mx.array) -> dict[str, dict[str, mx.array]]:
    """The persistent and step arrays by kind and name (the pools as they are now: call before the step)."""
    step = {"tokens": tokens, "slots": batch.slots, "positions": batch.positions, "q_rows": batch.q_rows,
            **{f"table{r}": t for r, t in batch.tables.items()}}  # fmt: skip
    return {"step": step, **persistent_arrays(model, pools)}


def fresh_batch(rows: Sequence[Row], page_size: int, widths: dict[int, int]) -> RowBatch:
    """`RowBatch.build`'s arrays, each a buffer of its own: the upload cache (by content) would hand two equal
    inputs (slots and q rows of one row, say) one array, and a graph would then read one staged field for both."""
    def arr(v: object) -> mx.array:
        return mx.array(np.array(v, np.int32))

    tables = {r: arr([list(x.tables.get(r, ())) + [0] * (w - len(x.tables.get(r, ()))) for x in rows])
              for r, w in widths.items()}  # fmt: skip
    return RowBatch(rows=tuple(rows), slots=arr([r.slot for r in rows]), positions=arr([r.position for r in rows]),
                    q_rows=arr([r.q_row for r in rows]), tables=tables, page_size=page_size)  # fmt: skip


def record_step(model: Any, pools: Any, rec: Recorder, handles: Sequence[Any],
                widths: dict[int, int]) -> tuple[StepPlan, list[RawLaunch], int, np.ndarray] | str:  # fmt: skip
    """A step of len(handles) rows at position 0 recorded through MLX (compile off) and planned: (plan, its
    launches detached, the logits' buffer id, MLX's logits), or why it cannot be captured. Runs on any machine
    (the CPU suite records the CUDA path with stand-in kernels)."""
    n = len(handles)
    rows = [Row(slot=h.slot, position=0, q_row=i, tables=h.tables) for i, h in enumerate(handles)]
    mx.disable_compile()  # every launch seen: a traced segment would hide its launches
    try:
        warm = fresh_batch(rows, pools.page_size, widths)  # constants and uploads made here, not while recording
        mx.eval(model.step(warm, mx.array(np.zeros(n, np.int32)), pools), pools.arrays())
        # a fresh batch again: a batch memoizes what it derives once a step (RoPE tables, ring rows), and the
        # recording must see those launches
        batch = fresh_batch(rows, pools.page_size, widths)
        tokens = mx.array(np.zeros(n, np.int32))
        step = [batch.slots, batch.positions, batch.q_rows, *batch.tables.values(), tokens]
        mx.eval(step)
        if len({record.address(a) for a in step}) != len(step):
            return "two step inputs share a buffer"
        held = record.hold(pool_arrays(pools))
        rec.launches.clear()
        rec.recording = True
        try:
            logits = model.step(batch, tokens, pools)
        finally:
            rec.recording = False
        mx.eval(logits, pools.arrays())
    finally:
        mx.enable_compile()
    try:
        rewritten = record.moved(held, pool_arrays(pools))
        del held
        plan = rec.plan(n, named_arrays(model, pools, batch, tokens), rewritten)
        why = fallback_reason(plan)
        if why is not None:
            return why
        out = plan.launches[-1].outputs
        # the logits' address read as the plan read it (by the address kernel on CUDA: DLPack would move the buffer
        # into managed memory first, a new address)
        if len(out) != 1 or plan.addresses.get(out[0].buffer) != record.addresses([logits])[0] \
                or out[0].nbytes != logits.nbytes:  # fmt: skip
            return "the step's logits are not its last launch's output"
        return plan, [record.detached(rec.launches[i]) for i in plan.kept], out[0].buffer, np.array(logits)
    finally:
        rec.launches.clear()  # the arrays: a pool held here could never be donated
