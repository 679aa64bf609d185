"""The MoE's glue on CUDA: router_topk (a row's scores, top-k and normalised weights in one launch, the
reference ~7) and moe_combine_rows (one thread a (row, column): the k weighted pairs summed in order, the
shared output added, one rounding; the reference 3).

One block a row. Each thread scores its experts (sqrt(softplus(l)) as MLX computes logaddexp(l, 0): the
larger plus log1p(exp(smaller - larger))) into shared memory; then k rounds of a block argmax over
score + bias (ties to the lower expert id), each pick masked out (NaN); thread 0 writes the ids in pick order
and the weights s / (sum s + 1e-20) * route_scale, summed in pick order. Fast path: f32 logits, up to
MAX_EXPERTS experts and k <= MAX_K; else the reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import MAX_GRID_Y, f32_params, kernel, plan_cached
from dsv4_serve.kernels.cuda.norms import POST_SOURCE
from dsv4_serve.kernels.router import (
    check_moe_combine_post_rows,
    check_moe_combine_rows,
    check_router_topk,
    moe_combine_post_rows_reference,
    moe_combine_rows_reference,
    router_topk_reference,
)

THREADS = 256
MAX_EXPERTS = 1024
MAX_K = 16

SOURCE = r"""
  __shared__ float sc[MAXE];
  __shared__ float bs[MAXE];
  __shared__ float rv[32];
  __shared__ int ri[32];
  __shared__ int pick[MAXK];
  const int r = blockIdx.x, tid = threadIdx.x;
  const int E = logits_shape[1];
  const float* lr = logits + (size_t)r * E;
  for (int e = tid; e < E; e += blockDim.x) {
    const float l = lr[e];
    const float hi = fmaxf(l, 0.f), lo = fminf(l, 0.f);
    const float s = sqrtf(hi + log1pf(expf(lo - hi)));
    sc[e] = s;
    bs[e] = s + dsv4_f(bias[e]);
  }
  __syncthreads();
  for (int j = 0; j < K; ++j) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = tid; e < E; e += blockDim.x) {
      const float v = bs[e];
      if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if ((tid & 31) == 0) { rv[tid >> 5] = bv; ri[tid >> 5] = bi; }
    __syncthreads();
    if (tid == 0) {
      float v = rv[0];
      int i = ri[0];
      for (int q = 1; q < (int)(blockDim.x >> 5); ++q)
        if (rv[q] > v || (rv[q] == v && ri[q] < i)) { v = rv[q]; i = ri[q]; }
      if (i >= E) i = 0;  // every biased score NaN / -inf: expert 0 (the reference's partition is arbitrary too)
      pick[j] = i;
      bs[i] = NAN;  // taken: NaN loses every comparison, so no later round picks it again
    }
    __syncthreads();
  }
  if (tid == 0) {
    float sum = 0.f;
    for (int j = 0; j < K; ++j) sum += sc[pick[j]];
    const float f = fparams[0] / (sum + 1e-20f);
    for (int j = 0; j < K; ++j) {
      idx[(size_t)r * K + j] = (uint32_t)pick[j];
      w[(size_t)r * K + j] = sc[pick[j]] * f;
    }
  }
"""


class Plan:
    __slots__ = ("fast", "fparams", "grid", "kernel", "tmpl")

    def __init__(self, logits: mx.array, bias: mx.array, k: int, route_scale: float) -> None:
        b, e = logits.shape
        self.fast = e <= MAX_EXPERTS and k <= MAX_K and b > 0
        if not self.fast:
            return
        self.kernel = kernel("router_topk", ("logits", "bias", "fparams"), ("idx", "w"), SOURCE)
        self.tmpl = [("K", k), ("MAXE", MAX_EXPERTS), ("MAXK", MAX_K)]
        self.grid = (b * THREADS, 1, 1)
        self.fparams = f32_params(route_scale)


def router_topk_cuda(logits: mx.array, bias: mx.array, *, k: int, route_scale: float) -> tuple[mx.array, mx.array]:
    try:
        key: tuple[Any, ...] = ("router_topk", logits.shape, logits.dtype, bias.shape, bias.dtype, type(k), k,
                                type(route_scale), route_scale)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_router_topk(logits, bias, k, route_scale)
        raise

    def make() -> Plan:
        check_router_topk(logits, bias, k, route_scale)  # once per shape key
        return Plan(logits, bias, k, route_scale)

    plan: Plan = plan_cached(key, make)
    if not plan.fast:
        return router_topk_reference(logits, bias, k=k, route_scale=route_scale)
    idx, w = plan.kernel(
        inputs=[logits, bias, plan.fparams],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(logits.shape[0], k), (logits.shape[0], k)],
        output_dtypes=[mx.uint32, mx.float32],
    )
    return idx, w


COMBINE_SOURCE = r"""
  const int b = blockIdx.y;
  const int H = pairs_shape[2];
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= H) return;
  const size_t row = (size_t)b * K;
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < K; ++j) acc += dsv4_f(pairs[(row + j) * H + d]) * dsv4_f(w[row + j]);
  out[(size_t)b * H + d] = dsv4_t<O>(acc + dsv4_f(shared[(size_t)b * H + d]));
