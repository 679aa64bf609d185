"""The MoE's glue around its products, plain-MLX references + checks: the routed experts' selection (V4's
noaux_tc router after its f32 logits) and the combine of the experts' outputs.

`router_topk(logits, bias, *, k, route_scale) -> (idx [B, k] uint32, w [B, k] f32)`: scores
s = sqrt(softplus(logits)); the k experts of the largest s + bias (the bias only selects); their s,
normalised to sum 1 and times route_scale. The reference is ~7 kernels on CUDA (softplus + sqrt, the
biased negation, a partition sort, a gather, a sum, the normalisation); the CUDA fast path is one.
The k experts come in no set order (argpartition's); the set and each one's weight are the contract.

`moe_combine_rows(pairs, w, shared, *, out_dtype) -> [B, H]`: sum_j w[b, j] pairs[b, j] + shared[b] in f32,
rounded once to out_dtype (the routed pairs' weighted sum, then the shared expert's output). The reference
is 3 kernels (the weighted products, the sum over k, the add and cast); the CUDA fast path is one.

`moe_combine_post_rows(pairs, w, shared, h, post, comb) -> [B, nc, H]`: that combine rounded to h.dtype, then
the unit's mHC post-mix (`kernels.norms.hc_post_rows`): the MoE half's end, one launch on CUDA where the two
ops take two.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from dsv4_serve.kernels.norms import check_hc_post_rows, hc_post_rows_reference


def check_router_topk(logits: mx.array, bias: mx.array, k: int, route_scale: float) -> None:
    if not isinstance(logits, mx.array) or logits.ndim != 2 or logits.dtype != mx.float32:
        got = f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, mx.array) else type(logits).__name__
        raise ValueError(f"router_topk: logits: must be f32 [rows, experts], got {got}")
    e = logits.shape[1]
    if not isinstance(bias, mx.array) or tuple(bias.shape) != (e,) or not mx.issubdtype(bias.dtype, mx.floating):
        got = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, mx.array) else type(bias).__name__
        raise ValueError(f"router_topk: bias: must be a float [{e}], got {got}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"router_topk: k: must be an int in [1, {e}], got {k!r}")
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)):
        raise ValueError(f"router_topk: route_scale: must be a number, got {route_scale!r}")


def router_topk_reference(logits: mx.array, bias: mx.array, *, k: int,
                          route_scale: float) -> tuple[mx.array, mx.array]:  # fmt: skip
    check_router_topk(logits, bias, k, route_scale)
    scores = mx.sqrt(nn.softplus(logits))
    biased = scores + bias.astype(mx.float32)
    idx = mx.argpartition(-biased, k - 1, axis=-1)[:, :k]  # uint32, the dtype gather_mm takes
    w = mx.take_along_axis(scores, idx, axis=-1)
    return idx, w / (mx.sum(w, axis=-1, keepdims=True) + 1e-20) * route_scale


def check_moe_combine_rows(pairs: mx.array, w: mx.array, shared: mx.array, out_dtype: mx.Dtype) -> None:
    for name, a in (("pairs", pairs), ("w", w), ("shared", shared)):
        if not isinstance(a, mx.array) or not mx.issubdtype(a.dtype, mx.floating):
            got = a.dtype if isinstance(a, mx.array) else type(a).__name__
            raise ValueError(f"moe_combine_rows: {name}: must be a float mx.array, got {got}")
    if pairs.ndim != 3:
        raise ValueError(f"moe_combine_rows: pairs: must be [rows, k, hidden], got shape {tuple(pairs.shape)}")
    b, k, hid = pairs.shape
    if tuple(w.shape) != (b, k):
        raise ValueError(f"moe_combine_rows: w: must be [{b}, {k}], got shape {tuple(w.shape)}")
    if tuple(shared.shape) != (b, hid):
        raise ValueError(f"moe_combine_rows: shared: must be [{b}, {hid}], got shape {tuple(shared.shape)}")
    if not isinstance(out_dtype, mx.Dtype) or not mx.issubdtype(out_dtype, mx.floating):
        raise ValueError(f"moe_combine_rows: out_dtype: must be a float dtype, got {out_dtype}")


def moe_combine_rows_reference(pairs: mx.array, w: mx.array, shared: mx.array, *, out_dtype: mx.Dtype) -> mx.array:
    check_moe_combine_rows(pairs, w, shared, out_dtype)
    routed = mx.sum(pairs.astype(mx.float32) * w[:, :, None], axis=1)
    return (routed + shared.astype(mx.float32)).astype(out_dtype)


def check_moe_combine_post_rows(pairs: mx.array, w: mx.array, shared: mx.array, h: mx.array, post: mx.array,
                                comb: mx.array) -> None:  # fmt: skip
    op = "moe_combine_post_rows"
    try:
        check_moe_combine_rows(pairs, w, shared, h.dtype if isinstance(h, mx.array) else mx.float32)
        check_hc_post_rows(shared, h, post, comb)
    except ValueError as e:  # the parts' checks, in this op's names
        msg = str(e).replace("hc_post_rows: y:", f"{op}: shared:").replace("hc_post_rows:", f"{op}:")
        raise ValueError(msg.replace("moe_combine_rows:", f"{op}:")) from None


def moe_combine_post_rows_reference(pairs: mx.array, w: mx.array, shared: mx.array, h: mx.array, post: mx.array,
                                    comb: mx.array) -> mx.array:  # fmt: skip
    check_moe_combine_post_rows(pairs, w, shared, h, post, comb)
    return hc_post_rows_reference(moe_combine_rows_reference(pairs, w, shared, out_dtype=h.dtype), h, post, comb)
