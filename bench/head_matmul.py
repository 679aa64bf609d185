"""The output head's f32 matmul (V4-Flash: vocab 129,280 x hidden 4,096, f32 weights: 2.1 GB a step) at 1-8
rows, in two forms, against the bytes floor. bench/timeline.py showed it at 887 us at 8 rows (cuBLAS
sgemm_largek, split-K) against 457 us at 1 row (MLX's gemv, at the floor): `x @ W.T` (the model's form) vs
`(W @ x.T).T` (M = vocab, N = rows: cuBLAS picks a tall-skinny kernel).

    python3 bench/head_matmul.py [--rows 1,2,4,8] [--out DIR]

Prints the median ms per call of each form, its ratio to the floor and the largest relative difference
from the model's form; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.floors import copy_bandwidth  # noqa: E402
from bench.profile_step import timed  # noqa: E402

FORMS = {
    "x @ W.T": lambda x, w: x @ w.T,
    "(W @ x.T).T": lambda x, w: (w @ x.T).T,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="/tmp/out")
    opt = ap.parse_args()
    w = mx.random.normal((opt.vocab, opt.hidden)) * opt.hidden**-0.5
    mx.eval(w)
    floor_ms = w.nbytes / copy_bandwidth() * 1e3
    print(f"head {opt.vocab} x {opt.hidden} f32 ({w.nbytes / 1e9:.2f} GB): floor {floor_ms:.3f} ms")
    res = []
    for rows in (int(r) for r in opt.rows.split(",")):
        x = mx.random.normal((rows, opt.hidden))
        mx.eval(x)
        want = FORMS["x @ W.T"](x, w)
        mx.eval(want)
        for name, f in FORMS.items():
            ms = timed(lambda f=f, x=x: mx.eval(f(x, w)), opt.reps)
            got = f(x, w)
            err = float(mx.max(mx.abs(got - want)) / mx.max(mx.abs(want)))
            res.append({"rows": rows, "form": name, "ms": ms, "x_floor": ms / floor_ms, "max_rel_diff": err})
            print(f"rows {rows}  {name:12s} {ms:7.3f} ms  {ms / floor_ms:5.2f}x floor  max rel diff {err:.1e}")
    Path(opt.out).mkdir(parents=True, exist_ok=True)
    (Path(opt.out) / "head_matmul.json").write_text(json.dumps({"floor_ms": floor_ms, "results": res}, indent=1))


if __name__ == "__main__":
    main()
