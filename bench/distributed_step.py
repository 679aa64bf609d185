"""The truncated V4-Flash decode step on 1 rank vs N ranks (expert + tensor parallel), plus the all-reduce cost.

One launch measures both arms: rank 0 first times the unsharded model alone (the others wait at a barrier),
then every rank shards the same random model (same seeds on every rank, bench/step.py's random_model) and
all time the sharded step in lockstep. The all-reduce cost is a standalone chain of the step's all_sums
(per layer: attention [B, H] in the model dtype + MoE [B, H] f32), timed alone, plus the serving plan
broadcast (one small int32 all_sum per step, service/engine/follower.py).

    mlx.launch --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 -- python bench/distributed_step.py --out $OUT/x.json
    mlx.launch -n 2 -- python bench/distributed_step.py --tiny          # CPU, ring backend, tiny dims
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.common import provenance  # noqa: E402
from bench.step import fill_state, flash_args, random_model  # noqa: E402
from model.config import ModelArgs  # noqa: E402
from model.distributed import shard_model  # noqa: E402
from model.state import StatePools  # noqa: E402
from service.engine.follower import _size  # noqa: E402


def one_step(model, pools, handles, pos: int, lead: bool) -> None:
    """What a serving rank runs: rank 0 the full step (logits), followers up to the hidden state."""
    if lead:
        model.decode(pools, handles, [7] * len(handles), [pos] * len(handles))
        return
    batch = model.make_batch(pools, handles, [pos] * len(handles))
    mx.eval(model.hidden(batch, mx.array([7] * len(handles), dtype=mx.int32), pools), pools.arrays())


def time_arm(
    model, args: ModelArgs, rows_list: list[int], ctx: int, reps: int, lead: bool, dtype: mx.Dtype
) -> dict[int, list[float]]:
    pools = StatePools(args, max_slots=max(rows_list), max_positions=ctx + 4 * reps + 16, page_size=256, dtype=dtype)
    handles = [pools.alloc(ctx + 4 * reps + 16) for _ in range(max(rows_list))]
    fill_state(pools, ctx)  # fixed keys: identical state on every rank
    out = {}
    pos = ctx
    for rows in rows_list:
        for _ in range(3):  # warm-up / compile
            one_step(model, pools, handles[:rows], pos, lead)
            pos += 1
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            one_step(model, pools, handles[:rows], pos, lead)
            ts.append(time.perf_counter() - t)
            pos += 1
        out[rows] = ts
    return out


def allreduce_chain(args: ModelArgs, rows: int, dtype, group, reps: int) -> tuple[float, float]:
    """(ms for the step's 2*L chained all_sums, ms for one plan broadcast), medians."""
    h = args.hidden_size
    x = mx.ones((rows, h), dtype)

    def chain() -> mx.array:
        y = x
        for _ in range(args.num_hidden_layers):
            y = mx.distributed.all_sum(y, group=group)  # attention partials, model dtype
            y = mx.distributed.all_sum(y.astype(mx.float32) * (1.0 / group.size()), group=group)  # MoE, f32
            y = (y * (1.0 / group.size())).astype(dtype)
        return y

    plan = mx.zeros((_size(8),), mx.int32)
    for _ in range(3):
        mx.eval(chain())
        mx.eval(mx.distributed.all_sum(plan, group=group))
    ts, tb = [], []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(chain())
        ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(plan, group=group))
        tb.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, statistics.median(tb) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backend", default="any", help="mx.distributed backend: any, ring, nccl, mpi")
    ap.add_argument("--tiny", action="store_true", help="ModelArgs.tiny() dims in f32 (CPU check)")
    ap.add_argument("--skip-single", action="store_true", help="no 1-rank arm")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "distributed_step.json"))
    opt = ap.parse_args()
    group = mx.distributed.init(backend=opt.backend)
    n, lead = group.size(), group.rank() == 0
    if opt.tiny:
        args, dtype = ModelArgs.tiny(), mx.float32
        args.max_position_embeddings = max(args.max_position_embeddings, 2 * opt.context)
    else:
        args, dtype = flash_args(opt.layers, 256), mx.bfloat16
    rows_list = [int(r) for r in opt.rows.split(",")]
    say = (lambda *a: print(*a, flush=True)) if lead else (lambda *a: None)
    t0 = time.perf_counter()
    model = random_model(args, quantize=False)  # same keys on every rank -> the same full model
    say(f"{n} rank(s), {mx.default_device()}; random model in {time.perf_counter() - t0:.1f} s")

    results = []
    single: dict[int, list[float]] = {}
    if not opt.skip_single:
        if lead:
            single = time_arm(model, args, rows_list, opt.context, opt.reps, True, dtype)
        mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # the other ranks wait here
    t0 = time.perf_counter()
    shard_model(model, group)
    gc.collect()
    mx.clear_cache()
    say(f"sharded over {n} in {time.perf_counter() - t0:.1f} s")
    sharded = time_arm(model, args, rows_list, opt.context, opt.reps, lead, dtype)
    for rows in rows_list:
        ar_ms, bc_ms = allreduce_chain(args, rows, dtype, group, opt.reps) if n > 1 else (0.0, 0.0)
        one = statistics.median(single[rows]) * 1e3 if rows in single else None
        many = statistics.median(sharded[rows]) * 1e3
        results.append({
            "layers": args.num_hidden_layers, "context": opt.context, "rows": rows, "ranks": n,
            "ms_per_step_1rank": one, "ms_per_step_nranks": many,
            "spread_ms_nranks": (max(sharded[rows]) - min(sharded[rows])) * 1e3,
            "ratio_n_to_1": many / one if one else None,
            "allreduce_ms_per_step": ar_ms, "allreduces_per_step": 2 * args.num_hidden_layers,
            "allreduce_us_each": ar_ms * 1e3 / (2 * args.num_hidden_layers), "plan_broadcast_ms": bc_ms,
        })
    if not lead:
        return
    meta = {
        "mlx": mx.__version__, "device": str(mx.default_device()), "ranks": n, "backend": opt.backend,
        "tiny": opt.tiny, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    } | provenance()
    Path(opt.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(json.dumps(meta))
    print(f"{'ctx':>6} {'rows':>4} {'1 rank ms':>10} {f'{n} ranks ms':>11} {'ratio':>6} {'allreduce ms':>13} "
          f"{'us/each':>8} {'plan bc ms':>10}")
    for r in results:
        one = f"{r['ms_per_step_1rank']:.2f}" if r["ms_per_step_1rank"] else "-"
        ratio = f"{r['ratio_n_to_1']:.2f}" if r["ratio_n_to_1"] else "-"
        print(f"{r['context']:>6} {r['rows']:>4} {one:>10} {r['ms_per_step_nranks']:>11.2f} {ratio:>6} "
              f"{r['allreduce_ms_per_step']:>13.3f} {r['allreduce_us_each']:>8.1f} {r['plan_broadcast_ms']:>10.3f}")


if __name__ == "__main__":
    main()
