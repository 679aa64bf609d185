"""A short prompt's 9..64 rows run through the registered fast products (kernels.matmul `fast_sliced`): on the
CPU a stand-in fast op (the plain product, refusing more than 8 rows) takes 8-row slices; one that says it takes
64 rows a launch (`rows_per_launch`, as the CUDA skinny kernels' 8-row groups) gets them all in one call unless
DSV4_SKINNY_GROUPS is off; the results are the plain products of all the rows at once, and past 64 rows nothing
is sliced."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.kernels import matmul as km
from dsv4_serve.model.quant import QuantizedExperts
from tests.kernels.test_matmul import mxfp

REFS = {"qlinear_rows": km.qlinear_rows_reference, "f32_linear_rows": km.f32_linear_rows_reference,
        "qlinear_cat_rows": km.qlinear_cat_rows_reference, "f32_linear_pair_rows": km.f32_linear_pair_rows_reference,
        "swiglu_rows": km.swiglu_rows_reference, "experts_gate_up_rows": km.experts_gate_up_rows_reference,
        "experts_down_rows": km.experts_down_rows_reference}  # fmt: skip


def registered_stand_ins(monkeypatch: pytest.MonkeyPatch, most: int | None):
    """Each op's reference registered as its fast path (and the fast path in use, as on a CUDA device),
    recording the rows of every call; `most`: the rows a launch it says it takes (None: says nothing, 8)."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(backend, "_use_fast", lambda: True)

    def make(op, ref):
        def fast(x, *a, **kw):
            assert x.shape[0] <= (most or km.SLICE_ROWS), f"{op} got {x.shape[0]} rows"
            calls.append((op, x.shape[0]))
            return ref(x, *a, **kw)

        if most is not None:
            fast.rows_per_launch = most
        return fast

    before = backend.registered()
    for op, ref in REFS.items():
        backend.register(op, make(op, ref))
    try:
        yield calls
    finally:
        for op in REFS:
            backend.unregister(op)
        for op, fn in before.items():
            backend.register(op, fn)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch):
    yield from registered_stand_ins(monkeypatch, None)


@pytest.fixture
def grouped_stand_ins(monkeypatch: pytest.MonkeyPatch):
    yield from registered_stand_ins(monkeypatch, 64)


def close(got: mx.array, want: mx.array) -> None:
    np.testing.assert_allclose(np.array(got, np.float32), np.array(want, np.float32), rtol=1e-5, atol=1e-5)


def products(x: mx.array) -> None:
    """Every dense product of x through kernels.matmul, each against the plain product of all its rows."""
    q1, s1, _ = mxfp((48, 64), 8)
    q2, s2, _ = mxfp((40, 64), 8)
    q3, s3, _ = mxfp((48, 64), 8)
    wb1, wb2 = (mx.random.normal((24, 64)).astype(mx.bfloat16) for _ in range(2))
    close(km.qlinear_rows(x, q1, s1), km.qlinear_rows_reference(x, q1, s1))
    close(km.f32_linear_rows(x, wb1), km.f32_linear_rows_reference(x, wb1))
    for got, want in zip(km.qlinear_cat_rows(x, q1, s1, q2, s2), km.qlinear_cat_rows_reference(x, q1, s1, q2, s2),
                         strict=True):  # fmt: skip
        close(got, want)
    for got, want in zip(km.f32_linear_pair_rows(x, wb1, wb2), km.f32_linear_pair_rows_reference(x, wb1, wb2),
                         strict=True):  # fmt: skip
        close(got, want)
    close(km.swiglu_rows(x, q1, s1, q3, s3, limit=2.0), km.swiglu_rows_reference(x, q1, s1, q3, s3, limit=2.0))


DENSE = ("qlinear_rows", "f32_linear_rows", "qlinear_cat_rows", "f32_linear_pair_rows", "swiglu_rows")


