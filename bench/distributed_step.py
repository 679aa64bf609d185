"""The full model's decode step and prefill on 1 device vs N (expert + tensor parallel), through the serving
engines (rank 0 a LeaderEngine, the others `follow()`), plus the all-reduce cost.

Full depth by default: V4-Flash, 43 layers, all 256 routed experts, release precision (mxfp8 dense +
mxfp4 experts), random weights built on each rank for its own shard (model/dummy.py: no 154 GB file).
Arms, in one launch:
- `1 device`: rank 0 alone (the others wait at a barrier) serves the model with its routed experts cut
  to `--single-experts` (default E / N: the same expert bytes a device as the sharded arm); freed after.
- `N devices`: every rank builds its shard of the full model and they serve in lockstep.
Each arm: decode at rows 1/2/4/8 at `--context` (random state laid down on every rank alike), synced (each
step read back before the next, as the leader's first token) and pipelined (step N + 1 queued with step N's
tokens on the device, the worker's loop); then the parallel prefill of one `--prefill`-token prompt
(Engine.prefill + the step that carries it in its plan). The all-reduce cost: the step's 2 all_sums a
layer chained alone, and one plan broadcast. The per-device byte floor: the weights a step reads on one
device (its dense shard + the expected distinct experts of B rows that are its own) and the state read,
over a copy's bandwidth measured in the same run.

    mlx.launch --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 -- python bench/distributed_step.py --out $OUT/x.json
    mlx.launch -n 2 -- python bench/distributed_step.py --preset tiny --context 64 --prefill 32   # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on shared hosts (device README)
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # as the server runs (service/__main__.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.common import copy_bandwidth, provenance  # noqa: E402
from dsv4_serve.model.config import ModelArgs  # noqa: E402
from dsv4_serve.model.dummy import cut, dummy_model, resolve_args  # noqa: E402
from dsv4_serve.model.state import StatePools  # noqa: E402
from dsv4_serve.service.engine.engine import Engine  # noqa: E402
from dsv4_serve.service.engine.follower import LeaderEngine, follow, plan_size  # noqa: E402

PAGE = 256


def fill_state(pools: StatePools) -> None:
    """Random window rings, compressed entries and compressor windows: fixed keys, the same on every rank."""
    for i, a in enumerate(pools.window):
        pools.window[i] = (0.5 * mx.random.normal(a.shape, key=mx.random.key(i + 2))).astype(a.dtype)
    for d, base in ((pools.ckv, 7), (pools.ikeys, 50), (pools.comp_kv, 99), (pools.comp_score, 150),
                    (pools.idx_kv, 200), (pools.idx_score, 250)):  # fmt: skip
        for layer, a in d.items():
            d[layer] = mx.random.normal(a.shape, key=mx.random.key(layer + base)).astype(a.dtype)
    mx.eval(pools.arrays())


def floor_bytes(model, ranks: int, rows: int, ctx: int) -> tuple[float, float]:
    """(weight bytes, state bytes) one step must read on one device: its dense shard whole, of its routed
    experts those the B rows pick (expected distinct experts E(1 - (1 - k/E)^B), 1/ranks of them its own),
    the state of every row (replicated: K = V is one head every rank reads)."""
    a = model.args
    dense = expert = 0
    for name, p in tree_flatten(model.parameters()):
        if ".ffn.experts." in name:
            expert += p.nbytes
        elif name not in ("embed.weight",):
            dense += p.nbytes
    dense += rows * a.hidden_size * model.embed.weight.dtype.size  # the embedding rows read
    e, k = a.n_routed_experts, a.num_experts_per_tok
    weights = dense + expert * (1 - (1 - k / e) ** rows)  # local experts: the same fraction of them
    state = 0
    for r in a.compress_ratios:
        n = min(ctx + 1, a.sliding_window)
        if r == 4:
            n += min(a.index_topk, ctx // 4)
            state += rows * (ctx // 4) * a.index_head_dim * 2
        elif r == 128:
            n += ctx // 128
        state += rows * n * a.head_dim * 2
    return weights, state


def lead(engine: Engine, rows_list: list[int], ctx: int, prompt: int, reps: int, bw: float, ranks: int) -> list[dict]:
    """Rank 0's measurements through its engine (a LeaderEngine: the followers replay every step)."""
    handles = [engine.admit(ctx + 4 * reps + 16) for _ in range(max(rows_list))]
    fill_state(engine.pools)
    out = []
    for rows in rows_list:
        hs, pos = handles[:rows], ctx
        for _ in range(3):  # warm-up / compile
            engine.step([(h, 7, pos) for h in hs]).tolist()
            pos += 1
        sync = []
        for _ in range(reps):
            t = time.perf_counter()
            engine.step([(h, 7, pos) for h in hs]).tolist()
            sync.append(time.perf_counter() - t)
            pos += 1
        pipe, tok = [], mx.argmax(engine.step([(h, 7, pos) for h in hs]), axis=-1).astype(mx.int32)
        t = time.perf_counter()
        for _ in range(reps):
            pos += 1
            nxt = mx.argmax(engine.step([(h, None, pos) for h in hs], tokens=tok), axis=-1).astype(mx.int32)
            tok.tolist()  # step N read back after step N + 1 was queued
            now = time.perf_counter()
            pipe.append(now - t)
            t, tok = now, nxt
        tok.tolist()
        pos += 1
        wb, sb = floor_bytes(engine.model, ranks, rows, ctx)
        floor = (wb + sb) / bw
        ms_s, ms_p = statistics.median(sync) * 1e3, statistics.median(pipe) * 1e3
        out.append({"kind": "decode", "rows": rows, "context": ctx, "ms_per_step_synced": ms_s,
                    "ms_per_step_pipelined": ms_p, "tokens_per_s_pipelined": rows * 1e3 / ms_p,
                    "spread_ms_pipelined": (max(pipe) - min(pipe)) * 1e3, "floor_ms": floor * 1e3,
                    "weight_bytes_per_device": wb, "state_bytes": sb, "x_floor_pipelined": ms_p / (floor * 1e3)})
    for h in handles:
        engine.release(h)
    if prompt:
        ts = []
        for _ in range(3):
            h = engine.admit(prompt + 2)
            t = time.perf_counter()
            engine.prefill(h, [(5 * j + 3) % 1000 + 2 for j in range(prompt)], 0)
            engine.step([(h, 7, prompt)]).tolist()  # the step whose plan carries the prefill
            ts.append(time.perf_counter() - t)
            engine.release(h)
        med = statistics.median(ts[1:])
        out.append({"kind": "prefill", "prompt_tokens": prompt, "seconds": med, "tokens_per_s": prompt / med,
                    "first_s": ts[0]})
    return out


