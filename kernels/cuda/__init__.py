"""CUDA fast path of the row-batched ops and the mHC pre-mix (`mx.fast.cuda_kernel`), registered on import.

`kernels.backend` imports this package lazily when MLX's default device is a CUDA GPU (and
`DSV4_KERNELS` is not `reference`). Each fast op has the reference's signature, runs the same
row-contract checks before launching, and falls back to the reference for dtypes or shapes its
kernels do not cover:
- compressor_rows: every float dtype (1 kernel + 1 scatter into the page pool; + 2 slot-pool
  scatters when the slot pools are large); compressor_rows_inplace (what the model runs): 1 kernel
  that writes the slot and page pools in place and returns a token for their readers;
  compressor_pair_rows_inplace: a CSA layer's main and indexer compressors in that 1 kernel's launch;
- indexer_rows: q / keys bf16 or f16, 16/32/64/128 heads, dim a multiple of 16 up to 256, topk <= 2048
  (1 kernel up to 8,192 entries of row capacity, else segment + merge);
- sparse_attention_rows: q / window / pool of one 16-bit dtype, heads multiple of 16, D multiple
  of 32 (1 kernel up to 3 chunks of 64 keys per row, else wide or partial + combine). float32 (the
  tiny test model) runs the reference for these two;
- hc_pre_mix: f32 mixing logits, nc <= 8, 1 kernel (`DSV4_HC_KERNEL=0` keeps the plain-MLX Sinkhorn:
  ~200 graph nodes per layer instead of ~14);
- grouped_experts (prefill's routed experts past 8 rows): bf16 x, H and I multiples of 128, 2 kernels
  (gate + up with SwiGLU, down) over 64-pair tiles of one expert, else the plain `tiles` form;
- rms_norm_rows / hc_post_rows / router_topk / hc_pre_rows / moe_combine_rows: 1 kernel each instead of 3
  (~7 for the router), on unless `DSV4_GLUE_KERNELS=0`.

NVRTC compiles each kernel variant (dtype, dims, page size, ratio, topk) the first time it runs,
about 1.5 s each: call `precompile(...)` (or `precompile_model(args, dtype, page_size)`) at
start-up, before the server says it is ready.

Host cost per call: each op validates the row contract once per RowBatch object and argument
shapes (`kernels.rows.checked`; every layer of a step shares the batch) and keeps its launch
parameters per shape (`common.plan_cached`), so a call after the first is a tuple, a dict lookup
and its kernel launches.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels import backend, upload
from dsv4_serve.kernels import matmul as kmatmul
from dsv4_serve.kernels.compressor import CompressorArgs
from dsv4_serve.kernels.compressor import new_workspace as new_comp_workspace
from dsv4_serve.kernels.cuda import hc_fused
from dsv4_serve.kernels.cuda.attention import sparse_attention_rows_cuda
from dsv4_serve.kernels.cuda.compressor import compressor_rows_cuda
from dsv4_serve.kernels.cuda.compressor_inplace import compressor_rows_inplace_cuda
from dsv4_serve.kernels.cuda.compressor_pair import compressor_pair_rows_inplace_cuda
from dsv4_serve.kernels.cuda.dequant import dequantize_mxfp8_cuda
from dsv4_serve.kernels.cuda.experts_grouped import grouped_experts_cuda
from dsv4_serve.kernels.cuda.glue import (
    embed_streams_cuda,
    hc_head_rows_cuda,
    index_weights_rows_cuda,
    router_hash_cuda,
)
from dsv4_serve.kernels.cuda.glue_rope import rms_rope_ring_rows_cuda, rope_step_tables_cuda
from dsv4_serve.kernels.cuda.hc import hc_pre_mix_cuda
from dsv4_serve.kernels.cuda.hc_fused import hc_pre_norm_rows_cuda, hc_pre_rows_cuda
from dsv4_serve.kernels.cuda.indexer import indexer_rows_cuda
from dsv4_serve.kernels.cuda.matmul import (
    experts_down_rows_cuda,
    experts_gate_up_rows_cuda,
    f32_linear_pair_rows_cuda,
    f32_linear_rows_cuda,
    grouped_qlinear_rows_cuda,
    qlinear_cat_rows_cuda,
    qlinear_rows_cuda,
    swiglu_rows_cuda,
)
from dsv4_serve.kernels.cuda.norms import hc_post_rows_cuda, rms_norm_rows_cuda
from dsv4_serve.kernels.cuda.pool_rows import write_rows_cuda, write_slots_cuda
from dsv4_serve.kernels.cuda.prefill_attention import prefill_attention_cuda
from dsv4_serve.kernels.cuda.rope import rms_rope_rows_cuda
from dsv4_serve.kernels.cuda.router import moe_combine_post_rows_cuda, moe_combine_rows_cuda, router_topk_cuda
from dsv4_serve.kernels.cuda.tiles_mm import indexer_scores_cuda
from dsv4_serve.kernels.indexer import new_workspace
from dsv4_serve.kernels.rows import Row, RowBatch

__all__ = [
    "compressor_pair_rows_inplace_cuda",
    "compressor_rows_cuda",
    "dequantize_mxfp8_cuda",
    "grouped_experts_cuda",
    "compressor_rows_inplace_cuda",
    "hc_post_rows_cuda",
    "indexer_scores_cuda",
    "hc_pre_mix_cuda",
    "hc_pre_rows_cuda",
    "indexer_rows_cuda",
    "moe_combine_rows_cuda",
    "precompile",
    "prefill_attention_cuda",
    "precompile_model",
    "rms_norm_rows_cuda",
    "router_topk_cuda",
    "sparse_attention_rows_cuda",
]


def _on(env: str) -> bool:
    """A fast path's switch: on unless the variable is 0."""
    return os.environ.get(env, "1").strip() != "0"