@pytest.mark.parametrize("rows", [9, 13, 64])
def test_products_run_in_8_row_slices(stand_ins, rows: int) -> None:
    products(mx.random.normal((rows, 64)))
    per_op = {op: [n for o, n in stand_ins if o == op] for op in REFS}
    want = [8] * (rows // 8) + ([rows % 8] if rows % 8 else [])
    for op in DENSE:
        assert per_op[op] == want, op


def test_past_64_rows_nothing_is_sliced(stand_ins) -> None:
    q1, s1, w = mxfp((48, 64), 8)
    x = mx.random.normal((65, 64))
    close(km.qlinear_rows(x, q1, s1), x @ w.T)
    assert not stand_ins


def test_routed_experts_of_a_short_prompt_run_in_slices(stand_ins) -> None:
    """QuantizedExperts at 21 rows: the pairs of each 8-row slice through the fast ops, router-weighted."""
    e, hid, inter, k, rows = 4, 64, 32, 2, 21
    q1, s1, _ = mxfp((e, inter, hid), 4)
    q3, s3, _ = mxfp((e, inter, hid), 4)
    q2, s2, _ = mxfp((e, hid, inter), 4)
    qe = QuantizedExperts({"w1": q1, "w1_scales": s1, "w2": q2, "w2_scales": s2, "w3": q3, "w3_scales": s3}, 7.0)
    x = mx.random.normal((rows, hid))
    idx = mx.array(np.random.default_rng(0).integers(0, e, (rows, k)), dtype=mx.int32)
    w = mx.random.uniform(shape=(rows, k))
    got = qe(x, idx, w)
    ri = idx.astype(mx.uint32)
    h = km.experts_gate_up_rows_reference(x, ri, q1, s1, q3, s3, limit=7.0)
    want = mx.sum(km.experts_down_rows_reference(h, ri, q2, s2).astype(mx.float32) * w[:, :, None], axis=1)
    close(got, want)
    assert [n for o, n in stand_ins if o == "experts_gate_up_rows"] == [8, 8, 5]
    assert [n for o, n in stand_ins if o == "experts_down_rows"] == [8, 8, 5]


@pytest.mark.parametrize("rows", [9, 21, 64])
def test_a_fast_op_taking_64_rows_gets_them_in_one_call(grouped_stand_ins, rows: int) -> None:
    """The CUDA skinny kernels take 9..64 rows as 8-row groups of one launch: one call an op, the same results;
    the routed experts' two halves too."""
    products(mx.random.normal((rows, 64)))
    for op in DENSE:
        assert [n for o, n in grouped_stand_ins if o == op] == [rows], op
    e, hid, inter, k = 4, 64, 32, 2
    (q1, s1, _), (q3, s3, _), (q2, s2, _) = mxfp((e, inter, hid), 4), mxfp((e, inter, hid), 4), mxfp((e, hid, inter), 4)
    qe = QuantizedExperts({"w1": q1, "w1_scales": s1, "w2": q2, "w2_scales": s2, "w3": q3, "w3_scales": s3}, 7.0)
    x = mx.random.normal((rows, hid))
    idx = mx.array(np.random.default_rng(1).integers(0, e, (rows, k)), dtype=mx.int32)
    ri = idx.astype(mx.uint32)
    h = km.experts_gate_up_rows_reference(x, ri, q1, s1, q3, s3, limit=7.0)
    close(qe.pairs(x, idx), km.experts_down_rows_reference(h, ri, q2, s2))
    for op in ("experts_gate_up_rows", "experts_down_rows"):
        assert [n for o, n in grouped_stand_ins if o == op] == [rows], op


def test_groups_off_slices_again(grouped_stand_ins, monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4_SKINNY_GROUPS=0 (km.GROUPED False): a launch an 8-row slice even where the fast op takes 64."""
    monkeypatch.setattr(km, "GROUPED", False)
    products(mx.random.normal((21, 64)))
    for op in DENSE:
        assert [n for o, n in grouped_stand_ins if o == op] == [8, 8, 5], op
