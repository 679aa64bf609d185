"""The fast paths' agreement with their references: relative to the output's scale (bf16 outputs round
once, the sums' order differs) and in direction (cosine)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def close(got: mx.array, want: mx.array, tol: float) -> None:
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert g.shape == w.shape and np.isfinite(g).all()
    scale = np.abs(w).max() + 1e-6
    assert np.abs(g - w).max() <= tol * scale, (np.abs(g - w).max(), scale)
    cos = (g * w).sum() / (np.linalg.norm(g) * np.linalg.norm(w) + 1e-30)
    assert cos >= 0.9999, cos
