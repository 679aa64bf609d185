"""rms_rope_rows on CUDA: an optional RMS norm of each vector and its RoPE in one launch.

One block a vector (a head of q, the window kv, a head of the output): the squares summed in f32 by
kernels/cuda/norms.py's rms_norm code (INV_RMS: strided over the threads, the warps' sums in order), the
normed value rounded to x's dtype (the norm's output), then x * C + swap_pairs(x) * S in f32 on each pair,
rounded once: the reference's two ops without the pair swap's copy. Fast path: c / s f32, x and the weight
any float dtype, d even; else the reference. Past MANY_VECTORS vectors (prefill) of 16-bit x with d a multiple
of 8 up to 1,024: `MANY_SOURCE`, a warp a vector (16-byte loads, the squares summed by the warp's shuffles).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import f32_params, kernel, plan_cached
from dsv4_serve.kernels.cuda.norms import INV_RMS
from dsv4_serve.kernels.rope import check_rms_rope_rows, rms_rope_rows_reference

THREADS = 128
# Past this many vectors (prefill: T x 64 heads; decode's <= 8 rows stay below) a warp a vector, 8 a block, 16-byte
# loads: the block-a-vector kernel's scalar loads and 131K tiny blocks took ~0.15 ms a call on a 2,048-token q
# (16 ms of a V4-Flash forward's 302 on the H200, PART=final, 2026-12-02). Its own order of the squares' sum.
MANY_VECTORS = 4096
MANY_THREADS = 256
MANY_ON = os.environ.get("DSV4_ROPE_MANY", "1").strip() != "0"  # 0: the block-a-vector kernel for every count
MANY_SOURCE = r"""
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int NV = x_shape[0], D = x_shape[1];
  const int vec = blockIdx.x * (blockDim.x >> 5) + warp;
  if (vec >= NV) return;
  const T* xr = x + (size_t)vec * D;
  const float* cr = c + (size_t)(vec / PER) * D;
  const float* sr = s + (size_t)(vec / PER) * D;
  float v[4][8];  // the lane's elements 8 lane + 256 u .. + 7, u < D / 256 (D <= 1024)
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int i = 8 * lane + 256 * u;
    if (i < D) {
      const uint4 q = *reinterpret_cast<const uint4*>(xr + i);
      const T* e = reinterpret_cast<const T*>(&q);
#pragma unroll
      for (int j = 0; j < 8; ++j) { v[u][j] = dsv4_f(e[j]); ss += v[u][j] * v[u][j]; }
    }
  }
  float inv = 1.f;
  if (NORM) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    inv = rsqrtf(ss / (float)D + fparams[0]);
  }
  T* orow = out + (size_t)vec * D;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int i = 8 * lane + 256 * u;
    if (i < D) {
      float y[8], cc[8], sn[8];  // the tables element by element (a row is shared by PER vectors: cached)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        cc[j] = cr[i + j];
        sn[j] = sr[i + j];
        y[j] = v[u][j];
        if (NORM) {  // the norm's output, rounded to T as the op's
          y[j] *= inv;
          if (HAS_W) y[j] = dsv4_f(w[i + j]) * y[j];
          y[j] = dsv4_f(dsv4_t<T>(y[j]));
        }
      }
      __align__(16) T o[8];
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        o[j] = dsv4_t<T>(y[j] * cc[j] + y[j + 1] * sn[j]);
        o[j + 1] = dsv4_t<T>(y[j + 1] * cc[j + 1] + y[j] * sn[j + 1]);
      }
      *reinterpret_cast<uint4*>(orow + i) = *reinterpret_cast<const uint4*>(o);
    }
  }
