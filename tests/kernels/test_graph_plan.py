"""The CUDA graph step's plan (kernels/graph): the arena never overlaps two buffers alive at once, the plan's
checks refuse what a replay cannot do, the recorder sorts arguments by the buffer they lie in, and the tool
plans the tiny model's step (one graph per row count replays steps at other positions)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels.graph.plan import (
    ALIGN,
    Buffer,
    Launch,
    Ref,
    build,
    fallback_reason,
    gaps,
    graph_key,
    lifetimes,
    same_launches,
)
from dsv4_serve.kernels.graph.record import Recorder, address, hold, moved

ROOT = Path(__file__).resolve().parents[2]


def launch(name: str, ins: list[int], outs: list[int], sizes: dict[int, int], grid=(1, 1, 1)) -> Launch:
    return Launch(name, grid, (32, 1, 1), (), tuple(Ref(b, 0, sizes[b]) for b in ins),
                  tuple(Ref(b, 0, sizes[b]) for b in outs))  # fmt: skip


def chain(sizes: dict[int, int], kinds: dict[int, str], steps: list[tuple[list[int], list[int]]]):
    buffers = {b: Buffer(b, kinds.get(b, "arena"), n, f"b{b}") for b, n in sizes.items()}
    return [launch(f"k{i}", i_, o, sizes) for i, (i_, o) in enumerate(steps)], buffers


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def check_no_clash(plan) -> None:
    """Brute force, independent of the packing: two arena buffers alive at one launch share no byte."""
    life = lifetimes(plan.launches, plan.buffers)
    ids = sorted(plan.arena)
    for i, a in enumerate(ids):
        ra = (plan.arena[a], plan.arena[a] + plan.buffers[a].nbytes)
        assert plan.arena[a] % ALIGN == 0 and ra[1] <= plan.arena_bytes
        for b in ids[i + 1 :]:
            rb = (plan.arena[b], plan.arena[b] + plan.buffers[b].nbytes)
            alive_together = not (life[a][1] < life[b][0] or life[b][1] < life[a][0])
            assert not (alive_together and overlaps(ra, rb)), (a, b, ra, rb, life[a], life[b])


def test_arena_reuses_what_is_dead_and_never_what_is_alive() -> None:
    # w (weight) -> k0 -> b1 -> k1 -> b2 -> k2 -> b3 -> k3 -> b4: b1 is dead once k1 ran, so b3 may take its bytes
    sizes = {0: 4096, 1: 1000, 2: 1000, 3: 1000, 4: 1000}
    launches, buffers = chain(sizes, {0: "weight"}, [([0], [1]), ([1], [2]), ([2], [3]), ([3], [4])])
    plan = build(1, launches, buffers)
    check_no_clash(plan)
    assert set(plan.arena) == {1, 2, 3, 4}  # the weight is not in the arena
    assert plan.arena_bytes == 2 * 1024  # two 1,000-byte buffers alive at a time, each aligned to 1,024
    assert plan.arena[1] == plan.arena[3] and plan.arena[2] == plan.arena[4]


def test_arena_keeps_a_long_lived_buffer_apart() -> None:
    # b1 is read again by the last launch: nothing written in between may take its bytes
    sizes = {1: 512, 2: 512, 3: 512, 4: 512}
    launches, buffers = chain(sizes, {}, [([], [1]), ([1], [2]), ([2], [3]), ([3, 1], [4])])
    plan = build(2, launches, buffers)
    check_no_clash(plan)
    assert all(plan.arena[b] != plan.arena[1] for b in (2, 3, 4))


def test_arena_random_chains_never_clash() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 25)
        sizes = {b: rng.choice([1, 100, 256, 4000, 70_000]) for b in range(n)}
        steps = []
        for b in range(1, n):
            steps.append(([rng.randrange(b) for _ in range(rng.randint(0, 3))], [b]))
        launches, buffers = chain(sizes, {0: "pool"}, steps)
        plan = build(rng.randint(1, 8), launches, buffers)
        check_no_clash(plan)
        assert plan.arena_bytes <= sum(-(-sizes[b] // ALIGN) * ALIGN for b in plan.arena)


def test_staging_packs_the_step_inputs() -> None:
    sizes = {0: 4, 1: 32, 2: 20, 3: 64}
    launches, buffers = chain(sizes, {0: "step", 1: "step", 2: "step"}, [([0, 1, 2], [3])])
    plan = build(8, launches, buffers)
    assert plan.staging == {0: 0, 1: 16, 2: 48} and plan.staging_bytes == 80


def test_build_refuses_what_a_replay_cannot_do() -> None:
    sizes = {0: 64, 1: 64}
    launches, buffers = chain(sizes, {0: "weight"}, [([0], [1])])
    with pytest.raises(ValueError, match="rows must be 1..8"):
        build(9, launches, buffers)
    with pytest.raises(ValueError, match="unknown buffer 7"):
        build(1, [launch("k", [7], [1], {7: 4, 1: 64})], buffers)
    with pytest.raises(ValueError, match="bytes 32..96 of b0"):
        build(1, [Launch("k", (1, 1, 1), (1, 1, 1), (), (Ref(0, 32, 64),), ())], buffers)
    with pytest.raises(ValueError, match="writes b0, a weight"):
        build(1, [launch("k", [1], [0], sizes)], buffers)
    with pytest.raises(ValueError, match="kind 'scratch'"):
        Buffer(0, "scratch", 4, "x")


def test_gaps_and_fallback_reasons() -> None:
    sizes = {0: 64, 1: 64, 2: 64}
    launches, buffers = chain(sizes, {0: "gap"}, [([0], [1]), ([1], [2])])
    plan = build(1, launches, buffers, rewritten=["window3"])
    assert gaps(plan) == ["window3: written by an MLX op", "b0: 64 bytes"]
    assert "2 arguments are made by MLX ops" in fallback_reason(plan)
    assert fallback_reason(None) == "no plan for this row count"
    assert fallback_reason(plan, "cuda.core is not installed").startswith("no CUDA graph runtime")
    clean, cb = chain(sizes, {0: "weight"}, [([0], [1]), ([1], [2])])
    assert fallback_reason(build(1, clean, cb)) is None


def test_launches_nothing_reads_are_left_out() -> None:
    """k0's output nobody reads and k1 whose only reader is dead go; k2 writes a pool in place (its token unread)
    and k4, the step's result, stay; k3 feeds k4."""
    sizes = {0: 64, 1: 64, 2: 64, 3: 64, 4: 64, 5: 64, 6: 64, 7: 64}
    launches, buffers = chain(sizes, {0: "weight", 3: "pool"}, [
        ([0], [1]),  # k0: b1 read by nobody
        ([0], [2]),  # k1: b2 read only by dead k... (none): dead
        ([3], [4]),  # k2: an in-place writer of pool b3, token b4 unread
        ([0], [5]),  # k3: b5 read by k4
        ([5], [6]),  # k4: the result
    ])  # fmt: skip
    plan = build(1, launches, buffers)
    assert [ln.kernel for ln in plan.launches] == ["k2", "k3", "k4"] and plan.dropped == 2
    chained, cb = chain(sizes, {0: "weight"}, [([0], [1]), ([1], [2]), ([0], [7])])  # k0 -> k1 -> nothing
    assert [ln.kernel for ln in build(1, chained, cb).launches] == ["k2"]


