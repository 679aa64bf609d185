"""CUDA fast ops vs their plain-MLX references on the GPU (fresh random data, real dims, bf16)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import Row, RowBatch, backend
from dsv4_serve.kernels import matmul as kmatmul
from dsv4_serve.kernels.compressor import compressor_rows_reference
from dsv4_serve.kernels.sparse_attention import sparse_attention_rows_reference
from tests.kernels.naive import scatter_tables

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]

PAGE = 64


def fast():
    import dsv4_serve.kernels.cuda as kc

    return kc


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(((a - b) ** 2).sum()) / mx.maximum(mx.sqrt((b * b).sum()), 1e-30))


def rows_for(rng, positions, ratios, extra_q=2, spare=2):
    n = len(positions)
    tables, pages = {}, {}
    for r in ratios:
        needs = [max(1, -(-((p + 1) // r) // PAGE)) for p in positions]
        tables[r], pages[r] = scatter_tables(rng, needs, spare)
    bq = n + extra_q
    q_rows = [int(x) for x in rng.permutation(bq)[:n]]
    slots = [int(x) for x in rng.permutation(n + 2)[:n]]
    rows = [Row(slots[i], positions[i], q_rows[i], {r: tuple(tables[r][i]) for r in ratios}) for i in range(n)]
    return rows, pages, bq, n + 2


# ---- compressor ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("ratio,d", [(4, 512), (4, 128), (128, 512)])
@pytest.mark.parametrize("n_rows", [1, 2, 5, 8])
def test_compressor_matches_reference(ratio: int, d: int, n_rows: int, dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(100 * ratio + n_rows)
    coff = 2 if ratio == 4 else 1
    base = [int(x) for x in rng.integers(0, 3000, size=n_rows)]
    # half the rows end a window (emit), the others do not; one row at its very first window
    positions = [(b // ratio) * ratio + (ratio - 1 if i % 2 == 0 else int(rng.integers(0, ratio - 1)))
                 for i, b in enumerate(base)]  # fmt: skip
    positions[0] = ratio - 1
    rows, pages, bq, slots = rows_for(rng, positions, (ratio,))
    batch = RowBatch.build(rows, PAGE)
    half = 32
    kv = mx.random.normal((bq, coff * d))
    score = mx.random.normal((bq, coff * d))
    ape = mx.random.normal((ratio, coff * d))
    norm = mx.random.uniform(0.5, 1.5, (d,))
    kv_state = mx.random.normal((slots, coff * ratio, coff * d))
    score_state = mx.random.normal((slots, coff * ratio, coff * d))
    score_state[0, 0] = -math.inf
    pool = mx.random.normal((pages[ratio], PAGE, d)).astype(dtype)
    ang = mx.random.uniform(-math.pi, math.pi, (bq, half))
    cos, sin = mx.cos(ang), mx.sin(ang)
    kw = dict(ratio=ratio, head_dim=d, eps=1e-6, cos=cos, sin=sin)
    want = compressor_rows_reference(batch, kv, score, ape, norm, kv_state, score_state, pool, **kw)
    got = fast().compressor_rows_cuda(batch, kv, score, ape, norm, kv_state, score_state, pool, **kw)
    mx.eval(want, got)
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))  # -inf scores compare equal
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    tol = 1e-2 if dtype == mx.bfloat16 else 1e-5
    assert rel_err(got[2][1:], want[2][1:]) <= tol  # page 0 is the trash page
    assert got[2].dtype == dtype


# ---- sparse attention ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca", "hca_all", "hca_long"])
@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_sparse_attention_matches_reference(kind: str, n_rows: int) -> None:
    """Every launch plan: dsplit (sliding), wide (CSA, HCA; hca_long with 1-3 rows), split-K over head
    groups (hca_long with 8 rows: 8 x 130 chunks)."""
    check_attention(kind, n_rows)


@pytest.mark.parametrize("kind", ["csa", "hca", "hca_long"])
@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_sparse_attention_wide_32_heads(kind: str, n_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide kernel with 32 heads per block (twice the blocks: 4 warps per head tile)."""
    import dsv4_serve.kernels.cuda.attention as at

    monkeypatch.setattr(at, "WIDE_HG", 32)  # part of the launch plan's key
    check_attention(kind, n_rows)


