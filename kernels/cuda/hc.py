"""hc_pre_mix on CUDA: the whole mHC pre-mix of every row in one launch (the reference is ~100 nodes).

One block per row. nc threads compute pre / post. Warps 0-1 run the row softmax and the Sinkhorn
rounds of the nc x nc matrix, one thread per element (nc <= 8), each sum read from shared memory in
index order (one thread doing the whole matrix took ~34 us a launch at 20 rounds, nc 4: ~700
dependent divisions). Meanwhile warps 2-7 sum their columns of x = sum_k pre_k h_k, U columns' loads
issued together: a load cannot be hoisted above a store to x, so one column at a time would cost a
memory round trip each. f32 arithmetic throughout, as the reference. Fast path: m, scale, base f32
(the release keeps every hc_* parameter f32), h of any float dtype, nc <= 8; else the reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import f32_params, kernel, plan_cached
from dsv4_serve.kernels.hc import check_hc_pre_mix, hc_pre_mix_reference

THREADS = 256
MAX_NC = 8
SINKHORN_THREADS = 64  # warps 0-1: one thread per comb element (MAX_NC ** 2); the rest of the block sums x
assert MAX_NC**2 <= SINKHORN_THREADS < THREADS and SINKHORN_THREADS % 32 == 0
INPUTS = ("m", "scale", "base", "h", "fparams")
OUTPUTS = ("x", "post", "comb")

SOURCE = r"""
  constexpr int NM = NC * (2 + NC);
  constexpr int SK = @SK@;  // the Sinkhorn group: warps 0-1, one thread per comb element
  __shared__ float pre_s[NC];
  __shared__ float cs[2][NC * NC];  // comb, double-buffered: one barrier per normalization
  const int b = blockIdx.x, tid = threadIdx.x;
  const int H = h_shape[2];
  const float eps = fparams[0];
  const float* mb = m + (size_t)b * NM;
  const bool own = tid < NC * NC;
  // every read before the first global store (post): the compiler cannot prove post does not alias m
  float v = own ? mb[2 * NC + tid] * scale[2] + base[2 * NC + tid] : 0.f;
  if (tid < NC) {
    const float zp = mb[tid] * scale[0] + base[tid], zq = mb[NC + tid] * scale[1] + base[NC + tid];
    pre_s[tid] = 1.f / (1.f + expf(-zp)) + eps;
    post[(size_t)b * NC + tid] = 2.f / (1.f + expf(-zq));
  }
  __syncthreads();
  if (tid < SK) {
    // element (i, j) = (tid / NC, tid % NC); each thread sums its row / column from shared memory in
    // index order (the summation order of one thread doing it all)
    const int i = tid / NC, j = tid % NC;
#define DSV4_SK_SYNC asm volatile("bar.sync 1, @SK@;" ::: "memory")
    if (own) cs[0][tid] = v;
    DSV4_SK_SYNC;
    if (own) {  // row softmax (max-subtracted) + eps
      float mv = -INFINITY;
#pragma unroll
      for (int jj = 0; jj < NC; ++jj) mv = fmaxf(mv, cs[0][i * NC + jj]);
      v = expf(v - mv);
      cs[1][tid] = v;
    }
    DSV4_SK_SYNC;
    if (own) {
      float s = 0.f;
#pragma unroll
      for (int jj = 0; jj < NC; ++jj) s += cs[1][i * NC + jj];
      v = v / s + eps;
    }
    int p = 0;
    for (int it = 0; it < ITERS; ++it) {  // Sinkhorn: columns; then (rows, columns) ITERS - 1 times
      if (it > 0) {
        if (own) cs[p][tid] = v;
        DSV4_SK_SYNC;
        if (own) {
          float s = 0.f;
#pragma unroll
          for (int jj = 0; jj < NC; ++jj) s += cs[p][i * NC + jj];
          s += eps;
          v = v / s;
        }
        p ^= 1;
      }
      if (own) cs[p][tid] = v;
      DSV4_SK_SYNC;
      if (own) {
        float s = 0.f;
#pragma unroll
        for (int ii = 0; ii < NC; ++ii) s += cs[p][ii * NC + j];
        s += eps;
        v = v / s;
      }
      p ^= 1;
    }
#undef DSV4_SK_SYNC
    if (own) comb[(size_t)b * NC * NC + tid] = v;
  } else {  // the other warps: x = sum_k pre_k h_k, meanwhile; U columns' loads issued before their stores
    constexpr int U = 8;
    const int nt = blockDim.x - SK;
    const T* hb = h + (size_t)b * NC * H;
    for (int d0 = tid - SK; d0 < H; d0 += U * nt) {
      float hv[U][NC];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < NC; ++k) hv[u][k] = d0 + u * nt < H ? dsv4_f(hb[(size_t)k * H + d0 + u * nt]) : 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (d0 + u * nt >= H) break;
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < NC; ++k) acc += pre_s[k] * hv[u][k];
        x[(size_t)b * H + d0 + u * nt] = dsv4_t<T>(acc);
      }
    }
  }
""".replace("@SK@", str(SINKHORN_THREADS))


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
