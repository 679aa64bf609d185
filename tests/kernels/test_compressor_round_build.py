"""The in-place compressors' kernels (kernels/cuda/compressor_inplace.py, compressor_pair.py) as NVRTC builds them
(no GPU): every decode form (ROUND -1, a step of one row a slot) and a chained batch's round (ROUND j: the rows that
are their slot's j-th), at V4-Flash's shapes: CSA (ratio 4, the pair: head dims 512 and 128) and HCA (ratio 128,
8 blocks a row, with and without the caller's workspace)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.kernels.nvrtc_here import NEEDS_NVRTC


def build(name: str, inputs: tuple[str, ...], source: str, header: str, template, arrays) -> None:  # noqa: ANN001
    from dsv4_serve.kernels.cuda.common import HEADER, minify
    from dsv4_serve.kernels.graph.codegen import translation_unit
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin
    from dsv4_serve.kernels.graph.record import KernelSource

    ks = KernelSource(name, inputs, ("token",), minify(source), minify(HEADER + header) + "\n", 0)
    cubin, lowered = compile_cubin(translation_unit(ks, template, arrays, [mx.int32]), f"mlx::core::cu::{name}",
                                   "sm_90a")  # fmt: skip
    assert cubin and name in lowered


def one(m: int, d: int, rows: int = 8, page: int = 64) -> list[mx.array]:
    """A compressor's arrays in INPUTS' order past the batch's: kv, score, ape, norm, kv_state, score_state, pool."""
    c, r = (2 if m == 4 else 1) * d, (2 if m == 4 else 1) * m
    f32 = mx.float32
    return [mx.zeros((rows, c), f32), mx.zeros((rows, c), f32), mx.zeros((m, c), f32), mx.zeros((d,), mx.bfloat16),
            mx.zeros((4, r, c), f32), mx.zeros((4, r, c), f32), mx.zeros((9, page, d), mx.bfloat16)]  # fmt: skip


@NEEDS_NVRTC
@pytest.mark.parametrize("ws", [False, True], ids=["token", "workspace"])
@pytest.mark.parametrize("chain_round", [-1, 0, 3])
@pytest.mark.parametrize("m", [4, 128])
def test_the_single_kernel_builds(m: int, chain_round: int, ws: bool) -> None:
    from dsv4_serve.kernels.cuda import compressor_inplace as ci
    from dsv4_serve.kernels.cuda.compressor import template

    d, half, page, ns = 512, 32, 64, ci.nsplit(m, 512)
    if ws and ns == 1:
        pytest.skip("a one-block row needs no workspace")
    i32 = mx.zeros((8,), mx.int32)
    arrays = [i32, i32, i32, mx.zeros((8, 4), mx.int32), *one(m, d), mx.zeros((8, half), mx.float32),
              mx.zeros((8, half), mx.float32), mx.zeros((1,), mx.float32), mx.zeros((1,), mx.int32)]  # fmt: skip
    ins, src = ci.INPUTS, ci.SOURCE
    if ws:
        ins, src = ins + ("workspace",), ci.SOURCE_WS
        arrays.append(mx.zeros((8 * d + 8,), mx.uint32))
    tmpl = template(mx.bfloat16, mx.bfloat16, m, d, half, page, False) + [("NT", ci.NT), ("NSPLIT", ns),
                                                                         ("ROUND", chain_round)]  # fmt: skip
    build(f"dsv4_compressor_round_test_{m}_{chain_round + 1}_{int(ws)}", ins, src, ci.ROW, tmpl, arrays)


@NEEDS_NVRTC
@pytest.mark.parametrize("chain_round", [-1, 2])
def test_the_pair_kernel_builds(chain_round: int) -> None:
    from dsv4_serve.kernels.cuda import compressor_inplace as ci
    from dsv4_serve.kernels.cuda import compressor_pair as cp
    from dsv4_serve.kernels.cuda.compressor import template

    half, page = 32, 64
    i32 = mx.zeros((8,), mx.int32)
    arrays = [i32, i32, i32, mx.zeros((8, 4), mx.int32), *one(4, 512), *one(4, 128), mx.zeros((8, half), mx.float32),
              mx.zeros((8, half), mx.float32), mx.zeros((1,), mx.float32), mx.zeros((1,), mx.int32)]  # fmt: skip
    tmpl = template(mx.bfloat16, mx.bfloat16, 4, 512, half, page, False) + [
        ("D2", 128), ("N2", mx.bfloat16), ("NT", ci.NT), ("NSPLIT", 1), ("ROUND", chain_round)]  # fmt: skip
    build(f"dsv4_compressor_pair_round_test_{chain_round + 1}", cp.INPUTS, cp.SOURCE, ci.ROW, tmpl, arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 128])
def test_on_cuda_a_launch_a_round_is_each_round_s_rows_alone(m: int) -> None:
    """A chained batch (chains of 4, 1 and 3 rows, across window ends) through the in-place compressor a launch a
    round (`chain_round`) against each round's rows as a batch of their own: state and pool bit for bit."""
    from dsv4_serve.kernels.backend import cuda_available

    if not cuda_available():
        pytest.skip("needs an MLX CUDA GPU")
    import numpy as np

    from dsv4_serve.kernels.cuda.compressor_inplace import compressor_rows_inplace_cuda
    from dsv4_serve.kernels.rows import Row, RowBatch, rounds

    d, half, page = 512, 32, 64
    first = {4: (5, 30, 61), 128: (125, 300, 254)}[m]
    rows, q = [], 0
    for slot, (p0, n) in enumerate(zip(first, (4, 1, 3), strict=True)):
        for i in range(n):
            rows.append(Row(slot=slot, position=p0 + i, q_row=q, tables={m: (1 + 2 * slot, 2 + 2 * slot)}))
            q += 1
    batch = RowBatch.build(rows, page, {m: 2})
    rng = np.random.default_rng(m)
    kv, score, ape, norm, kv_state, score_state, pool = (
        mx.array(rng.standard_normal(a.shape).astype(np.float32)).astype(a.dtype) for a in one(m, d, rows=q, page=page))
    pool = mx.array(rng.standard_normal((7, page, d)).astype(np.float32)).astype(mx.bfloat16)  # pages 1..6, trash
    cos, sin = (mx.array(rng.standard_normal((q, half)).astype(np.float32)) for _ in range(2))

    def run(parts) -> list[np.ndarray]:  # noqa: ANN001
        ks, ss, pl = kv_state + 0, score_state + 0, pool + 0
        mx.eval(ks, ss, pl)
        token = None
        for b, j in parts:
            ks, ss, pl, token = compressor_rows_inplace_cuda(b, kv, score, ape, norm, ks, ss, pl, ratio=m, head_dim=d,
                                                             eps=1e-6, cos=cos, sin=sin, after=token, chain_round=j)
        mx.eval(token)
        mx.synchronize()
        return [np.array(a.astype(mx.float32)) for a in (ks, ss, pl)]

    got = run([(batch, j) for j in range(4)])
    want = run([(part, None) for part in rounds(batch)])
    for g, w, name in zip(got, want, ("kv_state", "score_state", "pool"), strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)
