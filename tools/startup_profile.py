"""Where a start's warm-up goes, and what MLX's kernel cache holds before and after it.

Builds the engine as `serve --load-format dummy --model flash` does, then runs its warm-up (`Engine.warmup`:
our kernels' precompile, a step at each batch size, a prefill, the decode graphs when `--graphs on`) under
cProfile, and prints the warm-up's log line, the functions that held the time (cumulative), and the listing of
`MLX_PTX_CACHE_DIR` before and after (files, bytes, files by suffix). Run it twice in a row on one machine
(`PART=startup`): if the second run's first step still takes as long and the cache did not grow, MLX does not
load those kernels from its cache (docs/cuda_graphs.md#start-up). With `DSV4_KERNEL_CACHE=1` the first run also
writes MLX's cache entries for our kernels (kernels/cuda/mlx_cache.py; waited for here), which the second loads.

    MLX_PTX_CACHE_DIR=/tmp/ptxcache python tools/startup_profile.py [--layers 43] [--experts 32] [--graphs off]
        [--top 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import provenance  # noqa: E402


def listing(path: str | None) -> dict[str, object]:
    """A cache directory's files: count, bytes, count by suffix."""
    if not path or not Path(path).is_dir():
        return {"dir": path, "files": 0, "bytes": 0, "by_suffix": {}}
    files = [p for p in Path(path).iterdir() if p.is_file()]
    return {"dir": path, "files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "by_suffix": dict(Counter(p.suffix or "-" for p in files))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flash")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--graphs", choices=("off", "on"), default="off")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from dsv4_serve.kernels.cuda.mlx_cache import cache_dir
    from dsv4_serve.service.engine.build import build_engine

    cache = str(cache_dir())  # MLX_PTX_CACHE_DIR, else MLX's default
    before = listing(cache)
    t0 = time.perf_counter()
    eng, _ = build_engine(args.model, load_format="dummy", experts=args.experts, layers=args.layers,
                          decode_graphs=args.graphs)  # fmt: skip
    built = time.perf_counter() - t0
    prof = cProfile.Profile()
    t1 = time.perf_counter()
    prof.enable()
    eng.warmup()
    prof.disable()
    warm = time.perf_counter() - t1
    filling = [t for t in threading.enumerate() if t.name == "dsv4-kernel-cache"]  # DSV4_KERNEL_CACHE=1: let it end
    for t in filling:
        t.join()
    filled = time.perf_counter() - t1 - warm
    after = listing(cache)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())
    fill = f", MLX's kernel cache filled {filled:.1f} s after it" if filling else ""
    print(f"engine built in {built:.1f} s, warm-up {warm:.1f} s{fill}")
    print(f"MLX_PTX_CACHE_DIR before: {before}\nMLX_PTX_CACHE_DIR after:  {after}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": provenance(), "built_s": built, "warmup_s": warm,
                                               "cache_before": before, "cache_after": after}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
