"""bench/roofline.py and bench/roofline_table.py: the class of a kernel however a trace spells it, the bytes a step's
launches must move on a hand-built plan (every expected value worked out by hand in the comments), the join of a
hand-written CUPTI Chrome trace with the byte table, and the script end to end on the CPU (a 4-layer V4-Flash, the
kernels stood in for), with and without a trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.roofline_table import (
    Dims,
    Pool,
    byte_table,
    join,
    kernel_class,
    layer_of_launches,
    state_bytes,
    steps_in,
    trace_table,
)
from dsv4_serve.kernels.graph.plan import Buffer, Launch, Ref, StepPlan

ROOT = Path(__file__).resolve().parents[2]
DIMS = Dims(sliding_window=16, index_topk=512, n_routed_experts=8, num_experts_per_tok=2, vocab_size=100)


@pytest.mark.parametrize(("name", "cls"), [
    ("dsv4_skinny_mm_5f5bc13e2b", "dsv4_skinny_mm"),  # the plan's name
    ("mlx::core::cu::custom_kernel_dsv4_skinny_mm_5f5bc13e2b_8_t_bfloat16", "dsv4_skinny_mm"),  # MLX's, templated
    ("void mlx::core::cu::dsv4_rope_tables128_5f14c696f0(float const*, int const*, float*)", "dsv4_rope_tables128"),
    ("mlx::core::cu::dsv4_hc_pre_split_norm_f3acf3b695", "dsv4_hc_pre_split_norm"),  # the graph runtime's
    ("void mlx::core::cu::gather<float, unsigned int, 1>(float const*, unsigned int const*, float*)", "gather"),
    ("void mlx::core::cu::copy_g_nd<__nv_bfloat16, __nv_bfloat16, int, 3>(__nv_bfloat16 const*)", "copy_g_nd"),
    ("bench_copy16", "bench_copy16"),
])  # fmt: skip
def test_kernel_class(name: str, cls: str) -> None:
    assert kernel_class(name) == cls


def hand_plan() -> tuple[StepPlan, list[tuple[str, ...]], list[bool], dict[str, Pool]]:
    """Five launches over weights, a window ring, the arena and a step input (sizes in bytes)."""
    buffers = {b.id: b for b in [
        Buffer(0, "weight", 1000, "layers.0.attn.wo_b.weight"),
        Buffer(1, "weight", 8000, "layers.0.ffn.experts.w1"),
        Buffer(2, "weight", 400, "embed.weight"),
        Buffer(3, "pool", 2 * 16 * 8 * 2, "pool0"),  # a window ring [2 slots, 16 entries, 8] bf16: 16-byte entries
        Buffer(4, "step", 4, "tokens"),
        Buffer(5, "arena", 128, "x"),
        Buffer(6, "arena", 32, "y"),
        Buffer(7, "arena", 64, "z"),
    ]}  # fmt: skip
    pools = {"pool0": Pool("window", 0, 2, (2, 16, 8), 2)}
    launches = [
        Launch("dsv4_embed_streams_0123456789", (1, 1, 1), (32, 1, 1), (), (Ref(2, 0, 400), Ref(4, 0, 4)),
               (Ref(5, 0, 128),)),
        # the same weight as two arguments (a skinny product's w and w2), two overlapping reads of x: 0..64, 32..96
        Launch("dsv4_skinny_mm_0123456789", (1, 1, 1), (32, 1, 1), (),
               (Ref(5, 0, 64), Ref(0, 0, 1000), Ref(0, 0, 1000), Ref(5, 32, 64)), (Ref(6, 0, 32),)),
        Launch("dsv4_skinny_mm_0123456789", (1, 1, 1), (32, 1, 1), (), (Ref(6, 0, 32), Ref(1, 0, 8000)),
               (Ref(7, 0, 64),)),
        Launch("dsv4_rms_rope_ring_abcdef0123", (1, 1, 1), (32, 1, 1), (), (Ref(7, 0, 16), Ref(3, 0, 512)), ()),
        # a sliding layer's attention: the ring as `window` and again as `pool`
        Launch("dsv4_attn_dsplit_abcdef0123", (1, 1, 1), (32, 1, 1), (), (Ref(7, 0, 64), Ref(3, 0, 512),
               Ref(3, 0, 512)), (Ref(5, 0, 128),)),
    ]  # fmt: skip
    names = [("table", "token_ids"), ("x", "w", "w2", "x2"), ("x", "w"), ("x", "window"), ("q", "window", "pool")]
    inits = [False, False, True, False, False]
    return StepPlan(1, launches, buffers), names, inits, pools


def test_byte_table_of_a_hand_built_plan() -> None:
    plan, names, inits, pools = hand_plan()
    t = byte_table(plan, names, inits, pools, DIMS, rows=1, ctx=100)
    assert set(t) == {"dsv4_embed_streams", "dsv4_skinny_mm", "dsv4_rms_rope_ring", "dsv4_attn_dsplit", "memset"}
    # one embedding row of 100 (4 bytes), the token id (other), x written (128)
    assert t["dsv4_embed_streams"] == {"launches": 1, "weight": 4.0, "state": 0.0, "arena": 128.0, "other": 4.0}
    # wo_b once (1000) + 1 row's 2 distinct experts of 8 (2000); arena: x's 0..96 + y written 32, y 32 + z 64
    assert t["dsv4_skinny_mm"] == {"launches": 2, "weight": 3000.0, "state": 0.0, "arena": 224.0, "other": 0.0}
    # the ring write: one 16-byte entry; attention: min(100 + 1, 16) entries of the ring, once (16 x 16 = 256)
    assert t["dsv4_rms_rope_ring"] == {"launches": 1, "weight": 0.0, "state": 16.0, "arena": 16.0, "other": 0.0}
    assert t["dsv4_attn_dsplit"] == {"launches": 1, "weight": 0.0, "state": 256.0, "arena": 192.0, "other": 0.0}
    # the expert product's output filled first: one memset of z's 64 bytes
    assert t["memset"] == {"launches": 1, "weight": 0.0, "state": 0.0, "arena": 64.0, "other": 0.0}
    # 8 rows: 8 embedding rows (32 bytes); the experts 8 (1 - (3/4)^8) = 7.19910 of 8: 7199.10 of their 8000 bytes
    t8 = byte_table(plan, names, inits, pools, DIMS, rows=8, ctx=100)
    assert t8["dsv4_embed_streams"]["weight"] == 32.0
    assert t8["dsv4_skinny_mm"]["weight"] == pytest.approx(1000 + 7199.0966796875)
    assert t8["dsv4_attn_dsplit"]["state"] == 8 * 256


def test_state_model_of_csa_and_hca_pools() -> None:
    ckv4 = Pool("ckv", 4, 0, (65, 256, 512), 2)  # compressed entries: 1024-byte entries
    ikeys = Pool("ikeys", 4, 0, (65, 256, 128), 2)  # index keys: 256-byte entries
    ckv128 = Pool("ckv", 128, 0, (9, 256, 512), 2)
    comp = Pool("comp_kv", 4, 2, (2, 8, 1024), 4)  # a CSA compressor's state: 8 entries of 4096 bytes a slot
    assert state_bytes("dsv4_attn_wide", "pool", ckv4, 0, 2, 4096, DIMS) == 2 * 512 * 1024  # top-k of 1024 entries
    assert state_bytes("dsv4_attn_wide", "pool", ckv4, 0, 1, 1024, DIMS) == 256 * 1024  # 1024 / 4 < top-k
    assert state_bytes("dsv4_attn_dsplit", "pool", ckv128, 0, 1, 4096, DIMS) == 32 * 1024  # 4096 / 128 entries
    assert state_bytes("dsv4_idx_one_ws", "keys", ikeys, 0, 1, 4096, DIMS) == 1024 * 256  # every key scored
    assert state_bytes("dsv4_compressor_pair", "pool2", ikeys, 0, 1, 4096, DIMS) == 256 / 4  # an entry in 4 steps
    assert state_bytes("dsv4_compressor_pair", "kv_state", comp, 0, 1, 4096, DIMS) == 4096 * 3  # 1 + 8 / 4 entries
    ws = Pool("workspace", 4, 8, (8, 100), 4)
    assert state_bytes("dsv4_idx_one_ws", "workspace", ws, 3200, 2, 4096, DIMS) == 800  # 2 of its 8 rows


def test_launches_by_layer() -> None:
    plan, *_ = hand_plan()
    # the embedding is outside the layers; layer 0's weights from the skinny products on, carried to the next
    assert layer_of_launches(plan) == [-1, 0, 0, 0, 0]


def trace_events() -> list[dict]:
    """Two steps of hand_plan's kernels as CUPTI names them, a memset, an MLX kernel and a host call; one overlap."""
    ev = []
    for t0 in (0.0, 1000.0):
        ev += [
            {"ph": "X", "cat": "kernel", "name": "mlx::core::cu::dsv4_embed_streams_0123456789", "ts": t0, "dur": 4},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": t0 + 5, "dur": 1},
            {"ph": "X", "cat": "kernel", "name": "mlx::core::cu::dsv4_skinny_mm_0123456789", "ts": t0 + 10, "dur": 10},
            {"ph": "X", "cat": "kernel", "name": "mlx::core::cu::dsv4_skinny_mm_0123456789", "ts": t0 + 15, "dur": 20},
            {"ph": "X", "cat": "kernel", "name": "mlx::core::cu::dsv4_rms_rope_ring_abcdef0123", "ts": t0 + 40,
             "dur": 2},
            {"ph": "X", "cat": "kernel", "name": "mlx::core::cu::dsv4_attn_dsplit_abcdef0123", "ts": t0 + 50,
             "dur": 8},
            {"ph": "X", "cat": "kernel", "name": "void mlx::core::cu::arg_reduce<float>(float const*)", "ts": t0 + 60,
             "dur": 3},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0, "dur": 50},  # host: left out
        ]  # fmt: skip
    return ev


