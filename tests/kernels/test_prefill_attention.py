"""prefill_attention's plain form against a per-query NumPy attention, and its argument checks (CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import prefill_attention
from dsv4_serve.kernels.prefill_attention import prefill_attention_reference

NH, D, W, PAGE = 4, 16, 8, 4


def naive(q, ring, kv, start, pool, table, ind, sinks, scale, ratio):
    """Query by query: the window's positions from the ring (row = position mod W) or the chunk, the picked
    (CSA) or every emitted (HCA) entry through the table; softmax with the sink in the denominator."""
    t = q.shape[0]
    out = np.zeros((t, NH, D))
    for i in range(t):
        p = start + i
        keys = [kv[x - start] if x >= start else ring[x % W] for x in range(max(0, p - W + 1), p + 1)]
        if ratio:
            n = (p + 1) // ratio
            ids = range(n) if ratio == 128 else [int(j) for j in (ind[i] if n else []) if 0 <= j < n]
            keys += [pool[table[j // PAGE], j % PAGE] for j in ids]
        k = np.array(keys, np.float64)
        lg = q[i].astype(np.float64) @ k.T * scale  # [NH, L]
        top = np.maximum(lg.max(axis=1), sinks)
        e = np.exp(lg - top[:, None])
        out[i] = (e @ k) / (e.sum(axis=1) + np.exp(sinks - top))[:, None]
    return out


@pytest.mark.parametrize("ratio", [None, 4, 128])
@pytest.mark.parametrize("start,t", [(0, 1), (0, 11), (3, 9), (6, 20), (300, 13)])
def test_plain_prefill_attention_is_per_query_attention(ratio, start: int, t: int) -> None:
    rng = np.random.default_rng(start * 31 + t)
    q, ring, kv = rng.normal(size=(t, NH, D)), rng.normal(size=(W, D)), rng.normal(size=(t, D))
    sinks = rng.normal(size=NH)
    pool = table = ind = None
    if ratio:
        n = (start + t) // ratio
        pages = max(1, -(-n // PAGE)) + 1
        pool = rng.normal(size=(pages + 1, PAGE, D))
        table = rng.permutation(np.arange(1, pages + 1)).astype(np.int32)
        if ratio == 4 and n:
            ind = np.full((t, 3), -1, np.int32)
            for i in range(t):
                v = (start + i + 1) // 4
                pick = rng.permutation(v)[:3]
                ind[i, : len(pick)] = pick
    f = lambda a: None if a is None else mx.array(a.astype(np.float32))  # noqa: E731
    got = prefill_attention_reference(f(q), f(ring), f(kv), start, f(pool),
                                      None if table is None else mx.array(table),
                                      None if ind is None else mx.array(ind), f(sinks), scale=0.3,
                                      ratio=ratio)  # fmt: skip
    want = naive(q, ring, kv, start, pool, table, ind, sinks, 0.3, ratio)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5)


def test_plain_prefill_attention_blocks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTN_BLOCK queries at a time: blocks of 1, 3 and the whole chunk give the same output."""
    import importlib

    pa = importlib.import_module("dsv4_serve.kernels.prefill_attention")
    rng = np.random.default_rng(0)
    t, start = 23, 5
    q, ring, kv = (mx.array(rng.normal(size=s).astype(np.float32)) for s in ((t, NH, D), (W, D), (t, D)))
    pool = mx.array(rng.normal(size=(4, PAGE, D)).astype(np.float32))
    table, sinks = mx.array([2, 1, 3], dtype=mx.int32), mx.zeros((NH,))
    outs = []
    for block in (1, 3, 512):
        monkeypatch.setattr(pa, "ATTN_BLOCK", block)
        outs.append(np.array(pa.prefill_attention_reference(q, ring, kv, start, pool, table, None, sinks, scale=0.2,
                                                             ratio=128)))  # fmt: skip
    np.testing.assert_allclose(outs[0], outs[2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[1], outs[2], rtol=1e-5, atol=1e-6)


def _args(**over):
    a = dict(q=mx.zeros((5, NH, D)), ring=mx.zeros((W, D)), kv=mx.zeros((5, D)), start=10,
             pool=mx.zeros((3, PAGE, D)), table=mx.array([1, 2], dtype=mx.int32),
             indices=mx.zeros((5, 2), dtype=mx.int32), sinks=mx.zeros((NH,)), scale=0.1, ratio=4)  # fmt: skip
    a.update(over)
    return a


@pytest.mark.parametrize("over,arg", [
    (dict(q=mx.zeros((5, D))), "q"),
    (dict(kv=mx.zeros((4, D))), "kv"),
    (dict(ring=mx.zeros((W, D + 1))), "ring"),
    (dict(sinks=mx.zeros((NH + 1,))), "sinks"),
    (dict(start=-1), "start"),
    (dict(scale=0.0), "scale"),
    (dict(ratio=8), "ratio"),
    (dict(table=mx.array([1], dtype=mx.int32), start=40), "table"),
    (dict(table=None), "table"),
    (dict(indices=None), "indices"),
    (dict(ratio=128), "indices"),
    (dict(pool=None), "pool"),
])  # fmt: skip
def test_bad_arguments_are_named(over, arg: str) -> None:
    a = _args(**over)
    with pytest.raises(ValueError, match=f"^prefill_attention: {arg}: "):
        prefill_attention(a.pop("q"), a.pop("ring"), a.pop("kv"), a.pop("start"), a.pop("pool"), a.pop("table"),
                          a.pop("indices"), a.pop("sinks"), **a)  # fmt: skip


@pytest.mark.parametrize("ratio", [None, 4, 128])
@pytest.mark.parametrize("start,t", [(0, 7), (3, 8), (5, 6), (20, 7), (300, 5)])
def test_prefill_rows_are_decode_rows(ratio, start: int, t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's mapping (kernels/cuda/prefill_attention.py: the keys reversed, each row's window a strided
    view, blocks of ROWS_MAX queries) fed to decode's plain attention (`sparse_attention_rows_reference`, up to 8
    rows) gives the plain prefill attention: the same keys, masks and entries for every query. (The rows are one
    request's queries, so they share its table, which decode's contract refuses for rows that write a page:
    that check is off here, as the CUDA path never makes it.)"""
    import importlib

    from dsv4_serve.kernels import Row, RowBatch

    sparse = importlib.import_module("dsv4_serve.kernels.sparse_attention")
    monkeypatch.setattr(sparse, "check_tables", lambda *a, **k: None)
    from dsv4_serve.kernels.cuda.prefill_attention import block_rows, reversed_keys
    from dsv4_serve.kernels.sparse_attention import sparse_attention_rows_reference

    rng = np.random.default_rng(start * 13 + t)
    f = lambda *s: mx.array(rng.normal(size=s).astype(np.float32))  # noqa: E731
    q, ring, kv, sinks = f(t, NH, D), f(W, D), f(t, D), f(NH)
    pool = table = ind = None
    if ratio:
        n = (start + t) // ratio
        pages = max(1, -(-n // PAGE)) + 1
        pool = f(pages + 1, PAGE, D)
        table = [int(x) for x in rng.permutation(np.arange(1, pages + 1))]
        if ratio == 4 and n:
            ind = np.full((t, 3), -1, np.int32)
            for i in range(t):
                pick = rng.permutation((start + i + 1) // 4)[:3]
                ind[i, : len(pick)] = pick
            ind = mx.array(ind)
    want = prefill_attention_reference(q, ring, kv, start, pool, None if table is None else mx.array(table),
                                       ind, sinks, scale=0.25, ratio=ratio)  # fmt: skip
    rseq, outs = reversed_keys(ring, kv, start, q.dtype), []
    for t0 in range(0, t, 3):  # ROWS_MAX 3: several blocks
        t1 = min(t, t0 + 3)
        window, slots, positions, q_rows = block_rows(rseq, t, start, t0, t1)
        rows = [Row(int(s), int(p), int(r), {ratio: tuple(table)} if ratio else {})
                for s, p, r in zip(slots.tolist(), positions.tolist(), q_rows.tolist(), strict=True)]  # fmt: skip
        batch = RowBatch.build(rows, PAGE)
        outs.append(sparse_attention_rows_reference(batch, q[t0:t1], mx.contiguous(window), pool,
                                                    None if ind is None else ind[t0:t1], sinks, scale=0.25,
                                                    ratio=ratio if ratio else None))  # fmt: skip
    np.testing.assert_allclose(np.array(mx.concatenate(outs)), np.array(want), rtol=1e-5, atol=1e-5)
