"""rms_rope_rows on CUDA: an optional RMS norm of each vector and its RoPE in one launch.

One block a vector (a head of q, the window kv, a head of the output): the squares summed in f32 by
kernels/cuda/norms.py's rms_norm code (INV_RMS: strided over the threads, the warps' sums in order), the
normed value rounded to x's dtype (the norm's output), then x * C + swap_pairs(x) * S in f32 on each pair,
rounded once: the reference's two ops without the pair swap's copy. Fast path: c / s f32, x and the weight
any float dtype, d even; else the reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kernels.cuda.common import f32_params, kernel, plan_cached
from kernels.cuda.norms import INV_RMS
from kernels.rope import check_rms_rope_rows, rms_rope_rows_reference

THREADS = 128

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
    orow[i] = dsv4_t<T>(y0 * cr[i] + y1 * sr[i]);
    orow[i + 1] = dsv4_t<T>(y1 * cr[i + 1] + y0 * sr[i + 1]);
  }
""".replace("@INV_RMS@", INV_RMS.strip("\n"))

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


class Plan:
    __slots__ = ("fparams", "kernel", "tmpl", "vectors")

    def __init__(self, x: mx.array, weight: mx.array | None, eps: float | None) -> None:
        self.vectors = x.size // x.shape[-1]
        self.kernel = kernel("rms_rope", ("x", "c", "s", "w", "fparams"), ("out",), SOURCE)
        wdt = weight.dtype if weight is not None else mx.float32
        self.tmpl = [("T", x.dtype), ("W", wdt), ("NORM", eps is not None), ("HAS_W", weight is not None),
                     ("PER", self.vectors // x.shape[0])]  # fmt: skip
        self.fparams = f32_params(eps or 0.0)


def rms_rope_rows_cuda(x: mx.array, c: mx.array, s: mx.array, *, weight: mx.array | None = None,
                       eps: float | None = None) -> mx.array:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("rms_rope", x.shape, x.dtype, c.shape, c.dtype, s.shape, s.dtype,
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
        grid=(plan.vectors * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(plan.vectors, d)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(x.shape)
