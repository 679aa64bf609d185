"""kernels/cuda/experts_grouped.py (prefill's routed experts as grouped GEMMs on the mxfp4 weights) against the
per-pair reference and the plain `tiles` form, and the dispatch of `grouped_experts` to a registered fast form."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels import experts_grouped as eg
from tests.kernels.agreement import close
from tests.kernels.test_experts_grouped import args, experts, routing

needs_gpu = pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")


def test_tiles_dispatches_to_the_registered_fast_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """mode `tiles` with no `how` runs the registered op (with the same arguments); an explicit `how`, or
    `DSV4_GROUPED_EXPERTS=qtiles`, runs the plain forms."""
    seen = []

    def fast(*a: mx.array, limit: float | None, pairs: bool) -> mx.array:
        seen.append((len(a), limit))
        return mx.zeros((a[0].shape[0], a[0].shape[1]), mx.float32)

    monkeypatch.setattr(backend, "_use_fast", lambda: True)
    monkeypatch.setitem(backend._fast, eg.OP, fast)
    rng = np.random.default_rng(0)
    p = experts(8, 128, 64)
    x = mx.random.normal((17, 128))
    idx, w = routing("ragged", 17, 8, rng)
    monkeypatch.delenv(eg.ENV, raising=False)
    got = eg.grouped_experts(x, idx, w, *args(p), limit=0.5)
    assert seen == [(9, 0.5)] and not got.any().item()
    want = eg.experts_rows_reference(x, idx, w, *args(p), limit=0.5)
    close(eg.grouped_experts(x, idx, w, *args(p), limit=0.5, how="tiles"), want, 1e-4)
    monkeypatch.setenv(eg.ENV, "qtiles")
    close(eg.grouped_experts(x, idx, w, *args(p), limit=0.5), want, 1e-4)
    assert len(seen) == 1


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize(("b", "e", "hid", "inter", "kind"), [
    (9, 8, 128, 128, "ragged"), (17, 8, 256, 128, "unused"), (64, 16, 256, 256, "same"),
    (300, 16, 512, 256, "ragged"), (1000, 32, 256, 128, "unused"),
])  # fmt: skip
def test_cuda_grouped_is_the_per_pair_reference(b: int, e: int, hid: int, inter: int, kind: str,
                                                limit: float | None) -> None:  # fmt: skip
    from dsv4_serve.kernels.cuda.experts_grouped import fits, grouped_experts_cuda

    rng = np.random.default_rng(b + e)
    p = experts(e, hid, inter)
    x = (3 * mx.random.normal((b, hid))).astype(mx.bfloat16)  # gate / up ~ N(0, 9): the 0.5 clamp bites
    idx, w = routing(kind, b, e, rng)
    assert fits(x, p["w1"], p["w2"])
    got = grouped_experts_cuda(x, idx, w, *args(p), limit=limit)
    assert got.dtype == mx.float32 and got.shape == (b, hid)
    close(got, eg.experts_rows_reference(x, idx, w, *args(p), limit=limit), 2e-2)
    close(got, eg.grouped_experts(x, idx, w, *args(p), limit=limit, how="tiles"), 2e-2)
    pairs = grouped_experts_cuda(x, idx, w, *args(p), limit=limit, pairs=True)  # the MoE's fused combine's input
    assert pairs.dtype == x.dtype and pairs.shape == (b, idx.shape[1], hid)
    close(pairs, eg.grouped_experts(x, idx, w, *args(p), limit=limit, how="tiles", pairs=True), 2e-2)
    assert mx.array_equal(mx.sum(pairs.astype(mx.float32) * w[:, :, None], axis=1), got).item()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("limit", [None, 10.0])
def test_cuda_grouped_at_v4_flash_dims(limit: float | None) -> None:
    """H 4096, I 2048, 32 experts, a 2,048-token chunk: the kernels vs gather_qmm a pair."""
    from dsv4_serve.kernels.cuda.experts_grouped import grouped_experts_cuda

    rng = np.random.default_rng(0)
    p = experts(32, 4096, 2048)
    x = mx.random.normal((2048, 4096)).astype(mx.bfloat16)
    idx, w = routing("ragged", 2048, 32, rng)
    want = eg.experts_rows_reference(x, idx, w, *args(p), limit=limit)
    close(grouped_experts_cuda(x, idx, w, *args(p), limit=limit), want, 2e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("b", [9, 40])
def test_cuda_grouped_shapes_that_do_not_tile_run_the_plain_form(b: int) -> None:
    """H = 64 (not a multiple of 128): the plain `tiles` form, same result."""
    from dsv4_serve.kernels.cuda.experts_grouped import fits, grouped_experts_cuda

    p = experts(8, 64, 64)
    x = mx.random.normal((b, 64)).astype(mx.bfloat16)
    idx, w = routing("ragged", b, 8, np.random.default_rng(1))
    assert not fits(x, p["w1"], p["w2"])
    close(grouped_experts_cuda(x, idx, w, *args(p), limit=None),
          eg.grouped_experts(x, idx, w, *args(p), limit=None, how="tiles"), 1e-6)  # fmt: skip
