"""CUDA device code of the skinny matmuls (launch plans and ops: kernels/cuda/matmul.py): 1..8 rows, every
weight byte read once for all rows, on the tensor cores.

One kernel template covers the decode step's weight products (`kernels.matmul` has the plain twins):
- `WF` 0: bf16 weights, f32 out (the products the model runs in f32: compressor kv / gate, router, head;
  bf16 x bf16 is exact in the f32 accumulator, so this equals upcasting the weight);
- `WF` 1: mxfp8 (e4m3 bytes + one e8m0 scale per 32), the dense projections;
- `WF` 2: mxfp4 (e2m1 nibbles + e8m0 per 32), the routed experts.
The batch rows are mma.sync m16n8k16's n = 8 columns (rows >= B are zeros), 16 weight rows its m, so
a warp's 16 x 64-byte weight tile meets each x value once per 16 rows. Weights are decoded in
registers to bf16 exactly (bit moves into a bf16 whose exponent is short by a constant, times the
group's scale with that constant folded in: one bf16x2 multiply, a power of two), in a per-lane order
that the x fragment follows (`prmt`): the dot product does not care about the order of k.
A lane reads 16 contiguous bytes of a row a chunk (64 bytes a row across its 4 lanes: whole sectors).
Warps split K when there are few row tiles (the block sums them in shared memory), `U` chunks' loads
are issued before any is used. `PAIR`: a second weight with the same rows (gate and up), epilogue
SwiGLU (the limit clamp as `model.layers.swiglu`), each product rounded to T first as the reference's
matmul output is; `PAIR` 2: both products out, [2, B, N] (a compressor's kv and gate: one launch, each
product summed exactly as alone); `PAIR` 3 (CAT): a second weight of N2 other rows after the first's N, its
warps reading it instead, out [B, N] then [B, N2] (wq_a and wkv of one x; the two wq_b of one qr).
`EXP` 1 / 2: routed experts; grid.y is the (row, k) pair, the block of an expert's
first pair computes it for every batch row that chose it (the others exit): each distinct expert's
weights are read once a step. EXP 1 takes x [B, K], EXP 2 the pair's own hidden [B * k, K].
`GR` (past 8 rows: a short prompt's forward, up to 64): the rows are 8-row groups, each computed exactly as an
8-row launch of its rows would be (the same bits). `GR` 1: a group a block (grid.y, or grid.z for experts), so
every group reads the weights from DRAM again (a 32-token forward's products 32.9 ms against 8.9 for an 8-row
step's, H200, 2026-12-07). `GR` 2 (DSV4_SKINNY_GROUP_LOOP=1, not yet run on a GPU): each block runs every group in
turn over its weight tile, so DRAM gives the tile once and L2 the later groups; experts: a block is an expert of
any row's pair (the first), and skips the groups none of whose rows chose it. Without GR (the decode step's 1..8
rows) the loop is one group, the code the 8-row kernel's.
"""

from __future__ import annotations

