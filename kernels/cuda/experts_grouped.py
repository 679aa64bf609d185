"""The routed experts of a prefill forward on CUDA: a grouped GEMM that reads the mxfp4 weights as stored.

`kernels.experts_grouped` (`tiles`, the plain twin here) dequantizes every expert of the layer to bf16 and
runs MLX's gather_mm over 64-row tiles of one expert's pairs, with the pairs gathered into a sorted copy
and gathered back. On the H200 at a 2,048-token forward of V4-Flash that is ~53% of the forward's GPU time
(PART=accept, 6f0bde6, 2026-12-02: gather_mm 136 ms, the all-experts dequantized copy 129 ms, the sorted
copies' gathers 62 ms, SwiGLU's f32 clamps 38 ms), and the copy alone is a fixed ~127 ms a forward
whatever its length. Here each projection is one kernel over the same tiles:
- block = one tile (TILE_ROWS pairs of one expert, `ptab`: the pair a tile row holds, -1 padding) x
  16 * MT * WR weight rows; its warps each own MT 16-row weight tiles (PAIR: and the up projection's
  same rows) for all 64 pair rows: mma.sync m16n8k16, the weights as the A operand decoded from e2m1 +
  e8m0 in registers exactly as the decode step's skinny kernels do (kernels/cuda/matmul.py WF 2), the
  pairs' x rows as B from shared memory, gathered there by cp.async straight from x (no sorted copy),
  two 128-k chunks in flight, each x value read by a lane in the order the weight decode leaves k in;
- PAIR 1 (gate + up): epilogue SwiGLU with the limit clamp, each product rounded to T first (the
  reference's matmul outputs), hidden [P, I] in pair order; PAIR 0 (down): [P, H] in pair order.
The router-weighted sum over k stays the reference's f32 ops. Every pair is in exactly one tile row, so
every output row is written once.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kernels import experts_grouped as ref
from kernels.cuda.common import f32_params, kernel, launch_bounds, plan_cached

TR = ref.TILE_ROWS  # pair rows a tile (the mma's n: TR / 8 fragments)
CK = 128  # k values a chunk: 64 bytes of an mxfp4 weight row, 16 bytes a lane
XS = 20  # uint4 a tile row in shared memory (16 used): lanes 4 apart in gq land 4 banks apart
WR = 4  # warps a block

HEADER = r"""
// One 128-k chunk of the tile's x rows into shared memory: row r's uint4 u (k 8u..8u+7) at r * XS +
// (u % 4) * 4 + u / 4, so lane (gq, cq) reads its k range [32 cq, 32 cq + 32) as 4 uint4 at v * 4 + cq.
template <typename T, int K, int TR, int XS, int THREADS, int XDIV>
__device__ __forceinline__ void dsv4_gx_load(uint4* dst, const T* x, const int* ps, int c) {
#pragma unroll
  for (int m = 0; m < TR * 16 / THREADS; ++m) {
    const int i = threadIdx.x + m * THREADS, r = i >> 4, u = i & 15;
    const int p = ps[r];
    const T* src = x + (size_t)(p < 0 ? 0 : p / XDIV) * K + c * 128 + u * 8;
    dsv4_cp16(dst + r * XS + (u & 3) * 4 + (u >> 2), src, p < 0 ? 0 : 16);
  }
  dsv4_cp_commit();
}
"""

SOURCE = r"""
  constexpr int RB = K / 2, G32 = K / 32, NCH = K / 128, NT = PAIR ? 2 * MT : MT, THREADS = 32 * WR;
  __shared__ uint4 xs[2][TR * XS];
  __shared__ int ps[TR];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gq = lane >> 2, cq = lane & 3;
  const int tile = blockIdx.y;
  if (ptab[(size_t)tile * TR] < 0) return;  // past the last tile: padding only (uniform: whole block)
  for (int r = threadIdx.x; r < TR; r += THREADS) ps[r] = ptab[(size_t)tile * TR + r];
  __syncthreads();
  const size_t e = texp[tile];
  const int row0 = (blockIdx.x * WR + warp) * MT * 16;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w) + e * N * RB;
  const uint8_t* wb2 = reinterpret_cast<const uint8_t*>(w2) + e * N * RB;
  const uint8_t* sb = s + e * N * G32;
  const uint8_t* sb2 = s2 + e * N * G32;
  dsv4_gx_load<T, K, TR, XS, THREADS, XDIV>(xs[0], x, ps, 0);
  uint4 wv[NT][2];
  uint32_t sv[NT][2];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + (t % MT) * 16 + gq + 8 * h;
      const uint8_t* wt = t >= MT ? wb2 : wb;
      const uint8_t* sp = t >= MT ? sb2 : sb;
      wv[t][h] = __ldg(reinterpret_cast<const uint4*>(wt + (size_t)row * RB + cq * 16));
      sv[t][h] = __ldg(sp + (size_t)row * G32 + cq);
    }
  float acc[NT][TR / 8][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int j = 0; j < TR / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][j][i] = 0.f;
  for (int c = 0; c < NCH; ++c) {
    if (c + 1 < NCH) dsv4_gx_load<T, K, TR, XS, THREADS, XDIV>(xs[(c + 1) & 1], x, ps, c + 1);
    uint32_t a[NT][8][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      __nv_bfloat162 f[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float fs = ldexpf(1.f, (int)sv[t][h] - 1);  // e8m0 with e2m1's decode shortfall (2^126) folded in
        f[h] = __floats2bfloat162_rn(fs, fs);
      }
      const uint32_t* W0 = reinterpret_cast<const uint32_t*>(&wv[t][0]);
      const uint32_t* W1 = reinterpret_cast<const uint32_t*>(&wv[t][1]);
#pragma unroll
      for (int st = 0; st < 8; ++st) {
        uint32_t lo[2], hi[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // nibbles (i, i + 4), i = 2 r and 2 r + 1 of word st / 2
          const uint32_t q = (h ? W1 : W0)[st >> 1] >> (8 * (st & 1));
          const uint32_t q4 = q >> 4;
          lo[h] = ((q << 6) & 0x01C001C0u) | ((q << 12) & 0x80008000u);
          hi[h] = ((q4 << 6) & 0x01C001C0u) | ((q4 << 12) & 0x80008000u);
          __nv_bfloat162 l2 = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&lo[h]), f[h]);
          __nv_bfloat162 h2 = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&hi[h]), f[h]);
          lo[h] = *reinterpret_cast<uint32_t*>(&l2);
          hi[h] = *reinterpret_cast<uint32_t*>(&h2);
        }
        a[t][st][0] = lo[0]; a[t][st][1] = lo[1]; a[t][st][2] = hi[0]; a[t][st][3] = hi[1];
      }
    }
    if (c + 1 < NCH) {  // the next chunk's weights, in flight while this one's products run
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + (t % MT) * 16 + gq + 8 * h;
          const uint8_t* wt = t >= MT ? wb2 : wb;
          const uint8_t* sp = t >= MT ? sb2 : sb;
          wv[t][h] = __ldg(reinterpret_cast<const uint4*>(wt + (size_t)row * RB + (c + 1) * 64 + cq * 16));
          sv[t][h] = __ldg(sp + (size_t)row * G32 + (c + 1) * 4 + cq);
        }
      dsv4_cp_wait<1>();
    } else {
      dsv4_cp_wait<0>();
    }
    __syncthreads();
    const uint4* xt = xs[c & 1];
