"""hc_pre_rows on CUDA: an mHC unit's whole pre-mix in one launch, its input RMS and mixing logits included.

The pre-mix kernel (kernels/cuda/hc.py) takes the logits m = rms(h) @ fn.T; computing them takes two more
launches (the RMS, an f32 GEMV of 24 x 16,384 that MLX ran in ~27 us on the H200, one block per output).
Here each row's block first sums h's squares and the nm dot products h . fn_j itself (f32, 4 columns a
thread in flight: a row's fn is 1.5 MB, read from L2 after the first row), then m_j = dot_j * rsqrt(mean
h^2 + eps): the reference's rms(h) @ fn.T up to the association of that scale. The mixing that follows
is the pre-mix kernel's source unchanged. Fast path: nc <= MAX_NC, 1..MAX_ROWS rows, fn / scale / base f32, h any float;
else kernels' composition (the RMS op, the GEMV, the pre-mix op).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kernels.cuda import hc
from kernels.cuda.common import f32_params, kernel, plan_cached
from kernels.hc import check_hc_pre_rows, hc_pre_composed

MAX_NC = 4  # nm = nc (2 + nc) <= 24 accumulators a thread
MAX_ROWS = 8  # each row's block reads all of fn: past the decode rows (prefill) the composition's GEMM pays
U = 4  # columns a thread has in flight

PROLOGUE = r"""
  __shared__ float m_s[NM];  // NM: the pre-mix source's nc (2 + nc), declared above this point
  __shared__ float part[NM + 1][@WARPS@];
  {
    const int D = NC * H;
    const T* hr = h + (size_t)b * D;
    float acc[NM + 1];
#pragma unroll
    for (int j = 0; j <= NM; ++j) acc[j] = 0.f;
    for (int i0 = tid; i0 < D; i0 += @U@ * blockDim.x) {
      float v[@U@];
#pragma unroll
      for (int u = 0; u < @U@; ++u) v[u] = i0 + u * (int)blockDim.x < D ? dsv4_f(hr[i0 + u * blockDim.x]) : 0.f;
#pragma unroll
      for (int u = 0; u < @U@; ++u) {
        const int i = i0 + u * blockDim.x;
        if (i >= D) break;
        acc[NM] += v[u] * v[u];
#pragma unroll
        for (int j = 0; j < NM; ++j) acc[j] += fn[(size_t)j * D + i] * v[u];
      }
    }
#pragma unroll
    for (int j = 0; j <= NM; ++j) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    }
    if ((tid & 31) == 0) {
#pragma unroll
      for (int j = 0; j <= NM; ++j) part[j][tid >> 5] = acc[j];
    }
    __syncthreads();
    if (tid <= NM) {  // each sum over the warps in order
      float s = 0.f;
      for (int q = 0; q < @WARPS@; ++q) s += part[tid][q];
      part[tid][0] = s;
    }
    __syncthreads();
    if (tid < NM) m_s[tid] = part[tid][0] * rsqrtf(part[NM][0] / (float)D + fparams[1]);
    __syncthreads();
  }
  const float* mb = m_s;
"""


def fused_source() -> str:
    line = "const float* mb = m + (size_t)b * NM;"
    assert line in hc.SOURCE, "kernels/cuda/hc.py: the pre-mix source no longer reads m where expected"
    pro = PROLOGUE.replace("@U@", str(U)).replace("@WARPS@", str(hc.THREADS // 32))
    return hc.SOURCE.replace(line, pro.strip())


INPUTS = ("h", "fn", "scale", "base", "fparams")


class Plan:
    __slots__ = ("fast", "fparams", "grid", "kernel", "shapes", "tmpl")

    def __init__(self, h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, iters: int, eps: float,
                 norm_eps: float) -> None:  # fmt: skip
        b, nc, hid = h.shape
        self.fast = nc <= MAX_NC and 0 < b <= MAX_ROWS and all(a.dtype == mx.float32 for a in (fn, scale, base))
        if not self.fast:
            return
        self.kernel = kernel("hc_pre_rows", INPUTS, hc.OUTPUTS, fused_source())
        self.tmpl = [("T", h.dtype), ("NC", nc), ("ITERS", iters)]
        self.grid = (b * hc.THREADS, 1, 1)
        self.shapes = [(b, hid), (b, nc), (b, nc, nc)]
        self.fparams = f32_params(eps, norm_eps)


def hc_pre_rows_cuda(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, iters: int, eps: float,
                     norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("hc_pre_rows", h.shape, h.dtype, fn.shape, fn.dtype, scale.shape, scale.dtype,
                                base.shape, base.dtype, type(iters), iters, eps, norm_eps)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_hc_pre_rows(h, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)
        raise

    def make() -> Plan:
        check_hc_pre_rows(h, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)
        return Plan(h, fn, scale, base, iters, eps, norm_eps)

    plan: Plan = plan_cached(key, make)
    if not plan.fast:
        return hc_pre_composed(h, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)
    x, post, comb = plan.kernel(
        inputs=[h, fn, scale, base, plan.fparams],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(hc.THREADS, 1, 1),
        output_shapes=plan.shapes,
        output_dtypes=[h.dtype, mx.float32, mx.float32],
    )
    return x, post, comb
