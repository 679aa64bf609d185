"""The decode step's launches as a dependency graph instead of a chain: a launch waits only for the launches whose
bytes it needs in order, so independent kernels (a layer's projections of the same input, say) run side by side.

MLX's own CUDA graphs do this: on the H100 at 1 row its step's kernels add up to 11.09 ms but keep the GPU busy for
8.64 ms, while the replayed chain's add up to 9.45 ms and take 9.45 (`bench/step.py --profile`, 2026-12-06).

A launch reads its inputs and writes its outputs; it also writes the inputs its kernel writes in place (a
`const_cast` of the argument in its source or header) and, to be safe, every state pool it takes (the in-place
compressors, the ring write and the workspaces all write pools they take as inputs; a pool only read is ordered
with its writers either way). Launch j then waits for launch i < j where
- i last wrote a buffer j reads or writes (read after write, write after write), or
- i read, since its last write, a buffer j writes (write after read);
and buffers are whole buffers (a view is its buffer), an arena buffer standing for every arena buffer whose bytes
it shares (`plan.arena_layout` gives later buffers the bytes of earlier ones whose lifetimes ended).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dsv4_serve.kernels.graph.plan import StepPlan
from dsv4_serve.kernels.graph.record import KernelSource


def written_inputs(kernel: KernelSource) -> set[str]:
    """The kernel's inputs its source (or header) writes through a `const_cast` of the argument."""
    text = kernel.source + "\n" + kernel.header
    return {n for n in kernel.input_names if re.search(rf"const_cast<[^>]*>\(\s*{re.escape(n)}\s*\)", text)}


def aliases(plan: StepPlan) -> dict[int, tuple[int, ...]]:
    """Arena buffer id -> the arena buffers sharing any of its bytes (itself included)."""
    spans = sorted((off, off + max(plan.buffers[b].nbytes, 1), b) for b, off in plan.arena.items())
    out: dict[int, list[int]] = {b: [b] for _, _, b in spans}
    for i, (_, end, b) in enumerate(spans):
        for s2, _, b2 in spans[i + 1 :]:
            if s2 >= end:
                break
            out[b].append(b2)
            out[b2].append(b)
    return {b: tuple(v) for b, v in out.items()}


def dependencies(plan: StepPlan, kernels: Sequence[KernelSource]) -> list[tuple[int, ...]]:
    """For each launch of `plan` (its kernel `kernels[i]`), the earlier launches it must wait for."""
    if len(kernels) != len(plan.launches):
        raise ValueError(f"dependencies: {len(kernels)} kernels for {len(plan.launches)} launches")
    alias = aliases(plan)
    writer: dict[int, int] = {}  # buffer id -> the launch that last wrote it
    readers: dict[int, list[int]] = {}  # buffer id -> launches that read it since
    out: list[tuple[int, ...]] = []
    for i, (ln, k) in enumerate(zip(plan.launches, kernels, strict=True)):
        in_place = written_inputs(k)
        reads = {r.buffer for r in ln.inputs}
        writes = {r.buffer for r in ln.outputs}
        writes |= {r.buffer for r, n in zip(ln.inputs, k.input_names, strict=True)
                   if n in in_place or plan.buffers[r.buffer].kind == "pool"}  # fmt: skip
        deps: set[int] = set()
        for b in reads | writes:
            for x in alias.get(b, (b,)):
                if x in writer:
                    deps.add(writer[x])
                if b in writes:
                    deps.update(readers.get(x, ()))
        for b in writes:
            writer[b], readers[b] = i, []
        for b in reads - writes:
            readers.setdefault(b, []).append(i)
        deps.discard(i)
        out.append(tuple(sorted(deps)))
    return reduced(out)


def reduced(deps: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The same order with no edge a longer path already gives (fewer edges for the graph to hold)."""
    anc: list[int] = []  # bit j of anc[i]: launch j is before launch i
    out: list[tuple[int, ...]] = []
    for d in deps:
        keep = tuple(j for j in d if not any(k != j and anc[k] >> j & 1 for k in d))
        mask = 0
        for j in keep:
            mask |= anc[j] | 1 << j
        anc.append(mask)
        out.append(keep)
    return out


def levels(deps: Sequence[Sequence[int]]) -> list[int]:
    """Each launch's depth (0: waits for none): how many launches can run side by side is how many share one."""
    depth: list[int] = []
    for d in deps:
        depth.append(1 + max((depth[j] for j in d), default=-1))
    return depth
