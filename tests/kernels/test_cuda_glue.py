"""The glue kernels (DSV4_GRAPH_GLUE: kernels/cuda/glue.py, glue_rope.py) vs their plain twins on the GPU: rows
1..8, ragged positions, each layer kind; and a V4-Flash-dims step with them vs without."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend, glue

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]

POSITIONS = [0, 3, 127, 128, 700, 4099, 65000, 5]
ROWS = [1, 2, 3, 5, 8]


def cuda():
    from dsv4_serve.kernels.cuda import glue as g
    from dsv4_serve.kernels.cuda import glue_rope

    return g, glue_rope


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_rope_step_tables_bit_for_bit(rows: int, ratio: int) -> None:
    from bench.step import flash_args
    from dsv4_serve.model.config import ModelArgs
    from dsv4_serve.model.layers import inv_freq

    for args in (ModelArgs.tiny(), flash_args(4, 16)):
        head_dim, index_dim = args.head_dim, args.index_head_dim
        freqs = inv_freq(args, ratio != 0)
        pos = mx.array(POSITIONS[:rows], dtype=mx.int32)
        got = cuda()[1].rope_step_tables_cuda(freqs, pos, ratio=ratio, head_dim=head_dim, index_dim=index_dim)
        want = glue.rope_step_tables_reference(freqs, pos, ratio=ratio, head_dim=head_dim, index_dim=index_dim)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and np.array_equal(bits(g), bits(w))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d,pdt", [(512, mx.bfloat16), (64, mx.bfloat16), (512, mx.float32)])
def test_rms_rope_ring_rows_writes_the_twins_rows_in_place(rows: int, d: int, pdt: mx.Dtype) -> None:
    x = mx.random.normal((rows, d)).astype(mx.bfloat16)
    ang = mx.random.uniform(shape=(rows, 32)) * 6
    from dsv4_serve.kernels.rope import rope_tables

    c, s = rope_tables(mx.cos(ang), mx.sin(ang), d)
    weight = (1 + 0.2 * mx.random.normal((d,))).astype(mx.bfloat16)
    base = mx.random.normal((9, 128, d)).astype(pdt)
    slots = mx.array([8, 2, 4, 0, 7, 1, 3, 5][:rows], dtype=mx.int32)
    pos = mx.array(POSITIONS[:rows], dtype=mx.int32)
    mine = base + 0  # written in place: a buffer of its own
    mx.eval(mine)
    win, token = cuda()[1].rms_rope_ring_rows_cuda(x, c, s, mine, slots, pos, weight=weight, eps=1e-6)
    assert win is mine and token is not None
    mx.eval(token)
    want, none = glue.rms_rope_ring_rows_reference(x, c, s, base + 0, slots, pos, weight=weight, eps=1e-6)
    assert none is None and np.array_equal(bits(mine), bits(want))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("experts,k", [(256, 6), (16, 6), (8, 2)])
def test_router_hash_matches_twin(rows: int, experts: int, k: int) -> None:
    rng = np.random.default_rng(rows)
    logits = mx.array(rng.normal(size=(rows, experts)).astype(np.float32) * 3)
    table = mx.array(np.stack([rng.choice(experts, k, replace=False) for _ in range(100)]).astype(np.int32))
    tok = mx.array(rng.integers(0, 100, rows).astype(np.int32))
    idx, w = cuda()[0].router_hash_cuda(logits, table, tok, route_scale=1.5)
    ridx, rw = glue.router_hash_reference(logits, table, tok, route_scale=1.5)
    assert idx.dtype == ridx.dtype and np.array_equal(np.array(idx), np.array(ridx))
    np.testing.assert_allclose(np.array(w), np.array(rw), rtol=1e-6)  # the k-sum's order only


@pytest.mark.parametrize("rows", ROWS)
def test_index_weights_rows_matches_twin(rows: int) -> None:
    x = mx.random.normal((rows, 4096)).astype(mx.bfloat16)
    wt = (4096**-0.5 * mx.random.normal((64, 4096))).astype(mx.bfloat16)
    scale = 128**-0.5 * 64**-0.5
    got = cuda()[0].index_weights_rows_cuda(x, wt, scale=scale)
    want = glue.index_weights_rows_reference(x, wt, scale=scale)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=8e-3, atol=1e-7)  # one bf16 ulp


@pytest.mark.parametrize("rows", ROWS)
def test_embed_streams_exact(rows: int) -> None:
    table = mx.random.normal((1000, 4096)).astype(mx.bfloat16)
    tok = mx.array(np.random.default_rng(rows).integers(0, 1000, rows).astype(np.int32))
    got = cuda()[0].embed_streams_cuda(table, tok, 4)
    assert np.array_equal(bits(got), bits(glue.embed_streams_reference(table, tok, 4)))


@pytest.mark.parametrize("rows", ROWS)
def test_hc_head_rows_matches_twin(rows: int) -> None:
    h = mx.random.normal((rows, 4, 4096)).astype(mx.bfloat16)
    fn = 0.01 * mx.random.normal((4, 4 * 4096))
    scale, base = mx.array([0.5]), 0.1 * mx.random.normal((4,))
    got = cuda()[0].hc_head_rows_cuda(h, fn, scale, base, norm_eps=1e-6, hc_eps=1e-6)
    want = glue.hc_head_rows_reference(h, fn, scale, base, norm_eps=1e-6, hc_eps=1e-6)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=8e-3,
                               atol=8e-3)  # fmt: skip


def test_flash_step_with_the_glue_kernels_matches_without() -> None:
    """4 V4-Flash layers (hashed, CSA, HCA, sliding), 16 experts, 8 rows at ragged positions: the step's logits
    and every pool with the glue kernels as without (the RoPE tables, embedding and ring exact; the router's
    weights, the indexer's weights and the head's collapse within their tolerance)."""
    from bench.step import fill_state, flash_args, random_model
    from dsv4_serve.kernels.cuda import set_graph_glue
    from dsv4_serve.model.state import StatePools

    args = flash_args(4, 16)
    model = random_model(args)
    out = []
    for on in (False, True):
        set_graph_glue(on)
        try:
            pools = StatePools(args, max_slots=8, max_positions=8192, page_size=64, dtype=model.dtype)
            handles = [pools.alloc(8192) for _ in range(8)]
            fill_state(pools, 4096)
            batch = model.make_batch(pools, handles, [4096 + 37 * i for i in range(8)])
            logits = model.step(batch, mx.array([5 + 11 * i for i in range(8)], dtype=mx.int32), pools)
            mx.eval(logits, pools.arrays())
            out.append((np.array(logits), [np.array(a.astype(mx.float32)) for a in pools.arrays()]))
        finally:
            set_graph_glue(False)
    (l0, p0), (l1, p1) = out
    np.testing.assert_allclose(l1, l0, rtol=2e-2, atol=2e-2)
    assert (l1.argmax(-1) == l0.argmax(-1)).mean() >= 7 / 8
    for a, b in zip(p0, p1, strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
