"""Tile GEMMs for prefill's many rows on CUDA: weights read as stored, rows gathered in the kernel.

One mma.sync m16n8k16 kernel template (bf16 rows, f32 accumulation) for two users:
- the routed experts (`kernels/cuda/experts_grouped.py`): tiles of TR pairs of one expert (`ptab`: the
  pair a tile row holds, -1 padding; `texp`: the tile's expert), mxfp4 weights (`WF` 2);
- the products the model runs in f32 for T rows (`f32_linear_many`, `f32_linear_pair_many`: the
  compressors' kv and gate; the head of prompt logprobs): bf16 weights (`WF` 0), f32 out, one "expert", the
  rows in order. bf16 x bf16 is exact in the f32 accumulator, so this is the reference's f32 matmul (cast
  inputs) up to the order of the sum; MLX ran those as SIMT f32 GEMMs (TF32 off): ~76 ms of a 2,048-token
  forward of V4-Flash on the H200, ~21 ms with this kernel for the shapes it takes (PART=gmm, 76d6509).
The experts' two GEMMs took 137 ms of that forward (~200 TFLOP/s with the tiles' padding) where the
dequantized copy + gather_mm took ~300 ms with their gathers and clamps.
A block is one tile (TR rows) x 16 * MT * WR weight rows; each warp owns MT 16-row weight tiles (PAIR 1 / 2:
and the second weight's same rows) for all TR rows. The weights are the A operand, loaded straight to
registers (mxfp4 decoded from e2m1 + e8m0 exactly as the decode step's skinny kernels do,
kernels/cuda/matmul.py WF 2; bf16 as they are), the rows B from shared memory, gathered there by
cp.async (two 128-k chunks in flight), each x value read by a lane in the order its weight words hold k.
Epilogues: PAIR 0 one product [P, N]; PAIR 1 SwiGLU with the limit clamp, each product rounded to T first
(the reference's matmul outputs); PAIR 2 both products [2, P, N]; PAIR 3 the indexer's scores (TR rows a
query's heads: hw[row] * relu(product) summed over the tile's rows -> [P / TR, N], `indexer_scores_cuda`).
Every row of P is in exactly one tile row, so every output row is written once.
"""

from __future__ import annotations

import os

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import E2M1, dummy, f32_params, kernel, launch_bounds, plan_cached
from dsv4_serve.kernels.experts_grouped import TILE_ROWS
from dsv4_serve.kernels.indexer_scores import indexer_scores_reference
from dsv4_serve.kernels.matmul import MANY_ROWS  # fewer rows run as 8-row slices of the skinny kernels

