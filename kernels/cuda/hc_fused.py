"""hc_pre_rows on CUDA: an mHC unit's whole pre-mix in one launch, its input RMS and mixing logits included.

The pre-mix kernel (kernels/cuda/hc.py) takes the logits m = rms(h) @ fn.T; computing them takes two more
launches (the RMS, an f32 GEMV of 24 x 16,384 that MLX ran in ~27 us on the H200, one block per output).
Here each row's block first sums h's squares and the nm dot products h . fn_j itself (f32, 4 columns a
thread in flight: a row's fn is 1.5 MB, read from L2 after the first row), then m_j = dot_j * rsqrt(mean
h^2 + eps): the reference's rms(h) @ fn.T up to the association of that scale. The mixing that follows
is the pre-mix kernel's source unchanged. Fast path: nc <= MAX_NC, 1..MAX_ROWS rows, fn / scale / base f32, h any float;
else kernels' composition (the RMS op, the GEMV, the pre-mix op).

One block a row reads its 1.5 MB of fn alone: 76 us a launch on the H200 (86 launches, 6.5 ms of a 22.6 ms
step's GPU time at 8 rows; 383f696, 2026-12-02). `DSV4_HC_SPLIT=1` (opt-in until its gpu tests have run)
spreads each row over SPLITS blocks instead, each summing its slice of the columns; the last block of a row
to finish (a fence, then a ticket in WORKSPACE: CUDA's threadFenceReduction) adds the SPLITS partials in
split order and runs the mixing. One WORKSPACE serves every call: its tickets are back at zero after each
launch, and the model's calls are ordered on one stream by their data (each call's h comes from the one
before it), so no two launches use it at once.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.cuda import hc
from dsv4_serve.kernels.cuda.common import f32_params, kernel, plan_cached
from dsv4_serve.kernels.hc import check_hc_pre_norm_rows, check_hc_pre_rows, hc_pre_composed, hc_pre_norm_composed

MAX_NC = 4  # nm = nc (2 + nc) <= 24 accumulators a thread
MAX_ROWS = 8  # each row's block reads all of fn: past the decode rows (prefill) the composition's GEMM pays
U = 4  # columns a thread has in flight
SPLITS = 16  # blocks a row with DSV4_HC_SPLIT=1 (16 x 8 rows = 128 blocks: about one an SM)
WORKSPACE: mx.array | None = None  # uint32: MAX_ROWS tickets, then [MAX_ROWS][SPLITS][NM + 1] f32 partials

# Columns lo..hi-1 of row b: each warp's sums of h^2 (acc[NM]) and of h . fn_j, into part[j][warp].
SUMS = r"""
    const T* hr = h + (size_t)b * D;
    float acc[NM + 1];
