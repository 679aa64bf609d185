"""The routed experts of a prefill forward on CUDA: two tile GEMMs (kernels/cuda/tiles_mm.py) on the mxfp4
weights as stored.

`kernels.experts_grouped`'s `tiles` form (the plain twin) dequantizes every expert of the layer to bf16 and
runs MLX's gather_mm over TILE_ROWS-row tiles of one expert's pairs, with the pairs gathered into a sorted
copy and back. On the H200 at a 2,048-token forward of V4-Flash that was ~53% of the forward's GPU time
(PART=accept, 6f0bde6, 2026-12-02: gather_mm 136 ms, the all-experts dequantized copy 129 ms, the sorted
copies' gathers 62 ms, SwiGLU's f32 clamps 38 ms); the copy alone is a fixed ~127 ms a forward whatever
its length. Here the same tiles (`tiles`' ptab / tile experts) go through gate + up with the SwiGLU
epilogue (hidden [P, I] in pair order, x rows gathered in the kernel) and down ([P, H] in pair order); the
router-weighted sum over k stays the reference's f32 ops.

Nsight Compute (H200, e4b4565) finds both GEMMs bound by L2 traffic (72-74% of its throughput, DRAM 4-5%,
SM 37-42%, 12% occupancy at 194 registers), most of it each block gathering its tile's x rows. 8 warps a
block (one gather for twice the weight rows) was slower on the whole forward (2K: 6,304 against 6,830
tokens/s, 146 against ~138 ms of these GEMMs; 2026-12-03, 2094d6e..08b7568): not kept.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels import experts_grouped as ref
from dsv4_serve.kernels.cuda.common import plan_cached
from dsv4_serve.kernels.cuda.tiles_mm import TR, Plan, tiles_for


def fits(x: mx.array, w1: mx.array, w2: mx.array) -> bool:
    """bf16 rows and weights that tile: gate / up K = H, N = I; down K = I, N = H."""
    hid, inter = x.shape[1], w1.shape[1]
    return x.dtype == mx.bfloat16 and w2.shape[1] == hid and tiles_for(hid, inter, 1) and tiles_for(inter, hid, 0)


def grouped_experts_cuda(x: mx.array, idx: mx.array, weights: mx.array, w1: mx.array, s1: mx.array, w2: mx.array,
                         s2: mx.array, w3: mx.array, s3: mx.array, *, limit: float | None,
                         pairs: bool = False) -> mx.array:  # fmt: skip
    """`kernels.experts_grouped.grouped_experts` (same arguments, checks and result) as two tile GEMMs on the
    mxfp4 weights; shapes that do not tile run the plain `tiles` form."""
    ref.check_grouped("grouped_experts", x, idx, weights, w1, s1, w2, s2, w3, s3)
    if not fits(x, w1, w2):
        return ref.grouped_experts(x, idx, weights, w1, s1, w2, s2, w3, s3, limit=limit, how="tiles", pairs=pairs)
    b, k = idx.shape
    hid, inter, e = x.shape[1], w1.shape[1], w1.shape[0]
    ptab, texp = ref.tile_table(idx.reshape(-1).astype(mx.uint32), e)  # the pair a tile row holds, each tile's expert
    tiles = ptab.shape[0] // TR
    key = ("grouped_experts", b * k, hid, inter, tiles, limit)
    up = plan_cached(key + ("up",), lambda: Plan(b * k, hid, inter, tiles, wf=2, pair=1, xdiv=k, out=mx.bfloat16,
                                                 limit=limit))  # fmt: skip
    down = plan_cached(key + ("down",), lambda: Plan(b * k, inter, hid, tiles, wf=2, pair=0, xdiv=1, out=mx.bfloat16))
    hdn = up(x, w1, s1, w3, s3, ptab, texp)  # [B * k, I] in pair order
    out = down(hdn, w2, s2, w2, s2, ptab, texp)  # [B * k, H]
    if pairs:
        return out.reshape(b, k, hid)
    return mx.sum(out.reshape(b, k, hid).astype(mx.float32) * weights[:, :, None], axis=1)
