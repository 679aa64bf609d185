"""pooled_entry on CUDA: a compressor's entries from their windows' rows in one launch (prefill's compressors).

The plain twin (kernels/compressor.py `pooled_entry`) is ~33 MLX ops an entry set: the softmax of the gates over
the window's rows per feature, the weighted sum, the cast, the RMSNorm with its weight, the cast and the RoPE of the
last rope dims. A short prompt's forward pools twice a CSA layer (the entries and the indexer's keys), 42 calls of
~33 kernels of a 32-token V4-Flash forward's 3,103 (tools/prefill_count.py, 2026-12-07), all host cost there.

One block an entry: each thread a feature at a time, the gates' max, the exponentials' sum and the weighted sum over
the rows in f32 (rows in order), the sum rounded to the pool dtype; the squares summed over the features (the warps'
sums in order), each feature normed, times the weight, rounded; then the rope pairs (x0 c - x1 s, x1 c + x0 s) in
f32, rounded. The twin's order of the sums differs: equal within rounding, not bit for bit. Fast path: gates f32,
cos / sin f32 [E, rd / 2], d <= MAX_D; else the twin. Opt-in (`DSV4_POOLED_KERNEL=1`, model/prefill_indexer.py
`_pooling`) until its gpu tests (tests/kernels/test_cuda_pooled.py, tests/model/test_cuda_prefill.py) have run.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels.compressor import pooled_entry
from dsv4_serve.kernels.cuda.common import f32_params, kernel
from dsv4_serve.kernels.cuda.norms import INV_RMS

THREADS = 128
MAX_D = 1024

SOURCE = r"""
  __shared__ float red[32];
  __shared__ float ys[@MAX_D@];
  const int e = blockIdx.x, tid = threadIdx.x;
  const int R = vals_shape[1], D = vals_shape[2], HALF = cs_shape[1], LO = D - 2 * HALF;
  const T* vb = vals + (size_t)e * R * D;
  const float* gb = gates + (size_t)e * R * D;
  for (int j = tid; j < D; j += blockDim.x) {
    float m = -INFINITY;
    for (int r = 0; r < R; ++r) m = fmaxf(m, gb[(size_t)r * D + j]);
    float z = 0.f;
    for (int r = 0; r < R; ++r) z += expf(gb[(size_t)r * D + j] - m);
    float acc = 0.f;
    for (int r = 0; r < R; ++r) acc += (expf(gb[(size_t)r * D + j] - m) / z) * dsv4_f(vb[(size_t)r * D + j]);
    ys[j] = dsv4_f(dsv4_t<O>(acc));
  }
  const float* xr = ys;  // each thread reads back the features it wrote: no barrier needed before the sum
  float inv;
@INV_RMS@
  for (int j = tid; j < D; j += blockDim.x) ys[j] = dsv4_f(dsv4_t<O>(ys[j] * inv * dsv4_f(norm[j])));
  __syncthreads();
  O* orow = out + (size_t)e * D;
  for (int j = tid; j < D; j += blockDim.x) {
    if (j < LO) {
      orow[j] = dsv4_t<O>(ys[j]);
    } else {
      const int i = j - LO, p = i >> 1;
      const float c = cs[(size_t)e * HALF + p], s = sn[(size_t)e * HALF + p];
      orow[j] = dsv4_t<O>((i & 1) ? ys[j] * c + ys[j - 1] * s : ys[j] * c - ys[j + 1] * s);
    }
  }
""".replace("@MAX_D@", str(MAX_D)).replace("@INV_RMS@", INV_RMS.strip("\n"))


def pooled_entry_cuda(vals: mx.array, gates: mx.array, norm: mx.array, eps: float, cos: mx.array, sin: mx.array,
                      dtype: mx.Dtype) -> mx.array:  # fmt: skip
    """`pooled_entry` (kernels/compressor.py) in one launch where the fast path holds, else the twin."""
    e, r, d = vals.shape
    fast = (gates.shape == vals.shape and gates.dtype == mx.float32 and cos.dtype == mx.float32
            and sin.dtype == mx.float32 and cos.shape == sin.shape and cos.ndim == 2 and cos.shape[0] == e
            and 0 < 2 * cos.shape[1] <= d <= MAX_D and norm.shape == (d,) and e > 0 and r > 0)  # fmt: skip
    if not fast:
        return pooled_entry(vals, gates, norm, eps, cos, sin, dtype)
    (out,) = kernel("pooled_entry", ("vals", "gates", "norm", "cs", "sn", "fparams"), ("out",), SOURCE)(
        inputs=[vals, gates, norm, cos, sin, f32_params(eps)], template=[("T", vals.dtype), ("O", dtype)],
        grid=(e * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(e, d)], output_dtypes=[dtype],
    )  # fmt: skip
    return out
