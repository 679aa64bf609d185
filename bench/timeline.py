"""GPU and CUDA-API timeline of chained fast-path calls, 1 row vs 8 rows: where an 8-row call's extra wall
time goes when its kernels take the same GPU time (ncu: the compressor 5.6 vs 5.7 us). The device machine has
no Nsight Systems; this uses CUPTI through torch.profiler (the device's python3 holds PyTorch), which sees
every CUDA call and kernel of the process, MLX's included.

    python3 bench/timeline.py [--cases compressor_rows:1:8192,compressor_rows:8:8192] [--evals 5] [--out DIR]
    python3 bench/timeline.py --cases chain43 --step 1,8   # chain43; the 4-layer V4-Flash step (bench/step.py), 4K

Per case: the wall time per call (compiled chain of 10, as bench/kernels.py), then per eval the CUDA API
calls by name (count, total us), the GPU activities by kind (kernels, memsets, memcpys: count, busy us),
the span from the eval's first GPU activity to its last, and the idle gaps inside it. Writes the Chrome
traces and a JSON summary under --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.cases import chain43, make_case  # noqa: E402

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def summarize(trace: dict[str, Any], evals: int) -> dict[str, Any]:
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    api: collections.Counter = collections.Counter()
    api_us: collections.Counter = collections.Counter()
    gpu: collections.Counter = collections.Counter()
    gpu_us: collections.Counter = collections.Counter()
    names: collections.Counter = collections.Counter()
    spans = []
    for e in ev:
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            api[e["name"]] += 1
            api_us[e["name"]] += e.get("dur", 0)
        elif cat in GPU_CATS:
            gpu[cat] += 1
            gpu_us[cat] += e.get("dur", 0)
            names[(cat, e["name"][:60])] += 1
            spans.append((e["ts"], e["ts"] + e.get("dur", 0)))
    spans.sort()
    gaps, end = [], spans[0][1] if spans else 0.0
    for a, b in spans[1:]:  # idle time: starts after every earlier activity ended (they may overlap)
        if a > end:
            gaps.append(a - end)
        end = max(end, b)
    big = sorted(gaps, reverse=True)[: 3 * evals]
    return {
        "api_per_eval": {k: [round(api[k] / evals, 1), round(api_us[k] / evals, 1)] for k, _ in api_us.most_common()},
        "gpu_per_eval": {k: [round(gpu[k] / evals, 1), round(gpu_us[k] / evals, 1)] for k in gpu},
        "gpu_names": [[c, n, round(k / evals, 1)] for (c, n), k in names.most_common(12)],
        "gpu_first_to_last_us": round((spans[-1][1] - spans[0][0]) if spans else 0.0, 1),
        "gap_us_per_eval": round(sum(gaps) / evals, 1),
        "gap_median_us": round(statistics.median(gaps), 2) if gaps else 0.0,
        "largest_gaps_us": [round(g, 1) for g in big],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="compressor_rows:1:8192,compressor_rows:8:8192")
    ap.add_argument("--chain", type=int, default=10)
    ap.add_argument("--evals", type=int, default=5)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--step", default="", help="rows, e.g. 1,8: also the 4-layer decode step of bench/step.py at 4K")
    opt = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile  # the device's python3; not a project dependency

    out = Path(opt.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}

    def record(name: str, fn: Any, per: int) -> None:
        """fn(): one eval. Wall per call (20 evals / per), then a profiled run of opt.evals evals."""
        for _ in range(5):
            fn()
        mx.synchronize()
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6 / per)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(opt.evals):
                fn()
            mx.synchronize()
        path = out / f"timeline_{name.replace(':', '_')}.json"
        prof.export_chrome_trace(str(path))
        s = summarize(json.loads(path.read_text()), opt.evals)
        s["wall_us_per_call"] = round(statistics.median(ts), 1)
        result[name] = s
        print(f"== {name}: {s['wall_us_per_call']} us a call ({per} calls an eval)")
        for k, v in s.items():
            if k != "wall_us_per_call":
                print(f"   {k}: {v}")

    if opt.step:
        from bench.step import fill_state, flash_args, random_model
        from model.state import StatePools

        args = flash_args(4, 256)
        model = random_model(args, quantize=False)
        rows = [int(r) for r in opt.step.split(",")]
        pools = StatePools(args, max_slots=max(rows), max_positions=4096 + 200, page_size=256, dtype=mx.bfloat16)
        handles = [pools.alloc(4096 + 200) for _ in range(max(rows))]
        fill_state(pools, 4096)
        for r in rows:
            pos = [4096]

            def one_step(r: int = r, pos: list[int] = pos) -> None:  # decode() evaluates the step
                model.decode(pools, handles[:r], [7] * r, [pos[0]] * r)
                pos[0] += 1

            record(f"step:{r}:4096", one_step, 1)
        del pools, handles, model
    for spec in filter(None, opt.cases.split(",")):
        if spec == "chain43":  # the 43-layer emulation of the three ops, 8 rows, 8K, compiled (one eval a step)
            ch = chain43(8, 8192)
            record(spec, lambda ch=ch: mx.eval(ch.fast_c()), 1)
            continue
        op, rows, ctx = spec.rsplit(":", 2)
        case = make_case(op, int(rows), int(ctx))
        run = case.chain(case.fast, opt.chain, compiled=True)
        record(spec, lambda run=run: mx.eval(run()), opt.chain)
    (out / "timeline.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
