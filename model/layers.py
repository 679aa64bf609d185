"""Building blocks: RMSNorm, RoPE frequencies (YaRN), mHC hyper-connections, MoE.

Parameter names follow the release checkpoint (spec section 4) so loading is a rename-free copy;
the only exception is the routed experts, stacked per layer as `experts.w1/w2/w3` [E, out, in].
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dsv4_serve import kernels
from dsv4_serve.kernels import matmul as kmatmul
from dsv4_serve.kernels.experts_grouped import GROUPED_ROWS
from dsv4_serve.model.config import ModelArgs


class RMSNorm(nn.Module):
    """Computed in f32, weight applied in f32, cast back (as REF and transformers)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        # kernels.rms_norm_rows: f32 statistics, x * rsqrt(.) and the weight in f32, one rounding, as REF
        # (MLX's fused norm rounds x * rsqrt(.) before a weight). Its reference is 3 kernels (cast, norm,
        # weight + cast), the CUDA one 1: at <= 8 rows each is host time, 4 of these a layer.
        return kernels.rms_norm_rows(x, self.weight, eps=self.eps)


def rms(x: mx.array, eps: float) -> mx.array:
    """Unweighted RMSNorm (q heads, mHC input): f32 statistics and product, one rounding to x.dtype, as
    REF. MLX's fused op (1 graph node instead of 3) does exactly that when there is no weight; with a
    weight it rounds x * rsqrt(.) to x.dtype before the weight multiply, hence RMSNorm above stays."""
    return mx.fast.rms_norm(x, None, eps)


