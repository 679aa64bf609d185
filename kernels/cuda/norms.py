"""rms_norm_rows and hc_post_rows on CUDA: one kernel each where the reference launches three.

rms_norm: one block a row; the threads' squares summed in f32 (warp shuffles, then the warps' sums in
order), inv = rsqrt(sum / D + eps), then out = w * (x * inv) in f32, rounded once to the output dtype: the
reference's arithmetic (MLX's fused norm on an f32 copy, then the weight) up to the order of the sum.
hc_post: one thread a (row, column); out[k] = post[k] y + sum_j comb[j, k] h[j] in f32, j in order, one
rounding to h's dtype. Fast path: x / y / h of any float dtype, post and comb f32, nc <= 8; else the
reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import MAX_GRID_Y, f32_params, kernel, plan_cached
from dsv4_serve.kernels.norms import (
    check_hc_post_rows,
    check_rms_norm_rows,
    hc_post_rows_reference,
    rms_norm_rows_reference,
)

THREADS = 256
MAX_NC = 8

# The inverse RMS of the block's row xr [D] into `inv` (f32 squares strided over the threads, warp shuffles,
# the warps' sums in order; eps fparams[0]; a __shared__ red[32] declared before): rms_norm's and rms_rope's.
INV_RMS = r"""
  float ss = 0.f;
  for (int i = tid; i < D; i += blockDim.x) {
    const float v = dsv4_f(xr[i]);
    ss += v * v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((tid & 31) == 0) red[tid >> 5] = ss;
  __syncthreads();
  if (tid == 0) {
    float t = 0.f;
    for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += red[k];  // the warps' sums in order
    red[0] = t;
  }
  __syncthreads();
  inv = rsqrtf(red[0] / (float)D + fparams[0]);
"""

RMS_SOURCE = r"""
  __shared__ float red[32];
  const int r = blockIdx.x, tid = threadIdx.x;
  const int D = x_shape[1];
  const T* xr = x + (size_t)r * D;
  float inv;
@INV_RMS@
  O* orow = out + (size_t)r * D;
  for (int i = tid; i < D; i += blockDim.x) {
    float v = dsv4_f(xr[i]) * inv;
    if (HAS_W) v = dsv4_f(w[i]) * v;
    orow[i] = dsv4_t<O>(v);
  }
""".replace("@INV_RMS@", INV_RMS.strip("\n"))

POST_SOURCE = r"""
  const int b = blockIdx.y;
  const int H = h_shape[2];
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= H) return;
  const float yv = dsv4_f(y[(size_t)b * H + d]);
  float hv[NC];
#pragma unroll
  for (int j = 0; j < NC; ++j) hv[j] = dsv4_f(h[((size_t)b * NC + j) * H + d]);
  const float* cb = comb + (size_t)b * NC * NC;
#pragma unroll
  for (int k = 0; k < NC; ++k) {
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < NC; ++j) m += cb[j * NC + k] * hv[j];
    out[((size_t)b * NC + k) * H + d] = dsv4_t<T>(post[(size_t)b * NC + k] * yv + m);
  }
"""


class RmsPlan:
    __slots__ = ("fparams", "grid", "kernel", "rows", "tmpl")

    def __init__(self, x: mx.array, weight: mx.array | None, eps: float, out: mx.Dtype) -> None:
        self.rows = x.size // x.shape[-1]
        self.kernel = kernel("rms_norm", ("x", "w", "fparams"), ("out",), RMS_SOURCE)
        wdt = weight.dtype if weight is not None else mx.float32
        self.tmpl = [("T", x.dtype), ("O", out), ("W", wdt), ("HAS_W", weight is not None)]
        self.grid = (self.rows * THREADS, 1, 1)
        self.fparams = f32_params(eps)


def rms_norm_rows_cuda(x: mx.array, weight: mx.array | None, *, eps: float,
                       out_dtype: mx.Dtype | None = None) -> mx.array:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("rms_norm", x.shape, x.dtype, None if weight is None else (weight.shape, weight.dtype),
                                type(eps), eps, out_dtype)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_rms_norm_rows(x, weight, eps, out_dtype)
        raise

    def make() -> RmsPlan:
        check_rms_norm_rows(x, weight, eps, out_dtype)  # once per shape key
        return RmsPlan(x, weight, eps, out_dtype or x.dtype)

    plan: RmsPlan = plan_cached(key, make)
    if x.size == 0:
        return rms_norm_rows_reference(x, weight, eps=eps, out_dtype=out_dtype)
    w = weight if weight is not None else plan.fparams  # unread without a weight (HAS_W false)
    (out,) = plan.kernel(
        inputs=[x.reshape(plan.rows, x.shape[-1]), w, plan.fparams],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(plan.rows, x.shape[-1])],
        output_dtypes=[out_dtype or x.dtype],
    )
    return out.reshape(x.shape)


class PostPlan:
    __slots__ = ("fast", "grid", "kernel", "tmpl")

    def __init__(self, h: mx.array, post: mx.array, comb: mx.array) -> None:
        b, nc, hid = h.shape
        self.fast = post.dtype == mx.float32 and comb.dtype == mx.float32 and nc <= MAX_NC and b <= MAX_GRID_Y
        if not self.fast:
            return
        self.kernel = kernel("hc_post", ("y", "h", "post", "comb"), ("out",), POST_SOURCE)
        self.tmpl = [("T", h.dtype), ("NC", nc)]
        self.grid = (-(-hid // THREADS) * THREADS, b, 1)


def hc_post_rows_cuda(y: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    try:
        key: tuple[Any, ...] = ("hc_post", y.shape, y.dtype, h.shape, h.dtype, post.shape, post.dtype, comb.shape,
                                comb.dtype)  # fmt: skip
    except AttributeError:
        check_hc_post_rows(y, h, post, comb)
        raise

    def make() -> PostPlan:
        check_hc_post_rows(y, h, post, comb)
        return PostPlan(h, post, comb)

    plan: PostPlan = plan_cached(key, make)
    if not plan.fast or h.size == 0:
        return hc_post_rows_reference(y, h, post, comb)
    (out,) = plan.kernel(
        inputs=[y, h, post, comb],
        template=plan.tmpl,
        grid=plan.grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[tuple(h.shape)],
        output_dtypes=[h.dtype],
    )
    return out
