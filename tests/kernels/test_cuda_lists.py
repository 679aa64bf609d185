"""The CUDA indexer's dense segments (128K context) hand the merge a compact list each: their keys >= tau,
the least of their 32 class maxima. The merge reads a segment's list only when that holds every key >= the
row's bound; these cases force the other paths against the reference, exactly (small-integer scores)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import RowBatch, backend
from dsv4_serve.kernels.indexer import indexer_rows_reference
from tests.kernels.test_cuda import PAGE, fast, rows_for
from tests.kernels.test_cuda_indexer import assert_topk_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]

CAP = 32_768  # entries of capacity: 32 segments of 1,024 at top-512 (dense)
SEG = 1024


def entry_places(row, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(page, offset) of the row's entries lo..hi-1 (those it has)."""
    ids = np.arange(lo, min(hi, (row.position + 1) // 4))
    return np.array(row.tables[4])[ids // PAGE], ids % PAGE


@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_indexer_compact_list_fallbacks(n_rows: int) -> None:
    """Per row: segment 3's keys x 4 (its least class maximum lies above the row's bound: the merge reads
    that segment's keys, not its list); segment 5's keys all one vector (1,024 equal scores, more than its
    list holds: it reads the keys too, and ties go to the lowest ids); the rest small random integers.
    Rows of 32,768 entries (bounds from class maxima), 10,000 (m = 57: from the radix pass) and 6,000."""
    import dsv4_serve.kernels.cuda.indexer as ix

    assert ix.dense_segments(ix.segment_size(CAP, 512), 512) and ix.segment_size(CAP, 512) == SEG
    rng = np.random.default_rng(300 + n_rows)
    positions = [4 * CAP - 1, 40_003, 24_001, 4 * CAP - 1, 4 * CAP - 2, 40_003, 4 * CAP - 1, 24_001][:n_rows]
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE, {4: CAP // PAGE})
    q = mx.array(rng.integers(-1, 2, size=(bq, 32, 64)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), size=(bq, 32)))  # scores >= 0
    keys = rng.integers(-1, 2, size=(pages[4], PAGE, 64)).astype(np.float32)
    for r in rows:
        keys[entry_places(r, 3 * SEG, 4 * SEG)] *= 4
        keys[entry_places(r, 5 * SEG, 6 * SEG)] = np.sign(np.array(q[r.q_row].astype(mx.float32)).sum(axis=0))
    keys = mx.array(keys).astype(mx.bfloat16)
    want = np.array(indexer_rows_reference(batch, q, w, keys, topk=512))
    got = np.array(fast().indexer_rows_cuda(batch, q, w, keys, topk=512))
    assert_topk_equal(got, want, rows, q, w, keys, exact=True)
    # the cases are the ones named: segment 3 holds top entries, segment 5's equal scores are among them
    full = [r for r in rows if r.position == 4 * CAP - 1]
    for r in full:
        ids = got[r.q_row]
        assert ((ids >= 3 * SEG) & (ids < 4 * SEG)).any()