TR = TILE_ROWS  # rows a tile (the mma's n: TR / 8 fragments)
CK = 128  # k values a chunk: 64 (mxfp4) or 256 (bf16) bytes of a weight row, a quarter of it a lane
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
// Chunk c's weights of a lane: rows r, r + 8 of each of its NT 16-row tiles (the second weight's from MT on).
template <int WF, int NT, int MT, int WV, int RB, int CB, int G32>
__device__ __forceinline__ void dsv4_tw_load(uint4 (*wv)[2][WV], uint32_t (*sv)[2], const uint8_t* wb,
                                             const uint8_t* wb2, const uint8_t* sb, const uint8_t* sb2, int r,
                                             int cq, int c) {
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r + (t % MT) * 16 + 8 * h;
      const uint8_t* wr = (t >= MT ? wb2 : wb) + (size_t)row * RB + c * CB + cq * (CB / 4);
      const uint4* src = reinterpret_cast<const uint4*>(wr);
#pragma unroll
      for (int v = 0; v < WV; ++v) wv[t][h][v] = __ldg(src + v);
      if (WF) sv[t][h] = __ldg((t >= MT ? sb2 : sb) + (size_t)row * G32 + c * 4 + cq);
    }
}
"""

SOURCE = r"""
  constexpr int RB = WF ? K / 2 : K * 2, CB = WF ? 64 : 256;  // bytes a weight row; of it a chunk
  constexpr int WV = WF ? 1 : 4, G32 = K / 32, NCH = K / 128, NT = PAIR == 1 || PAIR == 2 ? 2 * MT : MT;
  constexpr int THREADS = 32 * WR;
  // N from the grid, not a template constant: the indexer's keys (N) grow with the context, and a
  // template value per N was an NVRTC compile per 512 tokens of prompt (~2 s each on the H200)
  const int N = gridDim.x * (16 * MT * WR);
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
  const uint8_t* sb = s + (WF ? e * N * G32 : 0);  // bf16 weights: no scales (a dummy)
  const uint8_t* sb2 = s2 + (WF ? e * N * G32 : 0);
  dsv4_gx_load<T, K, TR, XS, THREADS, XDIV>(xs[0], x, ps, 0);
  uint4 wv[NT][2][WV];  // a lane's 16 (mxfp4) or 64 (bf16) bytes of rows gq, gq + 8 of each tile: k [32 cq, +32)
  uint32_t sv[NT][2];
  dsv4_tw_load<WF, NT, MT, WV, RB, CB, G32>(wv, sv, wb, wb2, sb, sb2, row0 + gq, cq, 0);
  float acc[NT][TR / 8][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int j = 0; j < TR / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][j][i] = 0.f;
  for (int c = 0; c < NCH; ++c) {
    if (c + 1 < NCH) dsv4_gx_load<T, K, TR, XS, THREADS, XDIV>(xs[(c + 1) & 1], x, ps, c + 1);
    uint32_t a[WF ? NT : 1][8][4];  // mxfp4: the chunk's A fragments, decoded before the next chunk's loads
#pragma unroll
    for (int t = 0; t < (WF ? NT : 0); ++t) {
      __nv_bfloat162 f[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float fs = ldexpf(1.f, (int)sv[t][h] - 1);  // e8m0 with e2m1's decode shortfall (2^126) folded in
        f[h] = __floats2bfloat162_rn(fs, fs);
      }
      const uint32_t* W0 = reinterpret_cast<const uint32_t*>(&wv[t][0][0]);
      const uint32_t* W1 = reinterpret_cast<const uint32_t*>(&wv[t][1][0]);
#pragma unroll
      for (int st = 0; st < 8; ++st) {
        uint32_t lo[2], hi[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // nibbles (i, i + 4), i = 2 r and 2 r + 1 of word st / 2
          dsv4_e2m1_bits((h ? W1 : W0)[st >> 1] >> (8 * (st & 1)), lo[h], hi[h]);
          __nv_bfloat162 l2 = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&lo[h]), f[h]);
          __nv_bfloat162 h2 = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&hi[h]), f[h]);
          lo[h] = *reinterpret_cast<uint32_t*>(&l2);
          hi[h] = *reinterpret_cast<uint32_t*>(&h2);
        }
        a[t][st][0] = lo[0]; a[t][st][1] = lo[1]; a[t][st][2] = hi[0]; a[t][st][3] = hi[1];
      }
    }
    if (c + 1 < NCH) {  // mxfp4: the next chunk's weights, in flight while this one's products run
      if (WF) dsv4_tw_load<WF, NT, MT, WV, RB, CB, G32>(wv, sv, wb, wb2, sb, sb2, row0 + gq, cq, c + 1);
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
          const uint32_t b0 = __byte_perm(X[4 * q + r], X[4 * q + 2 + r], 0x5410);  // mxfp4's k order
          const uint32_t b1 = __byte_perm(X[4 * q + r], X[4 * q + 2 + r], 0x7632);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            if (WF) {
              dsv4_mma(acc[t][j + jj], a[WF ? t : 0][st], b0, b1, T());
            } else {  // bf16: words 2 st, 2 st + 1 hold k 4 st + {0, 1}, {2, 3} of the lane's 32, as x's below
              const uint32_t* W0 = reinterpret_cast<const uint32_t*>(wv[t][0]);
              const uint32_t* W1 = reinterpret_cast<const uint32_t*>(wv[t][1]);
              const uint32_t aw[4] = {W0[2 * st], W1[2 * st], W0[2 * st + 1], W1[2 * st + 1]};
              dsv4_mma(acc[t][j + jj], aw, X[2 * st], X[2 * st + 1], T());
            }
          }
        }
      }
    }
    __syncthreads();  // this stage is read: the next iteration's load may overwrite it
    if (!WF && c + 1 < NCH) dsv4_tw_load<WF, NT, MT, WV, RB, CB, G32>(wv, sv, wb, wb2, sb, sb2, row0 + gq, cq, c + 1);
  }
  if (PAIR == 3) {  // the indexer's scores: the tile's TR rows are one query's heads, summed here
    const int q0 = ps[0] / TR;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // weight row (key) gq + 8 h of tile t
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < TR / 8; ++j)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int p = ps[8 * j + 2 * cq + i];
            if (p >= 0) sum += hw[p] * fmaxf(acc[t][j][2 * h + i], 0.f);
          }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the 4 lanes of a key row hold the other heads
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (cq == 0) out[(size_t)q0 * N + row0 + t * 16 + gq + 8 * h] = dsv4_t<O>(sum);
      }
    return;
  }
  const int P = (int)fparams[1];
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
        if (PAIR == 2) {  // both products: out [2][P][N]
          out[(size_t)p * N + n] = dsv4_t<O>(v);
          out[((size_t)P + p) * N + n] = dsv4_t<O>(acc[t + MT][j][i]);
          continue;
        }
        if (PAIR == 1) {  // SwiGLU of the two products, each rounded to T first (the reference's matmul outputs)
          float g = dsv4_f(dsv4_t<T>(v)), up = dsv4_f(dsv4_t<T>(acc[t + MT][j][i]));
          if (lim > 0.f) {
            g = fminf(g, lim);
            up = fminf(fmaxf(up, -lim), lim);
          }
          v = g / (1.f + expf(-g)) * up;
        }
        out[(size_t)p * N + n] = dsv4_t<O>(v);
      }