backend.register("compressor_rows", compressor_rows_cuda)
backend.register("compressor_rows_inplace", compressor_rows_inplace_cuda)
backend.register("compressor_pair_rows_inplace", compressor_pair_rows_inplace_cuda)
backend.register("indexer_rows", indexer_rows_cuda)
backend.register("sparse_attention_rows", sparse_attention_rows_cuda)
# State pools' rows written in place (kernels/pool_rows.py): no copy of a whole pool a prefill chunk
backend.register("write_rows", write_rows_cuda)
backend.register("write_slots", write_slots_cuda)  # a slot of many per-slot pools in one launch
# Prefill's attention on CUDA (kernels/cuda/prefill_attention.py: `HEADS`, or with DSV4_PREFILL_ATTN=dsplit each
# query a row of decode's kernel). On unless DSV4_PREFILL_ATTN=0 (the plain masked f32 ops, ATTN_BLOCK queries at a
# time).
PREFILL_ATTN = _on("DSV4_PREFILL_ATTN")
if PREFILL_ATTN:
    backend.register("prefill_attention", prefill_attention_cuda)
# Prefill's routed experts as grouped GEMMs on the mxfp4 weights (kernels/cuda/experts_grouped.py), in place of
# the plain `tiles` form's dequantized copy + gather_mm. On unless DSV4_GROUPED_MMA=0.
GROUPED_MMA = _on("DSV4_GROUPED_MMA")
if GROUPED_MMA:
    backend.register("grouped_experts", grouped_experts_cuda)
# Prefill's indexer scores as one tile GEMM that sums the heads in its epilogue (kernels/cuda/tiles_mm.py PAIR
# 3) instead of the [queries, heads, entries] f32 products and three MLX ops. On unless DSV4_INDEXER_SCORES=0.
INDEXER_SCORES = _on("DSV4_INDEXER_SCORES")
if INDEXER_SCORES:
    backend.register("indexer_scores", indexer_scores_cuda)