def test_trace_joined_with_the_byte_table() -> None:
    plan, names, inits, pools = hand_plan()
    table = byte_table(plan, names, inits, pools, DIMS, rows=1, ctx=100)
    trace, busy = trace_table(trace_events())
    assert trace["dsv4_skinny_mm"] == [4, 60.0] and trace["memset"] == [2, 2.0] and trace["arg_reduce"] == [2, 6.0]
    # a step: 4 + 1 + (10..35: 25) + 2 + 8 + 3 = 43 us busy, twice
    assert busy == 86.0
    assert steps_in(table, trace) == 2  # 10 of the plan's 5 kernel launches
    rows = {r["class"]: r for r in join(table, trace, 2, copy_bps=1e9)}
    mm = rows["dsv4_skinny_mm"]
    # 3224 bytes in 30 us a step: 0.10747 GB/s, of a 1 GB/s copy
    assert mm["launches"] == 2 and mm["trace_launches"] == 2 and mm["bytes"] == 3224.0
    assert mm["ms"] == pytest.approx(0.030) and mm["GBs"] == pytest.approx(3224 / 30e-6 / 1e9)
    assert mm["x_copy"] == pytest.approx(3224 / 30e-6 / 1e9)
    assert rows["dsv4_attn_dsplit"]["GBs"] == pytest.approx(448 / 8e-6 / 1e9)
    # MLX's argmax has no bytes in the plan: its time, no bandwidth
    assert rows["arg_reduce"]["bytes"] == 0 and rows["arg_reduce"]["ms"] == pytest.approx(0.003)
    assert rows["arg_reduce"]["GBs"] is None and rows["arg_reduce"]["launches"] == 0
    assert next(iter(rows)) == "dsv4_skinny_mm"  # slowest first
    with pytest.raises(ValueError, match="holds 0 launches"):
        steps_in(table, {"gather": [5, 1.0]})


