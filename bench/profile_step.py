"""Where a decode step's time goes, on a truncated V4-Flash (real dims, random bf16 weights): the whole
step, the step without the head, the head, and per layer the compiled segments, the kernel part and the
MoE alone. Each piece timed with its own eval (so each carries one eval floor, printed too).

    python bench/profile_step.py [--rows 1] [--context 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # as the server runs (service/__main__.py)

import mlx.core as mx  # noqa: E402

from bench.step import fill_state, flash_args, random_model  # noqa: E402
from model.layers import hc_pre, rope_angles  # noqa: E402
from model.state import StatePools  # noqa: E402


def timed(fn, reps: int = 20) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    opt = ap.parse_args()
    args = flash_args(4)
    model = random_model(args, mx.bfloat16, None)
    pools = StatePools(args, max_slots=opt.rows, max_positions=opt.context + 64, page_size=256, dtype=mx.bfloat16)
    hs = [pools.alloc(opt.context + 64) for _ in range(opt.rows)]
    fill_state(pools, hs, opt.context)
    b = opt.rows
    tok = mx.array([7] * b, dtype=mx.int32)
    batch = model.make_batch(pools, hs, [opt.context] * b)
    eval_floor = timed(lambda: mx.eval(mx.zeros((1,)) + 1))
    print(f"eval floor {eval_floor:.3f} ms")
    print(f"decode() {timed(lambda: model.decode(pools, hs, [7] * b, [opt.context] * b)):.3f} ms")
    print(f"step {timed(lambda: mx.eval(model.step(batch, tok, pools), pools.arrays())):.3f} ms")
    print(f"hidden (no head) {timed(lambda: mx.eval(model.hidden(batch, tok, pools), pools.arrays())):.3f} ms")
    y = model.hidden(batch, tok, pools)
    mx.eval(y, pools.arrays())
    print(f"head f32 {timed(lambda: mx.eval(y.astype(mx.float32) @ model.head.weight.astype(mx.float32).T)):.3f} ms")
    print(f"head bf16 {timed(lambda: mx.eval(y @ model.head.weight.T)):.3f} ms")
    h = mx.random.normal((b, args.hc_mult, args.hidden_size)).astype(mx.bfloat16)
    mx.eval(h)
    for i, blk in enumerate(model.layers):
        before, after = blk._segments()
        fr = model._freqs[args.layer_ratio(i) != 0]
        angles = rope_angles(fr, batch.positions, args.layer_ratio(i), args)
        post, comb, *proj = before(h, *angles)
        mx.eval(post, comb, proj)
        o = blk.attn.attend(tuple(proj), batch, pools)
        mx.eval(o, pools.arrays())
        x = hc_pre(h, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale, args)[0]
        mx.eval(x)
        t_b = timed(lambda: mx.eval(before(h, *angles)))  # noqa: B023
        t_k = timed(lambda: mx.eval(blk.attn.attend(tuple(proj), batch, pools), pools.arrays()))  # noqa: B023
        t_a = timed(lambda: mx.eval(after(o, h, post, comb, proj[2], proj[3], tok)))  # noqa: B023
        t_m = timed(lambda: mx.eval(blk.ffn(x, tok)))  # noqa: B023
        t_o = timed(lambda: mx.eval(blk.attn.output(o, proj[2], proj[3], h.dtype)))  # noqa: B023
        print(f"layer {i} ratio {args.layer_ratio(i):>3}: before {t_b:.3f}  kernels {t_k:.3f}  after {t_a:.3f}"
              f"  (moe {t_m:.3f}, attn out {t_o:.3f}) ms")


if __name__ == "__main__":
    main()
