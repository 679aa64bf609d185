"""A chained batch's scratch ring (kernels/sparse_attention.py `scratch_ring`; CUDA: kernels/cuda/scratch_ring.py).

The twin against the ring NumPy writes a single step at a time; the sparse attention over it (as the fast path
reads a chained batch: a row a slot) against the twin's own tail form, bit for bit; the kernel built with NVRTC;
on a GPU the kernel against the twin bit for bit, chains of 1..8 rows, before and after the ring wraps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.rows import Row, RowBatch
from dsv4_serve.kernels.sparse_attention import scratch_ring, sparse_attention_rows_reference
from tests.kernels.nvrtc_here import NEEDS_NVRTC

W, D, PAGE = 8, 16, 4
# (slot, first position, rows): chains in an order unrelated to the slots, a ring not yet full, wraps, 8 rows of one
CASES = {
    "mixed": [(2, 5, 3), (0, 13, 1), (1, 30, 4)],
    "one_long": [(1, 21, 8)],
    "young": [(0, 0, 2), (3, 2, 3)],
    "singles": [(0, 9, 1), (1, 3, 1), (2, 17, 1)],
}


def chained(spec: list[tuple[int, int, int]]) -> RowBatch:
    rows, q = [], 0
    for slot, first, n in spec:
        for i in range(n):
            rows.append(Row(slot=slot, position=first + i, q_row=q, tables={}))
            q += 1
    return RowBatch.build(rows, PAGE)


def draw(spec, dtype, seed: int) -> tuple[RowBatch, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    batch = chained(spec)
    window = mx.array(rng.standard_normal((4, W, D)).astype(np.float32)).astype(dtype)
    tail = mx.array(rng.standard_normal((batch.size, D)).astype(np.float32)).astype(dtype)
    mx.eval(window, tail)
    return batch, window, tail


def by_single_steps(batch: RowBatch, window: mx.array, tail: mx.array) -> np.ndarray:
    """Each row's ring after the single steps of its slot up to its own position wrote their keys (in order)."""
    ring, keys = np.array(window.astype(mx.float32)), np.array(tail.astype(mx.float32))
    out = np.zeros((batch.size, W, D), np.float32)
    for i, r in enumerate(batch.rows):
        mine = ring[r.slot].copy()
        for o in batch.rows:
            if o.slot == r.slot and o.position <= r.position:
                mine[o.position % W] = keys[o.q_row]
        out[i] = mine
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_twin_is_the_ring_single_steps_read(name: str) -> None:
    batch, window, tail = draw(CASES[name], mx.float32, seed=len(name))
    np.testing.assert_array_equal(np.array(scratch_ring(batch, window, tail)), by_single_steps(batch, window, tail))


@pytest.mark.parametrize("name", list(CASES))
def test_attention_over_the_scratch_ring_is_the_tail_form(name: str) -> None:
    """A sliding layer: the fast path's reading (the scratch ring as a batch of distinct slots) gives the twin's tail
    form's output bit for bit."""
    batch, window, tail = draw(CASES[name], mx.float32, seed=7)
    rng = np.random.default_rng(8)
    q = mx.array(rng.standard_normal((batch.size, 2, D)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(2).astype(np.float32))
    want = sparse_attention_rows_reference(batch, q, window, None, None, sinks, scale=0.25, tail=tail)
    flat = RowBatch.build([Row(slot=i, position=r.position, q_row=r.q_row) for i, r in enumerate(batch.rows)], PAGE)
    got = sparse_attention_rows_reference(flat, q, scratch_ring(batch, window, tail), None, None, sinks, scale=0.25)
    np.testing.assert_array_equal(np.array(got), np.array(want))


@NEEDS_NVRTC
@pytest.mark.parametrize("dtype, d", [(mx.bfloat16, 512), (mx.float32, 7)])
def test_the_kernel_builds_with_nvrtc(dtype: mx.Dtype, d: int) -> None:
    from dsv4_serve.kernels.cuda.common import HEADER, minify
    from dsv4_serve.kernels.cuda.scratch_ring import SOURCE
    from dsv4_serve.kernels.graph.codegen import translation_unit
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin
    from dsv4_serve.kernels.graph.record import KernelSource

    names = ("slots", "positions", "q_rows", "window", "tail")
    ks = KernelSource("dsv4_scratch_ring_test", names, ("out",), minify(SOURCE), minify(HEADER) + "\n", 0)
    i32 = mx.zeros((8,), mx.int32)
    unit = translation_unit(ks, [("T", dtype), ("D", d)], [i32, i32, i32, mx.zeros((4, 128, d), dtype),
                                                         mx.zeros((8, d), dtype)], [dtype])  # fmt: skip
    cubin, lowered = compile_cubin(unit, f"mlx::core::cu::{ks.name}", "sm_90a")
    assert cubin and ks.name in lowered


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_is_the_twin_bit_for_bit(name: str, dtype: mx.Dtype) -> None:
    from dsv4_serve.kernels.cuda.scratch_ring import scratch_ring_cuda

    batch, window, tail = draw(CASES[name], dtype, seed=3)
    got, want = scratch_ring_cuda(batch, window, tail), scratch_ring(batch, window, tail)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
