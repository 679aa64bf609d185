"""The CUDA mHC pre-mix kernel vs its plain-MLX reference on the GPU (fresh random data), and the tiny
model's decode with the kernel vs without it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.hc import hc_pre_mix_reference
from tests.kernels.agreement import close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")]


def cuda_op():
    from dsv4_serve.kernels.cuda.hc import hc_pre_mix_cuda

    return hc_pre_mix_cuda


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("nc,iters", [(1, 1), (2, 5), (4, 20), (8, 20)])
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (3, 100), (8, 4096), (256, 64)])
def test_hc_pre_mix_matches_reference(rows: int, hidden: int, nc: int, iters: int, dtype: mx.Dtype) -> None:
    nm = nc * (2 + nc)
    m = 3 * mx.random.normal((rows, nm))
    scale = mx.random.uniform(0.2, 2.0, (3,))
    base = mx.random.normal((nm,))
    h = mx.random.normal((rows, nc, hidden)).astype(dtype)
    want = hc_pre_mix_reference(m, scale, base, h, iters=iters, eps=1e-6)
    got = cuda_op()(m, scale, base, h, iters=iters, eps=1e-6)
    mx.eval(want, got)
    for g, w in zip(got[1:], want[1:], strict=True):  # post, comb: f32, summation order only
        assert g.dtype == mx.float32 and g.shape == w.shape
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-6)
    assert got[0].dtype == dtype and got[0].shape == (rows, hidden)
    tol = 1e-5 if dtype == mx.float32 else 1e-2  # one rounding to the stream dtype
    gx, wx = np.array(got[0].astype(mx.float32)), np.array(want[0].astype(mx.float32))
    np.testing.assert_allclose(gx, wx, rtol=tol, atol=tol)


def test_hc_pre_mix_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="^hc_pre_mix: base: "):
        cuda_op()(mx.zeros((2, 24)), mx.ones((3,)), mx.zeros((23,)), mx.zeros((2, 4, 8)), iters=2, eps=1e-6)
    with pytest.raises(ValueError, match="^hc_pre_mix: m: "):
        cuda_op()([0.0], mx.ones((3,)), mx.zeros((24,)), mx.zeros((2, 4, 8)), iters=2, eps=1e-6)


def test_tiny_model_decode_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decode of the tiny f32 model: the same logits with the kernel as with the reference."""
    from dsv4_serve.model.state import StatePools
    from dsv4_serve.model.tiny import tiny_model

    def run() -> np.ndarray:
        model, args, _ = tiny_model(seed=0)  # fresh: compiled segments trace the current op choice
        pools = StatePools(args, max_slots=2, max_positions=64, page_size=8)
        a, b = pools.alloc(64), pools.alloc(64)
        out = []
        for i in range(20):
            out.append(np.array(model.decode(pools, [a, b], [3 + i, 100 + 2 * i], [i, i])))
        return np.stack(out)

    monkeypatch.delitem(backend._fast, "hc_pre_mix", raising=False)
    want = run()
    monkeypatch.setitem(backend._fast, "hc_pre_mix", cuda_op())
    got = run()
    assert np.max(np.abs(got - want)) <= 1e-4


def pure_pre(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, iters: int) -> tuple[mx.array, ...]:
    """hc_pre_rows from the plain references: the input RMS, the f32 logits, the pre-mix."""
    from dsv4_serve.kernels.norms import rms_norm_rows_reference

    f = rms_norm_rows_reference(h.reshape(h.shape[0], -1), None, eps=1e-6, out_dtype=mx.float32)
    return hc_pre_mix_reference(f @ fn.T, scale, base, h, iters=iters, eps=1e-6)