def inv_freq(args: ModelArgs, compressed: bool) -> mx.array:
    """Per-pair inverse frequencies. Sliding layers: rope_theta, no YaRN. CSA/HCA: compress theta + YaRN
    without any magnitude factor (spec 2.3). Computed in f32 like transformers, for logit parity."""
    rd = args.qk_rope_head_dim
    base = args.compress_rope_theta if compressed else args.rope_theta
    pos = np.float32(base) ** (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd))
    extra = (1.0 / pos).astype(np.float32)
    yarn = args.yarn
    if not compressed or yarn is None:
        return mx.array(extra)
    factor = float(yarn["factor"])
    orig = float(yarn["original_max_position_embeddings"])

    def corr(n_rot: float) -> float:
        return rd * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr(float(yarn["beta_fast"]))), 0)
    hi = min(math.ceil(corr(float(yarn["beta_slow"]))), rd - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(rd // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1).astype(np.float32)
    inter = (1.0 / (factor * pos)).astype(np.float32)
    return mx.array((inter * ramp + extra * (1 - ramp)).astype(np.float32))


def rope_cos_sin(freqs: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
    """cos/sin [B, rd/2] f32 at each row's own position."""
    ang = positions.astype(mx.float32)[:, None] * freqs[None, :]
    return mx.cos(ang), mx.sin(ang)


def rope_angles(freqs: mx.array, positions: mx.array, ratio: int, args: ModelArgs) -> tuple[mx.array, ...]:
    """A layer kind's RoPE inputs, the same for every layer of the kind: computed once per step
    (RowBatch.once), outside the layers' compiled segments.

    (C, S): `kernels.rope_tables` for the head_dim vectors (q, the window kv, the output) at each row's
    position; then, with a compressor, (ccos, csin) at the position of the entry it would emit this step
    (the window's first token, p + 1 - ratio); then, in CSA layers, the index_head_dim tables (C, S) of
    the indexer's q."""
    cos, sin = rope_cos_sin(freqs, positions)
    out = kernels.rope_tables(cos, sin, args.head_dim)
    if ratio:
        out += rope_cos_sin(freqs, mx.maximum(positions + 1 - ratio, 0))
    if ratio == 4:
        out += kernels.rope_tables(cos, sin, args.index_head_dim)
    return out


def step_angles(freqs: mx.array, positions: mx.array, ratio: int, args: ModelArgs) -> tuple[mx.array, ...]:
    """The decode step's `rope_angles` and, last, -S (the output's de-rotation): `kernels.rope_step_tables`, the
    same ops under mx.compile (one function a layer kind, traced once a batch size: their ~20-45 small ops are a
    few fused kernels; the same values bit for bit, checked on the CPU; on CUDA the fused kernel calls the same
    cosf / sinf, MLX compiles neither with fast math, and no product meets a sum to contract), one kernel with
    DSV4_GRAPH_GLUE=1 on CUDA. Prefill's T-row positions call rope_angles itself: a trace a T would cost more
    than it saves."""
    return kernels.rope_step_tables(freqs, positions, ratio=ratio, head_dim=args.head_dim,
                                    index_dim=args.index_head_dim)  # fmt: skip


# Keyed by the scalars they bake in, not id(args); never freed: a reset moves them to `_retired`, since a freed
# compiled function's traces can outlive it in another thread's cache (model/block.py, issue 57).
_compiled_pre: dict[object, object] = {}
_retired: list[object] = []


def reset_compiled() -> None:
    """Forget the compiled pre-mix functions (they traced the kernel choice of their first call; a call
    inside a compiled segment retraces anyway, a direct call, as in prefill, does not) and the RoPE tables'."""
    _retired.extend(_compiled_pre.values())
    _compiled_pre.clear()


def _hc_pre(
    h: mx.array, fn: mx.array, base: mx.array, scale: mx.array, args: ModelArgs
) -> tuple[mx.array, mx.array, mx.array]:
    """The mHC pre-mix alone, as the model ran it before its norm joined it (tools/step_nodes.py counts it)."""
    return kernels.hc_pre_rows(h, fn, scale, base, iters=args.hc_sinkhorn_iters, eps=args.hc_eps,
                               norm_eps=args.rms_norm_eps)


def hc_pre_norm(
    h: mx.array, fn: mx.array, base: mx.array, scale: mx.array, norm: RMSNorm, args: ModelArgs
) -> tuple[mx.array, mx.array, mx.array]:
    """h [B, nc, H] -> (the unit's RMSNorm of its block input x [B, H], post [B, nc], comb C [B, nc, nc]); all
    mixing in f32. `kernels.hc_pre_norm_rows`: one kernel on CUDA; its composition (the input RMS, the logits,
    the ~100-op mixing, the norm) is compiled here, so a direct call (prefill's) replays it."""
    key = (args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps, norm.eps)
    f = _compiled_pre.get(key)
    if f is None:
        f = _compiled_pre[key] = mx.compile(functools.partial(_hc_pre_norm, key=key))
    return f(h, fn, base, scale, norm.weight)


def _hc_pre_norm(h: mx.array, fn: mx.array, base: mx.array, scale: mx.array, weight: mx.array,
                 key: tuple[int, float, float, float]) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    iters, eps, norm_eps, x_eps = key
    return kernels.hc_pre_norm_rows(h, fn, scale, base, weight, iters=iters, eps=eps, norm_eps=norm_eps,
                                    x_eps=x_eps)  # fmt: skip


def hc_post(y: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """h'[k] = post[k] * y + sum_j C[j, k] h[j] in f32, h.dtype out (kernels.hc_post_rows: one kernel on
    CUDA, a cast + an f32 batched matmul + a fused tail in the reference)."""
    return kernels.hc_post_rows(y, h, post, comb)


def hc_head(h: mx.array, fn: mx.array, base: mx.array, scale: mx.array, args: ModelArgs) -> mx.array:
    """HyperHead: sigmoid weights only, no Sinkhorn and no post (kernels.hc_head_rows)."""
    return kernels.hc_head_rows(h, fn, scale, base, norm_eps=args.rms_norm_eps, hc_eps=args.hc_eps)


def swiglu(gate: mx.array, up: mx.array, limit: float | None) -> mx.array:
    if limit:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    return nn.silu(gate) * up


class Gate(nn.Module):
    """Router: sqrt(softplus) scores; hash layers select by tid2eid[token], others by top-k(s + bias)."""

    def __init__(self, args: ModelArgs, hashed: bool):
        super().__init__()
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        if hashed:
            self.tid2eid = mx.zeros((args.vocab_size, args.num_experts_per_tok), dtype=mx.int32)
        else:
            self.bias = mx.zeros((args.n_routed_experts,))
        self.hashed = hashed
        self.k = args.num_experts_per_tok
        self.route_scale = args.routed_scaling_factor

    def __call__(self, x: mx.array, token_ids: mx.array) -> tuple[mx.array, mx.array]:
        logits = kmatmul.f32_linear_rows(x, self.weight)  # REF: f32 product, the weight upcast
        if not self.hashed:  # scores, biased top-k, normalised weights: kernels.router_topk (1 kernel on CUDA)
            return kernels.router_topk(logits, self.bias, k=self.k, route_scale=self.route_scale)
        # uint32 expert ids (the dtype gather_mm takes) and their normalised weights: kernels.router_hash
        return kernels.router_hash(logits, self.tid2eid, token_ids, route_scale=self.route_scale)


_lhs_cache: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}


def expert_lhs_indices(b: int, k: int) -> tuple[mx.array, mx.array]:
    """gather_mm's lhs indices for x [B, 1, 1, H] ([B, 1]: row b) and for the hidden [B, k, 1, I]
    ([B, k]: b * k + j), as the defaults MLX would build, but made once from NumPy: passed in, they
    are constants, where the defaults are an arange + a cast node per call (6 per MoE)."""
    key = (b, k)
    if key not in _lhs_cache:
        _lhs_cache[key] = (mx.array(np.arange(b, dtype=np.uint32)[:, None]),
                           mx.array(np.arange(b * k, dtype=np.uint32).reshape(b, k)))  # fmt: skip
    return _lhs_cache[key]


class Experts(nn.Module):
    """Routed experts stacked [E, out, in]; one gathered matmul per projection for the whole batch."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, inter, hid = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
        self.w1 = mx.zeros((e, inter, hid))
        self.w2 = mx.zeros((e, hid, inter))
        self.w3 = mx.zeros((e, inter, hid))
        self.limit = args.swiglu_limit

    def __call__(self, x: mx.array, idx: mx.array, w: mx.array) -> mx.array:
        return mx.sum(self.pairs(x, idx).astype(mx.float32) * w[:, :, None], axis=1)  # [B, k, H] -> [B, H]

    def routed(self, x: mx.array, idx: mx.array, w: mx.array) -> mx.array:
        """Each pair's product [B, k, H], not yet weighted by `w` (model.quant.QuantizedExperts groups them)."""
        return self.pairs(x, idx)

    def pairs(self, x: mx.array, idx: mx.array) -> mx.array:
        """Each (row, k) pair through its expert -> [B, k, H]."""
        # MLX's CPU gather_mm is f32-only: there, run a bf16 model's experts in f32.
        ct = mx.float32 if mx.default_device() == mx.cpu else x.dtype
        xe = x[:, None, None, :].astype(ct)  # [B, 1, 1, H]: broadcast against idx [B, k]
        rows, hid_rows = expert_lhs_indices(*idx.shape)
        ri = idx.astype(mx.uint32)  # the router's ids are uint32 already (no node); other callers' are cast
        g = mx.gather_mm(xe, self.w1.astype(ct).swapaxes(-1, -2), lhs_indices=rows, rhs_indices=ri)
        u = mx.gather_mm(xe, self.w3.astype(ct).swapaxes(-1, -2), lhs_indices=rows, rhs_indices=ri)
        hdn = swiglu(g.astype(mx.float32), u.astype(mx.float32), self.limit).astype(ct)
        out = mx.gather_mm(hdn, self.w2.astype(ct).swapaxes(-1, -2), lhs_indices=hid_rows, rhs_indices=ri)
        return out[:, :, 0, :]


class SharedExpert(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.moe_intermediate_size, bias=False)
        self.w2 = nn.Linear(args.moe_intermediate_size, args.hidden_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.moe_intermediate_size, bias=False)
        self.limit = args.swiglu_limit if args.clamp_shared_expert else None

    def __call__(self, x: mx.array) -> mx.array:
        return self.project(x).astype(mx.float32)

    def project(self, x: mx.array) -> mx.array:
        """The shared expert's output in x's dtype (its down projection's)."""
        w1, w3 = self.w1, self.w3
        if x.ndim == 2 and isinstance(w1, nn.QuantizedLinear) and w1.mode == "mxfp8" == w3.mode:
            # one launch for both products and the SwiGLU on CUDA (kernels.matmul)
            h = kmatmul.swiglu_rows(x, w1.weight, w1.scales, w3.weight, w3.scales, limit=self.limit)
        else:
            h = swiglu(w1(x).astype(mx.float32), w3(x).astype(mx.float32), self.limit).astype(x.dtype)
        return self.w2(h)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.gate = Gate(args, hashed=args.is_hash_layer(layer))
        self.experts = Experts(args)
        self.shared_experts = SharedExpert(args)

    def post_mixed(self, x: mx.array, token_ids: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
        """The MoE's output through its unit's mHC post-mix (`hc_post`): the router-weighted combine, the
        shared expert and the post-mix are one op (`kernels.moe_combine_post_rows`, one launch on CUDA) for
        decode's rows and prefill's alike (the latter's pairs from the grouped GEMMs, in pair order)."""
        if x.ndim == 2:
            idx, w = self.gate(x, token_ids)
            shared = self.shared_experts.project(x)
            return kernels.moe_combine_post_rows(self.experts.routed(x, idx, w), w, shared, h, post, comb)
        return hc_post(self(x, token_ids), h, post, comb)

    def __call__(self, x: mx.array, token_ids: mx.array) -> mx.array:
        idx, w = self.gate(x, token_ids)
        if x.ndim == 2 and x.shape[0] <= GROUPED_ROWS:  # decode's rows: per pair, then one combine
            return kernels.moe_combine_rows(self.experts.pairs(x, idx), w, self.shared_experts.project(x),
                                            out_dtype=x.dtype)  # fmt: skip
        return (self.experts(x, idx, w) + self.shared_experts(x)).astype(x.dtype)