# Prefill's dequantized copy of each mxfp8 weight in one vectorized pass (kernels/cuda/dequant.py) in place of
# MLX's fp_dequantize (~0.7 TB/s on the H200). On unless DSV4_DEQUANT_KERNEL=0.
DEQUANT_KERNEL = _on("DSV4_DEQUANT_KERNEL")
if DEQUANT_KERNEL:
    backend.register("dequantize_mxfp8", dequantize_mxfp8_cuda)
# Two projections of one input in one skinny launch (kernels/cuda/matmul.py PAIR 3: wq_a + wkv, the two wq_b of
# a CSA layer: 64 launches a step fewer). On unless DSV4_SKINNY_CAT=0 (each product its own launch): its gpu test
# and the layer numerics passed on the H200 (PART=fused, 5d133be, 2026-12-02).
SKINNY_CAT = _on("DSV4_SKINNY_CAT")
# Skinny matmuls for 1..8 rows (kernels.matmul.SKINNY; DSV4_SKINNY=0: MLX's own quantized / f32 matmuls)
if kmatmul.SKINNY:
    backend.register("qlinear_rows", qlinear_rows_cuda)
    if SKINNY_CAT:
        backend.register("qlinear_cat_rows", qlinear_cat_rows_cuda)
    backend.register("f32_linear_rows", f32_linear_rows_cuda)
    backend.register("f32_linear_pair_rows", f32_linear_pair_rows_cuda)
    backend.register("swiglu_rows", swiglu_rows_cuda)
    backend.register("experts_gate_up_rows", experts_gate_up_rows_cuda)
    backend.register("experts_down_rows", experts_down_rows_cuda)
    backend.register("grouped_qlinear_rows", grouped_qlinear_rows_cuda)  # wo_a as released (mxfp8)
# The mHC pre-mix kernel: on unless DSV4_HC_KERNEL=0 (it halves the 4-layer step on the H200,
# bench/step.py at 645720a, 2026-11-29; the plain path stays for A/B runs).
HC_KERNEL = _on("DSV4_HC_KERNEL")
if HC_KERNEL:
    backend.register("hc_pre_mix", hc_pre_mix_cuda)
# The glue kernels, 1 launch each where the reference launches 3 or more: the norms and the mHC post-mix
# (kernels/cuda/norms.py; 6 norms and 2 post-mixes a layer), the router's top-k and the MoE's combine
# (kernels/cuda/router.py) and the mHC pre-mix with its input RMS and logits (kernels/cuda/hc_fused.py).
# On unless DSV4_GLUE_KERNELS=0: the full-depth step at 4K, 43 layers, 1 / 8 rows, 27.2 / 35.8 ms with them
# against 35.9 / 79.9 without (bench/step.py arms fast / no_glue, H200, 383f696, 2026-12-02).
GLUE_KERNELS = _on("DSV4_GLUE_KERNELS")
# The fused pre-mix spread over hc_fused.SPLITS blocks a row (1 block a row reads all 1.5 MB of fn: 76 us a
# launch). On unless DSV4_HC_SPLIT=0: the full-depth step's GPU busy time at 4K, 1 / 8 rows, 16.1 / 21.2 ms
# with one block a row against 10.8 / 16.1 ms split (bench/step.py arms fast / hc_split, H200, 74386e5,
# 2026-12-02); tests/kernels/test_cuda_hc.py passed whole there.
HC_SPLIT = _on("DSV4_HC_SPLIT")
if HC_SPLIT:
    hc_fused.set_split(True)
if GLUE_KERNELS:
    backend.register("rms_norm_rows", rms_norm_rows_cuda)
    backend.register("hc_post_rows", hc_post_rows_cuda)
    backend.register("router_topk", router_topk_cuda)
    backend.register("hc_pre_rows", hc_pre_rows_cuda)
    backend.register("hc_pre_norm_rows", hc_pre_norm_rows_cuda)
    backend.register("moe_combine_rows", moe_combine_rows_cuda)
    backend.register("moe_combine_post_rows", moe_combine_post_rows_cuda)
    backend.register("rms_rope_rows", rms_rope_rows_cuda)