#pragma unroll
    for (int j = 0; j < TR / 8; j += 2) {
      uint4 xv[2][4];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int v = 0; v < 4; ++v) xv[jj][v] = xt[(8 * (j + jj) + gq) * XS + v * 4 + cq];
#pragma unroll
      for (int st = 0; st < 8; ++st) {
        const int q = st >> 1, r = st & 1;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const uint32_t* X = reinterpret_cast<const uint32_t*>(xv[jj]);
          const uint32_t b0 = __byte_perm(X[4 * q + r], X[4 * q + 2 + r], 0x5410);
          const uint32_t b1 = __byte_perm(X[4 * q + r], X[4 * q + 2 + r], 0x7632);
#pragma unroll
          for (int t = 0; t < NT; ++t) dsv4_mma(acc[t][j + jj], a[t][st], b0, b1, T());
        }
      }
    }
    __syncthreads();  // this stage is read: the next iteration's load may overwrite it
  }
  const float lim = fparams[0];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int j = 0; j < TR / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = ps[8 * j + 2 * cq + (i & 1)];
        if (p < 0) continue;
        const int n = row0 + t * 16 + gq + 8 * (i >> 1);
        float v = acc[t][j][i];
        if (PAIR) {  // SwiGLU of the two products, each rounded to T first (the reference's matmul outputs)
          float g = dsv4_f(dsv4_t<T>(v)), up = dsv4_f(dsv4_t<T>(acc[t + MT][j][i]));
          if (lim > 0.f) {
            g = fminf(g, lim);
            up = fminf(fmaxf(up, -lim), lim);
          }
          v = g / (1.f + expf(-g)) * up;
        }
        out[(size_t)p * N + n] = dsv4_t<T>(v);
      }
