"""The engine's warm-up (`Engine.warmup`): what a start does after the weights are loaded and before /ready."""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx

log = logging.getLogger("dsv4.engine")


def warm_up(eng: Any) -> None:  # the Engine (not imported: engine.py imports this module)
    """A step at every batch size and one prefill, so kernels and compiled segments are built before /ready says
    yes; then the decode graphs, if on. Its log line splits the time by phase."""
    t0 = time.perf_counter()
    from dsv4_serve.kernels import backend

    if backend.name() == "cuda":  # NVRTC compiles each variant once per process: do it before /ready
        from dsv4_serve.kernels.cuda import precompile_model
        from dsv4_serve.model import attention

        precompile_model(eng.args, eng.model.dtype, eng.pools.page_size,
                         inplace_compressor=attention.INPLACE_COMPRESSOR)  # fmt: skip
    phases = {"kernels": time.perf_counter() - t0}  # where a start's warm-up goes (the log line below)
    handles = [eng.admit(2) for _ in range(eng.max_rows)]
    widths: list[float] = []  # each batch size's first step: the first one also loads what MLX built before
    built: list[float] = []  # of which the host's build of the lazy step (tracing the compiled segments)
    try:
        # Every batch size once: the compiled layer segments are traced per batch size.
        for width in range(1, eng.max_rows + 1):
            t = time.perf_counter()
            out = eng.step([(h, 0, 0) for h in handles[:width]])
            built.append(time.perf_counter() - t)
            mx.eval(out)
            widths.append(time.perf_counter() - t)
    finally:
        for h in handles:
            eng.release(h)
    phases["steps"] = time.perf_counter() - t0 - sum(phases.values())
    # One prompt through the parallel prefill, long enough that every compressor emits: on a GPU,
    # MLX JIT-compiles each kernel of a path on its first use (~15 s for the tiny model's prefill
    # on a fresh H200), which would otherwise land on the first request's time to first token.
    n = min(eng.max_model_len, 1 + max(eng.args.compress_ratios, default=0))
    if eng.parallel_prefill and eng.fits_ever(n):
        h = eng.admit(n)
        try:
            eng.prefill(h, [0] * n, 0)  # token 0, as the steps above
            mx.eval(eng.pools.arrays())
        finally:
            eng.release(h)
    phases["prefill"] = time.perf_counter() - t0 - sum(phases.values())
    if eng.graphs is not None:
        eng.graphs.capture()
        phases["graphs"] = time.perf_counter() - t0 - sum(phases.values())
    log.info("warm-up took %.2f s (%s; the steps by batch size: %s s, of which building them: %s s)",
             time.perf_counter() - t0, ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()),
             " ".join(f"{w:.2f}" for w in widths), " ".join(f"{b:.2f}" for b in built))  # fmt: skip
