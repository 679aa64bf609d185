"""The decode graphs' recorded plans on disk, so a restart captures its graphs without recording the step again.

A warm restart of a full-depth graph server spent 5.36 of its 11.8 s of warm-up recording one step a row count (H100,
2026-12-07, c6e72db; issue 58 asks for 10 s): an uncompiled MLX step, ~2,000 intermediates' addresses read (each a
DLPack export: a managed allocation and a synchronous copy) and the plan. A plan is plain data: launches over buffers
by kind (kernels/graph/plan.py) and each launch's kernel, template, grid and argument shapes (`record.detached`);
only the weights' and constants' addresses are the recording process's. So `save` writes it as JSON under a key of
everything the launches follow from (this package's kernel and model sources, MLX's version, the model's config,
the pools' shapes, the row count, the glue kernels and every `DSV4_*` variable), and `load` reads it back with those
addresses found again by label in this process. What `load` returns still goes through the capture's check (the
replayed logits equal an uncompiled MLX step's bit for bit); `GraphStep.capture` records that row count again if it
does not. On by default (`DSV4_GRAPH_PLAN_CACHE=0` records every start): on an H100 (2026-12-07, 63becbe) a warm
restart loaded all 8 row counts' plans, recording 2.20 s against 5.13 s, and served; its gpu test passed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.graph import record
from dsv4_serve.kernels.graph.plan import Buffer, Launch, Ref, StepPlan
from dsv4_serve.kernels.graph.record import ArraySpec, KernelSource, RawLaunch
from dsv4_serve.kernels.rows import Row
from dsv4_serve.model.graph_record import fresh_batch, named_arrays, pool_arrays

log = logging.getLogger("dsv4.graph")
VERSION = 1


def enabled() -> bool:
    return os.environ.get("DSV4_GRAPH_PLAN_CACHE", "1").strip() != "0"


@cache
def sources_digest() -> str:
    """SHA-256 of this package's kernel and model sources (what a recorded step's launches follow from)."""
    import dsv4_serve.kernels
    import dsv4_serve.model

    h = hashlib.sha256()
    for pkg in (dsv4_serve.kernels, dsv4_serve.model):
        root = Path(pkg.__file__).parent
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root.parent)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def key(model: Any, pools: Any, rows: int, widths: dict[int, int]) -> str:
    """What a row count's recorded step depends on, hashed."""
    from dsv4_serve.kernels import cuda

    parts = [str(VERSION), sources_digest(), mx.__version__, repr(model.args), str(model.dtype), str(rows),
             repr(sorted(widths.items())), repr(pools.page_size), repr(pools.max_positions), repr(cuda.GRAPH_GLUE),
             repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("DSV4_"))),
             repr([(k, tuple(a.shape), str(a.dtype)) for k, a in sorted(pool_arrays(pools).items())])]  # fmt: skip
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


# ---- encoding -----------------------------------------------------------------------------------------
def _dtype(d: mx.Dtype) -> str:
    return str(d).rsplit(".", 1)[-1]


def _value(v: Any) -> list[Any]:
    if isinstance(v, mx.Dtype):
        return ["dtype", _dtype(v)]
    if isinstance(v, bool):
        return ["bool", v]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v]
    raise TypeError(f"graph plan store: template value {v!r} of type {type(v).__name__}")


def _unvalue(v: list[Any]) -> Any:
    kind, x = v
    return getattr(mx, x) if kind == "dtype" else {"bool": bool, "int": int, "float": float}[kind](x)


def encode(plan: StepPlan, launches: Sequence[RawLaunch], logits_buffer: int) -> dict[str, Any]:
    kernels: dict[KernelSource, int] = {}
    for ln in launches:
        kernels.setdefault(ln.kernel, len(kernels))

    def refs(rs: Sequence[Ref]) -> list[list[int]]:
        return [[r.buffer, r.offset, r.nbytes] for r in rs]

    def specs(a: Sequence[ArraySpec]) -> list[list[Any]]:
        return [[list(s.shape), _dtype(s.dtype), s.nbytes] for s in a]

    return {
        "version": VERSION,
        "kernels": [[k.name, list(k.input_names), list(k.output_names), k.source, k.header, k.shared_memory]
                    for k in kernels],  # fmt: skip
        "launches": [[kernels[ln.kernel], [[n, _value(v)] for n, v in ln.template], list(ln.grid),
                      list(ln.threadgroup), specs(ln.inputs), specs(ln.outputs), ln.init_value]
                     for ln in launches],  # fmt: skip
        "plan": {"rows": plan.rows, "buffers": [[b.id, b.kind, b.nbytes, b.label] for b in plan.buffers.values()],
                 "launches": [[ln.kernel, list(ln.grid), list(ln.threadgroup), [list(t) for t in ln.template],
                               refs(ln.inputs), refs(ln.outputs)] for ln in plan.launches],
                 "arena": list(plan.arena.items()), "arena_bytes": plan.arena_bytes,
                 "staging": list(plan.staging.items()), "staging_bytes": plan.staging_bytes,
                 "dropped": plan.dropped, "kept": plan.kept},  # fmt: skip
        "logits_buffer": logits_buffer,
    }


