"""kernels/cuda/pooled.py (a compressor's pooling in one launch) against its plain twin, `pooled_entry`.

On the CPU: the kernel's translation units (bf16 and f32 pools, the windows' rows as CSA's 8 and HCA's 128, the
entries' and the indexer keys' widths) build with NVRTC for sm_90a. On a GPU (gpu): random windows, 1..64 entries,
equal to the twin within its rounding (the sums' order differs); the twin where the fast path does not hold."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.compressor import pooled_entry
from tests.kernels.nvrtc_here import NEEDS_NVRTC

HALF = 32  # V4's rope dims / 2


def inputs(e: int, r: int, d: int, dtype: mx.Dtype, seed: int = 0) -> tuple[mx.array, ...]:
    rng = np.random.default_rng(seed)
    vals = mx.array(rng.standard_normal((e, r, d)).astype(np.float32)).astype(dtype)
    gates = mx.array(3 * rng.standard_normal((e, r, d)).astype(np.float32))
    norm = mx.array(1 + 0.1 * rng.standard_normal(d).astype(np.float32)).astype(dtype)
    ang = rng.uniform(0, 6.3, (e, HALF)).astype(np.float32)
    return vals, gates, norm, mx.array(np.cos(ang)), mx.array(np.sin(ang))


@NEEDS_NVRTC
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_kernel_builds_with_nvrtc(dtype: mx.Dtype) -> None:
    from dsv4_serve.kernels.cuda.common import HEADER, minify
    from dsv4_serve.kernels.cuda.pooled import SOURCE
    from dsv4_serve.kernels.graph.codegen import translation_unit
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin
    from dsv4_serve.kernels.graph.record import KernelSource

    names = ("vals", "gates", "norm", "cs", "sn", "fparams")
    ks = KernelSource("dsv4_pooled_entry_test", names, ("out",), minify(SOURCE), minify(HEADER) + "\n", 0)
    for r, d in ((8, 512), (8, 128), (128, 512)):
        vals, gates, norm, cos, sin = inputs(2, r, d, dtype)
        src = translation_unit(ks, [("T", dtype), ("O", dtype)], [vals, gates, norm, cos, sin, mx.zeros((1,))],
                               [dtype])  # fmt: skip
        cubin, lowered = compile_cubin(src, f"mlx::core::cu::{ks.name}", "sm_90a")
        assert cubin and ks.name in lowered


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(("e", "r", "d"), [(1, 8, 512), (3, 8, 128), (8, 8, 512), (64, 8, 128), (5, 128, 512)])
def test_the_kernel_equals_its_twin(dtype: mx.Dtype, e: int, r: int, d: int) -> None:
    from dsv4_serve.kernels.cuda.pooled import pooled_entry_cuda

    args = inputs(e, r, d, dtype, seed=e + r + d)
    vals, gates, norm, cos, sin = args
    got = np.array(pooled_entry_cuda(vals, gates, norm, 1e-6, cos, sin, dtype).astype(mx.float32))
    want = np.array(pooled_entry(vals, gates, norm, 1e-6, cos, sin, dtype).astype(mx.float32))
    assert got.shape == want.shape == (e, d) and np.isfinite(got).all()
    ulp = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-20  # a rounding apart, on values of order 1 (normed)
    assert np.abs(got - want).max() <= 4 * ulp * max(1.0, np.abs(want).max()), np.abs(got - want).max()
    assert np.mean(got == want) > (0.9 if dtype == mx.bfloat16 else 0.0)  # most values the same bits


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
def test_off_the_fast_path_the_twin_runs() -> None:
    from dsv4_serve.kernels.cuda.pooled import pooled_entry_cuda

    vals, gates, norm, cos, sin = inputs(2, 8, 128, mx.bfloat16)
    half_gates = gates.astype(mx.bfloat16)  # gates not f32: the twin
    got = pooled_entry_cuda(vals, half_gates, norm, 1e-6, cos, sin, mx.bfloat16)
    want = pooled_entry(vals, half_gates, norm, 1e-6, cos, sin, mx.bfloat16)
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_the_switch_picks_the_kernel_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4_serve.kernels.cuda.pooled import pooled_entry_cuda
    from dsv4_serve.model import prefill_indexer

    monkeypatch.setenv("DSV4_POOLED_KERNEL", "1")
    monkeypatch.setattr(backend, "_use_fast", lambda: True)  # CUDA as the kernels' Python sees it
    assert prefill_indexer._pooling() is pooled_entry_cuda
    monkeypatch.setenv("DSV4_POOLED_KERNEL", "0")
    assert prefill_indexer._pooling() is pooled_entry
    monkeypatch.setenv("DSV4_POOLED_KERNEL", "1")
    monkeypatch.setattr(backend, "_use_fast", lambda: False)  # the CPU, Metal, DSV4_KERNELS=reference
    assert prefill_indexer._pooling() is pooled_entry
