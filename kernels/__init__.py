"""The three row-batched DeepSeek-V4 decode ops and the mHC pre-mix (see docs/kernels.md).

Each public op dispatches through `kernels.backend`: a registered fast path on a CUDA device,
else the plain-MLX reference (`DSV4_KERNELS=reference` forces it). Both validate the row
contract and raise `ValueError("<op>: <arg>: why")`.
"""

from __future__ import annotations

import importlib

import mlx.core as mx

from dsv4_serve.kernels import backend, chained
from dsv4_serve.kernels.compressor import (
    CompressorArgs,
    PairOut,
    compressor_pair_rows_inplace_reference,
    compressor_rows_inplace_reference,
    compressor_rows_reference,
)
from dsv4_serve.kernels.glue import (
    embed_streams_reference,
    hc_head_rows_reference,
    index_weights_rows_reference,
    rms_rope_ring_rows_reference,
    rope_step_tables_reference,
    router_hash_reference,
)
from dsv4_serve.kernels.hc import hc_pre_composed, hc_pre_mix_reference, hc_pre_norm_composed
from dsv4_serve.kernels.indexer import indexer_rows_reference
from dsv4_serve.kernels.norms import hc_post_rows_reference, rms_norm_rows_reference
from dsv4_serve.kernels.prefill_attention import prefill_attention_reference
from dsv4_serve.kernels.rope import rms_rope_rows_reference, rope, rope_apply, rope_tables
from dsv4_serve.kernels.router import moe_combine_post_rows_reference, moe_combine_rows_reference, router_topk_reference
from dsv4_serve.kernels.rows import Row, RowBatch
from dsv4_serve.kernels.sparse_attention import sparse_attention_rows_reference

backend.tune_cuda_commits()  # before any GPU eval
# The CUDA fast path, imported when an op first asks for it on a CUDA device (it registers its ops then).
backend.set_fast_loader(lambda: importlib.import_module("dsv4_serve.kernels.cuda"))

__all__ = [
    "CompressorArgs",
    "Row",
    "RowBatch",
    "backend",
    "chains_supported",
    "compressor_pair_rows_inplace",
    "compressor_rows",
    "compressor_rows_inplace",
    "embed_streams",
    "hc_head_rows",
    "index_weights_rows",
    "rms_rope_ring_rows",
    "rope_step_tables",
    "router_hash",
    "hc_pre_mix",
    "hc_post_rows",
    "hc_pre_composed",
    "hc_pre_rows",
    "hc_pre_norm_rows",
    "rms_norm_rows",
    "router_topk",
    "moe_combine_rows",
    "moe_combine_post_rows",
    "prefill_attention",
    "indexer_rows",
    "rms_rope_rows",
    "rope",
    "rope_apply",
    "rope_tables",
    "sparse_attention_rows",
]


