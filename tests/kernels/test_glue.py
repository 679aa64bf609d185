"""The step's glue ops (kernels/glue.py): their plain twins against NumPy and the model's own former code, their
argument checks, and the public ops' dispatch (the twins on the CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve import kernels
from dsv4_serve.kernels import glue
from dsv4_serve.kernels.rope import rms_rope_rows_reference
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import inv_freq, rope_angles

POSITIONS = [0, 3, 127, 128, 700, 4099, 65000, 5]  # ragged: ring wraps, compressor emits, position 0


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_rope_step_tables_are_the_models_angles_and_minus_s(ratio: int, rows: int) -> None:
    args = ModelArgs.tiny()
    freqs = inv_freq(args, ratio != 0)
    pos = mx.array(POSITIONS[:rows], dtype=mx.int32)
    got = kernels.rope_step_tables(freqs, pos, ratio=ratio, head_dim=args.head_dim, index_dim=args.index_head_dim)
    want = (*rope_angles(freqs, pos, ratio, args), -rope_angles(freqs, pos, ratio, args)[1])  # uncompiled
    assert len(got) == 3 + (2 if ratio else 0) + (2 if ratio == 4 else 0)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == mx.float32 and g.shape == w.shape
        assert np.array_equal(np.array(g).view(np.uint32), np.array(w).view(np.uint32))  # -0 included
    c, s, sb = (np.array(a) for a in (got[0], got[1], got[-1]))
    rd = 2 * freqs.shape[0]
    ang = np.array(pos, np.float32)[:, None] * np.array(freqs)[None, :]
    np.testing.assert_allclose(c[:, -rd::2], np.cos(ang), atol=2e-6)
    np.testing.assert_allclose(s[:, -rd::2], -np.sin(ang), atol=2e-6)
    np.testing.assert_allclose(s[:, -rd + 1 :: 2], np.sin(ang), atol=2e-6)
    assert (c[:, : c.shape[1] - rd] == 1).all() and np.signbit(sb[:, : c.shape[1] - rd]).all()
    if ratio:
        cang = np.maximum(np.array(pos) + 1 - ratio, 0).astype(np.float32)[:, None] * np.array(freqs)[None, :]
        np.testing.assert_allclose(np.array(got[2]), np.cos(cang), atol=2e-6)


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_rope_ring_rows_writes_each_rows_ring_row(rows: int, weighted: bool) -> None:
    d, ring_len, slots_n = 64, 16, 10
    x = mx.random.normal((rows, d)).astype(mx.bfloat16)
    ang = mx.random.uniform(shape=(rows, d // 2)) * 6
    c, s = kernels.rope_tables(mx.cos(ang), mx.sin(ang), d)
    weight = (1 + 0.2 * mx.random.normal((d,))).astype(mx.bfloat16) if weighted else None
    window = mx.random.normal((slots_n, ring_len, d)).astype(mx.bfloat16)
    before = np.array(window.astype(mx.float32))
    slots = mx.array([9, 2, 4, 0, 7, 1, 3, 5][:rows], dtype=mx.int32)
    pos = mx.array(POSITIONS[:rows], dtype=mx.int32)
    out, token = kernels.rms_rope_ring_rows(x, c, s, window, slots, pos, weight=weight, eps=1e-6)
    assert token is None  # the twin's scatter: its readers need no token
    kv = np.array(rms_rope_rows_reference(x, c, s, weight=weight, eps=1e-6).astype(mx.float32))
    want = before.copy()
    for i, (sl, p) in enumerate(zip(np.array(slots), np.array(pos), strict=True)):
        want[sl, p % ring_len] = kv[i]
    assert np.array_equal(np.array(out.astype(mx.float32)), want)
    # the step's own ring (positions % length, made once a step) writes the same rows
    out2, _ = kernels.rms_rope_ring_rows(x, c, s, mx.array(before).astype(mx.bfloat16), slots, pos,
                                         pos % ring_len, weight=weight, eps=1e-6)  # fmt: skip
    assert np.array_equal(np.array(out2.astype(mx.float32)), want)


@pytest.mark.parametrize("rows,k,experts", [(1, 6, 8), (5, 6, 256), (8, 2, 16)])
def test_router_hash_picks_the_tokens_experts_and_normalises(rows: int, k: int, experts: int) -> None:
    rng = np.random.default_rng(rows)
    logits = rng.normal(size=(rows, experts)).astype(np.float32) * 3
    table = np.stack([rng.choice(experts, k, replace=False) for _ in range(50)]).astype(np.int32)
    tokens = rng.integers(0, 50, rows).astype(np.int32)
    idx, w = kernels.router_hash(mx.array(logits), mx.array(table), mx.array(tokens), route_scale=2.5)
    assert idx.dtype == mx.uint32 and w.dtype == mx.float32 and idx.shape == w.shape == (rows, k)
    assert np.array_equal(np.array(idx), table[tokens])
    sc = np.sqrt(np.log1p(np.exp(logits.astype(np.float64))))
    sel = np.take_along_axis(sc, table[tokens], axis=1)
    np.testing.assert_allclose(np.array(w), sel / sel.sum(1, keepdims=True) * 2.5, rtol=2e-6)


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_index_weights_rows_is_the_linear_then_scaled(rows: int) -> None:
    x = mx.random.normal((rows, 256)).astype(mx.bfloat16)
    wt = (0.1 * mx.random.normal((64, 256))).astype(mx.bfloat16)
    got = kernels.index_weights_rows(x, wt, scale=0.125 * 64**-0.5)
    assert got.dtype == mx.float32 and got.shape == (rows, 64)
    prod = np.array(x.astype(mx.float32)).astype(np.float64) @ np.array(wt.astype(mx.float32)).astype(np.float64).T
    # the product rounded to bf16 (the linear's output), then scaled: within one bf16 ulp of the exact product
    np.testing.assert_allclose(np.array(got), prod * 0.125 * 64**-0.5, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_embed_streams_copies_each_row_to_every_stream(dtype: mx.Dtype) -> None:
    table = mx.random.normal((40, 24)).astype(dtype)
    tok = mx.array([3, 0, 39, 3], dtype=mx.int32)
    got = kernels.embed_streams(table, tok, 4)
    assert got.shape == (4, 4, 24) and got.dtype == dtype
    t = np.array(table.astype(mx.float32))
    assert np.array_equal(np.array(got.astype(mx.float32)), np.repeat(t[np.array(tok)][:, None, :], 4, axis=1))


@pytest.mark.parametrize("rows,nc,hid", [(1, 4, 64), (8, 4, 128), (3, 2, 32)])
def test_hc_head_rows_collapses_with_sigmoid_weights(rows: int, nc: int, hid: int) -> None:
    h = mx.random.normal((rows, nc, hid)).astype(mx.bfloat16)
    fn = 0.05 * mx.random.normal((nc, nc * hid))
    scale, base = mx.array([0.7]), 0.1 * mx.random.normal((nc,))
    got = kernels.hc_head_rows(h, fn, scale, base, norm_eps=1e-6, hc_eps=1e-6)
    assert got.shape == (rows, hid) and got.dtype == mx.bfloat16
    hh = np.array(h.astype(mx.float32)).astype(np.float64)
    flat = hh.reshape(rows, -1)
    f = flat / np.sqrt((flat**2).mean(1, keepdims=True) + 1e-6)
    pre = 1 / (1 + np.exp(-((f @ np.array(fn).T) * 0.7 + np.array(base)))) + 1e-6
    want = (pre[:, :, None] * hh).sum(1)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=8e-3, atol=1e-2)


def test_checks_name_the_argument() -> None:
    f32, i32, x8 = mx.zeros((4,)), mx.zeros((2,), mx.int32), mx.zeros((2, 8))
    cases = [
        (lambda: kernels.rope_step_tables(i32, i32, ratio=0, head_dim=8, index_dim=8), "rope_step_tables: freqs"),
        (lambda: kernels.rope_step_tables(f32, f32, ratio=0, head_dim=8, index_dim=8), "rope_step_tables: positions"),
        (lambda: kernels.rope_step_tables(f32, i32, ratio=-1, head_dim=8, index_dim=8), "rope_step_tables: ratio"),
        (lambda: kernels.rope_step_tables(f32, i32, ratio=4, head_dim=6, index_dim=8), "rope_step_tables: head_dim"),
        (lambda: kernels.rms_rope_ring_rows(mx.zeros((2, 8)), mx.zeros((2, 8)), mx.zeros((2, 8)), mx.zeros((3, 4, 6)),
                                            i32, i32), "rms_rope_ring_rows: window"),  # fmt: skip
        (lambda: kernels.rms_rope_ring_rows(mx.zeros((2, 8)), mx.zeros((2, 8)), mx.zeros((2, 8)), mx.zeros((3, 4, 8)),
                                            mx.zeros((3,), mx.int32), i32), "rms_rope_ring_rows: slots"),  # fmt: skip
        (lambda: kernels.rms_rope_ring_rows(mx.zeros((2, 8)), mx.zeros((1, 8)), mx.zeros((2, 8)), mx.zeros((3, 4, 8)),
                                            i32, i32), "rms_rope_ring_rows: c"),  # fmt: skip
        (lambda: kernels.router_hash(mx.zeros((2, 8), mx.bfloat16), mx.zeros((5, 2), mx.int32), i32, route_scale=1.0),
         "router_hash: logits"),  # fmt: skip
        (lambda: kernels.router_hash(mx.zeros((2, 8)), mx.zeros((5, 9), mx.int32), i32, route_scale=1.0),
         "router_hash: tid2eid"),  # fmt: skip
        (lambda: kernels.router_hash(mx.zeros((2, 8)), mx.zeros((5, 2), mx.int32), mx.zeros((3,), mx.int32),
                                     route_scale=1.0), "router_hash: token_ids"),  # fmt: skip
        (lambda: kernels.index_weights_rows(x8, mx.zeros((4, 6)), scale=1.0), "index_weights_rows: weight"),
        (lambda: kernels.index_weights_rows(x8, mx.zeros((4, 8)), scale="x"), "index_weights_rows: scale"),
        (lambda: kernels.embed_streams(mx.zeros((5, 8)), f32, 4), "embed_streams: token_ids"),
        (lambda: kernels.embed_streams(mx.zeros((5, 8)), i32, 0), "embed_streams: nc"),
        (lambda: kernels.hc_head_rows(mx.zeros((2, 4, 8)), mx.zeros((4, 16)), mx.zeros((1,)), mx.zeros((4,)),
                                      norm_eps=1e-6, hc_eps=1e-6), "hc_head_rows: fn"),  # fmt: skip
        (lambda: kernels.hc_head_rows(mx.zeros((2, 4, 8)), mx.zeros((4, 32)), mx.zeros((1,)), mx.zeros((3,)),
                                      norm_eps=1e-6, hc_eps=1e-6), "hc_head_rows: base"),  # fmt: skip
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()


def test_references_are_what_the_cpu_runs() -> None:
    assert kernels.backend.name() == "reference"
    for op in ("rope_step_tables", "rms_rope_ring_rows", "router_hash", "index_weights_rows", "embed_streams",
               "hc_head_rows"):  # fmt: skip
        assert op in kernels.backend.OPS and getattr(glue, f"{op}_reference") is not None
