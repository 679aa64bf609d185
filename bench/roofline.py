"""The decode step's roofline by kernel class: per class the bytes it must move in one step, its GPU time and the
fraction of a plain copy's bandwidth it reaches (issue 60's first bullet).

The bytes come from the CUDA graph plan of the V4-Flash step (43 layers, mxfp8 + mxfp4 as released, `--experts N`
routed experts a layer as bench/step.py runs it): `model/graph_record.record_step` records each row count's launches
with every kernel stood in for (bench/stand_in.py: the GPU's launch list for the same shapes, on any machine, the
weights zeros) and the plan sorts each argument into weights, state, intermediates. bench/roofline_table.py's
model turns them into bytes a step at each context (its docstring: the routed experts' expected distinct experts of
B rows, the state a context reaches). Without a trace it prints that byte table and the launches a layer.

With `--trace` (a CUPTI Chrome trace of the replayed step: bench/step.py `--arms graph --profile --traces DIR`
writes DIR/trace_<ctx>_<rows>_graph.json, 4 steps each) it joins each class with its GPU time a step and prints
launches a step, bytes, ms, achieved GB/s and the fraction of the copy's bandwidth of the same run (`--step-json`:
that run's JSON, whose meta has the copy; else `--copy-gbs`), then the step's GPU busy time against the byte floor
(bench/step.py's floor_bytes over the copy). Writes JSON where `--out` says.

    python bench/roofline.py --layers 4 --experts 16 --rows 1,8                         # the byte table, any machine
    python bench/roofline.py --experts 32 --rows 1,8 --from-profile --step-json step.json  # a --profile run's times
    python3 bench/roofline.py --experts 32 --rows 1,8 --contexts 4096 --trace $OUT/traces \
        --step-json $OUT/step_graph.json --out $OUT/roofline.json                       # after the GPU run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402

from bench.common import provenance  # noqa: E402
from bench.roofline_table import (  # noqa: E402
    FIELDS,
    Dims,
    Pool,
    byte_table,
    join,
    kernel_class,
    layer_of_launches,
    steps_in,
    trace_table,
)
from bench.stand_in import stand_in_recorder  # noqa: E402

FAMILIES = ("window", "comp_kv", "comp_score", "idx_kv", "idx_score", "ckv", "ikeys")  # StatePools.arrays()' order


def pool_info(pools) -> dict[str, Pool]:  # noqa: ANN001 - model.state.StatePools
    """The plan's pool labels (model/graph_record.pool_arrays) -> what each is."""
    from dsv4_serve.model.graph_record import pool_arrays

    ratios = pools.args.compress_ratios
    what = {}
    for family in FAMILIES:
        arrays = getattr(pools, family)
        for layer, a in enumerate(arrays) if isinstance(arrays, list) else arrays.items():
            what[id(a)] = (family, ratios[layer] if layer < len(ratios) else 0)
    for family in ("comp_ws", "idx_ws"):
        for layer, a in getattr(pools, family).items():
            what[id(a)] = ("workspace", ratios[layer])
    out = {}
    for label, a in pool_arrays(pools).items():
        family, ratio = what.get(id(a), ("workspace", 0))  # the pre-mix's tickets: not per row
        slots = pools.max_slots if family != "workspace" or label.startswith(("comp_ws", "idx_ws")) else 0
        out[label] = Pool(family, ratio, slots, tuple(a.shape), a.itemsize)
    return out


def record(model, rec, rows: int, ctx: int):  # noqa: ANN001, ANN201 - (plan, names, inits, pools)
    """The plan of a step of `rows` rows over pools sized as bench/step.py sizes them for context `ctx` (the table
    widths pick kernels: the indexer's form, attention's split), its launches' input names and fills, its pools."""
    from dsv4_serve.model.graph_record import record_step
    from dsv4_serve.model.state import StatePools

    cap = ctx + 4 * 12 + 64  # bench/step.py's capacity at its default --reps
    pools = StatePools(model.args, max_slots=rows, max_positions=cap, page_size=256, dtype=model.dtype)
    handles = [pools.alloc(cap) for _ in range(rows)]
    got = record_step(model, pools, rec, handles, {r: pools.table_width(r) for r in pools.ratios})
    if isinstance(got, str):
        raise SystemExit(f"roofline.py: the step at {rows} rows cannot be planned: {got}")
    plan, launches = got[0], got[1]
    names = [ln.kernel.input_names for ln in launches]
    inits = [ln.init_value is not None for ln in launches]
    return plan, names, inits, pool_info(pools)


