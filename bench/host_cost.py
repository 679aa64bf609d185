"""Where a chained call's wall time goes: host graph building vs GPU (run once per MLX env setting).

`mx.async_eval` runs every node's `eval_gpu` (argument marshalling, CUDA-graph node, commits) on the
calling thread and returns before the GPU is done, so its time is the host's share; the wait after
it is what the GPU still had to do. Prints one JSON line per case with both, per call.

Cases: trivial kernels chained 100 deep (1 input; 16 inputs; a 24 KB source) to price one node,
the op cases of bench/cases.py in a compiled chain, and chain43. Env knobs MLX reads once at start
(MLX_MAX_MB_PER_BUFFER, MLX_MAX_OPS_PER_BUFFER, MLX_USE_CUDA_GRAPHS) are set by the caller
(bench/gpu_host_cost.sh runs every setting in its own process).

    python bench/host_cost.py [--reps 20] [--cases indexer_rows:8:131072,...] [--no-chain43]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench import cases  # noqa: E402
from bench.cases import add_link_argument, chain43, make_case  # noqa: E402
from kernels.cuda import attention as at  # noqa: E402
from kernels.cuda import indexer as ix  # noqa: E402

ONE_MAX, WIDE_HG = ix.ONE_MAX, at.WIDE_HG

ENV = ("MLX_MAX_MB_PER_BUFFER", "MLX_MAX_OPS_PER_BUFFER", "MLX_USE_CUDA_GRAPHS", "DSV4_CUDA_COMPILE")


def split(run: Callable[[], Any], reps: int, per: int) -> dict[str, float]:
    for _ in range(3):
        mx.eval(run())
    mx.synchronize()
    host, total = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6 / per)
        total.append((t2 - t0) * 1e6 / per)
    return {"host_us": round(statistics.median(host), 2), "total_us": round(statistics.median(total), 2)}


def trivial(n_inputs: int, pad: int, depth: int = 100, compiled: bool = True) -> Callable[[], Any]:
    """`depth` dependent launches of a 1-block kernel with `n_inputs` inputs and `pad` bytes of source."""
    names = [f"in{i}" for i in range(n_inputs)]
    src = "/*" + "x" * pad + "*/\n" if pad else ""
    src += "int i = threadIdx.x; out[i] = in0[i] + 1.0f;"
    k = mx.fast.cuda_kernel(name=f"triv_{n_inputs}_{pad}", input_names=names, output_names=["out"], source=src)
    xs = [mx.zeros((32,)) for _ in range(n_inputs)]
    mx.eval(xs)

    def chain() -> Any:
        x = xs[0]
        for _ in range(depth):
            x = k(inputs=[x] + xs[1:], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                  threadgroup=(32, 1, 1))[0]  # fmt: skip
        return x

    return mx.compile(chain) if compiled else chain


def node_kinds(depth: int = 100) -> dict[str, Callable[[], Any]]:
    """`depth` dependent nodes of one kind, not compiled (mx.compile would fuse the adds): a custom
    kernel, MLX's own add (one kernel launch, no source hash or JIT-module lookup) and a reshape (a
    node with no launch). kernel - add is what `mx.fast.cuda_kernel` adds to a node; add - reshape is
    a kernel launch in a CUDA graph; reshape is MLX's per-node cost with no GPU work at all: what a
    C++ primitive that fused several launches into one node could save, at most, per node removed."""
    x0 = mx.zeros((32,))
    mx.eval(x0)

    def add() -> Any:
        x = x0
        for _ in range(depth):
            x = x + 1.0
        return x

    def reshape() -> Any:
        x = x0 + 1.0
        for i in range(depth):
            x = x.reshape((4, 8) if i % 2 == 0 else (32,))
        return x

    return {"kernel": trivial(1, 0, depth, compiled=False), "add": add, "reshape": reshape}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain", type=int, default=10)
    ap.add_argument("--cases", default="compressor_rows:8:8192,indexer_rows:8:8192,indexer_rows:8:131072,"
                    "sparse_attention_rows:8:8192,sparse_attention_rows:8:131072,indexer_rows:8:1048576")  # fmt: skip
    ap.add_argument("--no-chain43", action="store_true")
    add_link_argument(ap)
    ap.add_argument("--chain43-variants", default="",
                    help="link:drop,... e.g. depends:,after:,after:icomp+indexer (bench/cases.chain43)")
    ap.add_argument("--node-kinds", action="store_true", help="price a node: custom kernel, MLX add, reshape")
    ap.add_argument("--indexer-paths", action="store_true",
                    help="indexer cases per path: one launch (ONE_MAX raised), segment + merge (ONE_MAX 0)")
    ap.add_argument("--dsplit-chunks", type=int, default=None,
                    help="attention rows of up to this many 64-key chunks take `dsplit` (kernels/cuda/attention.py; "
                    "0: every row takes split-K + combine)")
    ap.add_argument("--wide-threads", type=int, default=None, help="threads per `wide` attention block (256, 512)")
    ap.add_argument("--ws-ab", action="store_true",
                    help="indexer and compressor cases with and without their workspace (bench.cases.CASE_WS)")
    ap.add_argument("--wide-heads", default="", help="attention cases once per heads-per-wide-block, e.g. 64,32")
    opt = ap.parse_args()
    env = {k: os.environ[k] for k in ENV if k in os.environ}
    if opt.dsplit_chunks is not None:
        at.DSPLIT_CHUNKS = opt.dsplit_chunks
        env["DSPLIT_CHUNKS"] = str(opt.dsplit_chunks)

    if opt.wide_threads is not None:
        at.WIDE_THREADS = opt.wide_threads
        env["WIDE_THREADS"] = str(opt.wide_threads)

    def emit(name: str, r: dict[str, float]) -> None:
        print(json.dumps({"case": name, "env": env} | r), flush=True)

    if opt.node_kinds:
        for name, fn in node_kinds().items():
            emit(f"node:{name}", split(fn, opt.reps, 100))
    for n_in, pad in ((1, 0), (16, 0), (1, 24000)):
        emit(f"trivial:inputs={n_in}:pad={pad}", split(trivial(n_in, pad), opt.reps, 100))
    for spec in filter(None, opt.cases.split(",")):
        op, rows, ctx = spec.rsplit(":", 2)  # op may carry ":128" (bench.cases.make_case)
        paths: list[tuple[str, Any]] = [("", None)]
        if op == "indexer_rows" and opt.indexer_paths:
            paths = [(":one", ("ONE_MAX", 1 << 40)), (":segment", ("ONE_MAX", 0))]
        if op == "sparse_attention_rows" and opt.wide_heads:
            paths = [(f":wide{h}", ("WIDE_HG", int(h))) for h in opt.wide_heads.split(",")]
        if opt.ws_ab and op.split(":")[0] in ("indexer_rows", "compressor_rows"):
            paths = [(":ws", ("CASE_WS", True)), (":nows", ("CASE_WS", False))]
        for tag, setting in paths:
            if setting and setting[0] == "CASE_WS":
                cases.CASE_WS = setting[1]
            elif setting:  # a module setting read when a launch plan is made (part of its key)
                setattr(at if setting[0] == "WIDE_HG" else ix, *setting)
            case = make_case(op, int(rows), int(ctx), link=opt.link)
            emit(spec + tag, split(case.chain(case.fast, opt.chain, compiled=True), opt.reps, opt.chain))
            del case
        ix.ONE_MAX, at.WIDE_HG, cases.CASE_WS = ONE_MAX, WIDE_HG, True
    if not opt.no_chain43:
        ch = chain43(8, 8192)
        emit("chain43:8:8192", split(ch.fast_c, opt.reps, 1))
        del ch
    if opt.chain43_variants:
        for spec in opt.chain43_variants.split(","):
            link, drop = spec.split(":")
            ch = chain43(8, 8192, link=link, drop=frozenset(filter(None, drop.split("+"))))
            emit(f"chain43:8:8192:{spec}", split(ch.fast_c, opt.reps, 1))
            del ch


if __name__ == "__main__":
    main()