def test_same_launches_names_the_first_difference() -> None:
    sizes = {0: 64, 1: 64}
    a = build(1, *chain(sizes, {0: "step"}, [([0], [1])]))
    b = build(1, [launch("k0", [0], [1], sizes, grid=(2, 1, 1))], a.buffers)
    assert same_launches(a, a) == []
    assert same_launches(a, b)[0].startswith("launch 0 (k0) differs")
    assert same_launches(a, build(1, [], a.buffers)) == ["1 launches against 0"]
    assert [graph_key(r) for r in range(1, 9)] == list(range(1, 9))
    with pytest.raises(ValueError):
        graph_key(0)


def test_recorder_sorts_arguments_by_buffer() -> None:
    """A view of an earlier output is that output (arena), an MLX op's result is a gap, a weight is a weight,
    and a state array written by `a[idx] = v` is seen as rewritten."""

    def base(**_spec):
        def run(*, inputs, output_shapes, output_dtypes, **_kw):
            dep = inputs[0].sum() * 0
            return [mx.zeros(s, d) + dep.astype(d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return run

    rec = Recorder(base)
    k = rec.factory(name="k", input_names=["x", "w"], output_names=["y"], source="")
    w = mx.ones((4, 8))
    x = mx.arange(8, dtype=mx.float32)
    pool = mx.zeros((3, 8))
    mx.eval(w, x, pool)
    held = hold({"pool": pool})
    rec.recording = True
    (y,) = k(inputs=[x, w], grid=(1, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(2, 8)], output_dtypes=[mx.float32])
    (z,) = k(inputs=[y.reshape(16), w], grid=(1, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8,)],
             output_dtypes=[mx.float32])  # fmt: skip
    k(inputs=[z * 2, w], grid=(1, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8,)], output_dtypes=[mx.float32])
    pool[mx.array([1])] = z[None]
    rec.recording = False
    plan = rec.plan(1, {"weight": {"w": w}, "step": {"x": x}}, moved(held, {"pool": pool}))
    kinds = [[plan.buffers[r.buffer].kind for r in ln.inputs] for ln in plan.launches]
    assert kinds == [["step", "weight"], ["arena", "weight"], ["gap", "weight"]]
    assert plan.launches[1].inputs[0].buffer == plan.launches[0].outputs[0].buffer
    assert gaps(plan) == ["pool: written by an MLX op", "k.x: 32 bytes"]
    assert address(mx.zeros((0,))) is None