def profile_table(step_json: Path, arm: str, rows: int, ctx: int) -> tuple[dict[str, list[float]], float]:
    """`trace_table`'s (class -> [launches, us], busy us) for one step, from bench/step.py's JSON: the arm's CUPTI
    profile at `rows` and `ctx` (its `top` list: kernel name, launches a step, ms a step)."""
    for cell in json.loads(step_json.read_text())["results"]:
        if cell["arm"] == arm and cell["rows"] == rows and cell["context"] == ctx and "top" in cell:
            by: dict[str, list[float]] = {}
            for name, n, ms in cell["top"]:
                cls = "memcpy" if name.startswith("Memcpy") else kernel_class(name)
                c = by.setdefault(cls, [0, 0.0])
                c[0] += n
                c[1] += ms * 1e3
            return by, cell["gpu_busy_ms_per_step"] * 1e3
    raise SystemExit(f"roofline.py: {step_json} has no profile of arm {arm} at {rows} rows, context {ctx}")


def trace_path(trace: Path, ctx: int, rows: int, arm: str) -> Path:
    return trace / f"trace_{ctx}_{rows}_{arm}.json" if trace.is_dir() else trace


def print_cell(cell: dict) -> None:
    t = cell["total"]
    print(f"\ncontext {cell['context']}, {cell['rows']} rows: {t['launches']} launches, {cell['per_layer']:.1f} a "
          f"layer (most {cell['most_in_a_layer']}, {cell['outside_layers']} outside the layers), "
          f"{t['bytes'] / 1e9:.3f} GB a step (the release-precision byte floor: {t['floor_GB']:.3f} GB)")  # fmt: skip
    head = ("class", "launches", "traced", "weight MB", "state MB", "arena MB", "total MB", "ms", "GB/s", "x copy")
    print("{:28} {:>8} {:>6} {:>10} {:>9} {:>9} {:>9} {:>7} {:>7} {:>6}".format(*head))
    for r in cell["classes"]:
        ms = f"{r['ms']:7.3f}" if "busy_ms" in t else f"{'':7}"
        gbs = f"{r['GBs']:7.0f} {r['x_copy']:6.2f}" if r["GBs"] else f"{'':7} {'':6}"
        mb = [r[f"{k}_bytes"] / 1e6 for k in ("weight", "state", "arena")] + [r["bytes"] / 1e6]
        print(f"{r['class'][:28]:28} {r['launches']:>8} {r['trace_launches']:6.0f} {mb[0]:10.2f} {mb[1]:9.2f} "
              f"{mb[2]:9.3f} {mb[3]:9.2f} {ms} {gbs}")  # fmt: skip
    if "busy_ms" in t:
        print(f"step: GPU busy {t['busy_ms']:.3f} ms ({cell['steps']} steps traced), byte floor {t['floor_ms']:.3f} ms "
              f"at {t['copy_GBs']:.0f} GB/s: busy / floor {t['busy_x_floor']:.2f}; the plan's bytes in the busy "
              f"time: {t['x_copy']:.2f} of the copy")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--experts", type=int, default=32, help="routed experts a layer (as bench/step.py ran)")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--trace", type=Path, help="a CUPTI Chrome trace, or bench/step.py's --traces folder")
    ap.add_argument("--arm", default="graph", help="the arm whose traces a --trace folder holds")
    ap.add_argument("--steps", type=int, default=0, help="steps a trace holds (0: from its launches)")
    ap.add_argument("--step-json", type=Path, help="the traced run's bench/step.py JSON (its copy bandwidth)")
    ap.add_argument("--copy-gbs", type=float, default=0.0, help="the copy's GB/s (else --step-json's)")
    ap.add_argument("--from-profile", action="store_true",
                    help="no trace: each class's GPU time from --step-json's CUPTI profile of --arm (its `top` "
                    "kernels a step and busy time: bench/step.py --profile), for a run whose traces were not kept")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "roofline.json"))
    opt = ap.parse_args()
    mx.set_default_device(mx.cpu)  # the plan is the same on any device; the CPU's is the one tests/bench checks
    rec = stand_in_recorder()  # bench/stand_in.py
    from bench.step import flash_args, floor_bytes, random_model

    copy = opt.copy_gbs * 1e9
    if opt.from_profile and not opt.step_json:
        raise SystemExit("roofline.py: --from-profile needs --step-json")
    if (opt.trace or opt.from_profile) and not copy:
        if not opt.step_json:
            raise SystemExit("roofline.py: --trace needs the run's copy bandwidth: --step-json or --copy-gbs")
        copy = json.loads(opt.step_json.read_text())["meta"]["copy_bw_GBs"] * 1e9
    args = flash_args(opt.layers, opt.experts)
    t0 = time.perf_counter()
    model = random_model(args)
    print(f"model: {opt.layers} layers, {opt.experts} experts (zeros, kernels stood in for), "
          f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    contexts = [int(c) for c in opt.contexts.split(",")]
    dims, cells = Dims.of(args), []
    for rows in (int(r) for r in opt.rows.split(",")):
        for ctx in contexts:
            plan, names, inits, pools = record(model, rec, rows, ctx)
            layers = layer_of_launches(plan)
            per = [layers.count(i) for i in range(opt.layers)]
            table = byte_table(plan, names, inits, pools, dims, rows, ctx)
            total = {"launches": len(plan.launches), **{f: sum(t[f] for t in table.values()) for f in FIELDS}}
            total["bytes"] = sum(total[f] for f in FIELDS)
            cell = {"rows": rows, "context": ctx, "per_layer": len(plan.launches) / opt.layers,
                    "most_in_a_layer": max(per), "outside_layers": layers.count(-1), "launches_by_layer": per,
                    "total": total}  # fmt: skip
            wb, sb = floor_bytes(model, rows, ctx)
            total["floor_GB"] = (wb + sb) / 1e9
            trace, steps = {}, 1
            if opt.from_profile:
                trace, busy = profile_table(opt.step_json, opt.arm, rows, ctx)
                total |= {"busy_ms": busy / 1e3, "copy_GBs": copy / 1e9, "floor_ms": (wb + sb) / copy * 1e3}
                total["busy_x_floor"] = total["busy_ms"] / total["floor_ms"]
                total["x_copy"] = total["bytes"] / (total["busy_ms"] / 1e3) / copy
            elif opt.trace:
                path = trace_path(opt.trace, ctx, rows, opt.arm)
                if not path.is_file():
                    raise SystemExit(f"roofline.py: no trace {path} (bench/step.py --arms {opt.arm} --traces)")
                events = json.loads(path.read_text()).get("traceEvents", [])
                trace, busy = trace_table(events)
                steps = opt.steps or steps_in(table, trace)
                total |= {"busy_ms": busy / steps / 1e3, "copy_GBs": copy / 1e9, "floor_ms": (wb + sb) / copy * 1e3}
                total["busy_x_floor"] = total["busy_ms"] / total["floor_ms"]
                total["x_copy"] = total["bytes"] / (total["busy_ms"] / 1e3) / copy
            cell |= {"steps": steps, "classes": join(table, trace, steps, copy or 1.0)}
            cells.append(cell)
            print_cell(cell)
    meta = {
        "mlx": mx.__version__,
        "layers": opt.layers,
        "experts": opt.experts,
        "copy_bw_GBs": copy / 1e9 or None,
        "trace": str(opt.trace) if opt.trace else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    } | provenance()
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": cells}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
