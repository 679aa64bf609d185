"""write_rows (kernels/pool_rows.py): rows of a state pool written, in place on CUDA.

The plain twin against numpy's row assignment; its checks by name; on a GPU the kernel against the twin bit for
bit, the pool keeping its buffer (the decode graphs' address), rows of every V4 width and odd ones, aligned and
not, an empty write, and a reader ordered after the write through the token."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.pool_rows import write_rows, write_rows_reference
from dsv4_serve.kernels.rows import ordered
from tests.kernels.nvrtc_here import NEEDS_NVRTC

NEEDS_GPU = pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
CASES = [((9, 64, 512), 37), ((5, 64, 128), 64), ((3, 4, 7), 5), ((2, 8, 1), 16), ((4, 16, 512), 0)]


def case(shape: tuple[int, int, int], e: int, dtype: mx.Dtype, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    pool = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype) + 0
    rows = mx.array(rng.permutation(shape[0] * shape[1])[:e].astype(np.int32))
    values = mx.array(rng.standard_normal((e, shape[2])).astype(np.float32)).astype(dtype)
    mx.eval(pool, rows, values)
    return pool, rows, values


def expected(pool: mx.array, rows: mx.array, values: mx.array) -> np.ndarray:
    want = np.array(pool.astype(mx.float32)).reshape(-1, pool.shape[2])
    want[np.array(rows)] = np.array(values.astype(mx.float32))
    return want.reshape(pool.shape)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("shape", "e"), CASES)
def test_the_twin_writes_exactly_the_rows(shape: tuple[int, int, int], e: int, dtype: mx.Dtype) -> None:
    pool, rows, values = case(shape, e, dtype, seed=e + shape[2])
    want = expected(pool, rows, values)
    out, token = write_rows_reference(pool, rows, values)
    assert token is None
    assert np.array_equal(np.array(out.astype(mx.float32)), want)
    carry = mx.array([3, 1, 4], mx.int32)
    assert write_rows_reference(pool, rows, values, carry)[1] is carry  # the readers' array, as it is


def test_bad_arguments_are_refused_by_name() -> None:
    pool = mx.zeros((2, 4, 8), mx.bfloat16)
    ok_rows, ok_vals = mx.array([1, 2], mx.int32), mx.zeros((2, 8), mx.bfloat16)
    for args, name in [
        ((pool.reshape(8, 8), ok_rows, ok_vals), "pool"),
        ((pool, ok_rows.astype(mx.int64), ok_vals), "rows"),
        ((pool, ok_rows[:, None], ok_vals), "rows"),
        ((pool, ok_rows, mx.zeros((3, 8), mx.bfloat16)), "values"),
        ((pool, ok_rows, mx.zeros((2, 7), mx.bfloat16)), "values"),
        ((pool, ok_rows, ok_vals.astype(mx.float32)), "values"),
        ((pool, [1, 2], ok_vals), "rows"),
        ((pool, ok_rows, ok_vals, mx.zeros((2,), mx.float32)), "carry"),
        ((pool, ok_rows, ok_vals, mx.zeros((2, 1), mx.int32)), "carry"),
    ]:
        with pytest.raises(ValueError, match=f"write_rows: {name}:"):
            write_rows(*args)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("shape", "e"), CASES)
def test_the_kernel_writes_the_pool_in_place(shape: tuple[int, int, int], e: int, dtype: mx.Dtype) -> None:
    from dsv4_serve.kernels.cuda.pool_rows import write_rows_cuda
    from dsv4_serve.kernels.graph.record import address

    pool, rows, values = case(shape, e, dtype, seed=e + shape[2])
    want = expected(pool, rows, values)
    where = address(pool)
    out, token = write_rows_cuda(pool, rows, values)
    assert out is pool
    if e:
        mx.eval(token)
    assert address(pool) == where
    assert np.array_equal(np.array(pool.astype(mx.float32)), want)


@pytest.mark.gpu
@NEEDS_GPU
def test_unaligned_values_and_a_reader_after_the_token() -> None:
    from dsv4_serve.kernels.cuda.pool_rows import write_rows_cuda

    pool, rows, values = case((6, 64, 512), 20, mx.bfloat16, seed=3)
    flat = mx.concatenate([mx.zeros((1,), mx.bfloat16), values.reshape(-1)])
    mx.eval(flat)
    shifted = flat[1:].reshape(20, 512)  # a view 2 bytes into its buffer: the element-wise path
    mx.eval(shifted)
    want = expected(pool, rows, shifted)
    _, token = write_rows_cuda(pool, rows, shifted, carry=rows)
    read = pool.reshape(-1, 512)[token]  # the rows as the launch hands them back: read after the write
    mx.eval(read)
    assert np.array_equal(np.array(token), np.array(rows))
    assert np.array_equal(np.array(read.astype(mx.float32)), np.array(shifted.astype(mx.float32)))
    assert np.array_equal(np.array(pool.astype(mx.float32)), want)
    _, token = write_rows_cuda(pool, rows[:3], shifted[:3] * 2)
    later = pool.reshape(-1, 512)[ordered(rows[:3], token)]  # without a carry: the 1-element token, ordered
    mx.eval(later)
    assert np.array_equal(np.array(later.astype(mx.float32)), np.array((shifted[:3] * 2).astype(mx.float32)))


# ---- write_slots: one slot of many per-slot pools in one launch (a slot's reset, load, copy) --------------------
# (slots, b, d, dtype): V4's rings and compressor windows (bf16 and f32, 512 / 128 wide) and odd sizes (84 bytes a
# slot: the byte-wise path)
SLOT_POOLS = [(4, 128, 512, mx.bfloat16), (4, 8, 512, mx.float32), (4, 16, 128, mx.float32), (4, 3, 7, mx.float32),
              (4, 2, 128, mx.bfloat16)]


def slot_case(layout: list, seed: int) -> tuple[list[mx.array], list[mx.array]]:
    rng = np.random.default_rng(seed)
    pools = [mx.array(rng.standard_normal((a, b, d)).astype(np.float32)).astype(t) + 0 for a, b, d, t in layout]
    values = [mx.array(rng.standard_normal((b, d)).astype(np.float32)).astype(t) for _, b, d, t in layout]
    mx.eval(pools, values)
    return pools, values


def slot_expected(pools: list[mx.array], slot: int, values: list[mx.array]) -> list[np.ndarray]:
    out = []
    for p, v in zip(pools, values, strict=True):
        w = np.array(p.astype(mx.float32))
        w[slot] = np.array(v.astype(mx.float32))
        out.append(w)
    return out


@pytest.mark.parametrize("slot", [0, 3])
def test_the_slots_twin_writes_one_slot_of_every_pool(slot: int) -> None:
    from dsv4_serve.kernels.pool_rows import write_slots_reference

    pools, values = slot_case(SLOT_POOLS, seed=slot)
    want = slot_expected(pools, slot, values)
    out, token = write_slots_reference(pools, slot, values)
    assert token is None and len(out) == len(pools)
    for o, w in zip(out, want, strict=True):
        assert np.array_equal(np.array(o.astype(mx.float32)), w)


def test_write_slots_refuses_bad_arguments_by_name() -> None:
    from dsv4_serve.kernels.pool_rows import write_slots

    p, q = mx.zeros((2, 4, 8), mx.bfloat16), mx.zeros((2, 3, 5), mx.float32)
    v, w = mx.zeros((4, 8), mx.bfloat16), mx.zeros((3, 5), mx.float32)
    for args, name in [
        (([], 0, []), "pools"),
        (([p, q], 0, [v]), "values"),
        (([p, p], 0, [v, v]), "pools"),
        (([p.reshape(8, 8)], 0, [v]), "pools"),
        (([p, q], 0, [v, mx.zeros((3, 4), mx.float32)]), "values"),
        (([p, q], 0, [v, w.astype(mx.bfloat16)]), "values"),
        (([p, q], 2, [v, w]), "slot"),
        (([p, q], -1, [v, w]), "slot"),
        (([p, q], True, [v, w]), "slot"),
    ]:
        with pytest.raises(ValueError, match=f"write_slots: {name}:"):
            write_slots(*args)


@NEEDS_NVRTC
def test_the_slots_kernel_builds_with_nvrtc() -> None:
    """The kernel as MLX would build it for V4-Flash's 167 per-slot arrays (two launches: 96 + 71 pools)."""
    from dsv4_serve.kernels.cuda.common import HEADER, minify
    from dsv4_serve.kernels.cuda.pool_rows import MAX_POOLS, slots_source
    from dsv4_serve.kernels.graph.codegen import translation_unit
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin
    from dsv4_serve.kernels.graph.record import KernelSource

    layout = (SLOT_POOLS * 40)[:MAX_POOLS]
    n = len(layout)
    names = tuple(f"pool{y}" for y in range(n)) + tuple(f"val{y}" for y in range(n)) + ("slot",)
    src = slots_source(tuple((a, b * d * t.size) for a, b, d, t in layout))
    ks = KernelSource(f"dsv4_write_slots{n}_test", names, ("token",), minify(src), minify(HEADER) + "\n", 0)
    pools = [mx.zeros((a, 1, 1), t) for a, _, _, t in layout]  # (dtypes are what the unit takes from them)
    unit = translation_unit(ks, [], [*pools, *pools, mx.zeros((1,), mx.int32)], [mx.int32])
    cubin, lowered = compile_cubin(unit, f"mlx::core::cu::{ks.name}", "sm_90a")
    assert cubin and ks.name in lowered


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("count", [1, len(SLOT_POOLS), 167])
def test_the_slots_kernel_writes_every_pool_in_place(count: int) -> None:
    """One slot of 1, 5 and 167 pools (two launches) against the twin bit for bit; every pool keeps its buffer and
    the other slots their values."""
    from dsv4_serve.kernels.cuda.pool_rows import write_slots_cuda
    from dsv4_serve.kernels.graph.record import address

    pools, values = slot_case((SLOT_POOLS * 34)[:count], seed=count)
    slot = 2
    want = slot_expected(pools, slot, values)
    where = [address(p) for p in pools]
    out, token = write_slots_cuda(pools, slot, values)
    assert all(o is p for o, p in zip(out, pools, strict=True))
    mx.eval(token)
    assert [address(p) for p in pools] == where
    for p, w in zip(pools, want, strict=True):
        assert np.array_equal(np.array(p.astype(mx.float32)), w)
