"""A chained batch (a slot's consecutive positions as rows of one step; kernels/rows.py `check_batch(chains=True)`)
through the fast paths, whose kernels take one row a slot: the compressors applied round by round
(`rows.rounds`: every slot's j-th row, a launch each, each round after the last's token), so a slot's rows update
its partial window in position order as single steps would. The plain twins take chains themselves; the sparse
attention's fast path takes them through a scratch ring (kernels/cuda/attention.py).

On CUDA chained batches are opt-in (`DSV4_CHAINED_ROWS=1`) until their gpu test holds them to the single steps
bit for bit (tests/model/test_chained_rows.py); without it `chains_supported` is False on CUDA and the callers
(MTP's verify) take their other form.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.compressor import CompressorArgs, PairOut
from dsv4_serve.kernels.rows import RowBatch, rounds

ENV = "DSV4_CHAINED_ROWS"


def supported() -> bool:
    """Whether the row-batched ops take a chained batch: the plain twins always, the CUDA path when opted in."""
    return backend.name() == "reference" or os.environ.get(ENV, "0") == "1"


def compressor_rounds(fn: Callable[..., Any], batch: RowBatch, kv: mx.array, score: mx.array, ape: mx.array,
                      norm: mx.array, kv_state: mx.array, score_state: mx.array, pool: mx.array, **kw: Any
                      ) -> tuple[mx.array, ...]:  # fmt: skip
    """compressor_rows (functional, no `after` in `kw`) or compressor_rows_inplace (-> ..., token) by rounds."""
    inplace = "after" in kw
    token = kw.pop("after", None)
    for part in rounds(batch):
        if inplace:
            kv_state, score_state, pool, tok = fn(part, kv, score, ape, norm, kv_state, score_state, pool,
                                                  after=token, **kw)  # fmt: skip
            token = token if tok is None else tok
        else:
            kv_state, score_state, pool = fn(part, kv, score, ape, norm, kv_state, score_state, pool, **kw)
    return (kv_state, score_state, pool, token) if inplace else (kv_state, score_state, pool)


def pair_rounds(fn: Callable[..., PairOut], batch: RowBatch, first: CompressorArgs, second: CompressorArgs,
                **kw: Any) -> PairOut:  # fmt: skip
    """compressor_pair_rows_inplace by rounds: each round's states and pools are the next round's."""
    token = kw.pop("after", None)
    outs: PairOut | None = None
    for part in rounds(batch):
        outs = fn(part, first, second, after=token, **kw)
        a, b, tok = outs
        first = first._replace(kv_state=a[0], score_state=a[1], pool=a[2])
        second = second._replace(kv_state=b[0], score_state=b[1], pool=b[2])
        token = token if tok is None else tok
    assert outs is not None, "pair_rounds: no rounds"
    return outs[0], outs[1], token
