"""The row contract: every violation raises ValueError("<op>: <arg>: why") before any work."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import Row, RowBatch, compressor_rows, indexer_rows, sparse_attention_rows
from dsv4_serve.kernels.rows import INT32_MAX

PAGE = 2
# Two valid rows: slots 0 and 2 of 3, q rows 1 and 0 of 2, pages 1 and 2 of 4 (page 0 is trash).
ROWS = [Row(slot=0, position=7, q_row=1, tables={4: (1,)}), Row(slot=2, position=3, q_row=0, tables={4: (2,)})]


def batch_of(rows: list[Row]) -> RowBatch:
    """Arrays from int32-clamped rows, python rows as given (so the checks see the bad ints)."""
    safe = [dataclasses.replace(r, position=min(r.position, INT32_MAX)) for r in rows]
    return dataclasses.replace(RowBatch.build(safe, PAGE), rows=tuple(rows))


def f32(*shape: int) -> mx.array:
    return mx.array(np.random.default_rng(0).normal(size=shape).astype(np.float32))


def compressor_args() -> dict[str, Any]:
    return dict(
        kv=f32(2, 16), score=f32(2, 16), ape=f32(4, 16), norm=f32(8), kv_state=f32(3, 8, 16),
        score_state=f32(3, 8, 16), pool=f32(4, PAGE, 8), ratio=4, head_dim=8, eps=1e-6, cos=f32(2, 2), sin=f32(2, 2),
    )  # fmt: skip


def indexer_args() -> dict[str, Any]:
    return dict(q=f32(2, 2, 4), weights=f32(2, 2), keys=f32(4, PAGE, 4), topk=3)


def attention_args() -> dict[str, Any]:
    idx = mx.array([[0, 1, -1], [0, -1, -1]], dtype=mx.int32)
    pool = f32(4, PAGE, 8)
    return dict(q=f32(2, 2, 8), window=f32(3, 4, 8), pool=pool, indices=idx, sinks=f32(2), scale=0.5, ratio=4)


OPS: dict[str, tuple[Callable[..., Any], Callable[[], dict[str, Any]]]] = {
    "compressor_rows": (compressor_rows, compressor_args),
    "indexer_rows": (indexer_rows, indexer_args),
    "sparse_attention_rows": (sparse_attention_rows, attention_args),
}


def call(op: str, rows: list[Row], **changes: Any) -> Any:
    fn, base = OPS[op]
    args = base() | changes
    return fn(batch_of(rows), **args)


def expect(op: str, arg: str, rows: list[Row] = ROWS, **changes: Any) -> str:
    with pytest.raises(ValueError) as e:
        call(op, rows, **changes)
    msg = str(e.value)
    assert msg.startswith(f"{op}: "), msg
    assert arg in msg.split(": ")[1], msg
    return msg


@pytest.mark.parametrize("op", list(OPS))
def test_valid_baseline_runs(op: str) -> None:
    """The control for the table below: the unmodified arguments pass the checks and give finite output."""
    out = call(op, ROWS)
    outs = out if isinstance(out, tuple) else (out,)
    mx.eval(outs)
    for a in outs:
        assert isinstance(a, mx.array) and a.size > 0
        if mx.issubdtype(a.dtype, mx.floating):
            # -inf is the compressor's "no score yet" marker; NaN or +inf would be a bug.
            assert not bool(mx.any(mx.isnan(a))) and not bool(mx.any(a == mx.inf))


def _rows(**per_row: Any) -> list[Row]:
    """ROWS with row 1 changed (`tables` given as a tuple for ratio 4)."""
    if "tables" in per_row:
        per_row["tables"] = {4: per_row["tables"]}
    return [ROWS[0], dataclasses.replace(ROWS[1], **per_row)]


ROW_CASES = {
    "nine rows": ([Row(slot=i, position=3, q_row=i, tables={4: (1 + i,)}) for i in range(9)], "rows"),
    "zero rows": ([], "rows"),
    "q row used twice": (_rows(q_row=1), "q_row"),
    "two rows one slot": (_rows(slot=0), "slot"),
    "page written by a row, mapped by another": (_rows(tables=(1,)), "block_table"),
    "block table too short": (_rows(position=5 * PAGE * 4), "block_table"),
    "slot out of range": (_rows(slot=3), "slot"),
    "page out of range": (_rows(tables=(4,)), "block_table"),
    "trash page in table": (_rows(tables=(0,)), "block_table"),
    "position > int32": (_rows(position=INT32_MAX + 1), "position"),
    "negative position": (_rows(position=-1), "position"),
}


@pytest.mark.parametrize("op", list(OPS))
def test_a_page_no_row_writes_may_be_shared(op: str) -> None:
    """The prefix cache maps a cached prefix's full page into several tables: page 1 (entries 0-1) is
    read by both rows, row 0 writes entry 2 into its own page 2 (position 11), row 1 emits nothing."""
    shared = [Row(slot=0, position=11, q_row=1, tables={4: (1, 2)}),
              Row(slot=2, position=9, q_row=0, tables={4: (1, 3)})]  # fmt: skip
    out = call(op, shared)
    for a in out if isinstance(out, tuple) else (out,):
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
            assert not bool(mx.any(mx.isnan(a)))


# The indexer reads no slot state (its keys come through the block table): no slot range to check.
ROW_PARAMS = [(op, c) for c in ROW_CASES for op in OPS if (op, c) != ("indexer_rows", "slot out of range")]


@pytest.mark.parametrize(("op", "case"), ROW_PARAMS)
def test_row_contract(op: str, case: str) -> None:
    rows, arg = ROW_CASES[case]
    expect(op, arg, rows)


NAN, INF = math.nan, math.inf
ARG_CASES = [
    # compressor: dtypes, shapes, short buffers, (ratio, head_dim), eps, zero width
    ("compressor_rows", "kv", "wrong dtype", dict(kv=f32(2, 16).astype(mx.float16))),
    ("compressor_rows", "kv", "not an array", dict(kv=np.zeros((2, 16), np.float32))),
    ("compressor_rows", "score", "wrong shape", dict(score=f32(2, 15))),
    ("compressor_rows", "ape", "wrong shape", dict(ape=f32(3, 16))),
    ("compressor_rows", "norm", "wrong dtype", dict(norm=mx.zeros((8,), mx.int32))),
    ("compressor_rows", "kv_state", "wrong shape", dict(kv_state=f32(3, 4, 16))),
    ("compressor_rows", "score_state", "wrong dtype", dict(score_state=f32(3, 8, 16).astype(mx.bfloat16))),
    ("compressor_rows", "score_state", "slot count differs", dict(score_state=f32(2, 8, 16))),
    ("compressor_rows", "pool", "wrong page size", dict(pool=f32(4, 3, 8))),
    ("compressor_rows", "sin", "shape differs from cos", dict(sin=f32(2, 3))),
    ("compressor_rows", "kv", "short buffer", dict(kv=f32(1, 16))),
    ("compressor_rows", "cos", "short buffer", dict(cos=f32(1, 2), sin=f32(1, 2))),
    ("compressor_rows", "cos", "zero width", dict(cos=f32(2, 0), sin=f32(2, 0))),
    ("compressor_rows", "ratio", "unsupported ratio 8", dict(ratio=8)),
    ("compressor_rows", "ratio", "unsupported ratio 64", dict(ratio=64)),
    ("compressor_rows", "head_dim", "odd head_dim", dict(head_dim=7)),
    ("compressor_rows", "head_dim", "head_dim below rope dims", dict(head_dim=2)),
    ("compressor_rows", "eps", "zero eps", dict(eps=0.0)),
    ("compressor_rows", "eps", "negative eps", dict(eps=-1e-6)),
    ("compressor_rows", "eps", "nan eps", dict(eps=NAN)),
    ("compressor_rows", "eps", "inf eps", dict(eps=INF)),
    # indexer
    ("indexer_rows", "topk", "zero width", dict(topk=0)),
    ("indexer_rows", "topk", "negative width", dict(topk=-2)),
    ("indexer_rows", "q", "wrong dtype", dict(q=mx.zeros((2, 2, 4), mx.int32))),
    ("indexer_rows", "q", "wrong rank", dict(q=f32(2, 8))),
    ("indexer_rows", "q", "short buffer", dict(q=f32(1, 2, 4))),
    ("indexer_rows", "q heads", "zero heads", dict(q=f32(2, 0, 4), weights=f32(2, 0))),
    ("indexer_rows", "weights", "wrong dtype", dict(weights=f32(2, 2).astype(mx.bfloat16))),
    ("indexer_rows", "weights", "wrong heads", dict(weights=f32(2, 3))),
    ("indexer_rows", "weights", "short buffer", dict(weights=f32(1, 2))),
    ("indexer_rows", "keys", "wrong page size", dict(keys=f32(4, 3, 4))),
    ("indexer_rows", "keys", "wrong dim", dict(keys=f32(4, PAGE, 5))),
    # sparse attention
    ("sparse_attention_rows", "scale", "zero scale", dict(scale=0.0)),
    ("sparse_attention_rows", "scale", "negative scale", dict(scale=-0.5)),
    ("sparse_attention_rows", "scale", "nan scale", dict(scale=NAN)),
    ("sparse_attention_rows", "scale", "inf scale", dict(scale=INF)),
    ("sparse_attention_rows", "q", "wrong dtype", dict(q=mx.zeros((2, 2, 8), mx.int32))),
    ("sparse_attention_rows", "q", "short buffer", dict(q=f32(1, 2, 8))),
    ("sparse_attention_rows", "window", "wrong dim", dict(window=f32(3, 4, 6))),
    ("sparse_attention_rows", "window", "zero width", dict(window=f32(3, 0, 8))),
    ("sparse_attention_rows", "sinks", "wrong shape", dict(sinks=f32(3))),
    ("sparse_attention_rows", "sinks", "wrong dtype", dict(sinks=f32(2).astype(mx.float16))),
    ("sparse_attention_rows", "pool", "wrong dim", dict(pool=f32(4, PAGE, 6))),
    ("sparse_attention_rows", "indices", "zero width", dict(indices=mx.zeros((2, 0), mx.int32))),
    ("sparse_attention_rows", "indices", "wrong dtype", dict(indices=mx.zeros((2, 3), mx.int64))),
    ("sparse_attention_rows", "indices", "short buffer", dict(indices=mx.zeros((1, 3), mx.int32))),
    ("sparse_attention_rows", "indices", "indices without pool", dict(pool=None)),
    ("sparse_attention_rows", "ratio", "unsupported ratio", dict(ratio=8)),
    ("sparse_attention_rows", "tables", "no table for the ratio", dict(ratio=128, pool=f32(4, PAGE, 8))),
]


@pytest.mark.parametrize(("op", "arg", "why", "changes"), ARG_CASES, ids=[f"{c[0]}-{c[2]}" for c in ARG_CASES])
def test_argument_contract(op: str, arg: str, why: str, changes: dict[str, Any]) -> None:
    msg = expect(op, arg, **changes)
    if arg == "head_dim":
        assert "(ratio, head_dim)" in msg  # an unsupported pair names both


def test_checks_run_before_any_state_change() -> None:
    args = compressor_args()
    before = np.array(args["pool"])
    with pytest.raises(ValueError):
        compressor_rows(batch_of(_rows(slot=0)), **args)
    np.testing.assert_array_equal(np.array(args["pool"]), before)
