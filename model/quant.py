"""Release storage codecs (spec section 4): FP8 e4m3 + UE8M0 per 128x128 block, FP4 e2m1 + UE8M0 per 32.

Decoding goes through 256-entry lookup tables, so it is bit exact in f32 (a code value times a power of
two is always representable, or overflows to inf exactly like the format's own arithmetic). Encoding
(used by the release-format writer) rounds to nearest, ties to the even code, and saturates.
The MLX mapping repacks the raw bytes for `mxfp8` / `mxfp4` quantized matmuls without decoding them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from dsv4_serve.kernels import experts_grouped
from dsv4_serve.kernels import matmul as kmatmul

FP8_BLOCK = 128  # UE8M0 scale per 128x128 block of an FP8 weight
FP4_GROUP = 32  # UE8M0 scale per 32 consecutive values of an FP4 expert row
# The nn.Linear modules the release stores as FP8, kept as mxfp8 QuantizedLinear (the loader and quantize_model
# both read this one list). All are called as modules but wo_a, whose weight is read by groups
# (model.attention's output: kernels.matmul.grouped_qlinear_rows on the mxfp8 weight, an einsum on a float one).
FP8_LINEAR = (
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_a",
    "attn.wo_b",
    "attn.indexer.wq_b",
    "ffn.shared_experts.w1",
    "ffn.shared_experts.w2",
    "ffn.shared_experts.w3",
    "e_proj",  # the MTP block's input projections (model/mtp.py)
    "h_proj",
)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)  # e4m3fn: no inf, one NaN per sign
    return (sign * mag).astype(np.float32)


E4M3_LUT = _e4m3_table()
# UE8M0: byte b is 2^(b-127); 0xFF is NaN. np.ldexp keeps 2^-127 exact (an f32 subnormal).
UE8M0_LUT = np.append(np.ldexp(np.float32(1), np.arange(255) - 127), np.nan).astype(np.float32)
# FP4 nibble -> value; bit 3 is the sign.
E2M1_LUT = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
# Byte -> (low nibble value, high nibble value): element 2j is the low nibble of byte j.
FP4_PAIR_LUT = np.stack([E2M1_LUT[np.arange(256) & 0xF], E2M1_LUT[np.arange(256) >> 4]], axis=-1)


def fp8_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    n, k = shape
    return -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)


def fp4_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """Scale grid of a *logical* [N, K] FP4 weight."""
    n, k = shape
    return n, k // FP4_GROUP


# ---- decoding (MLX, lazy, one tensor at a time) --------------------------------------------------
def _expand_blocks(scale: mx.array, n: int, k: int) -> mx.array:
    s = mx.repeat(mx.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return s[:n, :k]


def dequant_fp8(q: mx.array, scale: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """q: raw e4m3 bytes [N, K] (uint8); scale: UE8M0 bytes [ceil(N/128), ceil(K/128)], or f32 values."""
    n, k = q.shape
    vals = mx.array(E4M3_LUT)[q.astype(mx.uint32)]
    if scale.dtype == mx.uint8:
        scale = mx.array(UE8M0_LUT)[scale.astype(mx.uint32)]
    return (vals * _expand_blocks(scale.astype(mx.float32), n, k)).astype(dtype)


def dequant_fp4(packed: mx.array, scale: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """packed: [N, K/2] bytes (int8 or uint8, low nibble first); scale: UE8M0 bytes [N, K/32]."""
    n, half = packed.shape
    vals = mx.array(FP4_PAIR_LUT)[packed.view(mx.uint8).astype(mx.uint32)].reshape(n, 2 * half)
    s = mx.array(UE8M0_LUT)[scale.astype(mx.uint32)]
    return (vals * mx.repeat(s, FP4_GROUP, axis=1)).astype(dtype)


# ---- MLX quantized layout (bit exact, spec "MLX mapping") ---------------------------------------
def fp8_to_mxfp8(q: mx.array, scale: mx.array) -> tuple[mx.array, mx.array]:
    """-> (weight uint32 [N, K/4], scales uint8 [N, K/32]) for mode='mxfp8', group_size=32."""
    n, k = q.shape
    s = mx.repeat(mx.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK // 32, axis=1)[:n, : k // 32]
    return q.view(mx.uint32), s.astype(mx.uint8)


def fp4_to_mxfp4(packed: mx.array, scale: mx.array) -> tuple[mx.array, mx.array]:
    """-> (weight uint32 [..., N, K/8], scales uint8 [..., N, K/32]) for mode='mxfp4', group_size=32."""
    return packed.view(mx.uint8).view(mx.uint32), scale.astype(mx.uint8)


class RowsQuantizedLinear(nn.QuantizedLinear):
    """An mxfp8 QuantizedLinear whose 2-D calls go through `kernels.qlinear_rows` (on CUDA, 1..8 rows read the
    weight once on the tensor cores; more rows and other devices: MLX's quantized_matmul, as the base)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 2:
            return kmatmul.qlinear_rows(x, self.weight, self.scales)
        return super().__call__(x)


def linear_cat(x: mx.array, a: nn.Module, b: nn.Module) -> tuple[mx.array, mx.array]:
    """(a(x), b(x)) for two projections of one input: two mxfp8 RowsQuantizedLinear of a 2-D x go through
    `kernels.qlinear_cat_rows` (one launch on CUDA), anything else as two calls."""
    if x.ndim == 2 and isinstance(a, RowsQuantizedLinear) and isinstance(b, RowsQuantizedLinear):
        return kmatmul.qlinear_cat_rows(x, a.weight, a.scales, b.weight, b.scales)
    return a(x), b(x)


def mxfp8_linear(weight: mx.array, scales: mx.array) -> nn.QuantizedLinear:
    n, k4 = weight.shape
    lin = RowsQuantizedLinear(k4 * 4, n, bias=False, group_size=32, bits=8, mode="mxfp8")
    lin.weight, lin.scales = weight, scales
    return lin


class QuantizedExperts(nn.Module):
    """Drop-in for model.layers.Experts with mxfp4 weights: per (row, k) pair for 1..8 rows (decode), one
    grouped GEMM per projection past that (prefill).

    Parameters: w1/w2/w3 (uint32 packed) and w1_scales/w2_scales/w3_scales (uint8), stacked [E, ...]."""

    def __init__(self, w: dict[str, mx.array], limit: float):
        super().__init__()
        for key, value in w.items():
            setattr(self, key, value)
        self.limit = limit

    def __call__(self, x: mx.array, idx: mx.array, w: mx.array) -> mx.array:
        if self._grouped(x):  # prefill: one grouped GEMM a projection over the pairs sorted by expert
            return experts_grouped.grouped_experts(x, idx, w, self.w1, self.w1_scales, self.w2, self.w2_scales,
                                                   self.w3, self.w3_scales, limit=self.limit)  # fmt: skip
        return mx.sum(self.pairs(x, idx).astype(mx.float32) * w[:, :, None], axis=1)

    def _grouped(self, x: mx.array) -> bool:
        # a short prompt (9..64 rows) runs per pair too, in 8-row slices (`pairs`), where the grouped GEMM would
        # dequantize every expert of the layer
        short = kmatmul.fast_sliced("experts_gate_up_rows", x) is not None
        many = x.ndim == 2 and x.shape[0] > experts_grouped.GROUPED_ROWS
        return not short and many and experts_grouped.mode() != "off"

    def routed(self, x: mx.array, idx: mx.array, w: mx.array) -> mx.array:
        """Each (row, k) pair's product [B, k, H] in x.dtype, not yet weighted by `w` (checked only): grouped
        past 64 rows (prefill), else `pairs`; for the MoE's fused combine (`kernels.moe_combine_post_rows`)."""
        if self._grouped(x):
            return experts_grouped.grouped_experts(x, idx, w, self.w1, self.w1_scales, self.w2, self.w2_scales,
                                                   self.w3, self.w3_scales, limit=self.limit, pairs=True)  # fmt: skip
        return self.pairs(x, idx)

    def pairs(self, x: mx.array, idx: mx.array) -> mx.array:
        """Each (row, k) pair through its expert -> [B, k, H] in x.dtype. kernels.matmul: on CUDA, 1..8 rows
        in two launches that read each distinct expert once; else MLX's gather_qmm per pair."""
        fast = kmatmul.fast_sliced("experts_gate_up_rows", x)
        down = kmatmul.fast_sliced("experts_down_rows", x)
        if fast is not None and x.shape[0] > min(kmatmul.launch_rows(fast), kmatmul.launch_rows(down)):
            # 9..64 rows the fast ops take only 8 at a time: 8-row slices, each reading its slice's distinct experts
            # once (the CUDA kernels take 64 as 8-row groups, each group's experts read once)
            return mx.concatenate([self.pairs(x[a:b], idx[a:b]) for a, b in kmatmul.slices(x.shape[0])])
        ri = idx.astype(mx.uint32)
        hdn = kmatmul.experts_gate_up_rows(x, ri, self.w1, self.w1_scales, self.w3, self.w3_scales, limit=self.limit)
        return kmatmul.experts_down_rows(hdn, ri, self.w2, self.w2_scales)


# ---- encoding (NumPy; release-format writer) -----------------------------------------------------
def _round_to_codes(x: np.ndarray, pos_values: np.ndarray) -> np.ndarray:
    """Index of the nearest value in ascending `pos_values` for |x|, ties to the even index, saturating."""
    a = np.minimum(np.abs(x), pos_values[-1])
    hi = np.clip(np.searchsorted(pos_values, a), 1, len(pos_values) - 1)
    lo = hi - 1
    dlo, dhi = a - pos_values[lo], pos_values[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def _ue8m0_for(amax: np.ndarray, top: float) -> np.ndarray:
    """Smallest power-of-two scale with amax / scale <= top, as a UE8M0 byte."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax / top, 1.0)))
    return np.clip(e + 127, 0, 254).astype(np.uint8)


def encode_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32 [N, K] -> (e4m3 bytes uint8 [N, K], UE8M0 bytes uint8 [ceil(N/128), ceil(K/128)])."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    gn, gk = fp8_grid(w.shape)
    padded = np.zeros((gn * FP8_BLOCK, gk * FP8_BLOCK), np.float32)
    padded[:n, :k] = np.abs(w)
    amax = padded.reshape(gn, FP8_BLOCK, gk, FP8_BLOCK).max(axis=(1, 3))
    sb = _ue8m0_for(amax, 448.0)
    s = np.repeat(np.repeat(UE8M0_LUT[sb], FP8_BLOCK, 0), FP8_BLOCK, 1)[:n, :k]
    pos = E4M3_LUT[:127]  # codes 0..126 are the ascending non-negative finite values
    codes = _round_to_codes(w / s, pos).astype(np.uint8)
    return np.where(w < 0, codes | 0x80, codes).astype(np.uint8), sb


def encode_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32 [N, K] -> (packed int8 [N, K/2], low nibble = even element; UE8M0 bytes uint8 [N, K/32])."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % FP4_GROUP:
        raise ValueError(f"encode_fp4: K={k} must be a multiple of {FP4_GROUP}")
    amax = np.abs(w).reshape(n, k // FP4_GROUP, FP4_GROUP).max(axis=-1)
    sb = _ue8m0_for(amax, 6.0)
    s = np.repeat(UE8M0_LUT[sb], FP4_GROUP, axis=1)
    codes = _round_to_codes(w / s, E2M1_VALUES).astype(np.uint8)
    codes = np.where(w < 0, codes | 0x8, codes).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(np.int8), sb


# ---- in-memory quantization (benchmarks on random weights; the loader keeps released FP8/FP4 as is) ------
def quantize_block(block: nn.Module) -> nn.Module:
    """The release's storage formats on one in-memory float decoder block: its FP8 projections (`FP8_LINEAR`)
    as mxfp8 RowsQuantizedLinear, its routed experts as mxfp4 QuantizedExperts."""
    nn.quantize(block, group_size=32, bits=8, mode="mxfp8",
                class_predicate=lambda path, m: isinstance(m, nn.Linear) and path in FP8_LINEAR)  # fmt: skip
    swap = [(path, mxfp8_linear(m.weight, m.scales)) for path, m in block.named_modules()
            if type(m) is nn.QuantizedLinear]  # fmt: skip
    block.update_modules(tree_unflatten(swap))
    ex = block.ffn.experts
    w = {}
    for name in ("w1", "w2", "w3"):
        w[name], w[f"{name}_scales"] = mx.quantize(getattr(ex, name), group_size=FP4_GROUP, bits=4, mode="mxfp4")
    block.ffn.experts = QuantizedExperts(w, ex.limit)
    return block


def quantize_model(model: nn.Module, mode: str = "mxfp") -> nn.Module:
    """quantize_block on every block of an in-memory float model (benchmarks on random weights; the loader
    keeps a release checkpoint's FP8 / FP4 bytes as they are)."""
    if mode != "mxfp":
        raise ValueError(f"quantize_model: mode must be 'mxfp', got {mode!r}")
    for block in model.blocks():
        quantize_block(block)
        mx.eval(block.parameters())
    model.reset_compiled()  # compiled segments captured the float modules
    return model
