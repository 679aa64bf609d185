"""Build a GPU server's kernel caches on any machine (no GPU): the decode graphs' cubins and MLX's kernel cache.

A cold graph server spends most of its start building kernels with NVRTC: on an H100 (2026-12-07, 557134d, 43
layers, graphs for 1..8 rows) 429 s of warm-up, of which 250 s for the graphs' 193 translation units and most of the
rest MLX building our `mx.fast.cuda_kernel`s on first use. NVRTC needs no GPU, and what it builds depends only on
the kernels' sources and the shapes baked into them: the model's dims and routed experts, `--max-rows`,
`--max-model-len` and the page size (the state pools' tables and windows), not the layer count or the state budget.
So the server's warm-up runs here on a model of the config's first `--layers` layers (every layer kind: two window
layers, CSA, HCA) with CUDA faked (tools/warmup_variants.py: the kernels stood in for, zero weights), the kernel
noter (kernels/cuda/mlx_cache.py) keeps every variant MLX would build, and the graphs' recorder records one step at
each row count as `GraphStep.capture` does; then NVRTC builds both sets into the directories a server reads:
`--graph-cache-dir` (kernels/graph/cubin_cache.py: keyed by the unit, the architecture and NVRTC's version, so a
server whose NVRTC differs rebuilds) and MLX's cache (`MLX_PTX_CACHE_DIR`: keyed by MLX's generated source). An
entry nobody asks for is never loaded, and one that differs from what the server builds has another key: at worst
the server builds as before.

    python tools/prebuild_caches.py --experts 32 [--max-rows 8] [--max-model-len N] [--arch sm_90a]
        [--graph-cache-dir DIR] [--mlx-cache-dir DIR] [--no-graphs] [--workers N]

The server must then run with the same model flags, `--max-rows`, `--max-model-len` and page size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402


def fake_cuda_with_graphs(graphs: bool) -> tuple[object, object]:
    """The server's kernel factories over stand-in kernels: the noter over them, the graphs' recorder over the
    noter (as `Engine` installs them), the fast ops and, with graphs, the glue kernels; CUDA as the kernels' Python
    sees it. (noter, recorder)."""
    from bench.stand_in import stand_in, stand_in_recorder
    from dsv4_serve.kernels import backend
    from dsv4_serve.kernels.cuda import mlx_cache, set_graph_glue
    from tools.warmup_variants import _NotCpu

    noter = mlx_cache.Noter()
    noter.install(stand_in)
    rec = stand_in_recorder(noter.factory)  # over the noter: a recorded launch is noted too, as on the server
    backend.cuda_available = lambda: True
    mx.default_device = lambda: _NotCpu()  # Python's callers only: the model takes a GPU's dtypes
    set_graph_glue(graphs)
    return noter, rec


def graph_units(eng: object, rec: object) -> dict[str, str]:
    """Each row count's recorded step, as `GraphStep.capture` records it: translation unit -> kernel entry name."""
    from dsv4_serve.kernels.graph.codegen import entry, launch_unit
    from dsv4_serve.model.graph_record import record_step

    pools = eng.pools  # type: ignore[attr-defined]
    widths = {r: pools.table_width(r) for r in pools.ratios}
    handles = [eng.admit(2) for _ in range(eng.max_rows)]  # type: ignore[attr-defined]
    units: dict[str, str] = {}
    try:
        for n in range(len(handles), 0, -1):
            got = record_step(eng.model, pools, rec, handles[:n], widths)  # type: ignore[attr-defined]
            if isinstance(got, str):
                print(f"rows {n}: not recorded: {got}", flush=True)
                continue
            for ln in got[1]:
                units[launch_unit(ln)] = entry(ln.kernel)
    finally:
        for h in handles:
            eng.release(h)  # type: ignore[attr-defined]
    return units


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flash", help="a dummy config name (model/dummy.py presets)")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--layers", type=int, default=4, help="the config's first layers: V4-Flash's 4 hold every kind")
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--arch", default="sm_90a", help="NVRTC's target (H100 / H200: sm_90a)")
    ap.add_argument("--graph-cache-dir", type=Path, default=None, help="default: the server's (cubin_cache)")
    ap.add_argument("--mlx-cache-dir", type=Path, default=None, help="default: MLX_PTX_CACHE_DIR's")
    ap.add_argument("--no-graphs", action="store_true", help="a server with --decode-graphs off: MLX's cache only")
    ap.add_argument("--workers", type=int, default=None, help="NVRTC threads (default: a thread a core)")
    opt = ap.parse_args()
    os.environ["DSV4_KERNEL_CACHE"] = "0"  # the Engine must not install a second noter
    noter, rec = fake_cuda_with_graphs(not opt.no_graphs)
    from dsv4_serve.kernels.cuda import mlx_cache
    from dsv4_serve.kernels.graph import cubin_cache, nvrtc
    from dsv4_serve.service.engine.build import build_engine

    t0 = time.perf_counter()
    eng, _ = build_engine(opt.model, load_format="dummy", experts=opt.experts, layers=opt.layers,
                          max_rows=opt.max_rows, max_model_len=opt.max_model_len, state_budget_bytes=1 << 30,
                          prefix_cache_bytes=0)  # fmt: skip
    eng.warmup()
    units = {} if opt.no_graphs else graph_units(eng, rec)
    print(f"the warm-up and recording ({opt.layers} layers) in {time.perf_counter() - t0:.1f} s: "
          f"{len(noter.variants)} MLX kernel variants, {len(units)} graph translation units", flush=True)  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    if units:
        cache = cubin_cache.CubinCache(opt.graph_cache_dir or cubin_cache.default_dir())
        todo = {src: name for src, name in units.items() if not cache.has(src, name, opt.arch)}
        built = nvrtc.compile_many(todo, opt.arch, opt.workers)
        for src, name in todo.items():
            cache.get(src, name, opt.arch, lambda src=src: built[src])
        print(f"graph cubins: {len(todo)} built, {len(units) - len(todo)} there already, in {cache.dir} "
              f"({time.perf_counter() - t1:.1f} s; NVRTC {cubin_cache.nvrtc_version()})", flush=True)  # fmt: skip
    t2 = time.perf_counter()
    where = opt.mlx_cache_dir or mlx_cache.cache_dir()
    written, failed = noter.populate(where, opt.arch, opt.workers or os.cpu_count())  # type: ignore[attr-defined]
    print(f"MLX's kernel cache: {written} written, {failed} failed, in {where} ({time.perf_counter() - t2:.1f} s)")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
