"""The decode step's MLX glue between launches, as ops (plain-MLX references and their checks).

Each was a few MLX ops in the model between two of its kernels; a CUDA graph replays launches only, so on CUDA
(`DSV4_GRAPH_GLUE=1`, kernels/cuda/glue.py, glue_rope.py) each is an own kernel. The references are the model's
former code, unchanged, and what runs on the CPU, on Metal and with the switch off:
- `rope_step_tables(freqs, positions, *, ratio, head_dim, index_dim)`: a layer kind's RoPE tables of the step's
  positions (model.layers.rope_angles, then -S), compiled: (C, S[, ccos, csin][, Ci, Si], -S).
- `rms_rope_ring_rows(x, c, s, window, slots, positions, ring, *, weight, eps)`: the window kv's norm + RoPE
  (rms_rope_rows), written into each row's ring row `window[slot, ring]` -> (window, token).
- `router_hash(logits, tid2eid, token_ids, *, route_scale)`: a hash layer's expert ids and weights.
- `index_weights_rows(x, weight, *, scale)`: the indexer's head weights, (x @ W.T) in x's dtype, f32, scaled.
- `embed_streams(table, token_ids, nc)`: the embedding rows, laid out as the nc mHC streams.
- `hc_head_rows(h, fn, scale, base, *, norm_eps, hc_eps)`: the HyperHead's collapse of the streams.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.norms import rms_norm_rows_reference
from dsv4_serve.kernels.rope import check_rms_rope_rows, rms_rope_rows_reference, rope_tables
from dsv4_serve.kernels.rows import fail

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)
_INTS = (mx.int32, mx.uint32)


def _array(op: str, name: str, a: object, dtypes: tuple[mx.Dtype, ...], ndim: int) -> mx.array:
    if not isinstance(a, mx.array):
        raise fail(op, name, f"must be an mx.array, got {type(a).__name__}")
    if a.dtype not in dtypes:
        raise fail(op, name, f"must be one of {', '.join(str(d) for d in dtypes)}, got {a.dtype}")
    if a.ndim != ndim:
        raise fail(op, name, f"must have {ndim} dims, got shape {tuple(a.shape)}")
    return a


def _rows(op: str, name: str, a: object, rows: int) -> None:
    _array(op, name, a, _INTS, 1)
    if a.shape[0] != rows:  # type: ignore[union-attr]
        raise fail(op, name, f"must be [{rows}], got shape {tuple(a.shape)}")  # type: ignore[union-attr]


# ---- RoPE tables of the step's positions ------------------------------------------------------------------


def check_rope_step_tables(freqs: mx.array, positions: mx.array, ratio: int, head_dim: int, index_dim: int) -> None:
    op = "rope_step_tables"
    f = _array(op, "freqs", freqs, (mx.float32,), 1)
    _array(op, "positions", positions, (mx.int32,), 1)
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0:
        raise fail(op, "ratio", f"must be an int >= 0, got {ratio!r}")
    for name, d in (("head_dim", head_dim), ("index_dim", index_dim)):
        if isinstance(d, bool) or not isinstance(d, int) or d % 2 or d < 2 * f.shape[0]:
            raise fail(op, name, f"must be an even int >= the rope dims {2 * f.shape[0]}, got {d!r}")


def _step_tables(freqs: mx.array, positions: mx.array, ratio: int, head_dim: int, index_dim: int
                 ) -> tuple[mx.array, ...]:  # fmt: skip
    # model.layers.rope_cos_sin / rope_angles (prefill's), op for op, then -S
    ang = positions.astype(mx.float32)[:, None] * freqs[None, :]
    cos, sin = mx.cos(ang), mx.sin(ang)
    out = rope_tables(cos, sin, head_dim)
    if ratio:
        cang = mx.maximum(positions + 1 - ratio, 0).astype(mx.float32)[:, None] * freqs[None, :]
        out += (mx.cos(cang), mx.sin(cang))
    if ratio == 4:
        out += rope_tables(cos, sin, index_dim)
    return (*out, -out[1])


_compiled: dict[tuple[int, int, int], object] = {}


def rope_step_tables_reference(freqs: mx.array, positions: mx.array, *, ratio: int, head_dim: int,
                               index_dim: int) -> tuple[mx.array, ...]:  # fmt: skip
    """Compiled per layer kind (traced once a batch size): a few fused kernels, the same values bit for bit."""
    check_rope_step_tables(freqs, positions, ratio, head_dim, index_dim)
    key = (ratio, head_dim, index_dim)
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = mx.compile(lambda f, p: _step_tables(f, p, *key))
    return fn(freqs, positions)  # type: ignore[operator]


# ---- the window ring's write ------------------------------------------------------------------------------


def check_rms_rope_ring_rows(x: mx.array, c: mx.array, s: mx.array, window: mx.array, slots: mx.array,
                             positions: mx.array, weight: mx.array | None, eps: float | None) -> None:  # fmt: skip
    op = "rms_rope_ring_rows"
    try:
        check_rms_rope_rows(x, c, s, weight, eps)
    except ValueError as e:
        raise ValueError(str(e).replace("rms_rope_rows:", f"{op}:")) from None
    if x.ndim != 2:
        raise fail(op, "x", f"must be [rows, d], got shape {tuple(x.shape)}")
    w = _array(op, "window", window, _FLOATS, 3)
    if w.shape[2] != x.shape[1]:
        raise fail(op, "window", f"must be [slots, ring, {x.shape[1]}], got shape {tuple(w.shape)}")
    _rows(op, "slots", slots, x.shape[0])
    _rows(op, "positions", positions, x.shape[0])


def rms_rope_ring_rows_reference(x: mx.array, c: mx.array, s: mx.array, window: mx.array, slots: mx.array,
                                 positions: mx.array, ring: mx.array | None = None, *, weight: mx.array | None = None,
                                 eps: float | None = None, kv: mx.array | None = None
                                 ) -> tuple[mx.array, None]:  # fmt: skip
    """rms_rope_rows (`kv`: the caller's, already made), then the MLX scatter `window[slots, ring] = kv` (ring:
    positions % the ring's length, the step's own if given) -> (the written window, None)."""
    check_rms_rope_ring_rows(x, c, s, window, slots, positions, weight, eps)
    if kv is None:
        kv = backend.pick("rms_rope_rows", rms_rope_rows_reference)(x, c, s, weight=weight, eps=eps)  # the model's
    elif tuple(kv.shape) != tuple(x.shape):
        raise fail("rms_rope_ring_rows", "kv", f"must be x's shape {tuple(x.shape)}, got {tuple(kv.shape)}")
    window[slots, positions % window.shape[1] if ring is None else ring] = kv.astype(window.dtype)
    return window, None


# ---- the hashed router -----------------------------------------------------------------------------------


def check_router_hash(logits: mx.array, tid2eid: mx.array, token_ids: mx.array, route_scale: float) -> None:
    op = "router_hash"
    lg = _array(op, "logits", logits, (mx.float32,), 2)
    t = _array(op, "tid2eid", tid2eid, _INTS, 2)
    if not 1 <= t.shape[1] <= lg.shape[1]:
        raise fail(op, "tid2eid", f"must be [vocab, k] with 1 <= k <= {lg.shape[1]} experts, got {tuple(t.shape)}")
    _rows(op, "token_ids", token_ids, lg.shape[0])
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)):
        raise fail(op, "route_scale", f"must be a float, got {route_scale!r}")


def router_hash_reference(logits: mx.array, tid2eid: mx.array, token_ids: mx.array, *, route_scale: float
                          ) -> tuple[mx.array, mx.array]:  # fmt: skip
    """sqrt(softplus) scores at the token's fixed experts, normalised -> (uint32 ids [B, k], f32 weights)."""
    check_router_hash(logits, tid2eid, token_ids, route_scale)
    scores = mx.sqrt(nn.softplus(logits))
    idx = tid2eid[token_ids].astype(mx.uint32)  # uint32: the dtype gather_mm takes, no cast per MoE
    w = mx.take_along_axis(scores, idx, axis=-1)
    w = w / (mx.sum(w, axis=-1, keepdims=True) + 1e-20) * route_scale
    return idx, w


