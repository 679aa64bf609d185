"""The CUDA graph plan of the decode step, on any machine: its launches, buffers by kind, the static arena, the
staging bytes, whether one graph per row count replays every step, and the gaps (arguments made by MLX ops
between launches: each needs an own kernel before the step can be captured).

The CUDA path runs with each kernel stood in for (a launch returns zero buffers of its output shapes: the
launch list, grids and argument sizes are the GPU's for the same shapes and dtypes), MLX's compile off so every
launch is seen, and `kernels.graph.record.Recorder` keeping them.

    python tools/graph_plan.py [--tiny] [--glue] [--layers 4] [--experts 8] [--rows 1,8] [--json out.json] [--gaps 12]
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from dsv4_serve.model.graph_record import named_arrays, pool_arrays  # noqa: E402
from tools.build_profile import _stand_in, zero_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the built-in tiny model (bf16) instead of V4-Flash's dims")
    ap.add_argument("--layers", type=int, default=4, help="V4-Flash layers (sliding, sliding, CSA, HCA, ...)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--gaps", type=int, default=12, help="gaps to list (by argument)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--glue", action="store_true", help="the step's glue as own kernels (DSV4_GRAPH_GLUE=1)")
    ap.add_argument("--emit", type=Path, help="write each distinct kernel's translation unit (kernels.graph.codegen) "
                    "here, for nvcc")  # fmt: skip
    opt = ap.parse_args()

    from dsv4_serve.kernels.graph.codegen import translation_unit
    from dsv4_serve.kernels.graph.plan import gaps, same_launches
    from dsv4_serve.kernels.graph.record import Recorder, hold, moved

    rec = Recorder(_stand_in)
    rec.install()
    import dsv4_serve.kernels.cuda  # noqa: F401  (registers the fast ops, their kernels through the recorder)
    from dsv4_serve.kernels import backend
    from dsv4_serve.kernels.cuda import set_graph_glue

    if opt.glue:
        set_graph_glue(True)

    backend._use_fast = lambda: True
    mx.disable_compile()  # every launch seen: no traced segment hides them
    from dsv4_serve.model.state import StatePools

    if opt.tiny:
        from dsv4_serve.model.tiny import tiny_model

        model, args, _ = tiny_model(seed=0)
        model.set_dtype(mx.bfloat16)  # the fast path's dtype (f32 attention runs the reference)
    else:
        zero_weights()
        from bench.step import flash_args, random_model

        args = flash_args(opt.layers, opt.experts)
        model = random_model(args)
    report: dict[str, object] = {"layers": args.num_hidden_layers}
    for rows in [int(r) for r in opt.rows.split(",")]:
        plans = []
        for ctx in (300, 700):  # two steps at other positions and contexts: one graph must replay both
            pools = StatePools(args, max_slots=rows, max_positions=1024, page_size=64, dtype=model.dtype)
            handles = [pools.alloc(1024) for _ in range(rows)]
            batch = model.make_batch(pools, handles, [ctx + 37 * i for i in range(rows)])
            tokens = mx.array([5 + i for i in range(rows)], dtype=mx.int32)
            mx.eval(pools.arrays(), batch.positions)
            held = hold(pool_arrays(pools))
            rec.launches.clear()
            rec.recording = True
            logits = model.step(batch, tokens, pools)
            rec.recording = False
            mx.eval(logits, pools.arrays())
            rewritten = moved(held, pool_arrays(pools))
            if opt.emit:
                opt.emit.mkdir(parents=True, exist_ok=True)
                for ln in rec.launches:
                    src = translation_unit(ln.kernel, ln.template, ln.inputs, [o.dtype for o in ln.outputs])
                    (opt.emit / f"{ln.kernel.name}_{zlib.crc32(src.encode()):08x}.cu").write_text(src)
            del held
            plans.append(rec.plan(rows, named_arrays(model, pools, batch, tokens), rewritten))
        p = plans[0]
        found = gaps(p)
        kinds = {k: p.count(k) for k in ("weight", "pool", "const", "step", "arena", "gap")}
        by_kernel = Counter(ln.kernel.rsplit("_", 1)[0] for ln in p.launches)
        row = {"rows": rows, "launches": len(p.launches), "dropped": p.dropped,
               "launches_a_layer": len(p.launches) / args.num_hidden_layers,
               "buffers": kinds, "arena_bytes": p.arena_bytes, "staging_bytes": p.staging_bytes,
               "one_graph": not same_launches(*plans), "differs": same_launches(*plans), "gaps": len(found),
               "gap_args": Counter(g.split(":")[0] for g in found).most_common(opt.gaps),
               "kernels": by_kernel.most_common()}  # fmt: skip
        report[f"rows{rows}"] = row
        print(f"rows {rows}: {row['launches']} launches ({row['launches_a_layer']:.1f} a layer; {p.dropped} unread "
              f"left out), buffers {kinds}, "
              f"arena {p.arena_bytes / 2**20:.2f} MiB, staging {p.staging_bytes} B, one graph for every step: "
              f"{row['one_graph']}{' ' + row['differs'][0] if row['differs'] else ''}")  # fmt: skip
        print(f"  gaps {len(found)} (arguments an MLX op made), by argument:")
        for name, n in row["gap_args"]:
            print(f"    {n:4d}  {name}")
    if opt.json:
        opt.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
