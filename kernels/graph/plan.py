"""The CUDA graph step's plan, on any machine: the buffers a captured decode step touches, where its
intermediates live in one static arena, what the host stages each step, and what keeps a step from capture.

A captured graph replays fixed addresses. So every buffer a launch reads or writes must be one of:
- `weight` / `pool` / `const`: MLX arrays that live as long as the engine (addresses taken once at load);
- `step`: the step's small inputs (token ids, slots, positions, q rows, block tables), copied by the host into
  one staging buffer before each replay;
- `arena`: an output of an earlier launch of the same step, placed in the arena at an offset this plan picks.
What is none of these was made by an MLX op between two launches (a cast, a gather, a scatter, RoPE tables):
a `gap`. A step with gaps cannot be captured: each gap needs an own kernel first (`gaps()` names them).

Graph keys: one graph per row count (1..8). A launch list must not depend on anything else of the step
(positions, contexts, which slots): `same_launches` is the check, and the recorder's test runs it on steps
at different positions and contexts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dsv4_serve.kernels.rows import MAX_ROWS

ALIGN = 256  # bytes: cudaMalloc's alignment, so vector loads of an arena buffer stay aligned
PERSISTENT = ("weight", "pool", "const")
KINDS = (*PERSISTENT, "step", "arena", "gap")


@dataclass(frozen=True)
class Ref:
    """A launch argument: `nbytes` at byte `offset` of buffer `buffer` (views of one buffer share it)."""

    buffer: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Buffer:
    """One buffer of the step. `label`: what it is (a weight's name, `kernel.input`, ...), for messages."""

    id: int
    kind: str
    nbytes: int
    label: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Buffer {self.label}: kind {self.kind!r} is not one of {KINDS}")
        if self.nbytes < 0:
            raise ValueError(f"Buffer {self.label}: nbytes {self.nbytes} < 0")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the graph records it: the kernel (its name carries its source's digest), the
    launch values, and its arguments as buffer references."""

    kernel: str
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: tuple[tuple[str, str], ...]
    inputs: tuple[Ref, ...]
    outputs: tuple[Ref, ...]

    def signature(self) -> tuple[object, ...]:
        """What a replay fixes: kernel, launch values and the argument sizes."""
        return (self.kernel, self.grid, self.threadgroup, self.template,
                tuple(r.nbytes for r in self.inputs), tuple(r.nbytes for r in self.outputs))  # fmt: skip


@dataclass
class StepPlan:
    rows: int
    launches: list[Launch]
    buffers: dict[int, Buffer]
    arena: dict[int, int] = field(default_factory=dict)  # arena buffer id -> byte offset
    arena_bytes: int = 0
    staging: dict[int, int] = field(default_factory=dict)  # step buffer id -> byte offset in the staging buffer
    staging_bytes: int = 0
    rewritten: list[str] = field(default_factory=list)  # state arrays an MLX op replaced (a scatter, not a launch)
    dropped: int = 0  # launches left out: nothing reads their outputs (MLX never runs them either)
    kept: list[int] = field(default_factory=list)  # the recorded launch each of `launches` is
    addresses: dict[int, int] = field(default_factory=dict)  # buffer id -> its first byte as recorded

    def count(self, kind: str) -> int:
        return sum(b.kind == kind for b in self.buffers.values())


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def lifetimes(launches: Sequence[Launch], buffers: dict[int, Buffer]) -> dict[int, tuple[int, int]]:
    """Arena buffer id -> (launch that writes it first, launch that touches it last)."""
    out: dict[int, tuple[int, int]] = {}
    for i, ln in enumerate(launches):
        for r in (*ln.inputs, *ln.outputs):
            if buffers[r.buffer].kind == "arena":
                first, _ = out.get(r.buffer, (i, i))
                out[r.buffer] = (first, i)
    return out


def arena_layout(launches: Sequence[Launch], buffers: dict[int, Buffer],
                 align_to: int = ALIGN) -> tuple[dict[int, int], int]:  # fmt: skip
    """Offsets of the arena buffers in one allocation, and its size. Buffers whose lifetimes overlap never
    overlap in memory; one whose last reader ran before another is first written may share its bytes (each
    layer's intermediates reuse the layer before's). Greedy: largest first, each at the lowest offset that
    clears every placed buffer it overlaps in time."""
    life = lifetimes(launches, buffers)
    order = sorted(life, key=lambda b: (-buffers[b].nbytes, life[b][0], b))
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets: dict[int, int] = {}
    for b in order:
        first, last = life[b]
        size = align(max(buffers[b].nbytes, 1), align_to)
        busy = sorted((o, e) for o, e, f, lst in placed if not (lst < first or last < f))
        off = 0
        for o, e in busy:
            if off + size <= o:
                break
            off = max(off, e)
        offsets[b] = off
        placed.append((off, off + size, first, last))
    return offsets, max((e for _, e, _, _ in placed), default=0)


def staging_layout(buffers: dict[int, Buffer]) -> tuple[dict[int, int], int]:
    """The step inputs packed into one staging buffer (one host-to-device copy a step), in id order."""
    offsets, end = {}, 0
    for b in sorted(i for i, buf in buffers.items() if buf.kind == "step"):
        offsets[b] = end
        end += align(max(buffers[b].nbytes, 1), 16)
    return offsets, end


def gaps(plan: StepPlan) -> list[str]:
    """What an MLX op made between launches, as 'kernel.argument: nbytes', and the state arrays an MLX op wrote
    (empty: the step can be captured)."""
    out = [f"{name}: written by an MLX op" for name in plan.rewritten]
    for ln in plan.launches:
        for r in ln.inputs:
            b = plan.buffers[r.buffer]
            if b.kind == "gap":
                out.append(f"{b.label}: {b.nbytes} bytes")
    return out


def dead(launches: Sequence[Launch], buffers: dict[int, Buffer]) -> set[int]:
    """Launches a graph leaves out: MLX evaluates lazily, so a launch whose outputs nothing reads never runs
    there (the recorder sees every call). Dead: every output an arena buffer no kept later launch reads, no
    input a pool (an in-place writer's effect is its pool, not its output), and not the last launch (the
    step's result). Backwards, so a launch read only by dead launches is dead too."""
    out: set[int] = set()
    read: set[int] = set()
    for i in range(len(launches) - 1, -1, -1):
        ln = launches[i]
        unread = all(buffers[r.buffer].kind == "arena" and r.buffer not in read for r in ln.outputs)
        writes_state = any(buffers[r.buffer].kind == "pool" for r in ln.inputs)
        if i < len(launches) - 1 and unread and not writes_state:
            out.add(i)
            continue
        read.update(r.buffer for r in ln.inputs)
    return out


def build(rows: int, launches: Sequence[Launch], buffers: dict[int, Buffer], rewritten: Sequence[str] = (),
          addresses: dict[int, int] | None = None) -> StepPlan:  # fmt: skip
    """The plan of a step of `rows` rows (checked: every argument names a known buffer and lies inside it)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"graph plan: rows must be 1..{MAX_ROWS}, got {rows}")
    for ln in launches:
        for r in (*ln.inputs, *ln.outputs):
            b = buffers.get(r.buffer)
            if b is None:
                raise ValueError(f"graph plan: {ln.kernel} names unknown buffer {r.buffer}")
            if r.offset < 0 or r.offset + r.nbytes > b.nbytes:
                raise ValueError(f"graph plan: {ln.kernel} reads bytes {r.offset}..{r.offset + r.nbytes} of "
                                 f"{b.label} ({b.nbytes} bytes)")  # fmt: skip
        for r in ln.outputs:
            b = buffers[r.buffer]
            if b.kind in ("weight", "const", "step"):
                raise ValueError(f"graph plan: {ln.kernel} writes {b.label}, a {b.kind}")
    # with gaps, MLX ops read launches' outputs too: nothing is known dead (and nothing is captured anyway)
    gapless = not rewritten and all(b.kind != "gap" for b in buffers.values())
    drop = dead(launches, buffers) if gapless else set()
    kept = [i for i in range(len(launches)) if i not in drop]
    plan = StepPlan(rows, [launches[i] for i in kept], dict(buffers), rewritten=list(rewritten), dropped=len(drop),
                    kept=kept)  # fmt: skip
    plan.addresses = dict(addresses or {})
    plan.arena, plan.arena_bytes = arena_layout(plan.launches, plan.buffers)
    plan.staging, plan.staging_bytes = staging_layout(plan.buffers)
    return plan


def same_launches(a: StepPlan, b: StepPlan) -> list[str]:
    """Why one graph cannot replay both steps (empty: it can): launch count, or the first launch that differs."""
    if len(a.launches) != len(b.launches):
        return [f"{len(a.launches)} launches against {len(b.launches)}"]
    for i, (x, y) in enumerate(zip(a.launches, b.launches, strict=True)):
        if x.signature() != y.signature():
            return [f"launch {i} ({x.kernel}) differs: {x.signature()} against {y.signature()}"]
    return []


def graph_key(rows: int) -> int:
    """The graph a step of `rows` rows replays: one per row count (its launch list depends on nothing else)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"graph key: rows must be 1..{MAX_ROWS}, got {rows}")
    return rows


def fallback_reason(plan: StepPlan | None, runtime_error: str | None = None) -> str | None:
    """Why a step of this plan runs through MLX instead of a graph (None: it can be captured)."""
    if runtime_error:
        return f"no CUDA graph runtime: {runtime_error}"
    if plan is None:
        return "no plan for this row count"
    found = gaps(plan)
    if found:
        return f"{len(found)} arguments are made by MLX ops between launches (first: {found[0]})"
    return None