"""


class CombinePlan:
    __slots__ = ("grid", "kernel", "tmpl")

    def __init__(self, pairs: mx.array, out_dtype: mx.Dtype) -> None:
        b, k, hid = pairs.shape
        self.kernel = kernel("moe_combine", ("pairs", "w", "shared"), ("out",), COMBINE_SOURCE)
        self.tmpl = [("O", out_dtype), ("K", k)]
        self.grid = (-(-hid // THREADS) * THREADS, b, 1)


def moe_combine_rows_cuda(pairs: mx.array, w: mx.array, shared: mx.array, *, out_dtype: mx.Dtype) -> mx.array:
    try:
        key: tuple[Any, ...] = ("moe_combine", pairs.shape, pairs.dtype, w.shape, w.dtype, shared.shape,
                                shared.dtype, out_dtype)  # fmt: skip
    except AttributeError:
        check_moe_combine_rows(pairs, w, shared, out_dtype)
        raise

    def make() -> CombinePlan | None:
        check_moe_combine_rows(pairs, w, shared, out_dtype)
        dts = (pairs.dtype, w.dtype, shared.dtype, out_dtype)
        if pairs.size == 0 or any(d not in (mx.float32, mx.bfloat16, mx.float16) for d in dts):
            return None
        return CombinePlan(pairs, out_dtype)

    plan: CombinePlan | None = plan_cached(key, make)
    if plan is None:
        return moe_combine_rows_reference(pairs, w, shared, out_dtype=out_dtype)
    (out,) = plan.kernel(
        inputs=[pairs, w, shared],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(pairs.shape[0], pairs.shape[2])],
        output_dtypes=[out_dtype],
    )
    return out


# The combine above rounded to h's dtype (its store turned into the post-mix's y), then norms.POST_SOURCE's
# post-mix on it: the two kernels' arithmetic in one thread a (row, column).
_STORE = "out[(size_t)b * H + d] = dsv4_t<O>(acc + dsv4_f(shared[(size_t)b * H + d]));"
_Y = "const float yv = dsv4_f(y[(size_t)b * H + d]);"
assert _STORE in COMBINE_SOURCE and _Y in POST_SOURCE, "the combine's store or the post-mix's y moved"
_YV = "const float yv = dsv4_f(dsv4_t<T>(acc + dsv4_f(shared[(size_t)b * H + d])));"
COMBINE_POST_SOURCE = COMBINE_SOURCE.replace(_STORE, _YV) + POST_SOURCE[POST_SOURCE.index(_Y) + len(_Y) :]
MAX_NC = 8


def moe_combine_post_rows_cuda(pairs: mx.array, w: mx.array, shared: mx.array, h: mx.array, post: mx.array,
                               comb: mx.array) -> mx.array:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("moe_combine_post", *((a.shape, a.dtype) for a in (pairs, w, shared, h, post, comb)))
    except AttributeError:
        check_moe_combine_post_rows(pairs, w, shared, h, post, comb)
        raise

    def make() -> CombinePlan | None:
        check_moe_combine_post_rows(pairs, w, shared, h, post, comb)
        floats = (mx.float32, mx.bfloat16, mx.float16)
        if (pairs.size == 0 or h.shape[1] > MAX_NC or post.dtype != mx.float32 or comb.dtype != mx.float32
                or pairs.shape[0] > MAX_GRID_Y
                or any(a.dtype not in floats for a in (pairs, w, shared, h))):  # fmt: skip
            return None
        plan = CombinePlan(pairs, h.dtype)
        plan.kernel = kernel("moe_combine_post", ("pairs", "w", "shared", "h", "post", "comb"), ("out",),
                             COMBINE_POST_SOURCE)  # fmt: skip
        plan.tmpl = [("T", h.dtype), ("K", pairs.shape[1]), ("NC", h.shape[1])]
        return plan

    plan: CombinePlan | None = plan_cached(key, make)
    if plan is None:
        return moe_combine_post_rows_reference(pairs, w, shared, h, post, comb)
    (out,) = plan.kernel(
        inputs=[pairs, w, shared, h, post, comb],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[h.shape],
        output_dtypes=[h.dtype],
    )
    return out
