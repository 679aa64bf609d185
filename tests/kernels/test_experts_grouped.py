"""kernels.experts_grouped (the routed experts for prefill's many rows, grouped by expert) against the
per-pair references of kernels.matmul, on random mxfp4 experts; and QuantizedExperts' dispatch to it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels import experts_grouped as eg
from dsv4_serve.model.quant import QuantizedExperts
from tests.kernels.agreement import close

K = 6


def experts(e: int, hid: int, inter: int) -> dict[str, mx.array]:
    out = {}
    for name, shape in (("w1", (e, inter, hid)), ("w3", (e, inter, hid)), ("w2", (e, hid, inter))):
        w = mx.random.normal(shape) * shape[-1] ** -0.5
        out[name], out[f"{name}_scales"] = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")[:2]
    mx.eval(out)
    return out


def args(p: dict[str, mx.array]) -> tuple[mx.array, ...]:
    return p["w1"], p["w1_scales"], p["w2"], p["w2_scales"], p["w3"], p["w3_scales"]


def routing(kind: str, b: int, e: int, rng: np.random.Generator) -> tuple[mx.array, mx.array]:
    """idx [B, K] distinct experts a row (as the router's top-k) and router weights [B, K] f32."""
    if kind == "same":  # every row the same expert set
        idx = np.tile(rng.choice(e, K, replace=False), (b, 1))
    elif kind == "unused":  # experts 1 and E - 1 (and at E >= 16 also 3, E - 2, E - 3) are never picked
        unused = {1, e - 1} | ({3, e - 2, e - 3} if e >= 16 else set())
        pool = [i for i in range(e) if i not in unused]
        idx = np.stack([rng.choice(pool, K, replace=False) for _ in range(b)])
    else:  # ragged: a skewed popularity, so some experts get many pairs and some one or none
        p = rng.pareto(1.0, e) + 1e-3
        idx = np.stack([rng.choice(e, K, replace=False, p=p / p.sum()) for _ in range(b)])
    w = rng.random((b, K)).astype(np.float32) + 0.05
    return mx.array(idx.astype(np.uint32)), mx.array(w / w.sum(1, keepdims=True))


@pytest.mark.parametrize("b", [9, 17, 64, 300])
@pytest.mark.parametrize("e", [8, 16])
@pytest.mark.parametrize("kind", ["ragged", "unused", "same"])
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("how", ["tiles", "qtiles"])
def test_grouped_matches_the_per_pair_reference(b: int, e: int, kind: str, limit: float | None, how: str) -> None:
    rng = np.random.default_rng(b * 100 + e)
    p = experts(e, 128, 64)
    x = 3 * mx.random.normal((b, 128))  # gate / up ~ N(0, 9): the 0.5 clamp bites on most of them
    idx, w = routing(kind, b, e, rng)
    got = eg.grouped_experts(x, idx, w, *args(p), limit=limit, how=how)
    assert got.dtype == mx.float32 and got.shape == (b, 128)
    close(got, eg.experts_rows_reference(x, idx, w, *args(p), limit=limit), 1e-4)


@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("how", ["tiles", "qtiles"])
def test_grouped_bf16_x_rounds_as_the_reference(limit: float | None, how: str) -> None:
    rng = np.random.default_rng(3)
    p = experts(16, 128, 64)
    x = (4 * mx.random.normal((40, 128))).astype(mx.bfloat16)
    idx, w = routing("ragged", 40, 16, rng)
    close(eg.grouped_experts(x, idx, w, *args(p), limit=limit, how=how),
          eg.experts_rows_reference(x, idx, w, *args(p), limit=limit), 2e-2)  # fmt: skip


@pytest.mark.parametrize("how", ["tiles", "qtiles"])
def test_a_row_does_not_depend_on_the_other_rows(how: str) -> None:
    rng = np.random.default_rng(7)
    p = experts(16, 128, 64)
    xa, xb = mx.random.normal((64, 128)), mx.random.normal((17, 128))
    (ia, wa), (ib, wb) = routing("ragged", 64, 16, rng), routing("unused", 17, 16, rng)
    # row 5 of batch a run as row 11 of batch b (its other rows and their experts all differ)
    xb[11], ib[11], wb[11] = xa[5], ia[5], wa[5]
    ya = eg.grouped_experts(xa, ia, wa, *args(p), limit=0.5, how=how)
    yb = eg.grouped_experts(xb, ib, wb, *args(p), limit=0.5, how=how)
    np.testing.assert_allclose(np.array(yb[11]), np.array(ya[5]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["tiles", "qtiles"])
@pytest.mark.parametrize("b", [9, 300])
def test_pairs_are_each_pair_before_the_weighted_sum(b: int, how: str) -> None:
    """`pairs=True`: [B, k, H] in x.dtype, each pair's product (the per-pair reference's, pair by pair), whose
    router-weighted f32 sum is the grouped result."""
    rng = np.random.default_rng(b)
    p = experts(16, 128, 64)
    x = 3 * mx.random.normal((b, 128))
    idx, w = routing("ragged", b, 16, rng)
    got = eg.grouped_experts(x, idx, w, *args(p), limit=0.5, how=how, pairs=True)
    assert got.dtype == x.dtype and got.shape == (b, K, 128)
    ri = idx.astype(mx.uint32)
    hdn = eg.experts_gate_up_rows_reference(x, ri, p["w1"], p["w1_scales"], p["w3"], p["w3_scales"], limit=0.5)
    close(got, eg.experts_down_rows_reference(hdn, ri, p["w2"], p["w2_scales"]), 1e-4)
    summed = mx.sum(got.astype(mx.float32) * w[:, :, None], axis=1)
    assert mx.array_equal(summed, eg.grouped_experts(x, idx, w, *args(p), limit=0.5, how=how)).item()


@pytest.mark.parametrize("env", ["tiles", "off"])
def test_routed_is_the_pairs_the_experts_sum(env: str, monkeypatch) -> None:
    """QuantizedExperts.routed (the MoE's fused combine takes it): the pairs whose weighted sum is the
    module's output, grouped past the decode rows, per pair up to them."""
    monkeypatch.setenv(eg.ENV, env)
    rng = np.random.default_rng(5)
    mod = QuantizedExperts(experts(8, 128, 64), 0.5)
    for b in (3, 100):
        x = mx.random.normal((b, 128))
        idx, w = routing("ragged", b, 8, rng)
        pairs = mod.routed(x, idx, w)
        assert pairs.shape == (b, K, 128)
        assert mx.array_equal(mx.sum(pairs.astype(mx.float32) * w[:, :, None], axis=1), mod(x, idx, w)).item()


@pytest.mark.parametrize("env", ["", "tiles", "qtiles", "off"])
def test_quantized_experts_run_grouped_past_the_decode_rows_only(env: str, monkeypatch) -> None:
    monkeypatch.setenv(eg.ENV, env)
    rng = np.random.default_rng(11)
    p = experts(8, 128, 64)
    mod = QuantizedExperts(p, 0.5)
    for b in (1, 8, eg.GROUPED_ROWS + 1, 33):
        x = mx.random.normal((b, 128))
        idx, w = routing("ragged", b, 8, rng)
        want = eg.experts_rows_reference(x, idx, w, *args(p), limit=0.5)
        got = mod(x, idx, w)
        if b <= eg.GROUPED_ROWS or env == "off":  # the decode path (the per-pair one), unchanged
            assert mx.array_equal(got, want).item()
        else:
            if env != "qtiles":  # qtiles is gather_qmm too, in tiles: it may match the per-pair one bit for bit
                assert not mx.array_equal(got, want).item()  # another computation (not the per-pair one)
            close(got, want, 1e-4)


def test_the_switch_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(eg.ENV, "fast")
    with pytest.raises(ValueError, match=f"^experts_grouped: {eg.ENV}: "):
        eg.mode()
    with pytest.raises(ValueError, match="^grouped_experts: how: "):
        _bad(how="pairs")()


def _bad(how: str = "tiles", **change):
    p = experts(4, 64, 32)
    a = dict(x=mx.zeros((10, 64)), idx=mx.zeros((10, K), mx.uint32), weights=mx.ones((10, K)), w1=p["w1"],
             s1=p["w1_scales"], w2=p["w2"], s2=p["w2_scales"], w3=p["w3"], s3=p["w3_scales"])  # fmt: skip
    a.update(change)
    return lambda: eg.grouped_experts(a.pop("x"), a.pop("idx"), a.pop("weights"), *a.values(), limit=None, how=how)


@pytest.mark.parametrize("change,match", [
    (dict(x=mx.zeros((10, 1, 64))), "^grouped_experts: x: "),
    (dict(x=mx.zeros((9, 64))), "^grouped_experts: x: "),
    (dict(idx=mx.zeros((10, K))), "^grouped_experts: idx: "),
    (dict(idx=mx.zeros((10,), mx.uint32)), "^grouped_experts: idx: "),
    (dict(weights=mx.ones((10, K - 1))), "^grouped_experts: weights: "),
    (dict(weights=[1.0]), "^grouped_experts: weights: "),
    (dict(w1=mx.zeros((4, 32, 8))), "^grouped_experts: w1: "),
    (dict(w1=mx.zeros((32, 8), mx.uint32)), "^grouped_experts: w1: "),
    (dict(s1=mx.zeros((4, 32, 2))), "^grouped_experts: w1_scales: "),
    (dict(w3=mx.zeros((4, 64, 8), mx.uint32)), "^grouped_experts: w3: "),
    (dict(w2=mx.zeros((4, 64, 8), mx.uint32)), "^grouped_experts: w2: "),
    (dict(s2=mx.zeros((4, 64, 2), mx.uint8)), "^grouped_experts: w2_scales: "),
])  # fmt: skip
def test_bad_arguments_are_named(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _bad(**change)()


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
@pytest.mark.parametrize("how", ["tiles", "qtiles"])
@pytest.mark.parametrize("limit", [None, 10.0])
def test_grouped_at_v4_flash_dims_on_the_gpu(how: str, limit: float | None) -> None:
    """H 4096, I 2048, 32 experts, a 2048-token chunk in bf16: each grouped form vs gather_qmm a pair."""
    rng = np.random.default_rng(0)
    p = experts(32, 4096, 2048)
    x = mx.random.normal((2048, 4096)).astype(mx.bfloat16)
    idx, w = routing("ragged", 2048, 32, rng)
    want = eg.experts_rows_reference(x, idx, w, *args(p), limit=limit)
    close(eg.grouped_experts(x, idx, w, *args(p), limit=limit, how=how), want, 2e-2)


@pytest.mark.parametrize("b", [9, 64, 300])
@pytest.mark.parametrize("e", [8, 16, 32])
@pytest.mark.parametrize("kind", ["ragged", "unused", "same"])
def test_tile_table_is_the_tiles_of_the_sorted_pairs(b: int, e: int, kind: str) -> None:
    """`tile_table` (the CUDA form's table in one scatter) holds, row for row, the pair `tiles` puts there for
    the pairs in argsort order, and each tile's expert: every pair once, in a tile of its own expert."""
    idx, _ = routing(kind, b, e, np.random.default_rng(b + e))
    flat = idx.reshape(-1)
    ptab, texp = eg.tile_table(flat, e)
    order = mx.argsort(flat)
    src, want_texp, _ = eg.tiles(flat[order], e)
    want = np.where(np.array(src) >= 0, np.array(order).astype(np.int64)[np.maximum(np.array(src), 0)], -1)
    np.testing.assert_array_equal(np.array(ptab), want)
    np.testing.assert_array_equal(np.array(texp), np.array(want_texp))
    got, ids = np.array(ptab), np.array(flat)
    assert sorted(got[got >= 0].tolist()) == list(range(b * K))  # every pair once
    tile_of = np.repeat(np.array(texp), eg.TILE_ROWS)
    assert (ids[got[got >= 0]] == tile_of[got >= 0]).all()  # each in a tile of its own expert
