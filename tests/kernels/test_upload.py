"""kernels.upload: host values into device memory. Every size path (pieces in each kernel bucket, the
one-array copy beyond MAX_PIECES) against the values themselves, and the content cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend, upload

SIZES = [1, 2, 3, 4, 5, 8, 9, 17, 31, 32, 33, 63, 64, 65, 1000]


def check(values: np.ndarray, dtype: mx.Dtype) -> None:
    got = upload.upload(values, dtype)
    mx.eval(got)
    assert got.dtype == dtype and got.shape == values.shape
    np.testing.assert_array_equal(np.array(got), values)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [mx.int32, mx.uint32, mx.float32])
def test_upload_returns_the_values(n: int, dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(n)
    npd = {mx.int32: np.int32, mx.uint32: np.uint32, mx.float32: np.float32}[dtype]
    values = (rng.standard_normal(n) * 1e6).astype(npd) if dtype == mx.float32 else \
        rng.integers(0, 2**31 - 1, n).astype(npd)  # fmt: skip
    check(values, dtype)
    check(values[: n // 2 * 2].reshape(-1, 2) if n >= 2 else values, dtype)  # 2-D (block tables)


def test_upload_lists_bools_and_empty() -> None:
    check(np.array([3, -1, 7], np.int32), mx.int32)
    got = upload.upload([True, False, True])  # a condition for mx.where: int32, nonzero is true
    assert np.array(got).tolist() == [1, 0, 1]
    empty = upload.upload([])
    assert empty.shape == (0,) and empty.dtype == mx.int32


def test_upload_caches_by_content() -> None:
    a = upload.upload([5, 6, 7, 8, 9])
    assert upload.upload(np.array([5, 6, 7, 8, 9])) is a or not (upload.ENABLED and backend.cuda_available())
    b = upload.upload([5, 6, 7, 8, 10])
    assert np.array(b).tolist() == [5, 6, 7, 8, 10] and np.array(a).tolist() == [5, 6, 7, 8, 9]
    c = upload.upload([5, 6, 7, 8, 9], mx.float32)  # same bytes? no: another dtype, another entry
    assert c.dtype == mx.float32 and np.array(c).tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
def test_upload_on_cuda_uses_the_pieces_and_the_copy() -> None:
    assert upload.ENABLED
    upload.clear()
    upload.warm()
    assert set(upload._kernels) == {*upload.BUCKETS, 0}  # every variant compiled by warm()
    for n in SIZES:
        check(np.arange(n, dtype=np.int32) * 7 - 3, mx.int32)


def test_warm_launches_every_variant_that_serving_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA MLX builds an upload kernel once per piece count and input dtype (~1 s each): a variant warm() misses
    is built in a request's path (an H100 server built the float32 one of 5..8 values, a sampling parameter a row,
    for a user's request). The kernels stand in here (each launch noted), so this holds on any machine: every
    upload of up to a value a row, of every dtype, and a long one of each, launches a variant warm() launched."""
    launched: set[tuple[int, mx.Dtype]] = set()

    def kernel(k: int):  # noqa: ANN202 - upload._kernel's launch, noting (piece count, input dtype)
        def launch(*, inputs: list[mx.array], output_shapes: list, output_dtypes: list, **_: object) -> list:
            launched.add((k, inputs[0].dtype))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return launch

    monkeypatch.setattr(upload, "_kernel", kernel)
    monkeypatch.setattr(upload, "cuda_available", lambda: True)
    monkeypatch.setattr(upload, "ENABLED", True)
    monkeypatch.setattr(upload, "_zero", {})
    upload.clear()
    upload.warm()
    warmed = set(launched)
    launched.clear()
    for dtype in (mx.int32, mx.uint32, mx.float32):
        for n in range(1, upload.ROW_VALUES + 1):
            upload.upload(np.arange(n) + 3, dtype)
        upload.upload(np.arange(1000) + 3, dtype)  # a grammar mask's words, a block table
    for n in SIZES:
        upload.upload(np.arange(n) + 5)  # int32 (tables, slots, tokens): every size
    upload.clear()
    assert launched and launched <= warmed, sorted(launched - warmed, key=str)
    assert (4, mx.float32) in warmed  # the one the H100 built late


def test_row_values_is_the_row_limit() -> None:
    from dsv4_serve.kernels.rows import MAX_ROWS

    assert upload.ROW_VALUES == MAX_ROWS