# ---- the indexer's head weights --------------------------------------------------------------------------


def check_index_weights_rows(x: mx.array, weight: mx.array, scale: float) -> None:
    op = "index_weights_rows"
    _array(op, "x", x, _FLOATS, 2)
    w = _array(op, "weight", weight, _FLOATS, 2)
    if w.shape[1] != x.shape[1]:
        raise fail(op, "weight", f"must be [heads, {x.shape[1]}], got shape {tuple(w.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise fail(op, "scale", f"must be a float, got {scale!r}")


def index_weights_rows_reference(x: mx.array, weight: mx.array, *, scale: float) -> mx.array:
    """nn.Linear's product (x's dtype), then f32 and the scale: [B, heads] f32."""
    check_index_weights_rows(x, weight, scale)
    return (x @ weight.T).astype(mx.float32) * scale


# ---- the embedding as the mHC streams --------------------------------------------------------------------


def check_embed_streams(table: mx.array, token_ids: mx.array, nc: int) -> None:
    op = "embed_streams"
    _array(op, "table", table, _FLOATS, 2)
    _array(op, "token_ids", token_ids, _INTS, 1)
    if isinstance(nc, bool) or not isinstance(nc, int) or nc < 1:
        raise fail(op, "nc", f"must be an int >= 1, got {nc!r}")


def embed_streams_reference(table: mx.array, token_ids: mx.array, nc: int) -> mx.array:
    """table[token_ids] broadcast to [B, nc, H], laid out once (the first layer's two mixes would each copy
    the strided broadcast)."""
    check_embed_streams(table, token_ids, nc)
    x = table[token_ids]
    return mx.contiguous(mx.broadcast_to(x[:, None, :], (x.shape[0], nc, x.shape[1])))


# ---- the HyperHead's collapse ----------------------------------------------------------------------------


def check_hc_head_rows(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array) -> None:
    op = "hc_head_rows"
    hs = _array(op, "h", h, _FLOATS, 3)
    _, nc, hid = hs.shape
    for name, a, want in (("fn", fn, (nc, nc * hid)), ("scale", scale, (1,)), ("base", base, (nc,))):
        if tuple(_array(op, name, a, _FLOATS, len(want)).shape) != want:
            raise fail(op, name, f"must be {list(want)}, got shape {tuple(a.shape)}")


def hc_head_rows_reference(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, norm_eps: float,
                           hc_eps: float) -> mx.array:  # fmt: skip
    """HyperHead: sigmoid weights of the streams' RMS-normed concatenation, no Sinkhorn, no post -> [B, H]."""
    check_hc_head_rows(h, fn, scale, base)
    b = h.shape[0]
    norm = backend.pick("rms_norm_rows", rms_norm_rows_reference)  # the dispatching op, as the model called it
    f = norm(h.reshape(b, -1), None, eps=norm_eps, out_dtype=mx.float32)
    pre = mx.sigmoid((f @ fn.astype(mx.float32).T) * scale + base) + hc_eps
    return mx.sum(pre[:, :, None] * h.astype(mx.float32), axis=1).astype(h.dtype)