#pragma unroll
    for (int j = 0; j <= NM; ++j) acc[j] = 0.f;
    for (int i0 = lo + tid; i0 < hi; i0 += @U@ * blockDim.x) {
      float v[@U@];
#pragma unroll
      for (int u = 0; u < @U@; ++u) v[u] = i0 + u * (int)blockDim.x < hi ? dsv4_f(hr[i0 + u * blockDim.x]) : 0.f;
#pragma unroll
      for (int u = 0; u < @U@; ++u) {
        const int i = i0 + u * blockDim.x;
        if (i >= hi) break;
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
"""

PROLOGUE = r"""
  __shared__ float m_s[NM];  // NM: the pre-mix source's nc (2 + nc), declared above this point
  __shared__ float part[NM + 1][@WARPS@];
  {
    const int D = NC * H, lo = 0, hi = D;
@SUMS@
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

# The split form's prologue: block (s, b) sums columns [s * per, (s + 1) * per) of row b, the last one adds up.
SPLIT_PROLOGUE = r"""
  __shared__ float m_s[NM];
  __shared__ float part[NM + 1][@WARPS@];
  __shared__ bool last_s;
  {
    const int D = NC * H, S = gridDim.x, s = blockIdx.x;
    const int per = (D + S - 1) / S, lo = s * per, hi = min(D, lo + per);
    unsigned int* ticket = const_cast<unsigned int*>(workspace) + b;
    float* parts = reinterpret_cast<float*>(const_cast<unsigned int*>(workspace)) + @MAX_ROWS@;
@SUMS@
    if (tid <= NM) {  // this split's sums, over the warps in order
      float t = 0.f;
      for (int q = 0; q < @WARPS@; ++q) t += part[tid][q];
      parts[((size_t)b * S + s) * (NM + 1) + tid] = t;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last_s = atomicAdd(ticket, 1u) == (unsigned int)(S - 1);
    __syncthreads();
    if (!last_s) return;  // the whole block: the last one of the row goes on
    __threadfence();
    if (tid <= NM) {  // every split's sums, in split order (L2: another block wrote them)
      float t = 0.f;
      for (int q = 0; q < S; ++q) t += __ldcg(parts + ((size_t)b * S + q) * (NM + 1) + tid);
      part[tid][0] = t;
    }
    if (tid == 0) *ticket = 0u;  // back to zero for the next launch
    __syncthreads();
    if (tid < NM) m_s[tid] = part[tid][0] * rsqrtf(part[NM][0] / (float)D + fparams[1]);
    __syncthreads();
  }
  const float* mb = m_s;
"""


# `norm`: the x warps (all but the Sinkhorn group) also sum the squares of the x values they wrote (rounded to
# T, as x is), add the warps' sums in order behind their own named barrier, and overwrite each of their values
# with w * (x * rsqrt(mean + eps)) rounded once: the unit's RMSNorm (kernels.rms_norm_rows) on the block input.
NORM_TAIL = r"""
    {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) xss += __shfl_xor_sync(0xffffffffu, xss, o);
      __shared__ float xred[(@THREADS@ - SK) / 32];
      if ((tid & 31) == 0) xred[(tid - SK) >> 5] = xss;
      asm volatile("bar.sync 2, %0;" ::"r"(nt) : "memory");
      float t = 0.f;
      for (int q = 0; q < nt / 32; ++q) t += xred[q];
      const float inv = rsqrtf(t / (float)H + fparams[2]);
      // the columns this thread wrote above, read back 8 at a time: their loads before their stores (a store may
      // alias xw, so a load is never hoisted above one: a column at a time was a memory round trip each)
      for (int d0 = tid - SK; d0 < H; d0 += 8 * nt) {
        float xv[8], wv[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int d = d0 + u * nt;
          xv[u] = d < H ? dsv4_f(x[(size_t)b * H + d]) : 0.f;
          wv[u] = d < H ? dsv4_f(xw[d]) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int d = d0 + u * nt;
          if (d < H) x[(size_t)b * H + d] = dsv4_t<T>(wv[u] * (xv[u] * inv));
        }
      }
    }
"""


def fused_source(split: bool = False, norm: bool = False) -> str:
    line = "const float* mb = m + (size_t)b * NM;"
    assert line in hc.SOURCE, "kernels/cuda/hc.py: the pre-mix source no longer reads m where expected"
    pro = (SPLIT_PROLOGUE if split else PROLOGUE).replace("@SUMS@", SUMS.strip("\n"))
    pro = pro.replace("@U@", str(U)).replace("@WARPS@", str(hc.THREADS // 32))
    src = hc.SOURCE.replace(line, pro.replace("@MAX_ROWS@", str(MAX_ROWS)).strip())
    if split:  # the row is blockIdx.y; blockIdx.x its split
        row = "const int b = blockIdx.x, tid = threadIdx.x;"
        assert row in src, "kernels/cuda/hc.py: the pre-mix source no longer takes its row from blockIdx.x"
        src = src.replace(row, "const int b = blockIdx.y, tid = threadIdx.x;")
    if norm:
        hb, store = "const T* hb = h + (size_t)b * NC * H;", "x[(size_t)b * H + d0 + u * nt] = dsv4_t<T>(acc);"
        end = "      }\n    }\n  }\n"
        assert hb in src and store in src and src.endswith(end), "kernels/cuda/hc.py: the x loop moved"
        src = src.replace(hb, hb + " float xss = 0.f;")
        src = src.replace(store, "{ const T xv = dsv4_t<T>(acc); x[(size_t)b * H + d0 + u * nt] = xv; "
                                 "const float f = dsv4_f(xv); xss += f * f; }")  # fmt: skip
        src = src[: -len("  }\n")] + NORM_TAIL.replace("@THREADS@", str(hc.THREADS)) + "  }\n"
    return src


def set_split(on: bool) -> None:
    """The split form on (a zeroed WORKSPACE) or off (None); kernels.cuda turns it on on import when
    DSV4_HC_SPLIT=1. From host zeros (its own buffer, nothing to evaluate): that import may happen inside a
    compiled trace (the first fast op of a step), where an eval is not allowed."""
    global WORKSPACE
    words = MAX_ROWS + MAX_ROWS * SPLITS * (MAX_NC * (2 + MAX_NC) + 1)
    WORKSPACE = mx.array(np.zeros(words, dtype=np.uint32)) if on else None


INPUTS = ("h", "fn", "scale", "base", "fparams")
SPLIT_INPUTS = (*INPUTS, "workspace")


class Plan:
    __slots__ = ("fast", "fparams", "grid", "kernel", "shapes", "split", "tmpl")

    def __init__(self, h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, iters: int, eps: float,
                 norm_eps: float, xw: mx.array | None = None, x_eps: float = 0.0) -> None:  # fmt: skip
        b, nc, hid = h.shape
        self.fast = nc <= MAX_NC and 0 < b <= MAX_ROWS and all(a.dtype == mx.float32 for a in (fn, scale, base))
        if not self.fast:
            return
        self.split = WORKSPACE is not None
        norm = xw is not None
        name = ("hc_pre_split" if self.split else "hc_pre_rows") + ("_norm" if norm else "")
        inputs = (*(SPLIT_INPUTS if self.split else INPUTS), *(("xw",) if norm else ()))
        self.kernel = kernel(name, inputs, hc.OUTPUTS, fused_source(split=self.split, norm=norm))
        self.grid = (SPLITS * hc.THREADS, b, 1) if self.split else (b * hc.THREADS, 1, 1)
        self.tmpl = [("T", h.dtype), ("NC", nc), ("ITERS", iters)]
        self.shapes = [(b, hid), (b, nc), (b, nc, nc)]
        self.fparams = f32_params(eps, norm_eps, x_eps)


def hc_pre_rows_cuda(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, iters: int, eps: float,
                     norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("hc_pre_rows", h.shape, h.dtype, fn.shape, fn.dtype, scale.shape, scale.dtype,
                                base.shape, base.dtype, type(iters), iters, eps, norm_eps,
                                WORKSPACE is not None)  # fmt: skip
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
        inputs=[h, fn, scale, base, plan.fparams, *([WORKSPACE] if plan.split else [])],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(hc.THREADS, 1, 1),
        output_shapes=plan.shapes,
        output_dtypes=[h.dtype, mx.float32, mx.float32],
    )
    return x, post, comb


def hc_pre_norm_rows_cuda(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, weight: mx.array, *,
                          iters: int, eps: float, norm_eps: float,
                          x_eps: float) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("hc_pre_norm_rows", *((a.shape, a.dtype) for a in (h, fn, scale, base, weight)),
                                type(iters), iters, eps, norm_eps, x_eps, WORKSPACE is not None)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_hc_pre_norm_rows(h, fn, scale, base, weight, iters=iters, eps=eps, norm_eps=norm_eps, x_eps=x_eps)
        raise

    def make() -> Plan:
        check_hc_pre_norm_rows(h, fn, scale, base, weight, iters=iters, eps=eps, norm_eps=norm_eps, x_eps=x_eps)
        return Plan(h, fn, scale, base, iters, eps, norm_eps, weight, x_eps)

    plan: Plan = plan_cached(key, make)
    if not plan.fast or weight.dtype not in (mx.float32, mx.bfloat16, mx.float16):
        return hc_pre_norm_composed(h, fn, scale, base, weight, iters=iters, eps=eps, norm_eps=norm_eps, x_eps=x_eps)
    x, post, comb = plan.kernel(
        inputs=[h, fn, scale, base, plan.fparams, *([WORKSPACE] if plan.split else []), weight],
        template=[*plan.tmpl, ("XW", weight.dtype)],
        grid=plan.grid,
        threadgroup=(hc.THREADS, 1, 1),
        output_shapes=plan.shapes,
        output_dtypes=[h.dtype, mx.float32, mx.float32],
    )
    return x, post, comb