# The step's remaining MLX glue between launches as own kernels (kernels/cuda/glue.py, glue_rope.py: the RoPE
# tables of the step's positions, the window ring's write inside the kv's norm + RoPE, the hashed router, the
# indexer's head weights, the embedding as the mHC streams, the HyperHead's collapse), so that a step is launches
# only and can be captured as a CUDA graph (docs/cuda_graphs.md). Off unless DSV4_GRAPH_GLUE=1 until its gpu
# tests (tests/kernels/test_cuda_glue.py) have run and the step has been timed with it on the H200.
GRAPH_GLUE = os.environ.get("DSV4_GRAPH_GLUE", "0").strip() not in ("0", "")
_GLUE_OPS = {"rope_step_tables": rope_step_tables_cuda, "rms_rope_ring_rows": rms_rope_ring_rows_cuda,
             "router_hash": router_hash_cuda, "index_weights_rows": index_weights_rows_cuda,
             "embed_streams": embed_streams_cuda, "hc_head_rows": hc_head_rows_cuda}  # fmt: skip


def set_graph_glue(on: bool) -> None:
    """Register (or drop) the glue kernels: DSV4_GRAPH_GLUE at import; tools/graph_plan.py --glue, tests."""
    global GRAPH_GLUE
    GRAPH_GLUE = on
    for op, fn in _GLUE_OPS.items():
        backend.register(op, fn) if on else backend.unregister(op)


set_graph_glue(GRAPH_GLUE)