def decode(d: dict[str, Any]) -> tuple[StepPlan, list[RawLaunch], int]:
    """`encode`'s inverse, the weights' and constants' addresses left out (`resolve` reads them)."""
    if d.get("version") != VERSION:
        raise ValueError(f"graph plan store: version {d.get('version')!r}, not {VERSION}")
    kernels = [KernelSource(n, tuple(i), tuple(o), s, h, m) for n, i, o, s, h, m in d["kernels"]]

    def specs(a: list[list[Any]]) -> list[ArraySpec]:
        return [ArraySpec(tuple(s), getattr(mx, t), nb) for s, t, nb in a]

    launches = [RawLaunch(kernels[k], tuple((n, _unvalue(v)) for n, v in t), tuple(g), tuple(tg),  # type: ignore[arg-type]
                          specs(i), specs(o), iv)  # type: ignore[arg-type]
                for k, t, g, tg, i, o, iv in d["launches"]]  # fmt: skip
    p = d["plan"]

    def refs(rs: list[list[int]]) -> tuple[Ref, ...]:
        return tuple(Ref(*r) for r in rs)

    plan = StepPlan(p["rows"], [Launch(k, tuple(g), tuple(tg), tuple(tuple(x) for x in t), refs(i), refs(o))  # type: ignore[arg-type]
                                for k, g, tg, t, i, o in p["launches"]],
                    {b[0]: Buffer(*b) for b in p["buffers"]}, arena=dict(p["arena"]), arena_bytes=p["arena_bytes"],
                    staging=dict(p["staging"]), staging_bytes=p["staging_bytes"], dropped=p["dropped"],
                    kept=p["kept"])  # fmt: skip
    return plan, launches, d["logits_buffer"]


# ---- the store ------------------------------------------------------------------------------------------
class PlanStore:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def save(self, k: str, plan: StepPlan, launches: Sequence[RawLaunch], logits_buffer: int) -> None:
        """Written to a temporary file and renamed: a reader sees a whole entry or none."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": k, **encode(plan, launches, logits_buffer)}, f)
            os.replace(tmp, self.dir / f"{k}.json")
        except OSError as e:  # a read-only or full disk: the next start records again
            log.warning("graph plan store: %s not written: %s", k, e)

    def load(self, k: str) -> tuple[StepPlan, list[RawLaunch], int] | None:
        path = self.dir / f"{k}.json"
        try:
            d = json.loads(path.read_text())
            if d.get("key") != k:
                raise ValueError("another key")
            return decode(d)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign entry: recorded again, rewritten
            log.warning("graph plan store: %s is not a usable entry (%s): recording again", path, e)
            return None

    def drop(self, k: str) -> None:
        (self.dir / f"{k}.json").unlink(missing_ok=True)


def resolve(plan: StepPlan, named: dict[str, dict[str, mx.array]]) -> str | None:
    """The plan's weight and constant buffers' addresses read again by label from this process's arrays
    (`graph_record.named_arrays`), in place; why not, if one is missing or of another size."""
    for b in plan.buffers.values():
        if b.kind not in ("weight", "const"):
            continue
        a = named[b.kind].get(b.label)
        if a is None or a.nbytes != b.nbytes:
            return f"{b.kind} {b.label} is not here as recorded"
        at = record.address(a)
        if at is None:
            return f"{b.kind} {b.label} has no address"
        plan.addresses[b.id] = at
    return None


def expected_logits(model: Any, pools: Any, handles: Sequence[Any], widths: dict[int, int]) -> tuple[np.ndarray, Any]:
    """An uncompiled MLX step of the handles' rows at position 0, as `record_step` runs it (its constants made):
    the logits the capture's replay must equal, and the step's named arrays."""
    n = len(handles)
    rows = [Row(slot=h.slot, position=0, q_row=i, tables=h.tables) for i, h in enumerate(handles)]
    mx.disable_compile()
    try:
        batch = fresh_batch(rows, pools.page_size, widths)
        tokens = mx.array(np.zeros(n, np.int32))
        logits = model.step(batch, tokens, pools)
        mx.eval(logits, pools.arrays())
    finally:
        mx.enable_compile()
    return np.array(logits), named_arrays(model, pools, batch, tokens)