def check_attention(kind: str, n_rows: int) -> None:
    rng = np.random.default_rng(300 + n_rows)
    ratio = {"sliding": 4, "csa": 4, "hca": 128, "hca_all": 128, "hca_long": 128}[kind]
    positions = [int(x) for x in rng.choice([0, 5, 127, 128, 1000, 20_000, 131_071, 70_000], n_rows, replace=False)]
    if kind == "hca_long":
        positions[0] = 4 * 262_144 - 1  # 8,192 HCA entries
    rows, pages, bq, slots = rows_for(rng, positions, (ratio,))
    batch = RowBatch.build(rows, PAGE)
    nh, d, w_len = 64, 512, 128
    q = mx.random.normal((bq, nh, d)).astype(mx.bfloat16)
    window = mx.random.normal((slots, w_len, d)).astype(mx.bfloat16)
    pool = mx.random.normal((pages[ratio], PAGE, d)).astype(mx.bfloat16)
    sinks = mx.random.normal((nh,))
    indices = None
    if kind == "csa":
        k = 512
        ind = np.full((bq, k), -1, np.int32)
        for r in rows:
            cnt = (r.position + 1) // ratio
            cand = list(rng.permutation(cnt)[: k - 2]) + [cnt, cnt + 5]  # ids >= n are masked
            ind[r.q_row, : len(cand)] = cand
            rng.shuffle(ind[r.q_row])
        indices = mx.array(ind)
    elif kind in ("hca", "hca_long"):
        cap = max(len(r.tables[ratio]) for r in rows) * PAGE
        ids = mx.arange(cap, dtype=mx.int32)[None, :]
        n = mx.array([0] * bq, dtype=mx.int32)
        for r in rows:
            n[r.q_row] = (r.position + 1) // ratio
        indices = mx.where(ids < n[:, None], ids, -1)
    args = (batch, q, window, None if kind == "sliding" else pool, indices, sinks)
    kw = dict(scale=d**-0.5, ratio=None if kind == "sliding" else ratio)
    want = sparse_attention_rows_reference(*args, **kw)
    got = fast().sparse_attention_rows_cuda(*args, **kw)
    assert got.dtype == mx.bfloat16 and got.shape == want.shape
    assert rel_err(got, want) <= 1e-2
    named = {r.q_row for r in rows}
    for i in range(bq):
        if i not in named:
            assert float(mx.abs(got[i].astype(mx.float32)).max()) == 0.0


def test_dispatch_uses_fast_path() -> None:
    kc = fast()
    assert backend.name() == "cuda"
    opt_out = set() if kc.HC_KERNEL else {"hc_pre_mix"}  # DSV4_HC_KERNEL=0 keeps the plain mHC pre-mix
    if not kmatmul.SKINNY:  # DSV4_SKINNY=0 keeps MLX's own matmuls for the weight products
        opt_out |= {"qlinear_rows", "qlinear_cat_rows", "f32_linear_rows", "f32_linear_pair_rows", "swiglu_rows",
                    "experts_gate_up_rows", "experts_down_rows"}
    if not (kmatmul.SKINNY and kc.SKINNY_CAT):  # DSV4_SKINNY_CAT=0 keeps a launch a projection
        opt_out |= {"qlinear_cat_rows"}
    if not kc.GLUE_KERNELS:  # DSV4_GLUE_KERNELS=0 keeps the glue ops' references
        opt_out |= {"rms_norm_rows", "hc_post_rows", "router_topk", "hc_pre_rows", "moe_combine_rows",
                    "hc_pre_norm_rows", "moe_combine_post_rows", "rms_rope_rows"}
    if not kc.PREFILL_ATTN:  # DSV4_PREFILL_ATTN=0 keeps prefill's plain attention
        opt_out |= {"prefill_attention"}
    if not kc.GROUPED_MMA:  # DSV4_GROUPED_MMA=0 keeps prefill's dequantized-copy experts
        opt_out |= {"grouped_experts"}
    if not kc.INDEXER_SCORES:  # DSV4_INDEXER_SCORES=0 keeps the products + MLX ops for prefill's indexer
        opt_out |= {"indexer_scores"}
    if not kc.DEQUANT_KERNEL:  # DSV4_DEQUANT_KERNEL=0 keeps MLX's dequantize for prefill's dense products
        opt_out |= {"dequantize_mxfp8"}
    assert set(backend.registered()) == set(backend.OPS) - opt_out


@pytest.mark.parametrize("inplace", [False, True])
def test_precompile_tiny(inplace: bool) -> None:
    n = fast().precompile(dtype=mx.bfloat16, page_size=16, n_heads=16, head_dim=64, rope_dim=16,
                          index_heads=16, index_dim=32, topk=8, window=8, inplace_compressor=inplace)  # fmt: skip
    # 3 compressors (ratio 4 and 128 at D, 4 at the index dim: in place, or the functional op's), + the CSA
    # pair and the ratio-128 form with a workspace when in place; attention sliding + ratio 4 + ratio 128; the
    # indexer without and with a workspace
    assert n == (10 if inplace else 8)
