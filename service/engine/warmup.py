"""The engine's warm-up (`Engine.warmup`): what a start does after the weights are loaded and before /ready."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import mlx.core as mx

from dsv4_serve.model.prefill_indexer import scored
from dsv4_serve.service.engine.engine_profile import memory

log = logging.getLogger("dsv4.engine")


CACHE_MODES = ("0", "1", "watch")  # DSV4_KERNEL_CACHE: off; on (the default); on and noting while serving too


def kernel_cache_mode() -> str:
    """DSV4_KERNEL_CACHE: `1` (default) MLX's kernel cache filled after the warm-up, `watch` that and every variant
    first launched while serving logged and counted (~1-4 us of Python a launch), `0` off."""
    mode = os.environ.get("DSV4_KERNEL_CACHE", "1").strip() or "1"
    if mode not in CACHE_MODES:
        raise ValueError(f"DSV4_KERNEL_CACHE must be one of {CACHE_MODES}, got {mode!r}")
    return mode


def install_kernel_noter() -> Any:
    """On CUDA unless DSV4_KERNEL_CACHE=0, kernels/cuda/mlx_cache.py's Noter in place of `mx.fast.cuda_kernel` before
    any kernel object the engine launches is made (the objects made so far are dropped); else None."""
    from dsv4_serve.kernels import backend

    if kernel_cache_mode() == "0" or backend.name() != "cuda":
        return None
    from dsv4_serve.kernels.cuda import mlx_cache

    noter = mlx_cache.Noter()
    noter.install()
    return noter


def fill_kernel_cache(noter: Any) -> threading.Thread:
    """After the warm-up: write MLX's kernel cache entries for the variants it launched, in the background (NVRTC
    releases the GIL); the next start loads them (kernels/cuda/mlx_cache.py)."""
    from dsv4_serve.kernels.cuda import mlx_cache
    from dsv4_serve.kernels.graph import nvrtc

    noter.warmed = True  # watch: it goes on noting, a variant first launched while serving logged (a late build)
    noter.noting = kernel_cache_mode() == "watch"  # else a launch costs one Python call more, not a key's making
    info = mx.device_info()
    arch = nvrtc.arch(int(info["compute_capability_major"]), int(info["compute_capability_minor"]))

    def run() -> None:
        t0 = time.perf_counter()
        written, failed = noter.populate(mlx_cache.cache_dir(), arch)
        log.info("kernel cache: %d of %d variants written to %s in %.1f s (%d failed; MLX loads them next start)",
                 written, len(noter.variants), mlx_cache.cache_dir(), time.perf_counter() - t0, failed)  # fmt: skip

    t = threading.Thread(target=run, name="dsv4-kernel-cache", daemon=True)
    t.start()
    return t


SHORT_PROMPT = 32  # tokens of each of the warm-up's two short prompts (bench/serve.py's prompts are 32 tokens)


def warm_up(eng: Any) -> None:  # the Engine (not imported: engine.py imports this module)
    """A step at every batch size and two prefill forwards (a prompt long enough for every compressor, then two
    short ones together), so kernels and compiled segments are built before /ready says yes; then the decode
    graphs, if on. Its log line splits the time by phase."""
    t0 = time.perf_counter()
    from dsv4_serve.kernels import backend

    if backend.name() == "cuda":  # NVRTC compiles each variant once per process: do it before /ready
        from dsv4_serve.kernels.cuda import precompile_model
        from dsv4_serve.model import attention

        precompile_model(eng.args, eng.model.dtype, eng.pools.page_size,
                         inplace_compressor=attention.INPLACE_COMPRESSOR)  # fmt: skip
    phases = {"kernels": time.perf_counter() - t0}  # where a start's warm-up goes (the log line below)
    mem = {"start": memory()}  # and the memory after each phase (GB: MLX's, the device's free, its pool's)
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
    mem["steps"] = memory()
    # One prompt through the parallel prefill, long enough that every compressor emits: on a GPU,
    # MLX JIT-compiles each kernel of a path on its first use (~15 s for the tiny model's prefill
    # on a fresh H200), which would otherwise land on the first request's time to first token.
    # Its CSA picks through the indexer's scores and top-k (prefill_indexer.scored): a short context's are made on
    # the host, a long one's are not, and the first long prompt would build them.
    n = min(eng.max_model_len, 1 + max(eng.args.compress_ratios, default=0))
    if eng.parallel_prefill and eng.fits_ever(n):
        h = eng.admit(n)
        try:
            with scored():
                eng.prefill(h, [0] * n, 0)  # token 0, as the steps above
            mx.eval(eng.pools.arrays())
        finally:
            eng.release(h)
    # Then two short prompts in one forward, serving's commonest shape: a forward of at most MANY_ROWS rows runs its
    # products as 8-row slices joined by MLX (kernels/matmul.py), a path the prompt above never takes. It adds no
    # variant of our kernels (tools/warmup_variants.py); it is there for MLX's own first-use builds on that path.
    # (On an H100 the first 32-token request after /ready spent 5-6 s in prefill without it, 95f7932: cause unknown.)
    if eng.parallel_prefill and hasattr(eng, "prefill_batch") and eng.fits_ever(SHORT_PROMPT, rows=2):
        pair = [eng.admit(SHORT_PROMPT) for _ in range(2)]
        try:
            eng.prefill_batch([(h, [0] * SHORT_PROMPT, 0) for h in pair])
            mx.eval(eng.pools.arrays())
        finally:
            for h in pair:
                eng.release(h)
    phases["prefill"] = time.perf_counter() - t0 - sum(phases.values())
    mem["prefill"] = memory()
    if eng.graphs is not None:
        eng.graphs.capture()
        phases["graphs"] = time.perf_counter() - t0 - sum(phases.values())
        mem["graphs"] = memory()
    if getattr(eng, "kernel_noter", None) is not None:
        fill_kernel_cache(eng.kernel_noter)
    log.info("warm-up took %.2f s (%s; the steps by batch size: %s s, of which building them: %s s)",
             time.perf_counter() - t0, ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()),
             " ".join(f"{w:.2f}" for w in widths), " ".join(f"{b:.2f}" for b in built))  # fmt: skip
    log.info("warm-up memory, GB after each phase: %s", "; ".join(
        f"{k}: " + " ".join(f"{n} {v:.2f}" for n, v in m.items()) for k, m in mem.items()))  # fmt: skip
