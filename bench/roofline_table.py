"""The roofline by kernel class: the bytes each class of the decode step's launches must move in one step, from the
CUDA graph plan (kernels/graph/plan.py), joined with its GPU time from a CUPTI Chrome trace. Pure Python over the
plan's types, so tests/bench/test_roofline.py checks it on hand-built plans and traces; bench/roofline.py records
the plan and prints the table.

A class is a kernel's name without its source digest (`dsv4_skinny_mm_5f5bc13e2b` -> `dsv4_skinny_mm`), however
the trace spells it (MLX's `custom_kernel_<name><template hash>`, the graph runtime's `mlx::core::cu::<name>`).

The bytes of a launch (each buffer once a launch, the union of the byte ranges it touches):
- weights: what it reads as stored (mxfp8 / mxfp4 words and their scales); a gathered weight only the rows a step
  reads: the routed experts the expected distinct experts of B rows, E (1 - (1 - k / E)^B) of E, as
  bench/step.py's floor_bytes; the embedding and the hash router's tid2eid B rows of their vocab rows;
- state (the pools), per row at context T (`state_bytes`): the sliding window's min(T + 1, W) entries read by
  attention, one written by the ring write; the compressed entries attention reads (CSA min(index_topk, T / 4), HCA
  T / 128) and every index key the indexer scores (T / 4); a compressor's state one entry written a step and its n
  entries read at each emission (every `ratio` steps), its pool one entry an emission; a workspace the rows' share;
- intermediates (the arena): every byte range read plus every one written; constants and step inputs as `other`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dsv4_serve.kernels.graph.plan import Ref, StepPlan

FIELDS = ("weight", "state", "arena", "other")
_DIGEST = re.compile(r"(dsv4_\w+?)_[0-9a-f]{10}(?![0-9A-Za-z])")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_TEMPLATE = re.compile(r"<[^<>]*>")


@dataclass(frozen=True)
class Dims:
    """What the byte model reads of the V4 config (model/config.py's names)."""

    sliding_window: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    vocab_size: int

    @classmethod
    def of(cls, args: object) -> Dims:
        return cls(*(int(getattr(args, f)) for f in cls.__dataclass_fields__))


@dataclass(frozen=True)
class Pool:
    """A state buffer of the plan: `family` window | ckv | ikeys | comp_kv | comp_score | idx_kv | idx_score |
    workspace, its layer's compression `ratio` (0: sliding), `slots` (rows it holds; 0: not per row), its shape."""

    family: str
    ratio: int
    slots: int
    shape: tuple[int, ...]
    itemsize: int

    @property
    def entry(self) -> int:
        """Bytes of one entry (its last dimension)."""
        return self.shape[-1] * self.itemsize


def kernel_class(name: str) -> str:
    """A kernel's class: its name without digest, template hash, namespace, template arguments or parameters."""
    m = _DIGEST.search(name)
    if m:
        return m.group(1)
    s = name
    while _TEMPLATE.search(s):
        s = _TEMPLATE.sub("", s)
    s = s.split("(", 1)[0].strip()
    return s.split()[-1].rsplit("::", 1)[-1] if s else name


def distinct_experts(experts: int, k: int, rows: int) -> float:
    """Expected distinct experts k-of-E routing picks for `rows` rows (uniform, independent)."""
    return experts * (1 - (1 - k / experts) ** rows)


def weight_bytes(label: str, nbytes: int, rows: int, dims: Dims) -> float:
    """Bytes of weight `label` a launch reads of the `nbytes` it is handed."""
    if ".ffn.experts." in label:
        e = dims.n_routed_experts
        return nbytes * distinct_experts(e, dims.num_experts_per_tok, rows) / e
    if label == "embed.weight" or label.endswith(".tid2eid"):
        return nbytes * min(rows, dims.vocab_size) / dims.vocab_size
    return float(nbytes)


def state_bytes(cls: str, arg: str, pool: Pool, nbytes: int, rows: int, ctx: int, dims: Dims) -> float:
    """Bytes of state buffer `pool` (argument `arg` of a launch of class `cls`) one step moves for `rows` rows at
    context `ctx` (the module's model)."""
    r = pool.ratio
    if pool.family == "window":
        if cls.endswith("_ring"):
            return rows * pool.entry  # the new token's entry written
        return rows * min(ctx + 1, pool.shape[1]) * pool.entry
    if pool.family in ("ckv", "ikeys"):
        if "compressor" in cls:
            return rows * pool.entry / r  # one entry an emission
        if pool.family == "ckv" and "attn" in cls:
            return rows * (min(dims.index_topk, ctx // 4) if r == 4 else ctx // r) * pool.entry
        return rows * (ctx // r) * pool.entry  # the indexer scores every key
    if pool.family in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
        return rows * pool.entry * (1 + pool.shape[1] / r)
    return nbytes * rows / pool.slots if pool.slots else float(nbytes)


def union_bytes(refs: Iterable[Ref]) -> dict[int, int]:
    """Buffer id -> bytes of the union of the refs' ranges in it."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for r in refs:
        spans.setdefault(r.buffer, []).append((r.offset, r.offset + r.nbytes))
    out = {}
    for b, ss in spans.items():
        total, end = 0, -1
        for lo, hi in sorted(ss):
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
        out[b] = total
    return out


def layer_of_launches(plan: StepPlan) -> list[int]:
    """Each launch's layer: that of a `layers.N.` weight it reads, else the launch before's (-1: outside the layers:
    the embedding, the head, what runs before layer 0)."""
    out, cur = [], -1
    for ln in plan.launches:
        for r in ln.inputs:
            b = plan.buffers[r.buffer]
            m = _LAYER.match(b.label) if b.kind == "weight" else None
            if m:
                cur = int(m.group(1))
                break
            if b.kind == "weight":
                cur = -1
        out.append(cur)
    return out


def byte_table(plan: StepPlan, names: Sequence[Sequence[str]], inits: Sequence[bool], pools: dict[str, Pool],
               dims: Dims, rows: int, ctx: int) -> dict[str, dict[str, float]]:  # fmt: skip
    """Class -> launches a step and bytes by kind (FIELDS). `names[i]`: launch i's input names; `inits[i]`: MLX
    fills its outputs first (a memset node each, class `memset`); `pools`: the plan's pool labels."""
    out: dict[str, dict[str, float]] = {}

    def row(cls: str) -> dict[str, float]:
        return out.setdefault(cls, {"launches": 0, **dict.fromkeys(FIELDS, 0.0)})

    for ln, args, init in zip(plan.launches, names, inits, strict=True):
        cls = kernel_class(ln.kernel)
        t = row(cls)
        t["launches"] += 1
        arg_of: dict[int, str] = {}
        for r, a in zip(ln.inputs, args, strict=True):
            arg_of.setdefault(r.buffer, a)  # the first argument naming a buffer models it
        for b, n in union_bytes(ln.inputs).items():
            buf = plan.buffers[b]
            if buf.kind == "weight":
                t["weight"] += weight_bytes(buf.label, n, rows, dims)
            elif buf.kind == "pool":
                t["state"] += state_bytes(cls, arg_of[b], pools[buf.label], n, rows, ctx, dims)
            elif buf.kind == "arena":
                t["arena"] += n
            else:
                t["other"] += n
        t["arena"] += sum(union_bytes(r for r in ln.outputs if plan.buffers[r.buffer].kind == "arena").values())
        if init:
            m = row("memset")
            m["launches"] += len(ln.outputs)
            m["arena"] += sum(r.nbytes for r in ln.outputs)
    return out


def trace_table(events: Iterable[dict]) -> tuple[dict[str, list[float]], float]:
    """A Chrome trace's GPU events -> (class -> [launches, us], GPU busy us: the union of their spans)."""
    by: dict[str, list[float]] = {}
    spans = []
    for e in events:
        cat = e.get("cat")
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        cls = kernel_class(e["name"]) if cat == "kernel" else cat.removeprefix("gpu_")
        c = by.setdefault(cls, [0, 0.0])
        c[0] += 1
        c[1] += e.get("dur", 0)
        spans.append((e["ts"], e["ts"] + e.get("dur", 0)))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return by, busy


def steps_in(table: dict[str, dict[str, float]], trace: dict[str, list[float]]) -> int:
    """How many steps a trace holds: its launches of the plan's kernel classes over the plan's."""
    plan_n = sum(t["launches"] for c, t in table.items() if c != "memset")
    seen = sum(trace[c][0] for c in table if c != "memset" and c in trace)
    steps = round(seen / plan_n) if plan_n else 0
    if steps < 1:
        raise ValueError(f"the trace holds {seen} launches of the plan's classes, the plan {plan_n} a step")
    return steps


def join(table: dict[str, dict[str, float]], trace: dict[str, list[float]], steps: int,
         copy_bps: float) -> list[dict[str, object]]:  # fmt: skip
    """One row a class (the plan's and the trace's), slowest first: launches a step in the plan and the trace, bytes,
    GPU ms a step, achieved GB/s and its fraction of the copy's bandwidth (None where the plan has no bytes)."""
    out = []
    for cls in sorted(set(table) | set(trace)):
        t = table.get(cls, {"launches": 0, **dict.fromkeys(FIELDS, 0.0)})
        nbytes = sum(t[f] for f in FIELDS)
        n, us = trace.get(cls, [0, 0.0])
        sec = us / steps / 1e6
        bps = nbytes / sec if sec > 0 and nbytes else None
        out.append({"class": cls, "launches": t["launches"], "trace_launches": n / steps,
                    **{f"{f}_bytes": t[f] for f in FIELDS}, "bytes": nbytes, "ms": sec * 1e3,
                    "GBs": bps / 1e9 if bps else None, "x_copy": bps / copy_bps if bps else None})  # fmt: skip
    return sorted(out, key=lambda r: (-r["ms"], -r["bytes"]))  # type: ignore[operator]
