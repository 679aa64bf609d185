"""compressor_pair_rows_inplace on CUDA (a CSA layer's main and indexer compressors in one launch) against
the functional reference of each, against the two single in-place kernels, over chained steps in one
evaluation, and with the readers that wait for its token (GPU only)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import CompressorArgs, RowBatch, backend
from dsv4_serve.kernels.compressor import compressor_rows_reference
from dsv4_serve.kernels.indexer import indexer_rows_reference
from dsv4_serve.kernels.sparse_attention import sparse_attention_rows_reference
from tests.kernels.test_cuda import PAGE, fast, rel_err, rows_for
from tests.kernels.test_cuda_inplace import copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]

DIMS = (512, 128)  # V4-Flash: head_dim, index_head_dim


def setup(n_rows: int, dtype: mx.Dtype, seed: int, steps: int = 1, emit_all: bool = False):
    """Both compressors' inputs over one ragged batch: half the rows end a window at their first step (all
    with `emit_all`), one row is at its very first window; q rows not in batch order."""
    rng = np.random.default_rng(seed)
    base = [int(x) for x in rng.integers(0, 3000, size=n_rows)]
    positions = [(b // 4) * 4 + (3 if emit_all or i % 2 == 0 else int(rng.integers(0, 3))) for i, b in enumerate(base)]
    positions[0] = 3
    rows, pages, bq, slots = rows_for(rng, [p + steps - 1 for p in positions], (4,))
    sets = []
    for d in DIMS:
        st = (mx.random.normal((slots, 8, 2 * d)), mx.random.normal((slots, 8, 2 * d)),
              mx.random.normal((pages[4], PAGE, d)).astype(dtype))  # fmt: skip
        xs = [(mx.random.normal((bq, 2 * d)), mx.random.normal((bq, 2 * d))) for _ in range(steps)]
        ape, norm = mx.random.normal((4, 2 * d)), mx.random.uniform(0.5, 1.5, (d,))
        mx.eval(st, xs, ape, norm)
        sets.append((xs, ape, norm, st, d))
    ang = mx.random.uniform(-math.pi, math.pi, (bq, 32))
    rope = dict(eps=1e-6, cos=mx.cos(ang), sin=mx.sin(ang))
    mx.eval(rope["cos"], rope["sin"])

    def batch(step: int) -> RowBatch:
        return RowBatch.build([r.__class__(r.slot, positions[i] + step, r.q_row, r.tables) for i, r in enumerate(rows)],
                              PAGE)  # fmt: skip

    def args(step: int, i: int, st: tuple[mx.array, ...]) -> CompressorArgs:
        xs, ape, norm, _, d = sets[i]
        return CompressorArgs(*xs[step], ape, norm, *st, d)

    return batch, sets, rope, args, bq, slots, pages


def reference_steps(batch, sets, rope, args, steps: int) -> list[tuple[mx.array, ...]]:
    out = []
    for i in range(2):
        st = sets[i][3]
        for s in range(steps):
            a = args(s, i, st)
            st = compressor_rows_reference(batch(s), *a[:7], ratio=4, head_dim=a.head_dim, **rope)
        out.append(st)
    return out


def assert_matches(got: tuple[mx.array, ...], want: tuple[mx.array, ...], old_pool: mx.array, tol: float) -> None:
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    assert rel_err(got[2][1:], want[2][1:]) <= tol  # page 0: the reference's trash page
    np.testing.assert_array_equal(np.array(got[2][0].astype(mx.float32)), np.array(old_pool[0].astype(mx.float32)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("n_rows", [1, 2, 3, 5, 8])
def test_pair_matches_reference(n_rows: int, dtype: mx.Dtype) -> None:
    batch, sets, rope, args, *_ = setup(n_rows, dtype, 40 + n_rows)
    want = reference_steps(batch, sets, rope, args, 1)
    mine = [copies(*s[3]) for s in sets]
    m, i, token = fast().compressor_pair_rows_inplace_cuda(batch(0), args(0, 0, mine[0]), args(0, 1, mine[1]),
                                                           ratio=4, **rope)  # fmt: skip
    assert token is not None and all(g is x for g, x in zip(m + i, mine[0] + mine[1], strict=True))  # in place
    mx.eval(token, want)
    tol = 1e-2 if dtype == mx.bfloat16 else 1e-5
    for k in range(2):
        assert_matches((m, i)[k], want[k], sets[k][3][2], tol)


@pytest.mark.parametrize("n_rows", [1, 4, 8])
def test_pair_equals_the_two_single_kernels(n_rows: int) -> None:
    """The same device function per row: bit-identical to two compressor_rows_inplace launches."""
    kc = fast()
    batch, sets, rope, args, *_ = setup(n_rows, mx.bfloat16, 70 + n_rows)
    one = [copies(*s[3]) for s in sets]
    two = [copies(*s[3]) for s in sets]
    *_, token = kc.compressor_pair_rows_inplace_cuda(batch(0), args(0, 0, one[0]), args(0, 1, one[1]), ratio=4,
                                                     **rope)  # fmt: skip
    tokens = [kc.compressor_rows_inplace_cuda(batch(0), *args(0, k, two[k])[:7], ratio=4, head_dim=DIMS[k],
                                              **rope)[3] for k in range(2)]  # fmt: skip
    mx.eval(token, tokens)
    for a, b in zip(one[0] + one[1], two[0] + two[1], strict=True):
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_pair_steps_chained_by_tokens_in_one_eval(n_rows: int) -> None:
    """Six steps (windows complete at different steps per row) in one evaluation, each pair call `after`
    the last one's token: the reference's states and pools step by step."""
    steps = 6
    batch, sets, rope, args, *_ = setup(n_rows, mx.bfloat16, 90 + n_rows, steps)
    want = reference_steps(batch, sets, rope, args, steps)
    got, token = [copies(*s[3]) for s in sets], None
    for s in range(steps):
        m, i, token = fast().compressor_pair_rows_inplace_cuda(batch(s), args(s, 0, got[0]), args(s, 1, got[1]),
                                                               ratio=4, after=token, **rope)  # fmt: skip
        got = [m, i]
    mx.eval(token, want)
    for k in range(2):
        assert_matches(got[k], want[k], sets[k][3][2], 1e-2)


@pytest.mark.parametrize("n_rows", [1, 4, 8])
def test_readers_after_the_pair_token_see_the_new_entries(n_rows: int) -> None:
    """A CSA layer's kernel part in one evaluation, every row emitting: the indexer reads the keys pool and
    sparse attention the kv pool `after` the pair's one token. The top-k is wider than any row, so the new
    entries are selected and attended: a read before the write would change both results."""
    kc = fast()
    batch, sets, rope, args, bq, slots, _ = setup(n_rows, mx.bfloat16, 110 + n_rows, emit_all=True)
    qi, wi = mx.random.normal((bq, 64, 128)).astype(mx.bfloat16), mx.random.normal((bq, 64)) * 0.01
    q = mx.random.normal((bq, 64, 512)).astype(mx.bfloat16)
    win = mx.random.normal((slots, 128, 512)).astype(mx.bfloat16)
    sinks = mx.random.normal((64,))
    mx.eval(qi, wi, q, win, sinks)
    b = batch(0)

    def readers(idx, attn, ipool, cpool, token):
        ind = idx(b, qi, wi, ipool, topk=2048, after=token)
        return attn(b, q, win, cpool, ind, sinks, scale=512**-0.5, ratio=4, after=token), ind

    want = reference_steps(batch, sets, rope, args, 1)
    want_o, want_i = readers(indexer_rows_reference, sparse_attention_rows_reference, want[1][2], want[0][2], None)
    mx.eval(want_o, want_i)
    m, i, token = kc.compressor_pair_rows_inplace_cuda(b, args(0, 0, copies(*sets[0][3])),
                                                       args(0, 1, copies(*sets[1][3])), ratio=4, **rope)  # fmt: skip
    got_o, got_i = readers(kc.indexer_rows_cuda, kc.sparse_attention_rows_cuda, i[2], m[2], token)
    mx.eval(got_o, got_i)
    np.testing.assert_array_equal(np.sort(np.array(got_i), axis=1), np.sort(np.array(want_i), axis=1))
    assert rel_err(got_o, want_o) <= 1e-2
