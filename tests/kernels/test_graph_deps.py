"""kernels/graph/deps.py on the CPU: the step's launches as a dependency graph. On hand-made plans: readers of one
buffer run side by side, a write waits for the readers before it, an arena buffer that reuses another's bytes waits
for its last readers, a pool a launch takes is written; on the V4-Flash step recorded through the engine's path
(stand-in kernels): every pair of launches that touch the same bytes with a write between them is ordered by a path
of the graph (checked pair by pair on byte ranges), and the graph is wider than a chain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from dsv4_serve.kernels.graph.deps import dependencies, levels, written_inputs
from dsv4_serve.kernels.graph.plan import Buffer, Launch, Ref, build
from dsv4_serve.kernels.graph.record import KernelSource

ROOT = Path(__file__).resolve().parents[2]
ONE = (1, 1, 1)


def _kernel(inputs: tuple[str, ...], source: str = "") -> KernelSource:
    return KernelSource(name="k", input_names=inputs, output_names=("out",), source=source, header="",
                        shared_memory=0)  # fmt: skip


def _launch(ins: list[int], out: int, nbytes: int = 64) -> Launch:
    return Launch("k", ONE, ONE, (), tuple(Ref(b, 0, nbytes) for b in ins), (Ref(out, 0, nbytes),))


def test_written_inputs_are_the_const_cast_ones() -> None:
    k = _kernel(("x", "ring", "w"), "P* r = const_cast<P*>( ring ) + 4; float v = x[0] * w[0];")
    assert written_inputs(k) == {"ring"}
    assert written_inputs(_kernel(("x",), "const float* y = x;")) == set()


def test_readers_run_side_by_side_and_a_write_waits_for_them() -> None:
    # 0: weights (read only), 1: step input, 2..5: arena
    buffers = {0: Buffer(0, "weight", 64, "w"), 1: Buffer(1, "step", 64, "tokens"),
               **{b: Buffer(b, "arena", 64, f"a{b}") for b in range(2, 6)}}  # fmt: skip
    launches = [
        _launch([0, 1], 2),  # 0: x = f(w, tokens)
        _launch([0, 2], 3),  # 1: q = g(w, x)
        _launch([0, 2], 4),  # 2: kv = h(w, x), beside q
        _launch([3, 4], 5),  # 3: o = attend(q, kv)
    ]
    plan = build(1, launches, buffers)
    kernels = [_kernel(("w", "x"))] * 4
    deps = dependencies(plan, kernels)
    assert deps == [(), (0,), (0,), (1, 2)]
    assert levels(deps) == [0, 1, 1, 2]


def test_an_arena_buffer_reusing_bytes_waits_for_the_last_readers_of_the_old_one() -> None:
    buffers = {0: Buffer(0, "weight", 64, "w"), **{b: Buffer(b, "arena", 64, f"a{b}") for b in range(1, 6)}}
    launches = [
        _launch([0], 1),  # 0: a1
        _launch([1], 2),  # 1: a2 = f(a1)
        _launch([1], 3),  # 2: a3 = g(a1): a1's last reader
        _launch([2, 3], 4),  # 3: a4; a1 is dead from here: a5 may take its bytes
        _launch([4], 5),  # 4: a5
    ]
    plan = build(1, launches, buffers)
    shared = [b for b in (2, 3, 4, 5) if plan.arena[b] == plan.arena[1]]
    deps = dependencies(plan, [_kernel(tuple(f"i{j}" for j in range(len(ln.inputs)))) for ln in launches])
    for b in shared:  # whoever writes a1's bytes again waits for a1's readers (1 and 2)
        writer = next(i for i, ln in enumerate(launches) if ln.outputs[0].buffer == b)
        assert {1, 2} <= _ancestors(deps, writer), (b, writer, deps)


def test_a_pool_a_launch_takes_is_written() -> None:
    buffers = {0: Buffer(0, "pool", 256, "pool0"), 1: Buffer(1, "step", 64, "positions"),
               **{b: Buffer(b, "arena", 64, f"a{b}") for b in (2, 3, 4)}}  # fmt: skip
    launches = [
        _launch([1, 0], 2),  # 0: writes the ring (in place), token out
        _launch([0, 1], 3),  # 1: attention reads the ring
        _launch([0, 1], 4),  # 2: a second reader of the same pool
    ]
    deps = dependencies(build(1, launches, buffers), [_kernel(("positions", "window"))] * 3)
    assert deps == [(), (0,), (1,)]  # a pool taken is ordered with every other taker: state, never raced


def _ancestors(deps: list[tuple[int, ...]], i: int) -> set[int]:
    seen, todo = set(), list(deps[i])
    while todo:
        j = todo.pop()
        if j not in seen:
            seen.add(j)
            todo.extend(deps[j])
    return seen


SCRIPT = """
import json
from bench.stand_in import stand_in_recorder
rec = stand_in_recorder()
from bench.stand_in import flash_rows
from dsv4_serve.kernels.graph.deps import dependencies, written_inputs
from dsv4_serve.model.graph_record import record_step
model, pools, handles, widths = flash_rows()
out = {}
for n in (1, 3):
    plan, launches, _, _ = record_step(model, pools, rec, handles[:n], widths)
    kernels = [ln.kernel for ln in launches]
    space = lambda r: ("arena", plan.arena[r.buffer] + r.offset) if plan.buffers[r.buffer].kind == "arena" \\
        else (r.buffer, r.offset)
    acc = []
    for ln, k in zip(plan.launches, kernels):
        wi = written_inputs(k)
        w = [r for r in ln.outputs] + [r for r, nm in zip(ln.inputs, k.input_names)
                                       if nm in wi or plan.buffers[r.buffer].kind == "pool"]
        acc.append(([(*space(r), r.nbytes) for r in ln.inputs], [(*space(r), r.nbytes) for r in w]))
    in_place = sorted({plan.buffers[r.buffer].kind for ln, k in zip(plan.launches, kernels)
                       for r, nm in zip(ln.inputs, k.input_names) if nm in written_inputs(k)})
    out[n] = {"deps": dependencies(plan, kernels), "acc": acc, "in_place_kinds": in_place}
print(json.dumps(out))
"""


def _overlap(a: list, b: list) -> bool:
    return any(x[0] == y[0] and x[1] < y[1] + y[2] and y[1] < x[1] + x[2] for x in a for y in b)


def test_the_recorded_step_s_graph_orders_every_hazard_and_is_wider_than_a_chain() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MLX_ENABLE_TF32": "0"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for n, got in out.items():
        deps = [tuple(d) for d in got["deps"]]
        acc = got["acc"]
        assert got["in_place_kinds"] == ["pool"], got["in_place_kinds"]  # kernels write in place only the state
        anc = [_ancestors(deps, i) for i in range(len(deps))]
        for j in range(len(acc)):
            for i in range(j):
                (ri, wi), (rj, wj) = acc[i], acc[j]
                if _overlap(wi, rj + wj) or _overlap(ri, wj):
                    assert i in anc[j], (n, i, j)
        depth = levels(deps)
        assert max(depth) + 1 < len(deps), (n, max(depth) + 1, len(deps))  # some launches run side by side
        print(f"{n} rows: {len(deps)} launches in {max(depth) + 1} levels")


def test_mx_is_the_cpu_here() -> None:  # the recording above runs the CUDA path's launch list on the CPU
    assert mx.default_device() == mx.cpu or not mx.cuda.is_available()