def _batch(page_size: int, ratios: Iterable[int]) -> RowBatch:
    # position 511: emits for ratio 4 and 128, 128 ratio-4 entries, 4 ratio-128 entries
    tables = {r: tuple(range(1, 1 + max(1, -(-(512 // r) // page_size)))) for r in ratios}
    return RowBatch.build([Row(0, 511, 0, tables)], page_size)


def precompile(
    *,
    dtype: mx.Dtype,
    page_size: int,
    n_heads: int,
    head_dim: int,
    rope_dim: int,
    index_heads: int,
    index_dim: int,
    topk: int,
    window: int = 128,
    ratios: Iterable[int] = (4, 128),
    slots: int = 1,
    inplace_compressor: bool = True,
) -> int:
    """Compile (and run once) every kernel variant the model uses; returns the number of op calls.

    `slots`: the size of the slot pools; the compressor copies small slot pools whole and
    scatters into large ones (`compressor.FULL_BYTES`), two kernel variants. `inplace_compressor`:
    the in-place compressor's variants (what the model runs), else the functional one's
    (DSV4_INPLACE_COMPRESSOR=0)."""
    ratios = tuple(sorted(set(r for r in ratios if r)))
    upload.warm()
    batch = _batch(page_size, ratios or (4,))
    calls: list[Any] = []
    half = rope_dim // 2
    cos = mx.ones((1, half), mx.float32)
    pages = {r: len(batch.rows[0].tables[r]) + 1 for r in batch.rows[0].tables}
    comp = [(r, head_dim) for r in ratios] + ([(4, index_dim)] if 4 in ratios else [])
    made: dict[tuple[int, int], CompressorArgs] = {}
    for ratio, d in comp:
        coff = 2 if ratio == 4 else 1
        pool = mx.zeros((pages[ratio], page_size, d), dtype)
        st = mx.zeros((max(1, slots), coff * ratio, coff * d), mx.float32)
        x = mx.random.normal((1, coff * d))
        a = made[(ratio, d)] = CompressorArgs(x, x, mx.zeros((ratio, coff * d)), mx.ones((d,)), st, st, pool, d)
        kw: dict[str, Any] = dict(ratio=ratio, head_dim=d, eps=1e-6, cos=cos, sin=cos * 0)
        if inplace_compressor:  # written in place: on fresh buffers (a zeros array may be a broadcast)
            _, _, pl, token = compressor_rows_inplace_cuda(batch, *a[:4], st + 0, st + 0, pool + 0, **kw)
            calls.append(pl if token is None else token)  # None: that head_dim runs the reference
            if ratio != 4:  # the model's HCA form: its scratch in the layer's workspace (StatePools.comp_ws)
                _, _, pl, token = compressor_rows_inplace_cuda(batch, *a[:4], st + 0, st + 0, pool + 0, **kw,
                                                               workspace=new_comp_workspace(1, d))  # fmt: skip
                calls.append(pl if token is None else token)
        else:
            calls.append(compressor_rows_cuda(batch, *a[:7], **kw))
    if inplace_compressor and 4 in ratios:  # the CSA layers' pair (main + indexer compressor) in one launch
        pair = [a._replace(kv_state=a.kv_state + 0, score_state=a.score_state + 0, pool=a.pool + 0)
                for a in (made[(4, head_dim)], made[(4, index_dim)])]  # fmt: skip
        *_, token = compressor_pair_rows_inplace_cuda(batch, *pair, ratio=4, eps=1e-6, cos=cos, sin=cos * 0)
        calls.append(pair[0].pool if token is None else token)
    q = mx.random.normal((1, n_heads, head_dim)).astype(dtype)
    win = mx.random.normal((1, window, head_dim)).astype(dtype)
    sinks = mx.zeros((n_heads,), mx.float32)
    scale = 1.0 / math.sqrt(head_dim)
    calls.append(sparse_attention_rows_cuda(batch, q, win, None, None, sinks, scale=scale))
    for ratio in ratios:
        pool = mx.random.normal((pages[ratio], page_size, head_dim)).astype(dtype)
        ind = mx.arange(8, dtype=mx.int32)[None, :]
        calls.append(sparse_attention_rows_cuda(batch, q, win, pool, ind, sinks, scale=scale, ratio=ratio))
    if 4 in ratios:
        qi = mx.random.normal((1, index_heads, index_dim)).astype(dtype)
        keys = mx.random.normal((pages[4], page_size, index_dim)).astype(dtype)
        calls.append(indexer_rows_cuda(batch, qi, mx.ones((1, index_heads)), keys, topk=topk))
        # the model's form: its scratch in the layer's workspace (StatePools.idx_ws), no fill node
        calls.append(indexer_rows_cuda(batch, qi, mx.ones((1, index_heads)), keys, topk=topk,
                                       workspace=new_workspace(1, batch.tables[4].shape[1] * page_size)))  # fmt: skip
    for d in sorted({head_dim, index_dim}):  # the page pools' rows written in place (prefill, copies, imports)
        calls.append(write_rows_cuda(mx.zeros((2, page_size, d), dtype) + 0, mx.array([1], mx.int32),
                                     mx.ones((1, d), dtype))[1])  # fmt: skip
    mx.eval(calls)
    return len(calls)


def precompile_model(args: Any, dtype: mx.Dtype, page_size: int, slots: int = 1, inplace_compressor: bool = True
                     ) -> int:  # fmt: skip
    """`precompile` with the dims of a `model.config.ModelArgs` (and `slots` slot-pool rows), + the mHC
    pre-mix kernel when it is in use."""
    n = 0
    if HC_KERNEL:
        nc, nm = args.hc_mult, args.hc_mult * (2 + args.hc_mult)
        out = hc_pre_mix_cuda(mx.zeros((1, nm)), mx.ones((3,)), mx.zeros((nm,)),
                              mx.zeros((1, nc, args.hidden_size), dtype), iters=args.hc_sinkhorn_iters,
                              eps=args.hc_eps)  # fmt: skip
        mx.eval(out)
        n = 1
    return n + precompile(
        dtype=dtype,
        page_size=page_size,
        n_heads=args.num_attention_heads,
        head_dim=args.head_dim,
        rope_dim=args.qk_rope_head_dim,
        index_heads=args.index_n_heads,
        index_dim=args.index_head_dim,
        topk=args.index_topk,
        window=args.sliding_window,
        ratios=tuple(args.compress_ratios),
        slots=slots,
        inplace_compressor=inplace_compressor,
    )
