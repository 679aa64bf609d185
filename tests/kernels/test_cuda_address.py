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
        pytest.skip("on CUDA: the kernel's test below")
    assert addresses(arrays) == [address(a) for a in arrays]


@pytest.mark.gpu
@NEEDS_GPU
def test_kernel_addresses_equal_dlpack_and_move_nothing() -> None:
    from dsv4_serve.kernels.cuda.address import read

    arrays = cases()
    mx.eval(arrays)
    before = read(arrays)  # device addresses: nothing exported yet
    again = read(arrays)
    assert before == again  # a read moved no buffer
    base = before[0]
    assert base is not None and before[1] == base + 2 * 8 * 5 * 4 and before[2] == base + 3 * 8 * 5 * 4
    assert before[5] is None and before[6] is None and before[11] is None and before[15] is None
    assert before[-1] is None  # empty
    dl = [address(a) for a in arrays]  # DLPack: each buffer moved into managed memory; then both read the same
    assert read(arrays) == dl
    assert [x is None for x in before] == [x is None for x in dl]
