"""Addresses read by a kernel (kernels/cuda/address.py) for the decode graphs' plan: each equals what DLPack reads
(kernels/graph/record.py `address`) for contiguous arrays of every dtype the step has, views at an offset, dims of
one, scalars, and is None where DLPack sees a strided array; and reading one moves no buffer (DLPack's read does).
On the CPU `record.addresses` is DLPack's read itself."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.graph.record import address, addresses

NEEDS_GPU = pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")


NAMES = ["base", "base[2:]", "base[3]", "base[1:4]", "reshape", "base[:, :4]", "transpose", "base[2:3]",
         "dims of one", "bf16", "bf16[5:9]", "bf16.T", "u8", "u8[17:]", "i32", "broadcast", "scalar",
         "reshape[:, 8:]", "empty"]  # fmt: skip
STRIDED = {"base[:, :4]", "transpose", "bf16.T", "broadcast", "empty"}  # None from both readers


def cases() -> list[mx.array]:
    base = mx.arange(6 * 8 * 5, dtype=mx.float32).reshape(6, 8, 5) + 0
    bf = (mx.arange(64 * 3, dtype=mx.float32).reshape(64, 3) + 0).astype(mx.bfloat16)
    u8 = mx.arange(300, dtype=mx.uint8) + 0
    i32 = mx.arange(17, dtype=mx.int32) + 0
    return [
        base, base[2:], base[3], base[1:4], base.reshape(48, 5), base[:, :4],  # contiguous, offsets, strided
        base.transpose(1, 0, 2), base[2:3], base[:, 2:3, :][0:1], bf, bf[5:9], bf.T, u8, u8[17:], i32,
        mx.broadcast_to(i32[3:4], (4,)), mx.array(2.5) + 0, base.reshape(1, 240)[:, 8:], mx.zeros((0, 4)),
    ]  # fmt: skip


def test_addresses_on_the_cpu_are_dlpack_reads() -> None:  # the planner's path everywhere but CUDA
    arrays = cases()
    mx.eval(arrays)
    if backend.cuda_available():
        pytest.skip("on CUDA: the kernel's tests below")
    assert addresses(arrays) == [address(a) for a in arrays]


def _read(arrays: list[mx.array]) -> list[int | None]:
    from dsv4_serve.kernels.cuda.address import read

    return read(arrays)


@pytest.mark.gpu
@NEEDS_GPU
def test_kernel_reads_offsets_and_moves_nothing() -> None:
    """Views at an offset read their buffer's start plus the offset; a second read gives the same (nothing moved)."""
    arrays = cases()
    mx.eval(arrays)
    before = _read(arrays)  # device addresses: nothing exported yet
    base = before[0]
    assert base is not None
    assert before[1] == base + 2 * 8 * 5 * 4, "base[2:]"
    # (not base[3]: MLX's integer index is a gather on the GPU, a buffer of its own; the H100 read base + 3,584)
    assert before[3] == base + 1 * 8 * 5 * 4, "base[1:4]"
    assert before[17] == base + 8 * 4, "reshape[:, 8:]"
    assert _read(arrays) == before  # a read moved no buffer


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("i", range(len(NAMES)), ids=NAMES)
def test_kernel_read_equals_dlpack_read(i: int) -> None:
    """Case by case: None where DLPack sees a strided (or empty) array, else the address DLPack reads once the
    buffer is exported (DLPack moves it into managed memory; the kernel then reads the new place)."""
    arrays = cases()
    mx.eval(arrays)
    first = _read([arrays[i]])[0]
    assert (first is None) == (NAMES[i] in STRIDED), f"{NAMES[i]}: kernel read {first}"
    dl = address(arrays[i])
    assert (dl is None) == (NAMES[i] in STRIDED), f"{NAMES[i]}: DLPack read {dl}"
    assert _read([arrays[i]])[0] == dl, f"{NAMES[i]}: kernel {_read([arrays[i]])[0]} vs DLPack {dl}"
