"""Picks each op's implementation: a registered fast path (CUDA) or the plain-MLX reference.

The reference is always there (and is what CI and a Mac run). A fast module — `kernels/cuda/`
— registers its versions by op name:

    from dsv4_serve.kernels import backend
    backend.register("sparse_attention_rows", my_fast_fn)

and is imported lazily the first time the CUDA path is considered, so importing `kernels` never
compiles anything. The package (`kernels/__init__.py`) names that module through `set_fast_loader`:
the fast module imports the references and this module, so this module never imports it back.
`DSV4_KERNELS` selects: unset / `auto` (CUDA when available), `reference`
(force the plain twin), `cuda` (demand the fast path; an error where there is none).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

OPS = ("compressor_rows", "compressor_rows_inplace", "compressor_pair_rows_inplace", "indexer_rows",
       "sparse_attention_rows", "hc_pre_mix", "qlinear_rows", "qlinear_cat_rows", "f32_linear_rows",
       "f32_linear_pair_rows", "swiglu_rows", "experts_gate_up_rows", "experts_down_rows", "grouped_qlinear_rows",
       "rms_norm_rows",
       "hc_post_rows", "router_topk", "hc_pre_rows", "moe_combine_rows", "moe_combine_post_rows",
       "rms_rope_rows", "hc_pre_norm_rows", "prefill_attention", "grouped_experts", "dequantize_mxfp8",
       "indexer_scores", "rope_step_tables", "rms_rope_ring_rows", "router_hash", "index_weights_rows",
       "embed_streams", "hc_head_rows", "write_rows", "write_slots")
ENV = "DSV4_KERNELS"

_fast: dict[str, Callable[..., Any]] = {}
_loaded = False
_loader: Callable[[], Any] | None = None


def register(op: str, fn: Callable[..., Any]) -> None:
    """Register a fast implementation of `op` (same signature and checks as the reference)."""
    if op not in OPS:
        raise ValueError(f"backend: op: unknown op {op!r}, expected one of {OPS}")
    _fast[op] = fn


def unregister(op: str) -> None:
    """Drop `op`'s fast implementation (bench A/B arms); the reference runs again."""
    _fast.pop(op, None)


def registered() -> dict[str, Callable[..., Any]]:
    return dict(_fast)


def cuda_available() -> bool:
    """An MLX CUDA build whose default device is the GPU."""
    cuda = getattr(mx, "cuda", None)
    try:
        ok = bool(cuda is not None and cuda.is_available())
    except Exception:  # an older or odd build: treat as no CUDA
        return False
    return ok and mx.default_device().type == mx.gpu


# MLX commits its CUDA graph once it holds more than this many nodes (MLX_MAX_OPS_PER_BUFFER; 100 on sm_90).
# Picked on the full-depth step (43 layers, 4K, bench/step.py, H200, 383f696, 2026-12-02): 1 / 8 rows
# 25.3 / 38.5 ms at 8 against 24.0 / 36.4 ms at 100. (8 had won on the 43-layer chain of the row-batched ops
# alone, 2.7 -> 2.2 ms, d2d17d9: the full step has ~40 nodes a layer, enough to keep the GPU fed.) Pinned
# so an MLX release that changes its default does not change ours. MLX reads it when it builds its first
# command encoder (the first GPU eval), so `kernels` sets it on import; a value already in the environment wins.
CUDA_COMMIT_OPS = 100


def tune_cuda_commits() -> None:
    """Set MLX's CUDA-graph commit size (CUDA builds only: Metal reads the same variable)."""
    if cuda_available():
        os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", str(CUDA_COMMIT_OPS))


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "reference", "cuda"):
        raise ValueError(f"backend: {ENV}: must be auto, reference or cuda, got {mode!r}")
    return mode


def set_fast_loader(load: Callable[[], Any]) -> None:
    """`load()` imports the fast module (its import registers the fast ops); called once, when first needed."""
    global _loader
    _loader = load


def _load_fast() -> None:
    """Run the fast loader once. An absent fast module = no fast ops."""
    global _loaded
    if _loaded or _loader is None:
        return
    _loaded = True
    try:
        _loader()
    except ModuleNotFoundError as e:
        if e.name not in ("kernels.cuda",):
            raise


def _use_fast() -> bool:
    mode = _mode()
    if mode == "reference":
        return False
    if not cuda_available():
        if mode == "cuda":
            raise ValueError(f"backend: {ENV}: cuda was asked for but MLX has no CUDA GPU as default device")
        return False
    _load_fast()
    if mode == "cuda" and not _fast:
        raise ValueError(f"backend: {ENV}: cuda was asked for but no fast op is registered")
    return bool(_fast)


def name() -> str:
    """`"cuda"` when the fast path is in use (on a CUDA device, not forced off), else `"reference"`."""
    return "cuda" if _use_fast() else "reference"


def pick(op: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    """The implementation of `op` for the current device and env: fast if registered, else `reference`."""
    if _use_fast():
        return _fast.get(op, reference)
    return reference