"""

# A vector's pair (i, i + 1), normed as the op's output when NORM (`inv`: its inverse RMS); shared with the
# window ring's write (kernels/cuda/glue_rope.py), which must give the same values
NORMED_PAIR = r"""
    float y0 = dsv4_f(xr[i]), y1 = dsv4_f(xr[i + 1]);
    if (NORM) {  // the norm's output, rounded to T as the op's
      y0 *= inv;
      y1 *= inv;
      if (HAS_W) {
        y0 = dsv4_f(w[i]) * y0;
        y1 = dsv4_f(w[i + 1]) * y1;
      }
      y0 = dsv4_f(dsv4_t<T>(y0));
      y1 = dsv4_f(dsv4_t<T>(y1));
    }
"""
SOURCE = r"""
  __shared__ float red[32];
  const int vec = blockIdx.x, tid = threadIdx.x;
  const int D = x_shape[1];
  const T* xr = x + (size_t)vec * D;
  const float* cr = c + (size_t)(vec / PER) * D;
  const float* sr = s + (size_t)(vec / PER) * D;
  float inv = 1.f;
  if (NORM) {
@INV_RMS@
  }
  T* orow = out + (size_t)vec * D;
  for (int p = tid; p < D / 2; p += blockDim.x) {
    const int i = 2 * p;
@NORMED_PAIR@
    orow[i] = dsv4_t<T>(y0 * cr[i] + y1 * sr[i]);
    orow[i + 1] = dsv4_t<T>(y1 * cr[i + 1] + y0 * sr[i + 1]);
  }
""".replace("@INV_RMS@", INV_RMS.strip("\n")).replace("@NORMED_PAIR@", NORMED_PAIR.strip("\n"))

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


class Plan:
    __slots__ = ("fparams", "grid", "kernel", "nt", "tmpl", "vectors")

    def __init__(self, x: mx.array, weight: mx.array | None, eps: float | None) -> None:
        self.vectors = x.size // x.shape[-1]
        d = x.shape[-1]
        many = (self.vectors > MANY_VECTORS and x.dtype in (mx.bfloat16, mx.float16) and d % 8 == 0 and d <= 1024
                and MANY_ON)  # fmt: skip
        src = MANY_SOURCE if many else SOURCE
        self.kernel = kernel("rms_rope_many" if many else "rms_rope", ("x", "c", "s", "w", "fparams"), ("out",), src)
        self.nt = MANY_THREADS if many else THREADS
        self.grid = (-(-self.vectors // (MANY_THREADS // 32)) * MANY_THREADS if many else self.vectors * THREADS, 1, 1)
        wdt = weight.dtype if weight is not None else mx.float32
        self.tmpl = [("T", x.dtype), ("W", wdt), ("NORM", eps is not None), ("HAS_W", weight is not None),
                     ("PER", self.vectors // x.shape[0])]  # fmt: skip
        self.fparams = f32_params(eps or 0.0)


def rms_rope_rows_cuda(x: mx.array, c: mx.array, s: mx.array, *, weight: mx.array | None = None,
                       eps: float | None = None) -> mx.array:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("rms_rope", MANY_ON, x.shape, x.dtype, c.shape, c.dtype, s.shape, s.dtype,
                                None if weight is None else (weight.shape, weight.dtype), type(eps), eps)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_rms_rope_rows(x, c, s, weight, eps)
        raise

    def make() -> Plan | None:
        check_rms_rope_rows(x, c, s, weight, eps)  # once per shape key
        if (x.size == 0 or x.dtype not in _FLOATS or c.dtype != mx.float32 or s.dtype != mx.float32
                or (weight is not None and weight.dtype not in _FLOATS)):  # fmt: skip
            return None
        return Plan(x, weight, eps)

    plan: Plan | None = plan_cached(key, make)
    if plan is None:
        return rms_rope_rows_reference(x, c, s, weight=weight, eps=eps)
    d = x.shape[-1]
    (out,) = plan.kernel(
        inputs=[x.reshape(plan.vectors, d), c, s, weight if weight is not None else plan.fparams, plan.fparams],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(plan.nt, 1, 1),
        output_shapes=[(plan.vectors, d)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(x.shape)
