"""hc_pre_mix on CUDA: the whole mHC pre-mix of every row in one launch (the reference is ~100 nodes).

One block per row: thread 0 computes pre / post, the row-softmax and the Sinkhorn rounds of the
nc x nc matrix in registers (nc <= 8: a few hundred flops), then every thread sums its columns of
x = sum_k pre_k h_k. f32 arithmetic throughout, as the reference. Fast path: m, scale, base f32
(the release keeps every hc_* parameter f32), h of any float dtype, nc <= 8; else the reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kernels.cuda.common import f32_params, kernel, plan_cached
from kernels.hc import check_hc_pre_mix, hc_pre_mix_reference

THREADS = 256
MAX_NC = 8
INPUTS = ("m", "scale", "base", "h", "fparams")
OUTPUTS = ("x", "post", "comb")

SOURCE = r"""
  constexpr int NM = NC * (2 + NC);
  __shared__ float pre_s[NC];
  const int b = blockIdx.x, tid = threadIdx.x;
  const int H = h_shape[2];
  const float eps = fparams[0];
  if (tid == 0) {
    // every read before the first global store (post): the compiler cannot prove post does not alias
    // m / base, so a load after a store would wait for the store's round trip
    const float* mb = m + (size_t)b * NM;
    float mr[NM], br[NM];
#pragma unroll
    for (int k = 0; k < NM; ++k) { mr[k] = mb[k]; br[k] = base[k]; }
    const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
    float c[NC][NC];
#pragma unroll
    for (int k = 0; k < NC; ++k) {
      pre_s[k] = 1.f / (1.f + expf(-(mr[k] * s0 + br[k]))) + eps;
      post[(size_t)b * NC + k] = 2.f / (1.f + expf(-(mr[NC + k] * s1 + br[NC + k])));
    }
#pragma unroll
    for (int i = 0; i < NC; ++i) {  // row softmax (max-subtracted) + eps
      float mv = -INFINITY;
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        c[i][j] = mr[2 * NC + i * NC + j] * s2 + br[2 * NC + i * NC + j];
        mv = fmaxf(mv, c[i][j]);
      }
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < NC; ++j) { c[i][j] = expf(c[i][j] - mv); s += c[i][j]; }
#pragma unroll
      for (int j = 0; j < NC; ++j) c[i][j] = c[i][j] / s + eps;
    }
    for (int it = 0; it < ITERS; ++it) {  // Sinkhorn: columns; then (rows, columns) ITERS - 1 times
      if (it > 0) {
#pragma unroll
        for (int i = 0; i < NC; ++i) {
          float s = 0.f;
#pragma unroll
          for (int j = 0; j < NC; ++j) s += c[i][j];
          s += eps;
#pragma unroll
          for (int j = 0; j < NC; ++j) c[i][j] = c[i][j] / s;
        }
      }
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < NC; ++i) s += c[i][j];
        s += eps;
#pragma unroll
        for (int i = 0; i < NC; ++i) c[i][j] = c[i][j] / s;
      }
    }
#pragma unroll
    for (int i = 0; i < NC; ++i)
#pragma unroll
      for (int j = 0; j < NC; ++j) comb[((size_t)b * NC + i) * NC + j] = c[i][j];
  }
  __syncthreads();
  const T* hb = h + (size_t)b * NC * H;
  for (int d = tid; d < H; d += blockDim.x) {
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < NC; ++k) acc += pre_s[k] * dsv4_f(hb[(size_t)k * H + d]);
    x[(size_t)b * H + d] = dsv4_t<T>(acc);
  }
"""


def supported(m: mx.array, scale: mx.array, base: mx.array, h: mx.array) -> bool:
    return all(a.dtype == mx.float32 for a in (m, scale, base)) and h.shape[1] <= MAX_NC


class Plan:
    """Launch parameters of one (shapes, dtypes, iters, eps) combination, computed once."""

    __slots__ = ("fast", "fparams", "grid", "kernel", "shapes", "tmpl")

    def __init__(self, m: mx.array, scale: mx.array, base: mx.array, h: mx.array, iters: int, eps: float) -> None:
        self.fast = supported(m, scale, base, h)
        if not self.fast:
            return
        b, nc, hid = h.shape
        self.kernel = kernel("hc_pre_mix", INPUTS, OUTPUTS, SOURCE)
        self.tmpl = [("T", h.dtype), ("NC", nc), ("ITERS", iters)]
        self.grid = (b * THREADS, 1, 1)
        self.shapes = [(b, hid), (b, nc), (b, nc, nc)]
        self.fparams = f32_params(eps)


def hc_pre_mix_cuda(
    m: mx.array, scale: mx.array, base: mx.array, h: mx.array, *, iters: int, eps: float
) -> tuple[mx.array, mx.array, mx.array]:
    try:
        key: tuple[Any, ...] = ("hc_pre_mix", m.shape, m.dtype, scale.shape, scale.dtype, base.shape, base.dtype,
                                h.shape, h.dtype, type(iters), iters, type(eps), eps)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_hc_pre_mix(m, scale, base, h, iters=iters, eps=eps)
        raise

    def make() -> Plan:
        check_hc_pre_mix(m, scale, base, h, iters=iters, eps=eps)  # once per shape key
        return Plan(m, scale, base, h, iters, eps)

    plan: Plan = plan_cached(key, make)
    if not plan.fast:
        return hc_pre_mix_reference(m, scale, base, h, iters=iters, eps=eps)
    x, post, comb = plan.kernel(
        inputs=[m, scale, base, h, plan.fparams],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=plan.shapes,
        output_dtypes=[h.dtype, mx.float32, mx.float32],
    )
    return x, post, comb
