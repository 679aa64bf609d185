"""The interleaved RoPE helper vs NumPy, its per-step tables form vs the op, and backend selection (env
override, fast-path registry)."""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve import kernels
from dsv4_serve.kernels import backend, rope, rope_apply, rope_tables
from dsv4_serve.kernels.indexer import indexer_rows_reference
from tests.kernels.naive import rope_np


@pytest.mark.parametrize(("d", "half"), [(12, 2), (8, 4)])
def test_rope_interleaved_last_dims_matches_numpy(d: int, half: int) -> None:
    rng = np.random.default_rng(d)
    x = rng.normal(size=(3, 5, d)).astype(np.float32)
    ang = rng.uniform(-math.pi, math.pi, size=(3, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    got = np.array(rope(mx.array(x), mx.array(cos), mx.array(sin)))
    want = np.stack([np.stack([rope_np(x[b, h], cos[b], sin[b]) for h in range(5)]) for b in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[..., : d - 2 * half], x[..., : d - 2 * half])  # nope dims untouched


def test_rope_keeps_dtype() -> None:
    x = mx.ones((2, 8), mx.bfloat16)
    assert rope(x, mx.ones((2, 2)), mx.zeros((2, 2))).dtype == mx.bfloat16


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(("shape", "half"), [((3, 12), 2), ((3, 5, 12), 2), ((4, 8, 64), 8), ((2, 16), 8)])
def test_rope_tables_apply_equals_rope(shape: tuple[int, ...], half: int, dtype: mx.Dtype) -> None:
    """The model's form (tables once per step, one fused kernel per application) gives the op's results
    bit for bit (the nope dims are x * 1 + y * 0 = x), and -S rotates back as the op with -sin does."""
    rng = np.random.default_rng(sum(shape) + half)
    x = mx.array(rng.normal(size=shape).astype(np.float32)).astype(dtype)
    ang = rng.uniform(-math.pi, math.pi, size=(shape[0], half)).astype(np.float32)
    cos, sin = mx.array(np.cos(ang)), mx.array(np.sin(ang))
    c, s = rope_tables(cos, sin, shape[-1])
    for got, want in ((rope_apply(x, c, s), rope(x, cos, sin)), (rope_apply(x, c, -s), rope(x, cos, -sin))):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
    compiled = mx.compile(rope_apply)(x, c, s)
    np.testing.assert_array_equal(np.array(compiled.astype(mx.float32)), np.array(rope(x, cos, sin).astype(mx.float32)))


def test_rope_tables_and_apply_name_bad_arguments() -> None:
    cos = mx.ones((2, 4))
    with pytest.raises(ValueError, match="^rope_tables: d: 6 "):
        rope_tables(cos, cos, 6)
    with pytest.raises(ValueError, match="^rope_tables: d: 9 "):
        rope_tables(cos, cos, 9)
    c, s = rope_tables(cos, cos, 16)
    with pytest.raises(ValueError, match="^rope_apply: c, s: "):
        rope_apply(mx.ones((2, 3, 12)), c, s)
    with pytest.raises(ValueError, match="^rope_apply: c, s: "):
        rope_apply(mx.ones((3, 16)), c, s)


@pytest.fixture
def fresh_backend(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(backend, "_fast", {})
    monkeypatch.setattr(backend, "_loaded", True)
    monkeypatch.delenv(backend.ENV, raising=False)
    return monkeypatch


def test_backend_is_reference_without_cuda(fresh_backend: pytest.MonkeyPatch) -> None:
    fresh_backend.setattr(backend, "cuda_available", lambda: False)
    backend.register("indexer_rows", lambda *a, **k: "fast")
    assert backend.name() == "reference"
    assert backend.pick("indexer_rows", indexer_rows_reference) is indexer_rows_reference


def test_backend_picks_registered_fast_op_on_cuda(fresh_backend: pytest.MonkeyPatch) -> None:
    fresh_backend.setattr(backend, "cuda_available", lambda: True)
    assert backend.name() == "reference"  # CUDA but nothing registered yet
    backend.register("indexer_rows", lambda *a, **k: "fast")
    assert backend.name() == "cuda"
    assert kernels.indexer_rows(None, None, None, None, topk=1) == "fast"  # type: ignore[arg-type]
    # an op without a fast version still gets its reference
    from dsv4_serve.kernels.compressor import compressor_rows_reference

    assert backend.pick("compressor_rows", compressor_rows_reference) is compressor_rows_reference
    fresh_backend.setenv(backend.ENV, "reference")
    assert backend.name() == "reference"
    assert backend.pick("indexer_rows", indexer_rows_reference) is indexer_rows_reference


def test_backend_env_errors(fresh_backend: pytest.MonkeyPatch) -> None:
    fresh_backend.setattr(backend, "cuda_available", lambda: False)
    fresh_backend.setenv(backend.ENV, "cuda")
    with pytest.raises(ValueError, match="DSV4_KERNELS"):
        backend.name()
    fresh_backend.setenv(backend.ENV, "metal-please")
    with pytest.raises(ValueError, match="DSV4_KERNELS"):
        backend.name()
    with pytest.raises(ValueError, match="op"):
        backend.register("rows_gather", lambda: None)


def test_cuda_commit_size_only_on_cuda_and_never_over_the_user(fresh_backend: pytest.MonkeyPatch) -> None:
    """MLX_MAX_OPS_PER_BUFFER: set on CUDA builds only (Metal reads it too), an explicit value kept."""
    fresh_backend.delenv("MLX_MAX_OPS_PER_BUFFER", raising=False)
    fresh_backend.setattr(backend, "cuda_available", lambda: False)
    backend.tune_cuda_commits()
    assert "MLX_MAX_OPS_PER_BUFFER" not in os.environ
    fresh_backend.setattr(backend, "cuda_available", lambda: True)
    backend.tune_cuda_commits()
    assert os.environ["MLX_MAX_OPS_PER_BUFFER"] == str(backend.CUDA_COMMIT_OPS)
    fresh_backend.setenv("MLX_MAX_OPS_PER_BUFFER", "100")
    backend.tune_cuda_commits()
    assert os.environ["MLX_MAX_OPS_PER_BUFFER"] == "100"