"""

INPUTS = ("x", "w", "s", "w2", "s2", "ptab", "texp", "fparams")


class Plan:
    """One projection's launch (gate + up with SwiGLU, or down) for (P pairs, K, N, tiles), made once."""

    __slots__ = ("fparams", "grid", "kernel", "shape", "tmpl")

    def __init__(self, p: int, k: int, n: int, tiles: int, *, pair: bool, xdiv: int, limit: float | None) -> None:
        mt = 1 if pair else 2
        self.kernel = kernel("grouped_mm", INPUTS, ("out",), SOURCE, header=HEADER + launch_bounds(32 * WR, 2))
        self.tmpl = [("T", mx.bfloat16), ("K", k), ("N", n), ("PAIR", int(pair)), ("XDIV", xdiv), ("MT", mt),
                     ("WR", WR), ("TR", TR), ("XS", XS)]  # fmt: skip
        self.grid = (n // (16 * mt * WR) * 32 * WR, tiles, 1)
        self.shape = (p, n)
        self.fparams = f32_params(float(limit or 0.0))

    def __call__(self, x: mx.array, w: mx.array, s: mx.array, w2: mx.array, s2: mx.array, ptab: mx.array,
                 texp: mx.array) -> mx.array:  # fmt: skip
        return self.kernel(inputs=[x, w, s, w2, s2, ptab, texp, self.fparams], template=self.tmpl, grid=self.grid,
                           threadgroup=(32 * WR, 1, 1), output_shapes=[self.shape],
                           output_dtypes=[mx.bfloat16])[0]  # fmt: skip


def fits(x: mx.array, w1: mx.array, w2: mx.array) -> bool:
    """bf16 rows and weights that tile: K (H for gate / up, I for down) a multiple of CK, N of the block's rows."""
    hid, inter = x.shape[1], w1.shape[1]
    return (x.dtype == mx.bfloat16 and hid % CK == 0 and inter % CK == 0 and inter % (16 * WR) == 0
            and hid % (32 * WR) == 0 and w2.shape[1] == hid)  # fmt: skip


def grouped_experts_cuda(x: mx.array, idx: mx.array, weights: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                         s2: mx.array, w3: mx.array, s3: mx.array, *, limit: float | None) -> Any:  # fmt: skip
    """`kernels.experts_grouped.grouped_experts` (same arguments, checks and result) as two grouped kernels
    on the mxfp4 weights; shapes that do not tile run the plain `tiles` form."""
    ref.check_grouped("grouped_experts", x, idx, weights, w1, s1, w2, s2, w3, s3)
    if not fits(x, w1, w2):
        return ref.grouped_experts(x, idx, weights, w1, s1, w2, s2, w3, s3, limit=limit, how="tiles")
    b, k = idx.shape
    hid, inter, e = x.shape[1], w1.shape[1], w1.shape[0]
    flat = idx.reshape(-1).astype(mx.uint32)
    order = mx.argsort(flat)  # the B * k pairs grouped by expert
    src, texp, _ = ref.tiles(flat[order], e)
    ptab = mx.where(src >= 0, order.astype(mx.int32)[mx.maximum(src, 0)], -1)  # the pair a tile row holds
    tiles = src.shape[0] // TR
    key = ("grouped_experts", b * k, hid, inter, tiles, limit)
    up = plan_cached(key + ("up",), lambda: Plan(b * k, hid, inter, tiles, pair=True, xdiv=k, limit=limit))
    down = plan_cached(key + ("down",), lambda: Plan(b * k, inter, hid, tiles, pair=False, xdiv=1, limit=None))
    hdn = up(x, w1, s1, w3, s3, ptab, texp)  # [B * k, I] in pair order
    out = down(hdn, w2, s2, w2, s2, ptab, texp)  # [B * k, H]
    return mx.sum(out.reshape(b, k, hid).astype(mx.float32) * weights[:, :, None], axis=1)
