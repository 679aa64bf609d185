"""compressor_rows_inplace on CUDA against the functional reference: states, entries, chained steps in one
evaluation (the `after` tokens order the writes) and the readers that wait for the token (GPU only)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import RowBatch, backend
from dsv4_serve.kernels.compressor import compressor_rows_reference
from dsv4_serve.kernels.indexer import indexer_rows_reference
from dsv4_serve.kernels.sparse_attention import sparse_attention_rows_reference
from tests.kernels.test_cuda import PAGE, fast, rel_err, rows_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def copies(*xs: mx.array) -> tuple[mx.array, ...]:
    out = tuple(mx.array(np.array(x.astype(mx.float32))).astype(x.dtype) for x in xs)
    mx.eval(out)
    return out


def setup(ratio: int, d: int, n_rows: int, dtype: mx.Dtype, seed: int, steps: int = 1):
    rng = np.random.default_rng(seed)
    coff = 2 if ratio == 4 else 1
    base = [int(x) for x in rng.integers(0, 3000, size=n_rows)]
    # ragged: half the rows end a window at their first step, one row is at its very first window
    positions = [(b // ratio) * ratio + (ratio - 1 if i % 2 == 0 else int(rng.integers(0, ratio - 1)))
                 for i, b in enumerate(base)]  # fmt: skip
    positions[0] = ratio - 1
    rows, pages, bq, slots = rows_for(rng, [p + steps - 1 for p in positions], (ratio,))
    kv = [mx.random.normal((bq, coff * d)) for _ in range(steps)]
    score = [mx.random.normal((bq, coff * d)) for _ in range(steps)]
    ape = mx.random.normal((ratio, coff * d))
    norm = mx.random.uniform(0.5, 1.5, (d,))
    st = (mx.random.normal((slots, coff * ratio, coff * d)), mx.random.normal((slots, coff * ratio, coff * d)),
          mx.random.normal((pages[ratio], PAGE, d)).astype(dtype))  # fmt: skip
    ang = mx.random.uniform(-math.pi, math.pi, (bq, 32))
    kw = dict(ratio=ratio, head_dim=d, eps=1e-6, cos=mx.cos(ang), sin=mx.sin(ang))
    mx.eval(kv, score, ape, norm, st, kw["cos"], kw["sin"])

    def batch(step: int) -> RowBatch:
        return RowBatch.build([r.__class__(r.slot, positions[i] + step, r.q_row, r.tables) for i, r in enumerate(rows)],
                              PAGE)  # fmt: skip

    return batch, kv, score, ape, norm, st, kw


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("ratio,d", [(4, 512), (4, 128), (128, 512)])
@pytest.mark.parametrize("n_rows", [1, 2, 5, 8])
def test_compressor_inplace_matches_reference(ratio: int, d: int, n_rows: int, dtype: mx.Dtype) -> None:
    batch, kv, score, ape, norm, st, kw = setup(ratio, d, n_rows, dtype, 100 * ratio + n_rows)
    want = compressor_rows_reference(batch(0), kv[0], score[0], ape, norm, *st, **kw)
    mine = copies(*st)
    got = fast().compressor_rows_inplace_cuda(batch(0), kv[0], score[0], ape, norm, *mine, **kw)
    assert all(g is m for g, m in zip(got[:3], mine, strict=True))  # the same arrays, written in place
    mx.eval(want, got[3])
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    tol = 1e-2 if dtype == mx.bfloat16 else 1e-5
    assert rel_err(got[2][1:], want[2][1:]) <= tol  # page 0: the reference's trash page
    np.testing.assert_array_equal(np.array(got[2][0].astype(mx.float32)), np.array(st[2][0].astype(mx.float32)))


@pytest.mark.parametrize("ratio,d", [(4, 128), (128, 512)])
@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_compressor_inplace_steps_chained_by_tokens_in_one_eval(ratio: int, d: int, n_rows: int) -> None:
    """Several decode steps in one evaluation, each call `after` the last one's token: the same states
    and pools as the functional reference step by step (a missing edge lets the writes race)."""
    steps = 6 if ratio == 4 else 3
    batch, kv, score, ape, norm, st, kw = setup(ratio, d, n_rows, mx.bfloat16, 7 + n_rows, steps)
    want = st
    for i in range(steps):
        want = compressor_rows_reference(batch(i), kv[i], score[i], ape, norm, *want, **kw)
    got, token = copies(*st), None
    for i in range(steps):
        *got, token = fast().compressor_rows_inplace_cuda(batch(i), kv[i], score[i], ape, norm, *got, after=token,
                                                          **kw)  # fmt: skip
    mx.eval(want, token)
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    assert rel_err(got[2][1:], want[2][1:]) <= 1e-2


@pytest.mark.parametrize("n_rows", [1, 4, 8])
def test_readers_after_the_token_see_the_new_entries(n_rows: int) -> None:
    """A CSA layer's kernel part in one evaluation, every row emitting: the indexer's compressor writes
    its keys pool in place and the indexer reads it `after` that token; the main compressor writes the
    kv pool and sparse attention reads it `after` its token. The top-k is wider than any row, so the
    new entries are selected and attended: a read before the write would change both results."""
    kc = fast()
    rng = np.random.default_rng(n_rows)
    positions = [int(x) * 4 + 3 for x in rng.integers(200, 1500, n_rows)]
    rows, pages, bq, slots = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE)

    def inputs(d: int) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        st = (mx.random.normal((slots, 8, 2 * d)), mx.random.normal((slots, 8, 2 * d)),
              mx.random.normal((pages[4], PAGE, d)).astype(mx.bfloat16))  # fmt: skip
        x = (mx.random.normal((bq, 2 * d)), mx.random.normal((bq, 2 * d)), mx.random.normal((4, 2 * d)),
             mx.random.uniform(0.5, 1.5, (d,)))  # fmt: skip
        return x, st

    (x_i, st_i), (x_m, st_m) = inputs(128), inputs(512)
    ang = mx.random.uniform(-math.pi, math.pi, (bq, 32))
    rope = dict(ratio=4, eps=1e-6, cos=mx.cos(ang), sin=mx.sin(ang))
    qi, wi = mx.random.normal((bq, 64, 128)).astype(mx.bfloat16), mx.random.normal((bq, 64)) * 0.01
    q = mx.random.normal((bq, 64, 512)).astype(mx.bfloat16)
    win = mx.random.normal((slots, 128, 512)).astype(mx.bfloat16)
    sinks = mx.random.normal((64,))
    mx.eval(x_i, st_i, x_m, st_m, rope, qi, wi, q, win, sinks)

    def layer(comp, idx, attn, st_i, st_m):
        *_, ipool, itok = comp(batch, *x_i, *st_i, head_dim=128, **rope)
        ind = idx(batch, qi, wi, ipool, topk=2048, after=itok)
        *_, cpool, tok = comp(batch, *x_m, *st_m, head_dim=512, **rope)
        return attn(batch, q, win, cpool, ind, sinks, scale=512**-0.5, ratio=4, after=tok), ind

    def ref_comp(*a, **k):
        return (*compressor_rows_reference(*a, **k), None)

    want_o, want_i = layer(ref_comp, indexer_rows_reference, sparse_attention_rows_reference, st_i, st_m)
    mx.eval(want_o, want_i)
    got_o, got_i = layer(kc.compressor_rows_inplace_cuda, kc.indexer_rows_cuda, kc.sparse_attention_rows_cuda,
                         copies(*st_i), copies(*st_m))  # fmt: skip
    mx.eval(got_o, got_i)
    np.testing.assert_array_equal(np.sort(np.array(got_i), axis=1), np.sort(np.array(want_i), axis=1))
    assert rel_err(got_o, want_o) <= 1e-2


def test_inplace_writes_a_large_pool_without_a_copy() -> None:
    batch, kv, score, ape, norm, st, kw = setup(4, 512, 8, mx.bfloat16, 3)
    big = mx.zeros((1 << 13, PAGE, 512), mx.bfloat16)  # 512 MiB page pool
    mine = (*copies(st[0], st[1]), big)
    mx.eval(big)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    got = fast().compressor_rows_inplace_cuda(batch(0), kv[0], score[0], ape, norm, *mine, **kw)
    mx.eval(got[3])
    assert mx.get_peak_memory() - base < big.nbytes // 8
    assert float(mx.abs(got[2].astype(mx.float32)).sum()) > 0  # the entries landed in `big` itself


@pytest.mark.parametrize("prefill", [False, True])
def test_tiny_model_decode_in_place_equals_functional(prefill: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model with model.attention.INPLACE_COMPRESSOR on: the same greedy tokens as with the functional
    op, token-serial from position 0 and after a parallel prefill, on pools of one slot (a slot reset is
    then a whole-array update, for which MLX returns a broadcast scalar, and a custom kernel gets a copy
    of a broadcast: the divergence found and fixed in 79b27c3; model/state.py keeps every state array a
    full buffer)."""
    import dsv4_serve.model.attention as att
    from dsv4_serve.model.tiny import tiny_model
    from tests.kernels.inplace_model import run

    model, args, _ = tiny_model(seed=0)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    monkeypatch.setattr(att, "INPLACE_COMPRESSOR", False)  # the functional op (the default is in place)
    want = run(model, args, prompt, prefill=prefill)
    monkeypatch.setattr(att, "INPLACE_COMPRESSOR", True)
    assert run(model, args, prompt, prefill=prefill) == want
