"""bench/step.py's A/B arms: which fast paths a step runs, switched in one process (the compiled segments
retrace after each switch).

- `fast`: every fast path (the skinny matmul kernels, the glue kernels, the fused glue, the split mHC
  pre-mix), whatever DSV4_SKINNY / DSV4_GLUE_KERNELS / DSV4_HC_SPLIT say;
- `unfused`: `fast` with each fused op run as the fast ops it fuses, launched one by one (the two
  projections of one input, a compressor's kv and gate products, the norm before RoPE and RoPE itself,
  the MoE combine and the mHC post-mix, the mHC pre-mix and the unit's RMSNorm);
- `mlx_mm`: MLX's own matmuls for the weight products (the skinny kernels off);
- `no_glue`: the glue ops' references (norms, mHC pre- and post-mix, router top-k, MoE combine, RoPE);
- `hc_one`: `fast` with the fused mHC pre-mix one block a row (DSV4_HC_SPLIT=0);
- `graph_glue`: `fast` with the step's glue between launches as own kernels (DSV4_GRAPH_GLUE: RoPE tables,
  the window ring's write, the hashed router, the indexer's head weights, the embedding, the HyperHead); every
  other arm runs without them, whatever DSV4_GRAPH_GLUE says;
- `graph`: the step replayed as one CUDA graph (model/graph_step.py: `graph_glue`'s launches, captured once a row
  count), then the engine's greedy read-back (bench/step.py's `graph_loop`).
- `graph_dag`: `graph` with each launch waiting only for the launches it depends on (kernels/graph/deps.py), not
  for the one before it (`DSV4_GRAPH_DAG=1` in the engine).
Each arm holds the f32-multiplied weights as it reads them (bf16 as stored for the skinny kernels, f32
copies for MLX's matmuls: both kept).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

SKINNY_OPS = ("qlinear_rows", "qlinear_cat_rows", "f32_linear_rows", "f32_linear_pair_rows", "swiglu_rows",
              "experts_gate_up_rows", "experts_down_rows", "grouped_qlinear_rows")  # fmt: skip
GLUE_OPS = ("rms_norm_rows", "hc_post_rows", "router_topk", "hc_pre_rows", "moe_combine_rows", "hc_pre_norm_rows",
            "moe_combine_post_rows", "rms_rope_rows")  # fmt: skip
ARMS = ("fast", "unfused", "mlx_mm", "no_glue", "hc_one", "graph_glue", "graph", "graph_dag")
_as_held: dict[bool, list[tuple[str, mx.array]]] = {}


def _fast_ops() -> dict[str, Any]:
    import dsv4_serve.kernels.cuda.hc_fused as kh
    import dsv4_serve.kernels.cuda.matmul as km
    import dsv4_serve.kernels.cuda.norms as kn
    import dsv4_serve.kernels.cuda.rope as kp
    import dsv4_serve.kernels.cuda.router as kr

    where = {"rms_norm_rows": kn, "hc_post_rows": kn, "router_topk": kr, "hc_pre_rows": kh, "moe_combine_rows": kr,
             "hc_pre_norm_rows": kh, "moe_combine_post_rows": kr, "rms_rope_rows": kp}  # fmt: skip
    return {op: getattr(km, f"{op}_cuda") for op in SKINNY_OPS} | {op: getattr(where[op], f"{op}_cuda")
                                                                   for op in GLUE_OPS}  # fmt: skip


def _unfused() -> dict[str, Any]:
    """The fused ops as the fast ops they fuse, one launch each (the step before they were fused)."""
    import dsv4_serve.kernels.cuda.matmul as km
    import dsv4_serve.kernels.cuda.norms as kn
    import dsv4_serve.kernels.cuda.router as kr
    from dsv4_serve.kernels.hc import hc_pre_norm_composed
    from dsv4_serve.kernels.rope import rope_apply

    def pair(x: mx.array, w1: mx.array, w2: mx.array) -> tuple[mx.array, mx.array]:
        return km.f32_linear_rows_cuda(x, w1), km.f32_linear_rows_cuda(x, w2)

    def cat(x: mx.array, w1: mx.array, s1: mx.array, w2: mx.array, s2: mx.array) -> tuple[mx.array, mx.array]:
        return km.qlinear_rows_cuda(x, w1, s1), km.qlinear_rows_cuda(x, w2, s2)

    def rms_rope(x: mx.array, c: mx.array, s: mx.array, *, weight: mx.array | None = None,
                 eps: float | None = None) -> mx.array:  # fmt: skip
        if eps is not None:
            x = mx.fast.rms_norm(x, None, eps) if weight is None else kn.rms_norm_rows_cuda(x, weight, eps=eps)
        return rope_apply(x, c, s)

    def combine_post(pairs: mx.array, w: mx.array, shared: mx.array, h: mx.array, post: mx.array,
                     comb: mx.array) -> mx.array:  # fmt: skip
        return kn.hc_post_rows_cuda(kr.moe_combine_rows_cuda(pairs, w, shared, out_dtype=h.dtype), h, post, comb)

    return {"f32_linear_pair_rows": pair, "qlinear_cat_rows": cat, "rms_rope_rows": rms_rope,
            "moe_combine_post_rows": combine_post, "hc_pre_norm_rows": hc_pre_norm_composed}  # fmt: skip


def set_arm(arm: str, model: Any) -> None:
    """Register the arm's fast paths in the backend (the rest run their references) and retrace."""
    from dsv4_serve.kernels import backend
    from dsv4_serve.model.checkpoint import is_f32_compute

    if arm not in ARMS:
        raise SystemExit(f"step.py: --arms: unknown arm {arm!r}, expected some of {', '.join(ARMS)}")
    skinny = arm != "mlx_mm"
    if not _as_held:
        stored = [(n, p) for n, p in tree_flatten(model.parameters()) if is_f32_compute(n)]
        _as_held[True] = stored
        _as_held[False] = [(n, p.astype(mx.float32)) for n, p in stored]
        mx.eval([p for _, p in _as_held[False]])
    model.update(tree_unflatten(_as_held[skinny]))
    fast: dict[str, Any] = {}
    if backend.cuda_available():
        import dsv4_serve.kernels.cuda.hc_fused as kh
        from dsv4_serve.kernels.cuda import set_graph_glue

        kh.set_split(arm != "hc_one")
        set_graph_glue(arm in ("graph_glue", "graph", "graph_dag"))
        fast = _fast_ops() | (_unfused() if arm == "unfused" else {})
    for op in SKINNY_OPS + GLUE_OPS:
        if op in fast and (skinny if op in SKINNY_OPS else arm != "no_glue"):
            backend.register(op, fast[op])
        else:
            backend.unregister(op)
    model.reset_compiled()