def allreduce_chain(args: ModelArgs, rows: int, dtype, group, reps: int, prefill_cap: int) -> tuple[float, float]:
    """(ms for the step's 2 * L chained all_sums, ms for one plan broadcast), medians."""
    x = mx.ones((rows, args.hidden_size), dtype)

    def chain() -> mx.array:
        y = x
        for _ in range(args.num_hidden_layers):
            y = mx.distributed.all_sum(y, group=group)  # attention partials, model dtype
            y = mx.distributed.all_sum(y.astype(mx.float32) * (1.0 / group.size()), group=group)  # MoE, f32
            y = (y * (1.0 / group.size())).astype(dtype)
        return y

    plan = mx.zeros((plan_size(8, prefill_cap),), mx.int32)
    ts, tb = [], []
    for i in range(reps + 3):
        t = time.perf_counter()
        mx.eval(chain())
        t1 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(plan, group=group))
        if i >= 3:
            ts.append(t1 - t)
            tb.append(time.perf_counter() - t1)
    return statistics.median(ts) * 1e3, statistics.median(tb) * 1e3


def serve_arm(args: ModelArgs, group, opt, bw: float, max_len: int) -> list[dict] | None:
    """Build this rank's model, serve the measurements (rank 0) or follow them; free the model after."""
    n = 1 if group is None else group.size()
    t0 = time.perf_counter()
    model = dummy_model(args, quantize=not opt.dequantize, group=group)
    built = time.perf_counter() - t0
    kw = {"max_rows": max(opt.rows_list), "max_model_len": max_len}
    try:
        if group is not None and group.rank() > 0:
            follow(Engine(model, **kw), group, prefill_cap=opt.prefill_cap)
            return None
        engine = LeaderEngine(model, group, prefill_cap=opt.prefill_cap, **kw) if n > 1 else Engine(model, **kw)
        res = lead(engine, opt.rows_list, opt.context, opt.prefill, opt.reps, bw, n)
        if n > 1:
            engine.close()
        for r in res:
            r |= {"devices": n, "routed_experts": args.n_routed_experts, "build_s": built,
                  "resident_gib": mx.get_active_memory() / 2**30}
        return res
    finally:
        del model
        gc.collect()
        mx.clear_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash", help="flash, pro, tiny or a config.json")
    ap.add_argument("--layers", type=int, default=None, help="default: the config's (43 for flash)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts of the N-device arm (default all)")
    ap.add_argument("--single-experts", type=int, default=None,
                    help="routed experts of the 1-device arm (default experts / N; 0: no such arm)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill (0: none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dequantize", action="store_true", help="model-dtype weights instead of mxfp8 / mxfp4")
    ap.add_argument("--backend", default="any", help="mx.distributed backend: any, ring, nccl, mpi")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "distributed_step.json"))
    opt = ap.parse_args()
    opt.rows_list = [int(r) for r in opt.rows.split(",")]
    opt.prefill_cap = max(opt.prefill, 1)  # the whole prompt in one plan, as one chunk
    group = mx.distributed.init(backend=opt.backend)
    n, is_lead = group.size(), group.rank() == 0
    say = (lambda *a: print(*a, flush=True)) if is_lead else (lambda *a: None)
    args = resolve_args(opt.preset, experts=opt.experts, layers=opt.layers)
    args.max_position_embeddings = max(args.max_position_embeddings, 2 * (opt.context + opt.prefill))
    max_len = max(opt.context + 4 * opt.reps + 16, opt.prefill + 2)
    bw = copy_bandwidth(1 << 31 if mx.default_device() != mx.cpu else 1 << 26)
    results = []
    single = args.n_routed_experts // n if opt.single_experts is None else opt.single_experts
    if n > 1 and single:
        if is_lead:
            say(f"1 device: {args.num_hidden_layers} layers, {single} routed experts")
            results += serve_arm(cut(args, experts=single), None, opt, bw, max_len) or []
        mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # the other ranks wait here
    say(f"{n} device(s): {args.num_hidden_layers} layers, {args.n_routed_experts} routed experts")
    results += serve_arm(args, group if n > 1 else None, opt, bw, max_len) or []
    ar = {rows: allreduce_chain(args, rows, mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32,
                                group, opt.reps, opt.prefill_cap) for rows in opt.rows_list} if n > 1 else {}
    for r in results:
        if r["kind"] == "decode" and r["devices"] > 1:
            r["allreduce_ms_per_step"], r["plan_broadcast_ms"] = ar[r["rows"]]
    if not is_lead:
        return
    meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "ranks": n, "backend": opt.backend,
            "preset": opt.preset, "layers": args.num_hidden_layers, "quantized": not opt.dequantize,
            "copy_bw_GBs": bw / 1e9, "date": time.strftime("%Y-%m-%d %H:%M:%S")} | provenance()
    Path(opt.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(json.dumps(meta))
    print(f"{'dev':>3} {'experts':>7} {'rows':>4} {'sync ms':>8} {'pipe ms':>8} {'tok/s':>7} {'floor ms':>8} "
          f"{'x floor':>7} {'allreduce ms':>12} {'plan ms':>7}")
    for r in results:
        if r["kind"] == "decode":
            print(f"{r['devices']:>3} {r['routed_experts']:>7} {r['rows']:>4} {r['ms_per_step_synced']:>8.2f} "
                  f"{r['ms_per_step_pipelined']:>8.2f} {r['tokens_per_s_pipelined']:>7.1f} {r['floor_ms']:>8.3f} "
                  f"{r['x_floor_pipelined']:>7.1f} {r.get('allreduce_ms_per_step', 0):>12.3f} "
                  f"{r.get('plan_broadcast_ms', 0):>7.3f}")
        else:
            print(f"{r['devices']:>3} {r['routed_experts']:>7} prefill {r['prompt_tokens']} tokens: "
                  f"{r['seconds'] * 1e3:.1f} ms ({r['tokens_per_s']:.0f} tokens/s; first {r['first_s']:.2f} s)")


if __name__ == "__main__":
    main()