"""

INPUTS = ("x", "w", "s", "w2", "s2", "ptab", "texp", "fparams", "hw")  # hw: PAIR 3's head weights
# f32_linear(_pair)_rows past MANY_ROWS rows through the tile GEMM; DSV4_TILES_F32=0 (or bench/prefill.py's
# arm f32_simt) keeps the reference's f32 matmul
F32_MANY = os.environ.get("DSV4_TILES_F32", "1").strip() != "0"
_dense: dict[int, mx.array] = {}  # T -> its rows as tiles (a few distinct T: the chunk sizes)


class Plan:
    """One launch (P rows, K, N, tiles, weight format, epilogue), made once per shape."""

    __slots__ = ("dtype", "fparams", "grid", "kernel", "shape", "tmpl")

    def __init__(self, p: int, k: int, n: int, tiles: int, *, wf: int, pair: int, xdiv: int, out: mx.Dtype,
                 limit: float | None = None) -> None:  # fmt: skip
        mt = 1 if pair in (1, 2) else 2
        self.kernel = kernel("tiles_mm", INPUTS, ("out",), SOURCE, header=E2M1 + HEADER + launch_bounds(32 * WR, 2))
        self.tmpl = [("T", mx.bfloat16), ("O", out), ("WF", wf), ("K", k), ("PAIR", pair),
                     ("XDIV", xdiv), ("MT", mt), ("WR", WR), ("TR", TR), ("XS", XS)]  # fmt: skip
        self.grid = (n // (16 * mt * WR) * 32 * WR, tiles, 1)
        self.shape = {2: (2, p, n), 3: (p // TR, n)}.get(pair, (p, n))
        self.dtype = out
        self.fparams = f32_params(float(limit or 0.0), float(p))

    def __call__(self, x: mx.array, w: mx.array, s: mx.array, w2: mx.array, s2: mx.array, ptab: mx.array,
                 texp: mx.array, hw: mx.array | None = None) -> mx.array:  # fmt: skip
        hw = dummy((1,), mx.float32) if hw is None else hw
        return self.kernel(inputs=[x, w, s, w2, s2, ptab, texp, self.fparams, hw], template=self.tmpl, grid=self.grid,
                           threadgroup=(32 * WR, 1, 1), output_shapes=[self.shape],
                           output_dtypes=[self.dtype])[0]  # fmt: skip


def tiles_for(k: int, n: int, pair: int) -> bool:
    """K a multiple of the 128-k chunk, N of a block's weight rows (16 x MT x WR)."""
    return k % CK == 0 and n % (16 * (1 if pair in (1, 2) else 2) * WR) == 0


