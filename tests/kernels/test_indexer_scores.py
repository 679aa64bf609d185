"""kernels.indexer_scores' plain twin against the definition in NumPy (f64), and its argument checks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels.indexer_scores import indexer_scores, indexer_scores_reference


@pytest.mark.parametrize(("b", "nh", "n"), [(1, 4, 3), (3, 64, 130), (20, 8, 17)])
def test_indexer_scores_is_the_weighted_relu_sum_over_heads(b: int, nh: int, n: int) -> None:
    rng = np.random.default_rng(b * nh + n)
    q = rng.standard_normal((b, nh, 32)).astype(np.float32)
    w = rng.standard_normal((b, nh)).astype(np.float32)
    keys = rng.standard_normal((n, 32)).astype(np.float32)
    qb, kb = mx.array(q).astype(mx.bfloat16), mx.array(keys).astype(mx.bfloat16)
    qd, kd = np.array(qb.astype(mx.float32), np.float64), np.array(kb.astype(mx.float32), np.float64)
    want = (w[:, :, None] * np.maximum(np.einsum("bhd,nd->bhn", qd, kd), 0.0)).sum(axis=1)
    for fn in (indexer_scores_reference, indexer_scores):
        got = fn(qb, mx.array(w), kb)
        assert got.dtype == mx.float32 and got.shape == (b, n)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arg", "q", "w", "keys"), [
    ("q", mx.zeros((4, 8)), mx.zeros((4, 8)), mx.zeros((3, 8))),
    ("w", mx.zeros((4, 2, 8)), mx.zeros((4, 3)), mx.zeros((3, 8))),
    ("keys", mx.zeros((4, 2, 8)), mx.zeros((4, 2)), mx.zeros((3, 9))),
])  # fmt: skip
def test_bad_arguments_are_named(arg: str, q: mx.array, w: mx.array, keys: mx.array) -> None:
    with pytest.raises(ValueError, match=f"indexer_scores: {arg}:"):
        indexer_scores_reference(q, w, keys)