def compressor_rows(
    batch: RowBatch,
    kv: mx.array,
    score: mx.array,
    ape: mx.array,
    norm: mx.array,
    kv_state: mx.array,
    score_state: mx.array,
    pool: mx.array,
    *,
    ratio: int,
    head_dim: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """One compressor step for every row -> new `(kv_state, score_state, pool)`."""
    fn = backend.pick("compressor_rows", compressor_rows_reference)
    if batch.chained and fn is not compressor_rows_reference:  # a launch a round: a slot's rows in order
        return chained.compressor_rounds(fn, batch, kv, score, ape, norm, kv_state, score_state, pool, ratio=ratio,
                                         head_dim=head_dim, eps=eps, cos=cos, sin=sin)  # fmt: skip
    return fn(
        batch, kv, score, ape, norm, kv_state, score_state, pool,
        ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin,
    )  # fmt: skip


def compressor_rows_inplace(
    batch: RowBatch,
    kv: mx.array,
    score: mx.array,
    ape: mx.array,
    norm: mx.array,
    kv_state: mx.array,
    score_state: mx.array,
    pool: mx.array,
    *,
    ratio: int,
    head_dim: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    after: mx.array | None = None,
    workspace: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """compressor_rows that may write in place -> `(kv_state, score_state, pool, token)`.

    The CUDA path writes the rows' state and new entries straight into the buffers of `kv_state`,
    `score_state` and `pool` (MLX does not see it) and returns those same arrays with `token`, a small
    array that every later reader of them in the same evaluation must take: `after=token` of
    indexer_rows / sparse_attention_rows, or of the next in-place call (MLX orders CUDA-graph nodes by
    their inputs; separate evaluations run in order). Its inputs' old values are gone: keep no other
    reference expecting them. The reference returns the functional update and `token=None`. `after`:
    a previous in-place writer's token that this call's reads and writes must follow. `workspace`
    (`kernels.compressor.new_workspace(rows, head_dim)`): scratch the CUDA path's long-window (HCA) form
    uses in place of a zeroed token (a fill node); calls that share one must be ordered."""
    fn = backend.pick("compressor_rows_inplace", compressor_rows_inplace_reference)
    if batch.chained and fn is not compressor_rows_inplace_reference:
        return chained.compressor_rounds(fn, batch, kv, score, ape, norm, kv_state, score_state, pool, ratio=ratio,
                                         head_dim=head_dim, eps=eps, cos=cos, sin=sin, after=after,
                                         workspace=workspace)  # fmt: skip
    return fn(
        batch, kv, score, ape, norm, kv_state, score_state, pool,
        ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin, after=after, workspace=workspace,
    )  # fmt: skip


def compressor_pair_rows_inplace(
    batch: RowBatch,
    first: CompressorArgs,
    second: CompressorArgs,
    *,
    ratio: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    after: mx.array | None = None,
) -> PairOut:
    """A CSA layer's two compressors (main and indexer: same batch, ratio, RoPE row and eps) as ONE dispatch
    -> `((kv_state, score_state, pool) of each, token)`; compressor_rows_inplace's semantics for both, one
    token for both writes."""
    fn = backend.pick("compressor_pair_rows_inplace", compressor_pair_rows_inplace_reference)
    if batch.chained and fn is not compressor_pair_rows_inplace_reference:
        return chained.pair_rounds(fn, batch, first, second, ratio=ratio, eps=eps, cos=cos, sin=sin, after=after)
    return fn(batch, first, second, ratio=ratio, eps=eps, cos=cos, sin=sin, after=after)


def indexer_rows(
    batch: RowBatch, q: mx.array, weights: mx.array, keys: mx.array, *, topk: int, after: mx.array | None = None,
    workspace: mx.array | None = None,
) -> mx.array:  # fmt: skip
    """Top-k visible indexer entries per row -> `[Bq, topk] int32` (-1 padded), row `q_row`. `after`:
    the token of an in-place write of `keys` (compressor_rows_inplace). `workspace`
    (`kernels.indexer.new_workspace(rows)`): zeroed scratch the CUDA path uses in place of a fill of its
    own and leaves zeroed; calls that share one must be ordered (each waits for the last's output)."""
    fn = backend.pick("indexer_rows", indexer_rows_reference)
    return fn(batch, q, weights, keys, topk=topk, after=after, workspace=workspace)


def sparse_attention_rows(
    batch: RowBatch,
    q: mx.array,
    window: mx.array,
    pool: mx.array | None,
    indices: mx.array | None,
    sinks: mx.array,
    *,
    scale: float,
    ratio: int | None = None,
    after: mx.array | None = None,
    tail: mx.array | None = None,
) -> mx.array:
    """Attention over window + selected compressed entries -> `[Bq, nh, D]` in `q.dtype`. `after`: the
    token of an in-place write of `pool` (compressor_rows_inplace). `tail`: the step's own window keys, the
    ring read as before the step's writes (a chained batch; the plain twin only, `chains_supported`)."""
    fn = backend.pick("sparse_attention_rows", sparse_attention_rows_reference)
    if tail is None:
        return fn(batch, q, window, pool, indices, sinks, scale=scale, ratio=ratio, after=after)
    if not chains_supported():
        raise ValueError(f"sparse_attention_rows: tail: chained rows are off on this path ({chained.ENV})")
    return fn(batch, q, window, pool, indices, sinks, scale=scale, ratio=ratio, after=after, tail=tail)


def chains_supported() -> bool:
    """Whether the row-batched ops take a chained batch (a slot's consecutive positions as rows of one step:
    `rows.check_batch(chains=True)`): the plain twins do, the CUDA path when opted in (kernels/chained.py)."""
    return chained.supported()


def hc_pre_mix(
    m: mx.array, scale: mx.array, base: mx.array, h: mx.array, *, iters: int, eps: float
) -> tuple[mx.array, mx.array, mx.array]:
    """mHC pre-mix of every row -> `(x [B, H] h.dtype, post [B, nc] f32, comb [B, nc, nc] f32)` (kernels/hc.py)."""
    fn = backend.pick("hc_pre_mix", hc_pre_mix_reference)
    return fn(m, scale, base, h, iters=iters, eps=eps)


def rms_norm_rows(x: mx.array, weight: mx.array | None, *, eps: float, out_dtype: mx.Dtype | None = None) -> mx.array:
    """RMSNorm over the last axis: f32 statistics and products, one rounding to out_dtype (kernels/norms.py)."""
    return backend.pick("rms_norm_rows", rms_norm_rows_reference)(x, weight, eps=eps, out_dtype=out_dtype)


def hc_post_rows(y: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """mHC post-mix h'[k] = post[k] y + sum_j comb[j, k] h[j] -> [B, nc, H] h.dtype (kernels/norms.py)."""
    return backend.pick("hc_post_rows", hc_post_rows_reference)(y, h, post, comb)


def router_topk(logits: mx.array, bias: mx.array, *, k: int, route_scale: float) -> tuple[mx.array, mx.array]:
    """The router after its f32 logits -> (expert ids [B, k] uint32, weights [B, k] f32) (kernels/router.py)."""
    return backend.pick("router_topk", router_topk_reference)(logits, bias, k=k, route_scale=route_scale)


def hc_pre_rows(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, iters: int, eps: float,
                norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """An mHC unit's pre-mix from its streams h [B, nc, H] and weights -> (x, post, comb) as hc_pre_mix's:
    one kernel on CUDA (with the glue kernels), else `hc_pre_composed`."""
    fast = backend.pick("hc_pre_rows", None)
    fn_ = fast if fast is not None else hc_pre_composed
    return fn_(h, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)


def hc_pre_norm_rows(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, weight: mx.array, *, iters: int,
                     eps: float, norm_eps: float, x_eps: float) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """hc_pre_rows with the unit's RMSNorm (weight, x_eps) on its x (kernels/hc.py): one kernel on CUDA."""
    fn_ = backend.pick("hc_pre_norm_rows", hc_pre_norm_composed)
    return fn_(h, fn, scale, base, weight, iters=iters, eps=eps, norm_eps=norm_eps, x_eps=x_eps)


def moe_combine_rows(pairs: mx.array, w: mx.array, shared: mx.array, *, out_dtype: mx.Dtype) -> mx.array:
    """The routed pairs' weighted sum plus the shared expert's output -> [B, H] out_dtype (kernels/router.py)."""
    return backend.pick("moe_combine_rows", moe_combine_rows_reference)(pairs, w, shared, out_dtype=out_dtype)


def moe_combine_post_rows(pairs: mx.array, w: mx.array, shared: mx.array, h: mx.array, post: mx.array,
                          comb: mx.array) -> mx.array:  # fmt: skip
    """moe_combine_rows (rounded to h.dtype) then hc_post_rows: the MoE half's end in one op (kernels/router.py)."""
    fn = backend.pick("moe_combine_post_rows", moe_combine_post_rows_reference)
    return fn(pairs, w, shared, h, post, comb)


def rms_rope_rows(x: mx.array, c: mx.array, s: mx.array, *, weight: mx.array | None = None,
                  eps: float | None = None) -> mx.array:  # fmt: skip
    """rope_apply(x, c, s) after an optional RMS norm of each vector (kernels/rope.py): one kernel on CUDA."""
    return backend.pick("rms_rope_rows", rms_rope_rows_reference)(x, c, s, weight=weight, eps=eps)


def prefill_attention(q: mx.array, ring: mx.array, kv: mx.array, start: int, pool: mx.array | None,
                      table: mx.array | None, indices: mx.array | None, sinks: mx.array, *, scale: float,
                      ratio: int | None = None) -> mx.array:  # fmt: skip
    """Attention of T prompt tokens at positions start.. of one request over their window ([ring; kv]) and
    compressed entries (kernels/prefill_attention.py) -> [T, nh, D] in q.dtype; the decode kernel's T rows on
    CUDA (kernels/cuda/prefill_attention.py)."""
    fn = backend.pick("prefill_attention", prefill_attention_reference)
    return fn(q, ring, kv, start, pool, table, indices, sinks, scale=scale, ratio=ratio)


# The step's glue between launches (kernels/glue.py): its former MLX ops as references, own kernels on CUDA with
# DSV4_GRAPH_GLUE=1 (kernels/cuda/glue.py, glue_rope.py), so that a step is launches only (docs/cuda_graphs.md).
def rope_step_tables(freqs: mx.array, positions: mx.array, *, ratio: int, head_dim: int, index_dim: int
                     ) -> tuple[mx.array, ...]:  # fmt: skip
    """A layer kind's RoPE tables at the step's positions: (C, S[, ccos, csin][, Ci, Si], -S)."""
    fn = backend.pick("rope_step_tables", rope_step_tables_reference)
    return fn(freqs, positions, ratio=ratio, head_dim=head_dim, index_dim=index_dim)


def rms_rope_ring_rows(x: mx.array, c: mx.array, s: mx.array, window: mx.array, slots: mx.array,
                       positions: mx.array, ring: mx.array | None = None, *, weight: mx.array | None = None,
                       eps: float | None = None, kv: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """rms_rope_rows of the window kv [B, D] written into `window[slots, positions % ring length]` -> (window,
    token). The CUDA kernel writes the ring in place and returns a token its readers take (`after=`, as
    compressor_rows_inplace's); the reference scatters (`ring`: the step's positions % length, if made; `kv`:
    the rms_rope_rows of x if the caller has it) and returns None."""
    fn = backend.pick("rms_rope_ring_rows", rms_rope_ring_rows_reference)
    return fn(x, c, s, window, slots, positions, ring, weight=weight, eps=eps, kv=kv)


def router_hash(logits: mx.array, tid2eid: mx.array, token_ids: mx.array, *, route_scale: float
                ) -> tuple[mx.array, mx.array]:  # fmt: skip
    """A hash layer's experts: (tid2eid[token] as uint32 [B, k], their normalised sqrt(softplus) weights)."""
    return backend.pick("router_hash", router_hash_reference)(logits, tid2eid, token_ids, route_scale=route_scale)


def index_weights_rows(x: mx.array, weight: mx.array, *, scale: float) -> mx.array:
    """The indexer's head weights: (x @ weight.T) in x's dtype, then f32 * scale -> [B, heads]."""
    return backend.pick("index_weights_rows", index_weights_rows_reference)(x, weight, scale=scale)


def embed_streams(table: mx.array, token_ids: mx.array, nc: int) -> mx.array:
    """The tokens' embedding rows as the nc mHC streams [B, nc, H], contiguous."""
    return backend.pick("embed_streams", embed_streams_reference)(table, token_ids, nc)


def hc_head_rows(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, norm_eps: float,
                 hc_eps: float) -> mx.array:  # fmt: skip
    """The HyperHead's collapse of the streams h [B, nc, H] -> [B, H] in h's dtype (before the final norm)."""
    return backend.pick("hc_head_rows", hc_head_rows_reference)(h, fn, scale, base, norm_eps=norm_eps,
                                                                hc_eps=hc_eps)  # fmt: skip