SOURCE = r"""
  constexpr int CK = WF == 0 ? 32 : (WF == 1 ? 64 : 128);   // k values a chunk (64 bytes a row)
  constexpr int RB = WF == 0 ? K * 2 : (WF == 1 ? K : K / 2);  // bytes a weight row
  constexpr int XV = CK / 32;                                // uint4 of x a lane a chunk
  constexpr int NT = (PAIR == 1 || PAIR == 2) ? 2 * MT : MT;  // row tiles a warp
  constexpr int CPW = K / CK / WK;                           // chunks a warp
  constexpr int G32 = K / 32;                                // scale groups a row
  const int NBT = (int)fparams[1];                            // batch rows (1..64; 1..8 unless GR), a runtime value
  const int g0 = GR == 1 ? (EXP ? blockIdx.z : blockIdx.y) : 0;  // GR 1: this block's 8-row group
  const int NG = GR == 2 ? (NBT + 7) / 8 : g0 + 1;              // GR 2: every group, one after another
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wk = warp % WK, wr = warp / WK;
  const int gq = lane >> 2, cq = lane & 3;
  const int rowg = (blockIdx.x * WR + wr) * MT * 16;
  const bool sec = PAIR == 3 && rowg >= N;  // CAT: this warp's rows are the second weight's (a block's all are)
  const int row0 = sec ? rowg - N : rowg;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(sec ? w2 : w);
  const uint8_t* wb2 = reinterpret_cast<const uint8_t*>(w2);
  const uint8_t* sb = sec ? s2 : s;
  const uint8_t* sb2 = s2;
  const int NO = sec ? N2 : N;
  int e = 0;
  if (EXP) {
    const int p = blockIdx.y;  // a pair of the group's rows (GR 1), of any row (else)
    const uint32_t* const ip = idx + (GR == 1 ? (size_t)g0 * 8 * TOPK : 0);
    if (GR == 1 && p >= min(8, NBT - 8 * g0) * TOPK) return;  // the last group's missing rows (uniform)
    e = ip[p];
    for (int q = 0; q < p; ++q)
      if (ip[q] == e) return;  // an earlier pair's block computes this expert (uniform: whole block)
    wb += (size_t)e * N * RB;
    wb2 += (size_t)e * N * RB;
    sb += (size_t)e * N * G32;
    sb2 += (size_t)e * N * G32;
  }
  // GR 2: the groups one after another over the same weight tile, so DRAM gives it once and L2 the later groups;
  // each group's products are summed exactly as an 8-row launch of its rows sums them
  for (int grp = g0; grp < NG; ++grp) {
  const int NB = GR ? min(8, NBT - 8 * grp) : NBT;            // the group's rows (1..8)
  const T* const xg = x + (GR ? (size_t)grp * 8 * (EXP == 2 ? TOPK : 1) * K : 0);
  const uint32_t* const ig = idx + (GR && EXP ? (size_t)grp * 8 * TOPK : 0);
  O* const og = out + (GR ? (size_t)grp * 8 * (EXP ? TOPK : 1) * (PAIR == 3 ? 0 : N) : 0);  // CAT: below
  // CAT: [NBT][N] then [NBT][N2]
  O* const ob = og + (PAIR == 3 ? (sec ? (size_t)NBT * N + (size_t)grp * 8 * N2 : (size_t)grp * 8 * N) : 0);
  int jn = 0, jb0 = -1, jb1 = -1;  // experts: this lane's x row's pair slot; its two output columns' slots
  if (EXP) {
    jn = -1;
    bool any = GR != 2;
#pragma unroll
    for (int j = 0; j < TOPK; ++j) {
      if (gq < NB && ig[gq * TOPK + j] == e) jn = j;
      if (2 * cq < NB && ig[2 * cq * TOPK + j] == e) jb0 = j;
      if (2 * cq + 1 < NB && ig[(2 * cq + 1) * TOPK + j] == e) jb1 = j;
    }
    if (GR == 2)
      for (int q = 0; q < NB * TOPK; ++q) any |= ig[q] == e;
    if (!any) continue;  // no row of this group chose the expert (uniform: whole block)
  }
  const bool xok = gq < NB && jn >= 0;
  const T* xr = xg + (size_t)(EXP == 2 ? gq * TOPK + (jn < 0 ? 0 : jn) : gq) * K;
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
  const int c0 = wk * CPW;
  for (int c = c0; c < c0 + CPW; c += U) {
    uint4 xv[U][XV];
    uint4 wv[NT][2][U];
    uint32_t sv[NT][2][U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int v = 0; v < XV; ++v)
        xv[u][v] = xok ? __ldg(reinterpret_cast<const uint4*>(xr + (c + u) * CK + cq * (CK / 4)) + v)
                       : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + (t % MT) * 16 + gq + 8 * h;
        const uint8_t* wt = (NT > MT && t >= MT) ? wb2 : wb;
        const uint8_t* st = (NT > MT && t >= MT) ? sb2 : sb;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          wv[t][h][u] = __ldg(reinterpret_cast<const uint4*>(wt + (size_t)row * RB + (c + u) * 64 + cq * 16));
          sv[t][h][u] = WF ? (uint32_t)__ldg(st + (size_t)row * G32 + ((c + u) * CK + cq * (CK / 4)) / 32) : 0u;
        }
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      constexpr int SPC = CK / 16;  // mma steps a chunk
      uint32_t b0[SPC], b1[SPC];
      const uint32_t* X = reinterpret_cast<const uint32_t*>(xv[u]);
#pragma unroll
      for (int st = 0; st < SPC; ++st) {
        if (WF == 0) {
          b0[st] = X[2 * st];
          b1[st] = X[2 * st + 1];
        } else if (WF == 1) {
          b0[st] = __byte_perm(X[2 * st], X[2 * st + 1], 0x5410);
          b1[st] = __byte_perm(X[2 * st], X[2 * st + 1], 0x7632);
        } else {
          const int q = st >> 1, r = st & 1;
          b0[st] = __byte_perm(X[4 * q + r], X[4 * q + 2 + r], 0x5410);
          b1[st] = __byte_perm(X[4 * q + r], X[4 * q + 2 + r], 0x7632);
        }
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        __nv_bfloat162 f[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // e8m0 scale with the decode's exponent shortfall folded in: 2^(s-127) * 2^120 (e4m3), * 2^126 (e2m1)
          const float fs = WF ? ldexpf(1.f, (int)sv[t][h][u] - (WF == 1 ? 7 : 1)) : 1.f;
          f[h] = __floats2bfloat162_rn(fs, fs);
        }
        const uint32_t* W0 = reinterpret_cast<const uint32_t*>(&wv[t][0][u]);
        const uint32_t* W1 = reinterpret_cast<const uint32_t*>(&wv[t][1][u]);
#pragma unroll
        for (int st = 0; st < SPC; ++st) {
          uint32_t a[4];
          if (WF == 0) {
            a[0] = W0[2 * st]; a[1] = W1[2 * st]; a[2] = W0[2 * st + 1]; a[3] = W1[2 * st + 1];
          } else {
            uint32_t lo[2], hi[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint32_t* Wh = h ? W1 : W0;
              if (WF == 1) {  // bytes (0, 2) and (1, 3) of word st into bf16 pairs
                const uint32_t q = Wh[st], q8 = q << 8;
                lo[h] = (q8 & 0x80008000u) | ((q8 & 0x7F007F00u) >> 4);
                hi[h] = (q & 0x80008000u) | ((q & 0x7F007F00u) >> 4);
              } else {
                dsv4_e2m1_bits(Wh[st >> 1] >> (8 * (st & 1)), lo[h], hi[h]);
              }
              __nv_bfloat162 l2 = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&lo[h]), f[h]);
              __nv_bfloat162 h2 = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&hi[h]), f[h]);
              lo[h] = *reinterpret_cast<uint32_t*>(&l2);
              hi[h] = *reinterpret_cast<uint32_t*>(&h2);
            }
            a[0] = lo[0]; a[1] = lo[1]; a[2] = hi[0]; a[3] = hi[1];
          }
          dsv4_mma(acc[t], a, b0[st], b1[st], __nv_bfloat16());
        }
      }
    }
  }
  if (WK > 1) {
    __shared__ float red[(WK > 1 ? WK - 1 : 1) * WR * NT * 128];
    if (wk > 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[(((wk - 1) * WR + wr) * NT + t) * 128 + i * 32 + lane] = acc[t][i];
    }
    __syncthreads();
    if (GR != 2 && wk > 0) return;
    if (wk == 0)
      for (int k2 = 1; k2 < WK; ++k2)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[t][i] += red[(((k2 - 1) * WR + wr) * NT + t) * 128 + i * 32 + lane];
    if (GR == 2) __syncthreads();  // read before the next group writes it
    if (wk > 0) continue;
  }
  const float lim = fparams[0];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + t * 16 + gq + 8 * (i >> 1);
      const int b = 2 * cq + (i & 1);
      if (b >= NB) continue;
      int orow = b;
      if (EXP) {
        const int j = (i & 1) ? jb1 : jb0;
        if (j < 0) continue;
        orow = b * TOPK + j;
      }
      float v = acc[t][i];
      if (PAIR == 2) {  // both products: out [2][NBT][N] (out is at this group's first row of the first)
        og[(size_t)orow * N + row] = dsv4_t<O>(v);
        og[((size_t)NBT + orow) * N + row] = dsv4_t<O>(acc[t + MT][i]);
        continue;
      }
      if (PAIR == 1) {  // SwiGLU of the two products, each rounded to T first (the reference's matmul outputs)
        float g = dsv4_f(dsv4_t<T>(v)), up = dsv4_f(dsv4_t<T>(acc[t + MT][i]));
        if (lim > 0.f) {
          g = fminf(g, lim);
          up = fminf(fmaxf(up, -lim), lim);
        }
        v = g / (1.f + expf(-g)) * up;
      }
      ob[(size_t)orow * NO + row] = dsv4_t<O>(v);
    }
  }
"""
