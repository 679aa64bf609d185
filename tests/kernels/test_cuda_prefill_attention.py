"""prefill_attention's CUDA paths against their plain twin on the GPU: `HEADS` (one block a query, all 64
heads; the default at V4 dims) and the decode kernel's rows (`dsplit`); V4-Flash dims (64 heads, D 512,
W 128), bf16, sliding / CSA / HCA, chunks that start at 0, inside the first window and deep in the context,
ragged lengths, CSA picks that leave whole chunks empty, several launches (ROWS_MAX cut small)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from tests.kernels.naive import scatter_tables

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]

NH, D, W, PAGE, TOPK = 64, 512, 128, 256, 512


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(((a - b) ** 2).sum()) / mx.maximum(mx.sqrt((b * b).sum()), 1e-30))


def cosine(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32).reshape(-1), b.astype(mx.float32).reshape(-1)
    return float((a * b).sum() / mx.maximum(mx.sqrt((a * a).sum() * (b * b).sum()), 1e-30))


def case(kind: str, start: int, t: int, seed: int):
    rng = np.random.default_rng(seed)
    q = mx.random.normal((t, NH, D), key=mx.random.key(seed)).astype(mx.bfloat16)
    ring = mx.random.normal((W, D), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    kv = mx.random.normal((t, D), key=mx.random.key(seed + 2)).astype(mx.bfloat16)
    sinks = mx.random.normal((NH,), key=mx.random.key(seed + 3))
    if kind == "sliding":
        return q, ring, kv, None, None, None, sinks, None
    ratio = 4 if kind == "csa" else 128
    n = (start + t) // ratio
    (table,), pages = scatter_tables(rng, [max(1, -(-n // PAGE)) + 1])  # one page past the reach
    pool = mx.random.normal((pages, PAGE, D), key=mx.random.key(seed + 4)).astype(mx.bfloat16)
    ind = None
    if ratio == 4 and n:
        vis = (np.arange(start, start + t) + 1) // 4
        ind = np.full((t, TOPK), -1, np.int32)
        for i, v in enumerate(vis):  # each query's visible entries, some picked, in any order
            pick = rng.permutation(v)[:TOPK]
            ind[i, : len(pick)] = pick
            rng.shuffle(ind[i])
        ind = mx.array(ind)
    return q, ring, kv, pool, mx.array(table, dtype=mx.int32), ind, sinks, ratio


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("start,t", [(0, 1), (0, 7), (5, 64), (0, 300), (120, 200), (2_000, 513), (16_380, 97)])
def test_prefill_attention_is_the_plain_attention(kind: str, start: int, t: int) -> None:
    from dsv4_serve.kernels.cuda.prefill_attention import prefill_attention_cuda
    from dsv4_serve.kernels.prefill_attention import prefill_attention_reference

    args = case(kind, start, t, seed=7 * start + t)
    q, ring, kv, pool, table, ind, sinks, ratio = args
    kw = dict(scale=D**-0.5, ratio=ratio)
    want = prefill_attention_reference(q, ring, kv, start, pool, table, ind, sinks, **kw)
    got = prefill_attention_cuda(q, ring, kv, start, pool, table, ind, sinks, **kw)
    assert got.dtype == mx.bfloat16 and got.shape == (t, NH, D)
    # the kernel's P is bf16 (as in decode), the plain form's f32
    assert rel_err(got, want) <= 1e-2
    assert cosine(got, want) >= 0.9999


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_prefill_attention_dsplit_rows_are_the_plain_attention(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4_PREFILL_ATTN=dsplit: the decode kernel's rows, one per query."""
    kc = importlib.import_module("dsv4_serve.kernels.cuda.prefill_attention")
    from dsv4_serve.kernels.prefill_attention import prefill_attention_reference

    monkeypatch.setattr(kc, "HEADS_ON", False)
    q, ring, kv, pool, table, ind, sinks, ratio = case(kind, 120, 200, seed=11)
    kw = dict(scale=D**-0.5, ratio=ratio)
    want = prefill_attention_reference(q, ring, kv, 120, pool, table, ind, sinks, **kw)
    got = kc.prefill_attention_cuda(q, ring, kv, 120, pool, table, ind, sinks, **kw)
    assert rel_err(got, want) <= 1e-2 and cosine(got, want) >= 0.9999


def test_prefill_attention_csa_picks_in_front() -> None:
    """CSA picks packed in front (-1 after them, as the indexer's top-k leaves a short prompt): the chunks
    after them hold no valid key and are skipped, the rest attended as the plain form does."""
    from dsv4_serve.kernels.cuda.prefill_attention import prefill_attention_cuda
    from dsv4_serve.kernels.prefill_attention import prefill_attention_reference

    q, ring, kv, pool, table, ind, sinks, ratio = case("csa", 0, 700, seed=13)
    ind = mx.sort(ind, axis=1)[:, ::-1]  # valid ids first, the -1s last
    kw = dict(scale=D**-0.5, ratio=ratio)
    want = prefill_attention_reference(q, ring, kv, 0, pool, table, ind, sinks, **kw)
    got = prefill_attention_cuda(q, ring, kv, 0, pool, table, ind, sinks, **kw)
    assert rel_err(got, want) <= 1e-2 and cosine(got, want) >= 0.9999


def test_prefill_attention_launches_in_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """More queries than ROWS_MAX: several launches, each its own window view of the reversed keys."""
    kc = importlib.import_module("dsv4_serve.kernels.cuda.prefill_attention")
    from dsv4_serve.kernels.prefill_attention import prefill_attention_reference

    monkeypatch.setattr(kc, "ROWS_MAX", 100)
    q, ring, kv, pool, table, ind, sinks, ratio = case("csa", 60, 333, seed=3)
    kw = dict(scale=D**-0.5, ratio=ratio)
    want = prefill_attention_reference(q, ring, kv, 60, pool, table, ind, sinks, **kw)
    got = kc.prefill_attention_cuda(q, ring, kv, 60, pool, table, ind, sinks, **kw)
    assert rel_err(got, want) <= 1e-2 and cosine(got, want) >= 0.9999


def test_prefill_attention_f32_takes_the_plain_path() -> None:
    """An f32 model (the tiny one): the kernels take 16-bit q and keys only; the op answers with the twin's
    values exactly."""
    from dsv4_serve.kernels.cuda.prefill_attention import prefill_attention_cuda
    from dsv4_serve.kernels.prefill_attention import prefill_attention_reference

    q, ring, kv, pool, table, ind, sinks, ratio = case("hca", 300, 40, seed=5)
    q, ring, kv, pool = (x.astype(mx.float32) for x in (q, ring, kv, pool))
    kw = dict(scale=D**-0.5, ratio=ratio)
    want = prefill_attention_reference(q, ring, kv, 300, pool, table, ind, sinks, **kw)
    got = prefill_attention_cuda(q, ring, kv, 300, pool, table, ind, sinks, **kw)
    np.testing.assert_array_equal(np.array(got), np.array(want))