def test_tool_plans_the_tiny_step(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "tools/graph_plan.py", "--tiny", "--rows", "1,3", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    for rows in (1, 3):
        row = rep[f"rows{rows}"]
        assert row["one_graph"] is True, row["differs"]  # steps at other positions replay one graph
        assert row["launches"] > rep["layers"]  # at least a launch a layer
        assert row["buffers"]["step"] == 6  # tokens, slots, positions, q_rows and the two ratios' tables
        assert row["buffers"]["weight"] > 0 and row["buffers"]["arena"] > 0
    assert f"rows 3: {rep['rows3']['launches']} launches" in r.stdout


@pytest.mark.parametrize("experts", [16, 8])
def test_tool_plans_the_flash_step_without_gaps_with_the_glue_kernels(tmp_path: Path, experts: int) -> None:
    """V4-Flash dims, 4 layers (hashed, CSA, HCA, sliding), DSV4_GRAPH_GLUE's kernels: every argument of every
    launch is a weight, a pool, a constant, a step input or an earlier launch's output, and no MLX op writes
    a pool. At 8 experts the router's logits stay MLX's: f32_linear_rows' kernel takes 16 outputs at a time
    (kernels/cuda/matmul.py geometry: n % 16), which 16 and the release's 256 experts are."""
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "tools/graph_plan.py", "--glue", "--layers", "4", "--experts", str(experts),
                        "--rows", "1,8", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    for rows in (1, 8):
        row = rep[f"rows{rows}"]
        assert row["one_graph"] is True, row["differs"]
        gap_args = {name.rsplit("_", 1)[0]: n for name, n in row["gap_args"]}
        if experts == 16:
            assert row["gaps"] == 0 and row["buffers"]["gap"] == 0, row["gap_args"]
        else:  # the 3 hash layers' logits (router_hash) and the top-k layer's (router_topk)
            assert gap_args == {"dsv4_router_hash": 3, "dsv4_router_topk": 1}, row["gap_args"]
            assert all(name.endswith(".logits") for name, _ in row["gap_args"])


def test_staging_packs_what_the_mlx_step_uploads() -> None:
    """step_values from the rows' ints equal the arrays RowBatch.build uploads for the MLX step, and pack puts each
    at its plan offset (ragged rows: other positions, slots and tables)."""
    from dsv4_serve.kernels.graph.staging import Staging, step_values
    from dsv4_serve.model.state import StatePools
    from dsv4_serve.model.tiny import tiny_model

    model, args, _ = tiny_model(seed=0)
    pools = StatePools(args, max_slots=8, max_positions=900, page_size=16)
    handles = [pools.alloc(100 + 97 * i) for i in range(5)]
    batch = model.make_batch(pools, handles, [3, 90, 17, 250, 401])
    tokens = [5, 6, 7, 8, 9]
    widths = {r: pools.table_width(r) for r in pools.ratios}
    values = step_values(batch.rows, tokens, widths)
    uploaded = {"slots": batch.slots, "positions": batch.positions, "q_rows": batch.q_rows,
                **{f"table{r}": t for r, t in batch.tables.items()}}  # fmt: skip
    assert set(values) == {"tokens", *uploaded}
    for name, a in uploaded.items():
        assert np.array_equal(values[name], np.array(a)), name
    sizes = {i: values[n].nbytes for i, n in enumerate(values)}
    buffers = {i: Buffer(i, "step", sizes[i], n) for i, n in enumerate(values)}
    out = 100
    buffers[out] = Buffer(out, "arena", 64, "logits")
    plan = build(5, [launch("k", list(sizes), [out], {**sizes, out: 64})], buffers)
    packed = Staging(plan).pack(values)
    for i, name in enumerate(values):
        off = plan.staging[i]
        assert packed[off : off + sizes[i]].tobytes() == values[name].tobytes(), name
    with pytest.raises(ValueError, match="no value for"):
        Staging(plan).pack({"tokens": values["tokens"]})
    with pytest.raises(ValueError, match="tokens is 16 bytes, the graph reads 20"):
        Staging(plan).pack({**values, "tokens": np.zeros(4, np.int32)})
