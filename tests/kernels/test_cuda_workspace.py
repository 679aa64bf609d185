"""indexer_rows on CUDA with a caller's `workspace` (the one-launch kernel's tickets, histograms and keys:
no fill node, the output the ids alone): the reference's top-k over repeated calls on one workspace
(separate evals, and chained by `after` in one eval), batch sizes and table capacities that change between
calls, and the workspace's counts left zeroed (GPU only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import RowBatch, backend
from dsv4_serve.kernels.indexer import WS_HEAD, indexer_rows_reference, new_workspace
from tests.kernels.test_cuda import PAGE, fast, rel_err, rows_for
from tests.kernels.test_cuda_indexer import assert_topk_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def inputs(rng: np.random.Generator, n_rows: int, width: int):
    """A ragged batch at `width` pages of capacity, with random q / w / keys (64 heads x 128)."""
    cap = width * PAGE
    choices = [3, 130, 2047, 2051, 4099, 4 * cap - 1, 4 * cap // 3, 4 * cap // 2 + 1]
    positions = [int(x) for x in rng.choice(choices, size=n_rows, replace=False)]
    rows, pages, bq, _ = rows_for(rng, positions, (4,))
    batch = RowBatch.build(rows, PAGE, {4: width})
    q = mx.random.normal((bq, 64, 128)).astype(mx.bfloat16)
    w = mx.random.normal((bq, 64))
    keys = mx.random.normal((pages[4], PAGE, 128)).astype(mx.bfloat16)
    mx.eval(q, w, keys)
    return batch, rows, q, w, keys


def assert_zero(ws: mx.array) -> None:
    """Every row's ticket and histogram zero again (its keys after them may hold anything)."""
    assert int(mx.sum(ws[:, :WS_HEAD] != 0)) == 0, "the workspace's counts were not left zeroed"


@pytest.mark.parametrize("n_rows", range(1, 9))
def test_workspace_calls_match_reference(n_rows: int) -> None:
    """Three calls on one workspace in separate evals, then three chained by `after` in one eval (a
    row's histogram left over from the last call would change the next call's top-k)."""
    rng = np.random.default_rng(300 + n_rows)
    ws = new_workspace(8, 8192)
    kc = fast()
    for _ in range(3):
        batch, rows, q, w, keys = inputs(rng, n_rows, 8192 // PAGE)
        want = np.array(indexer_rows_reference(batch, q, w, keys, topk=512))
        got = np.array(kc.indexer_rows_cuda(batch, q, w, keys, topk=512, workspace=ws))
        assert_topk_equal(got, want, rows, q, w, keys, exact=False)
        assert_zero(ws)
    batch, rows, q, w, keys = inputs(rng, n_rows, 8192 // PAGE)
    outs, prev = [], None
    for topk in (512, 100, 512):
        prev = kc.indexer_rows_cuda(batch, q, w, keys, topk=topk, after=prev, workspace=ws)
        outs.append(prev)
    mx.eval(outs)
    for topk, got in zip((512, 100, 512), outs, strict=True):
        want = np.array(indexer_rows_reference(batch, q, w, keys, topk=topk))
        assert_topk_equal(np.array(got), want, rows, q, w, keys, exact=False)
    assert_zero(ws)


def test_workspace_shared_across_batch_sizes() -> None:
    """8 rows, then 3, then 8, then 1 on one workspace, the tables' capacity changing too (a call's keys
    must never land where a later call expects zeroed counts), each call leaving its counts zeroed."""
    rng = np.random.default_rng(400)
    ws = new_workspace(8, 8192)
    for n, width in ((8, 8192 // PAGE), (3, 4096 // PAGE), (8, 2048 // PAGE), (1, 8192 // PAGE), (8, 8192 // PAGE)):
        batch, rows, q, w, keys = inputs(rng, n, width)
        want = np.array(indexer_rows_reference(batch, q, w, keys, topk=512))
        got = np.array(fast().indexer_rows_cuda(batch, q, w, keys, topk=512, workspace=ws))
        assert_topk_equal(got, want, rows, q, w, keys, exact=False)
        assert_zero(ws)


def test_workspace_ignored_on_long_rows() -> None:
    """Past ONE_MAX (segment + merge: no tickets) the workspace is unused and untouched."""
    rng = np.random.default_rng(500)
    ws = new_workspace(4, 8192)
    batch, rows, q, w, keys = inputs(rng, 4, 65536 // PAGE)
    want = np.array(indexer_rows_reference(batch, q, w, keys, topk=512))
    got = np.array(fast().indexer_rows_cuda(batch, q, w, keys, topk=512, workspace=ws))
    assert_topk_equal(got, want, rows, q, w, keys, exact=False)
    assert_zero(ws)


@pytest.mark.parametrize("n_rows", [1, 3, 8])
def test_hca_compressor_workspace_steps_match_reference(n_rows: int) -> None:
    """The in-place HCA compressor (ratio 128: 8 blocks a row, a ticket each) with a workspace over steps
    that complete windows (chained by tokens in one eval), then a call with fewer rows on the same
    workspace: the reference's states and pools, and the workspace's tickets (its last words) zero."""
    from dsv4_serve.kernels.compressor import compressor_rows_reference, new_workspace
    from tests.kernels.test_cuda_inplace import copies, setup

    ws = new_workspace(8, 512)
    for rows, seed, steps in ((n_rows, 600 + n_rows, 3), (1, 700, 2)):
        batch, kv, score, ape, norm, st, kw = setup(128, 512, rows, mx.bfloat16, seed, steps)
        want = st
        for i in range(steps):
            want = compressor_rows_reference(batch(i), kv[i], score[i], ape, norm, *want, **kw)
        got, token = copies(*st), None
        for i in range(steps):
            *got, token = fast().compressor_rows_inplace_cuda(batch(i), kv[i], score[i], ape, norm, *got,
                                                              after=token, workspace=ws, **kw)  # fmt: skip
        mx.eval(want, token)
        np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
        np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
        assert rel_err(got[2][1:], want[2][1:]) <= 1e-2
        assert int(mx.sum(ws[-8:] != 0)) == 0, "a ticket was left set"
