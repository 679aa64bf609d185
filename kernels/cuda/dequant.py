"""dequantize_mxfp8 on CUDA: an mxfp8 weight [N, K] (e4m3 codes, 4 a uint32 word; one e8m0 scale per 32) to
bf16 / f16 in one pass, 8 codes a thread (an 8-byte load, a 16-byte store).

Prefill's dense projections multiply a dequantized copy of each weight (kernels/matmul.py
`qlinear_many_rows`): MLX's `fp_dequantize` took 22.9 ms of a 2,048-token V4-Flash forward on the H200
(322 calls, ~0.7 TB/s of its 16.6 GB; PART=heads, 2026-12-02), a fixed cost per forward whatever its tokens.
Exact, as the reference: each code decodes to f32 from its bits (normal: exponent + 120 into f32's field;
subnormal: m x 2^-9; 0x7F / 0xFF: NaN), times the scale 2^(s - 127) built from its bits (s = 0: 2^-127,
255: NaN), rounded once to the output dtype, so values are mx.dequantize's bit for bit (gpu test).
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import kernel
from dsv4_serve.kernels.matmul import dequantize_mxfp8_reference

THREADS = 256
HELPER = r"""
// One e4m3 code (bits 0-7 of c) as f32, exactly.
__device__ __forceinline__ float dsv4_e4m3(uint32_t c) {
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
  if ((c & 0x7Fu) == 0x7Fu) mag = __uint_as_float(0x7FC00000u);
  return (c & 0x80u) ? -mag : mag;
}
"""
SOURCE = r"""
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;  // codes 8 i .. 8 i + 7
  const size_t n8 = (size_t)w_shape[0] * w_shape[1] / 2;
  if (i >= n8) return;
  const uint2 q = reinterpret_cast<const uint2*>(w)[i];
  const uint32_t sc = s[i >> 2];  // 32 codes a scale: K is a multiple of 32, so a group never spans rows
  const float f = sc == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(sc == 255u ? 0x7FC00000u : sc << 23);
  __align__(16) T v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = dsv4_t<T>(dsv4_e4m3(((j < 4 ? q.x : q.y) >> (8 * (j & 3))) & 0xFFu) * f);
  reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<const uint4*>(v);
"""


def dequantize_mxfp8_cuda(w: mx.array, scales: mx.array, dtype: mx.Dtype) -> mx.array:
    """mx.dequantize(w, scales, group_size=32, bits=8, mode="mxfp8", dtype=dtype) for a 2-D weight."""
    ok = (isinstance(w, mx.array) and isinstance(scales, mx.array) and w.ndim == 2 and w.dtype == mx.uint32
          and scales.dtype == mx.uint8 and scales.shape == (w.shape[0], w.shape[1] // 8) and w.shape[1] % 8 == 0
          and dtype in (mx.bfloat16, mx.float16))  # fmt: skip
    if not ok:
        return dequantize_mxfp8_reference(w, scales, dtype)
    n, k = w.shape[0], w.shape[1] * 4
    threads = n * k // 8
    (out,) = kernel("dq_mxfp8", ("w", "s"), ("out",), SOURCE, header=HELPER)(
        inputs=[w, scales],
        template=[("T", dtype)],
        grid=(-(-threads // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n, k)],
        output_dtypes=[dtype],
    )
    return out
