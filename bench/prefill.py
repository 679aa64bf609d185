"""Parallel prefill vs token-serial decode of one prompt: time to the first token's logits, and agreement.

A truncated V4-Flash (real dims, --layers layers: sliding, CSA, HCA, CSA, ...; random bf16 weights, as
bench/step.py) or the tiny model (--tiny, f32). The same prompt goes into two slots: token by token
through the batched decode step (the fast kernels on a GPU) and in parallel chunks (model/prefill.py).
Prints the milliseconds both ways, the speed-up, max |logit diff| relative to max |logit| and whether
the argmax agrees; writes JSON.

    python bench/prefill.py [--tokens 256] [--chunk 256] [--layers 4] [--tiny] [--out prefill.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.step import flash_args, random_model  # noqa: E402
from kernels import backend  # noqa: E402
from model.loader import tiny_model  # noqa: E402
from model.state import StatePools  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill.json"))
    opt = ap.parse_args()
    if opt.tiny:
        model, args, _ = tiny_model(seed=0)
        dtype, page = mx.float32, 8
    else:
        args = flash_args(opt.layers, 256)
        model, dtype, page = random_model(args, quantize=False), mx.bfloat16, 256
    n = opt.tokens
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, args.vocab_size, n)]
    pools = StatePools(args, max_slots=3, max_positions=n + 8, page_size=page, dtype=dtype)
    warm, a, b = (pools.alloc(n + 8) for _ in range(3))
    # warm-up: the decode step's kernels and compiled segments, the prefill's ops
    model.decode(pools, [warm], [prompt[0]], [0])
    model.prefill(pools, warm, prompt[1 : 1 + min(n - 1, 64)], 1, chunk=opt.chunk)
    t = time.perf_counter()
    for i, tok in enumerate(prompt):
        la = model.decode(pools, [a], [tok], [i])[0]
    serial = time.perf_counter() - t
    t = time.perf_counter()
    lb = model.prefill(pools, b, prompt, 0, chunk=opt.chunk)
    parallel = time.perf_counter() - t
    la, lb = np.array(la), np.array(lb)
    res = {
        "model": "tiny" if opt.tiny else f"V4-Flash dims, {opt.layers} layers, bf16",
        "device": str(mx.default_device()), "kernels": backend.name(), "tokens": n, "chunk": opt.chunk,
        "serial_ms": serial * 1e3, "parallel_ms": parallel * 1e3, "speedup": serial / parallel,
        "max_abs_logit_diff": float(np.abs(la - lb).max()),
        "rel_logit_diff": float(np.abs(la - lb).max() / max(np.abs(la).max(), 1e-30)),
        "argmax_equal": bool(la.argmax() == lb.argmax()), "mlx": mx.__version__,
    }  # fmt: skip
    Path(opt.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opt.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    print(f"{res['model']}, {n} tokens: token-serial {res['serial_ms']:.1f} ms, parallel {res['parallel_ms']:.1f} ms "
          f"({res['speedup']:.1f}x); max |logit diff| {res['max_abs_logit_diff']:.3g} "
          f"(rel {res['rel_logit_diff']:.2g}), argmax equal {res['argmax_equal']}")  # fmt: skip


if __name__ == "__main__":
    main()