@pytest.fixture(params=[False, True], ids=["one_block", "split"])
def split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The fused kernel's two forms: one block a row, or DSV4_HC_SPLIT's SPLITS blocks a row."""
    from dsv4_serve.kernels.cuda import hc_fused

    monkeypatch.setattr(hc_fused, "WORKSPACE", hc_fused.WORKSPACE)  # restored after the test
    hc_fused.set_split(request.param)
    return request.param


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("nc,hidden", [(4, 4096), (2, 100), (4, 64), (8, 64)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 64])  # 64: past MAX_ROWS, the composition
def test_hc_pre_rows_matches_the_composed_references(rows: int, nc: int, hidden: int, dtype: mx.Dtype,
                                                     split: bool) -> None:  # fmt: skip
    """The fused kernel (nc <= 4; nc 8 falls back to the composition) against the parts' references."""
    from dsv4_serve.kernels.cuda.hc_fused import hc_pre_rows_cuda

    nm = nc * (2 + nc)
    h = mx.random.normal((rows, nc, hidden)).astype(dtype)
    fn = mx.random.normal((nm, nc * hidden)) * (nc * hidden) ** -0.5
    scale, base = mx.random.uniform(0.2, 2.0, (3,)), mx.random.normal((nm,))
    got = hc_pre_rows_cuda(h, fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-6)
    want = pure_pre(h, fn, scale, base, 20)
    for g, w in zip(got[1:], want[1:], strict=True):  # post, comb: f32; the logits' association differs
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5)
    tol = 1e-4 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np.array(got[0].astype(mx.float32)), np.array(want[0].astype(mx.float32)),
                               rtol=tol, atol=tol)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_split_form_is_deterministic_and_leaves_its_tickets_at_zero(rows: int, split: bool) -> None:
    """Launch after launch (each evaluated before the next, as the model's data chain orders them) the split
    form gives the same bits: the tickets the last block of each row resets are at zero again."""
    from dsv4_serve.kernels.cuda import hc_fused
    from dsv4_serve.kernels.cuda.hc_fused import hc_pre_rows_cuda

    h = mx.random.normal((rows, 4, 4096)).astype(mx.bfloat16)
    fn = mx.random.normal((24, 4 * 4096)) * (4 * 4096) ** -0.5
    scale, base = mx.random.uniform(0.2, 2.0, (3,)), mx.random.normal((24,))
    runs = []
    for _ in range(3):
        out = hc_pre_rows_cuda(h, fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-6)
        mx.eval(out)
        runs.append([np.array(o.astype(mx.float32)) for o in out])
    for later in runs[1:]:
        for a, b in zip(runs[0], later, strict=True):
            np.testing.assert_array_equal(a, b)
    if split:
        assert np.array(hc_fused.WORKSPACE[: hc_fused.MAX_ROWS]).tolist() == [0] * hc_fused.MAX_ROWS


def test_hc_pre_rows_bad_arguments_are_named() -> None:
    from dsv4_serve.kernels.cuda.hc_fused import hc_pre_rows_cuda

    h = mx.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="^hc_pre_rows: fn: "):
        hc_pre_rows_cuda(h, mx.zeros((24, 31)), mx.ones((3,)), mx.zeros((24,)), iters=2, eps=1e-6, norm_eps=1e-6)


@pytest.mark.parametrize("wdtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("nc,hidden", [(4, 4096), (2, 100), (8, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 64])  # 64: past MAX_ROWS, the composition
def test_hc_pre_norm_rows_is_the_pre_mix_then_the_rms_norm(rows: int, nc: int, hidden: int, wdtype: mx.Dtype,
                                                          split: bool) -> None:  # fmt: skip
    """The fused pre-mix with the unit's RMSNorm on x (nc <= 4; nc 8 falls back) against the parts' references:
    the pre-mix's x, then rms_norm_rows with the weight."""
    from dsv4_serve.kernels.cuda.hc_fused import hc_pre_norm_rows_cuda
    from dsv4_serve.kernels.norms import rms_norm_rows_reference

    nm = nc * (2 + nc)
    h = mx.random.normal((rows, nc, hidden)).astype(mx.bfloat16)
    fn = mx.random.normal((nm, nc * hidden)) * (nc * hidden) ** -0.5
    scale, base = mx.random.uniform(0.2, 2.0, (3,)), mx.random.normal((nm,))
    w = (1 + 0.3 * mx.random.normal((hidden,))).astype(wdtype)
    got = hc_pre_norm_rows_cuda(h, fn, scale, base, w, iters=20, eps=1e-6, norm_eps=1e-6, x_eps=1e-6)
    x, post, comb = pure_pre(h, fn, scale, base, 20)
    want = (rms_norm_rows_reference(x, w, eps=1e-6), post, comb)
    for g, ww in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(np.array(g), np.array(ww), rtol=1e-4, atol=1e-5)
    assert got[0].dtype == mx.bfloat16 and got[0].shape == (rows, hidden)
    close(got[0], want[0], 2e-2)  # x rounds to bf16 before the norm: an x an ulp apart moves its normed value


def test_hc_pre_norm_rows_bad_arguments_are_named() -> None:
    from dsv4_serve.kernels.cuda.hc_fused import hc_pre_norm_rows_cuda

    h, fn, scale, base = mx.zeros((2, 4, 8)), mx.zeros((24, 32)), mx.ones((3,)), mx.zeros((24,))
    with pytest.raises(ValueError, match="^hc_pre_norm_rows: weight: "):
        hc_pre_norm_rows_cuda(h, fn, scale, base, mx.ones((7,)), iters=2, eps=1e-6, norm_eps=1e-6, x_eps=1e-6)
    with pytest.raises(ValueError, match="^hc_pre_norm_rows: fn: "):
        hc_pre_norm_rows_cuda(h, mx.zeros((24, 31)), scale, base, mx.ones((8,)), iters=2, eps=1e-6, norm_eps=1e-6,
                              x_eps=1e-6)  # fmt: skip