def _rows(t: int) -> tuple[mx.array, mx.array]:
    """T rows in order as whole tiles of one "expert": (ptab [tiles * TR], -1 past T; texp zeros [tiles])."""
    tiles = -(-t // TR)
    if t not in _dense:
        r = mx.arange(tiles * TR, dtype=mx.int32)
        _dense[t] = mx.where(r < t, r, -1)
        mx.eval(_dense[t])
    return _dense[t], dummy((tiles,), mx.uint32)


def _dense_ok(x: object, *ws: object) -> bool:
    return (isinstance(x, mx.array) and x.ndim == 2 and x.dtype == mx.bfloat16 and x.shape[0] > MANY_ROWS
            and all(isinstance(w, mx.array) and w.ndim == 2 and w.dtype == mx.bfloat16 and w.shape == ws[0].shape
                    and w.shape[1] == x.shape[1] for w in ws))  # fmt: skip


def _f32_many(x: mx.array, w1: mx.array, w2: mx.array, pair: int) -> mx.array | None:
    """x [T, K] bf16 @ w1 (and w2, PAIR 2) [N, K] bf16 -> f32 for T > MANY_ROWS; None where it does not tile."""
    if not _dense_ok(x, w1, w2) or not tiles_for(x.shape[1], w1.shape[0], pair):
        return None
    t, k = x.shape
    ptab, texp = _rows(t)
    p = plan_cached(("f32_many", pair, t, k, w1.shape[0]),
                    lambda: Plan(t, k, w1.shape[0], texp.shape[0], wf=0, pair=pair, xdiv=1, out=mx.float32))
    return p(x, w1, dummy((4,), mx.uint8), w2, dummy((4,), mx.uint8), ptab, texp)


def f32_linear_many(x: mx.array, w: mx.array) -> mx.array | None:
    """x [T, K] bf16 @ w [N, K] bf16 -> [T, N] f32 for T > MANY_ROWS; None where it does not tile."""
    return _f32_many(x, w, w, 0)


def f32_linear_pair_many(x: mx.array, w1: mx.array, w2: mx.array) -> tuple[mx.array, mx.array] | None:
    """(x @ w1.T, x @ w2.T) in f32 in one launch for T > MANY_ROWS; None where it does not tile."""
    out = _f32_many(x, w1, w2, 2)
    if out is None:
        return None
    return out[:1].reshape(out.shape[1:]), out[1:].reshape(out.shape[1:])


def indexer_scores_cuda(q: mx.array, w: mx.array, keys: mx.array) -> mx.array:
    """kernels.indexer_scores for TR heads, bf16 q and keys, f32 w, past MANY_ROWS rows: one tile GEMM (PAIR 3);
    else the plain twin."""
    ok = (F32_MANY and isinstance(q, mx.array) and q.ndim == 3 and q.shape[1] == TR and isinstance(w, mx.array)
          and w.dtype == mx.float32 and w.shape == q.shape[:2])  # fmt: skip
    x = q.reshape(-1, q.shape[2]) if ok else None
    if not ok or not _dense_ok(x, keys) or not tiles_for(x.shape[1], keys.shape[0], 3):
        return indexer_scores_reference(q, w, keys)
    t, k = x.shape
    ptab, texp = _rows(t)
    p = plan_cached(("idx_scores", t, k, keys.shape[0]),
                    lambda: Plan(t, k, keys.shape[0], texp.shape[0], wf=0, pair=3, xdiv=1, out=mx.float32))
    return p(x, keys, dummy((4,), mx.uint8), keys, dummy((4,), mx.uint8), ptab, texp, w.reshape(-1))
