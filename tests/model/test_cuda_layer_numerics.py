"""The fast path's numerics layer by layer, at V4-Flash dims and release precision (mxfp8 + mxfp4, 8 routed
experts), on the GPU.

A random network amplifies rounding over 43 layers, so whole-model logits of random weights cannot judge a
kernel. Here every layer kind (sliding, CSA, HCA) gets the reference path's input and a copy of the same
state, runs once with every fast path and once with the plain-MLX references, and the two block outputs
must agree within bf16 tolerance (relative error <= 2e-2 of the output's scale, cosine >= 0.9999), at 1 and
8 rows, 4K and 64K context. When a layer misses, the message names the op whose fast path alone makes the
difference (each fast op swapped for its reference in turn).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]

LAYERS = (0, 4, 128)  # one block of each kind


def copy_state(pools) -> list[mx.array]:
    """Fresh buffers of every state array (the in-place compressor writes through the old ones)."""
    snap = [a + 0 for a in pools.arrays()]
    mx.eval(snap)
    return snap


def restore(pools, snap: list[mx.array]) -> None:
    fresh = iter([a + 0 for a in snap])
    pools.window[:] = [next(fresh) for _ in pools.window]
    for d in (pools.comp_kv, pools.comp_score, pools.idx_kv, pools.idx_score, pools.ckv, pools.ikeys):
        for layer in d:  # pools.arrays()' order
            d[layer] = next(fresh)
    mx.eval(pools.arrays())


def block_out(model, block, h, tok, pools, handles, ctx: int, mode: str, drop: str | None = None) -> np.ndarray:
    """One block's output with every fast op (`auto`), none (`reference`) or all but `drop`."""
    os.environ["DSV4_KERNELS"] = mode
    saved = None
    if drop:
        saved = backend.registered().get(drop)
        backend.unregister(drop)
    try:
        model.reset_compiled()
        batch = model.make_batch(pools, handles, [ctx] * len(handles))
        freqs = model._freqs[block.attn.ratio != 0]
        out = block(h, tok, batch, pools, freqs)
        mx.eval(out, pools.arrays())
        return np.array(out.astype(mx.float32))
    finally:
        if saved is not None:
            backend.register(drop, saved)
        os.environ["DSV4_KERNELS"] = "auto"


def agreement(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    rel = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
    cos = float((got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want) + 1e-30))
    return rel, cos


@pytest.fixture(scope="module")
def flash4():
    from bench.step import fill_state, flash_args, random_model

    args = flash_args(4, 8)  # sliding, CSA, HCA, CSA
    return args, random_model(args), fill_state


@pytest.mark.parametrize("ctx", [4096, 65536])
@pytest.mark.parametrize("rows", [1, 8])
def test_each_layer_kind_agrees_with_the_reference(flash4, rows: int, ctx: int) -> None:
    from dsv4_serve.model.state import StatePools

    args, model, fill_state = flash4
    pools = StatePools(args, max_slots=rows, max_positions=ctx + 8, page_size=256, dtype=mx.bfloat16)
    handles = [pools.alloc(ctx + 8) for _ in range(rows)]
    fill_state(pools, ctx)
    snap = copy_state(pools)
    tok = mx.array(list(range(7, 7 + rows)), dtype=mx.int32)
    x = model.embed(tok)
    h = mx.broadcast_to(x[:, None, :], (rows, args.hc_mult, x.shape[1])) + 0
    report = []
    for i, block in enumerate(model.layers):
        restore(pools, snap)
        want = block_out(model, block, h, tok, pools, handles, ctx, "reference")
        restore(pools, snap)
        got = block_out(model, block, h, tok, pools, handles, ctx, "auto")
        rel, cos = agreement(got, want)
        if rel > 2e-2 or cos < 0.9999:
            worst = []
            for op in sorted(backend.registered()):
                restore(pools, snap)
                r2, c2 = agreement(block_out(model, block, h, tok, pools, handles, ctx, "auto", drop=op), want)
                worst.append((r2, op))
            report.append(f"layer {i} (ratio {block.attn.ratio}): rel {rel:.3g} cos {cos:.6f}; without each fast op "
                          f"(rel, op): {sorted(worst)[:3]}")  # fmt: skip
        restore(pools, snap)
        h = mx.array(want).astype(h.dtype)  # the next layer takes the reference's output
    assert not report, "\n".join(report)
