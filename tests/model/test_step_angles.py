"""`layers.step_angles` (the decode step's RoPE tables and -S, compiled a layer kind) against `rope_angles` and
its negated sine, bit for bit: every ratio, edge positions, several batch sizes. On the CPU in CI; the gpu-marked
twin runs the same on CUDA, where the compiled form is a fused kernel of its own."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import inv_freq, reset_compiled, rope_angles, step_angles

POSITIONS = ([0], [1, 2, 3, 4, 5, 6, 7, 8], [4095, 70000, 131071, 1000000, 5, 127, 128, 129], [2**20 + 17],
             [2**31 - 1], [3, 2**24 + 1], list(range(4090, 4098)))  # fmt: skip


def _same_bits(device: mx.Device) -> None:
    a = ModelArgs()
    reset_compiled()
    with mx.stream(device):
        for r in (0, 4, 128):
            freqs = inv_freq(a, r != 0)
            for pos in POSITIONS:
                p = mx.array(pos, dtype=mx.int32)
                want = rope_angles(freqs, p, r, a)
                want = (*want, -want[1])
                got = step_angles(freqs, p, r, a)
                assert len(got) == len(want)
                for i, (u, v) in enumerate(zip(want, got, strict=True)):
                    assert u.shape == v.shape and u.dtype == v.dtype, (r, pos, i)
                    same = mx.array_equal(u.view(mx.uint32), v.view(mx.uint32)) if u.dtype == mx.float32 else \
                        mx.array_equal(u, v)  # fmt: skip
                    assert same.item(), (r, pos, i)
    reset_compiled()


def test_step_angles_equal_rope_angles_bit_for_bit() -> None:
    _same_bits(mx.default_device())


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
def test_step_angles_equal_rope_angles_bit_for_bit_on_cuda() -> None:
    _same_bits(mx.gpu)
