"""Where a graph server's device memory goes, without a server (CUDA only): V4-Flash's dummy weights at release
precision, then each step that moves them, with MLX's active / cached bytes, the device's free bytes and its
memory pool's reserved / used bytes (service/engine/engine_profile.py `memory`) after each:

1. loaded; 2. every weight's address read through DLPack (MLX moves each into managed memory,
kernels/graph/runtime.py); 3. MLX's cache cleared and the pool trimmed (`release_pool`); 4. the managed weights
prefetched to the GPU; 5. a cuda.core allocation (which raises the pool's release threshold), then trimmed.

    python tools/memory_probe.py --experts 32 [--layers 43]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from dsv4_serve.model.dummy import dummy_model, resolve_args  # noqa: E402
from dsv4_serve.service.engine.engine_profile import memory  # noqa: E402


def show(what: str) -> None:
    print(f"{what:<34}" + " ".join(f"{k} {v:6.2f}" for k, v in memory().items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--layers", type=int, default=None)
    opt = p.parse_args()
    from dsv4_serve.kernels.graph.runtime import Runtime, mlx_address

    show("start (GB)")
    model = dummy_model(resolve_args("flash", experts=opt.experts, layers=opt.layers))
    mx.synchronize()
    show("weights loaded")
    weights = [a for _, a in tree_flatten(model.parameters())]
    for a in weights:
        mlx_address(a)
    mx.synchronize()
    show(f"{len(weights)} weights exported")
    rt = Runtime()
    mx.clear_cache()
    rt.release_pool()
    show("cache cleared, pool trimmed")
    rt.prefetch(weights)
    show("weights prefetched")
    rt.allocate(64 << 20)
    show("cuda.core allocated 64 MB")


if __name__ == "__main__":
    main()
