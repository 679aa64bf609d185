"""One fast-path case in a loop, for a GPU profiler (nsys / ncu): where its time per call goes.

Runs an op case (`--case op:rows:ctx`, as bench/kernels.py builds it) or the 43-layer chain
(`--chain43`) as a compiled chain of dependent calls, `--reps` evals after a warm-up, and prints the
wall time per call. Under `nsys profile -t cuda` the kernel summary then gives each kernel's time per
call beside it (bench/gpu_profile.sh runs every case that way).

    python bench/profile_kernels.py --case indexer_rows:8:131072 [--reps 20] [--chain 10] [--eager]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.cases import chain43, make_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="indexer_rows:8:131072")
    ap.add_argument("--chain43", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain", type=int, default=10)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--link", default="depends", help="chain43's layer link: depends | after (bench/cases.chain43)")
    ap.add_argument("--drop", default="", help="chain43's drop set, e.g. pair or icomp+indexer (bench/cases.chain43)")
    opt = ap.parse_args()
    if opt.chain43:
        ch = chain43(8, 8192, link=opt.link, drop=frozenset(filter(None, opt.drop.split("+"))))
        run, per, name = (ch.fast if opt.eager else ch.fast_c), 1, "chain43:8:8192"
    else:
        op, rows, ctx = opt.case.rsplit(":", 2)  # op may carry ":128"
        case = make_case(op, int(rows), int(ctx))
        run, per, name = case.chain(case.fast, opt.chain, compiled=not opt.eager), opt.chain, opt.case
    for _ in range(3):
        mx.eval(run())
    mx.synchronize()
    ts = []
    for _ in range(opt.reps):
        t = time.perf_counter()
        mx.eval(run())
        ts.append((time.perf_counter() - t) * 1e6 / per)
    print(json.dumps({"case": name, "compiled": not opt.eager, "calls_per_eval": per, "reps": opt.reps,
                      "warmup_evals": 3, "median_us_per_call": round(statistics.median(ts), 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
