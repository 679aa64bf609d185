"""model/prefill_compress.py: a forward's requests through ONE compressor call against a call a request (the form
before it, and its plain twin), bit for bit: the slots' state, the pool's entries and the carry.

The calls are those a real forward makes: the tiny model's prefill of 1..8 requests (ragged chunks, unaligned
starts after a first forward, shuffled slots) records each compressor call's inputs (CSA: ratio 4, two halves a
row; HCA: ratio 128; the indexer's compressor), and each is replayed both ways on copies of its inputs."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model import prefill
from dsv4_serve.model.prefill_compress import Chunk, compress_chunks
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


def copy(a: mx.array | None) -> mx.array | None:
    return None if a is None else mx.array(np.array(a))


def recorded_calls(tiny, n_req: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Two forwards of n_req requests (the second at the first's unaligned ends), each compressor call's inputs."""
    model, args = tiny
    calls: list[tuple[Any, ...]] = []

    def spy(comp, proj, kv_state, score_state, pool, chunks, page, eps, carry, pooled, memo=None,  # noqa: ANN001, ANN202
            written=None):  # noqa: ANN001
        calls.append((comp, [copy(p) for p in proj], copy(kv_state), copy(score_state), copy(pool), list(chunks),
                      page, eps, copy(carry), pooled))  # fmt: skip
        return compress_chunks(comp, proj, kv_state, score_state, pool, chunks, page, eps, carry, pooled, memo,
                               written)  # fmt: skip

    monkeypatch.setattr(prefill, "compress_chunks", spy)
    rng = np.random.default_rng(n_req)
    pools = StatePools(args, max_slots=8, max_positions=512, page_size=8)
    order = rng.permutation(8)[:n_req]  # slots in another order than the requests'
    handles = [pools.alloc(400) for _ in range(8)]
    handles = [handles[i] for i in order]
    firsts = rng.integers(1, 140, n_req)
    for part in (0, 1):
        lens = firsts if part == 0 else rng.integers(1, 60, n_req)
        starts = [0] * n_req if part == 0 else [int(f) for f in firsts]
        work = [(h, [int(t) for t in rng.integers(0, args.vocab_size, int(n))], s)
                for h, n, s in zip(handles, lens, starts, strict=True)]  # fmt: skip
        mx.eval(model.prefill_batch(pools, work), *pools.arrays())
    return calls


@pytest.mark.parametrize("n_req", range(1, 9))
def test_one_call_equals_a_call_a_request(tiny, n_req: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = recorded_calls(tiny, n_req, monkeypatch)
    assert len(calls) == 2 * (2 * 2 + 1)  # two forwards x (two CSA layers, two compressors each; one HCA layer)
    emitted = 0
    for comp, proj, kv_state, score_state, pool, chunks, page, eps, carry, pooled in calls:
        assert len(chunks) == n_req
        one = compress_chunks(comp, proj, copy(kv_state), copy(score_state), copy(pool), chunks, page, eps,
                              copy(carry), pooled)  # fmt: skip
        kv, sc, pl = copy(kv_state), copy(score_state), copy(pool)
        for c in chunks:  # each request alone on its own rows, one after the other
            alone = [p[c.b0 : c.b1] for p in proj]
            kv, sc, pl, _ = compress_chunks(comp, alone, kv, sc, pl, [Chunk(c.slot, c.table, c.start, 0, c.b1 - c.b0)],
                                            page, eps, None, pooled)  # fmt: skip
        mx.eval(*[x for x in one if x is not None], kv, sc, pl)
        for got, want in zip(one[:3], (kv, sc, pl), strict=True):
            assert np.array_equal(np.array(got), np.array(want))
        if carry is not None:  # the readers' int32 array comes back as it went in
            assert np.array_equal(np.array(one[3]), np.array(carry))
        emitted += int(not np.array_equal(np.array(pool), np.array(pl)))
    assert emitted  # some call wrote entries (the comparison covers the pool's writes, not only the states)
