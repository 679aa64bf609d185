"""model/prefill_indexer.py `select_all`: several requests' indexer picks in one call over their keys side by side,
against `select` a request (the form before, on its own keys), bit for bit: random queries and keys, ragged
requests (1..8 of them, 1..40 queries each, 0..300 entries), ties in the scores (duplicated keys: the lowest id
wins within a request), a top-k under and over the keys' count; and the size past which it declines."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model import prefill_indexer as pi
from dsv4_serve.model.prefill_compress import Chunk

HEADS, DIM, RATIO = 4, 16, 4


def requests(rng: np.random.Generator, n_req: int) -> tuple[list[Chunk], list[int]]:
    """Chunks at random starts (entries seen: (start + t + 1) // RATIO) and each one's entries emitted."""
    chunks, b0 = [], 0
    for _ in range(n_req):
        t, start = int(rng.integers(1, 41)), int(rng.integers(0, 1200))
        chunks.append(Chunk(0, (), start, b0, b0 + t))
        b0 += t
    return chunks, [(c.start + c.b1 - c.b0) // RATIO for c in chunks]


@pytest.mark.parametrize("topk", [8, 64, 4096])
@pytest.mark.parametrize("n_req", range(2, 9))
def test_one_call_equals_a_call_a_request(n_req: int, topk: int) -> None:
    rng = np.random.default_rng(10 * n_req + topk)
    chunks, ns = requests(rng, n_req)
    t = chunks[-1].b1
    q = mx.array(rng.standard_normal((t, HEADS, DIM)).astype(np.float32))
    w = mx.array(rng.standard_normal((t, HEADS)).astype(np.float32))
    own = []
    for n in ns:  # each request's keys padded to a multiple of KEY_ROWS, with duplicates (tied scores)
        k = -(-max(n, 1) // pi.KEY_ROWS) * pi.KEY_ROWS if n else 0
        base = rng.standard_normal((max(1, k // 3), DIM)).astype(np.float32)
        own.append(base[rng.integers(0, len(base), k)] if k else np.zeros((0, DIM), np.float32))
    offs = np.cumsum([0, *map(len, own)]).tolist()
    keys = mx.array(np.concatenate(own))
    picks = pi.select_all(q, w, keys, chunks, offs, RATIO, topk)
    assert picks is not None and picks.shape == (t, topk)
    for c, n, lo, hi in zip(chunks, ns, offs[:-1], offs[1:], strict=True):
        if not n:
            continue
        vis = mx.arange(c.start + 1, c.start + c.b1 - c.b0 + 1, dtype=mx.int32) // RATIO
        alone = pi.select(q[c.b0 : c.b1], w[c.b0 : c.b1], keys[lo:hi], vis, topk)
        assert np.array_equal(np.array(picks[c.b0 : c.b1]), np.array(alone)), (c, n)


def test_a_single_request_or_a_large_score_goes_a_request_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """One request: nothing to share. Queries x keys past SELECT_SCORES: each query against every request's keys
    would cost more than the calls it saves (a long context), so None: the caller goes a request at a time."""
    rng = np.random.default_rng(1)
    chunks, _ = requests(rng, 3)
    t = chunks[-1].b1
    q, w = mx.zeros((t, HEADS, DIM)), mx.zeros((t, HEADS))
    keys = mx.zeros((3 * pi.KEY_ROWS, DIM))
    offs = [0, 128, 256, 384]
    assert pi.select_all(q, w, keys, chunks[:1], offs[:2], RATIO, 8) is None
    assert pi.select_all(q, w, keys, chunks, offs, RATIO, 8) is not None
    monkeypatch.setattr(pi, "SELECT_SCORES", t * keys.shape[0] - 1)
    assert pi.select_all(q, w, keys, chunks, offs, RATIO, 8) is None


@pytest.mark.parametrize("n_req", range(1, 9))
def test_every_visible_is_what_select_picks_for_any_scores(n_req: int) -> None:
    """Where no query sees more entries than the top-k keeps, `every_visible` (host-made, no scores) equals
    `select` on random queries and keys, tied keys included, request by request; one entry past: None."""
    rng = np.random.default_rng(100 + n_req)
    chunks, ns = requests(rng, n_req)
    topk = max((c.start + c.b1 - c.b0) // RATIO for c in chunks)  # the largest entries any query sees
    seen = pi.every_visible([(c.start, c.b1 - c.b0) for c in chunks], RATIO, topk)
    assert seen is not None and seen.shape == (chunks[-1].b1, topk) and seen.dtype == np.int32
    for c, n in zip(chunks, ns, strict=True):
        if not n:
            assert (seen[c.b0 : c.b1] == -1).all()
            continue
        t = c.b1 - c.b0
        k = -(-n // pi.KEY_ROWS) * pi.KEY_ROWS
        base = rng.standard_normal((max(1, k // 3), DIM)).astype(np.float32)
        keys = mx.array(base[rng.integers(0, len(base), k)])
        q = mx.array(rng.standard_normal((t, HEADS, DIM)).astype(np.float32))
        w = mx.array(rng.standard_normal((t, HEADS)).astype(np.float32))
        vis = mx.arange(c.start + 1, c.start + t + 1, dtype=mx.int32) // RATIO
        assert np.array_equal(seen[c.b0 : c.b1], np.array(pi.select(q, w, keys, vis, topk))), c
    assert pi.every_visible([(c.start, c.b1 - c.b0) for c in chunks], RATIO, topk - 1) is None


def test_scored_turns_every_visible_off_inside_only() -> None:
    """The warm-up's long prompt builds the scored path (a long context's) through `scored()`."""
    spans = [(0, 32)]
    assert pi.every_visible(spans, RATIO, 512) is not None
    with pi.scored():
        assert pi.every_visible(spans, RATIO, 512) is None
    assert pi.every_visible(spans, RATIO, 512) is not None