@pytest.mark.slow
def test_script_on_the_cpu_prints_the_byte_table(tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    cmd = [sys.executable, "bench/roofline.py", "--layers", "4", "--experts", "16", "--rows", "1,8", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "MLX_ENABLE_TF32": "0"})  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "context 4096, 1 rows:" in r.stdout and "context 4096, 8 rows:" in r.stdout
    assert "dsv4_skinny_mm" in r.stdout and "weight MB" in r.stdout
    cells = {c["rows"]: c for c in json.loads(out.read_text())["results"]}
    for rows, c in cells.items():
        cls = {x["class"]: x for x in c["classes"]}
        # one embedding row a row: 4096 bf16 = 8192 bytes; the HyperHead's fn [4, 4 x 4096] f32 + scale + base
        assert cls["dsv4_embed_streams"]["weight_bytes"] == 8192 * rows
        assert cls["dsv4_hc_head"]["weight_bytes"] == 4 * 16384 * 4 + 4 + 16
        assert sum(c["launches_by_layer"]) + c["outside_layers"] == c["total"]["launches"] > 80
        assert cls["dsv4_skinny_mm"]["ms"] == 0 and cls["dsv4_skinny_mm"]["GBs"] is None  # no trace
    # the same launches at 1 and 8 rows; more expert bytes at 8
    assert cells[1]["total"]["launches"] == cells[8]["total"]["launches"]
    assert cells[8]["total"]["weight"] > cells[1]["total"]["weight"]
    # with a trace (one step's skinny products 1 ms, a 1000 GB/s copy), found in a folder by bench/step.py's name
    # for it: the step's total against the floor
    trace = tmp_path / "trace_4096_1_graph.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "dsv4_skinny_mm_5f5bc13e2b",
                                                  "ts": 0, "dur": 1000}]}))  # fmt: skip
    cmd = [sys.executable, "bench/roofline.py", "--layers", "4", "--experts", "16", "--rows", "1", "--trace",
           str(tmp_path), "--steps", "1", "--copy-gbs", "1000", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "MLX_ENABLE_TF32": "0"})  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (c,) = json.loads(out.read_text())["results"]
    t = c["total"]
    assert t["busy_ms"] == 1.0 and t["copy_GBs"] == 1000 and t["floor_ms"] == pytest.approx(t["floor_GB"])
    mm = next(x for x in c["classes"] if x["class"] == "dsv4_skinny_mm")
    assert mm["ms"] == 1.0 and mm["GBs"] == pytest.approx(mm["bytes"] / 1e-3 / 1e9)
    assert "busy / floor" in r.stdout
