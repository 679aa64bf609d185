"""A chained batch (a slot's consecutive positions as rows of one step; kernels/rows.py `check_batch(chains=True)`)
through the fast paths: the compressors applied round by round (every slot's j-th row, a launch of the whole batch
each, `chain_round` j, each after the last's token), so a slot's rows update its partial window in position order as
single steps would. The plain twins take chains themselves; the sparse
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
from dsv4_serve.kernels.rows import RowBatch, chain_length, rounds

ENV = "DSV4_CHAINED_ROWS"


def supported() -> bool:
    """Whether the row-batched ops take a chained batch: the plain twins always, the CUDA path when opted in."""
    return backend.name() == "reference" or os.environ.get(ENV, "0") == "1"


def compressor_rounds(fn: Callable[..., Any], batch: RowBatch, kv: mx.array, score: mx.array, ape: mx.array,
                      norm: mx.array, kv_state: mx.array, score_state: mx.array, pool: mx.array, **kw: Any
                      ) -> tuple[mx.array, ...]:  # fmt: skip
    """compressor_rows_inplace (`after` in `kw`: -> ..., token): the whole batch a launch a round (`chain_round`:
    the rows' ranks read from the slots in the kernel, so the launches are the same for every chain pattern);
    compressor_rows (functional): each round's rows as a batch of their own (`rows.rounds`)."""
    inplace = "after" in kw
    token = kw.pop("after", None)
    if inplace:
        for j in range(chain_length(batch)):
            kv_state, score_state, pool, tok = fn(batch, kv, score, ape, norm, kv_state, score_state, pool,
                                                  after=token, chain_round=j, **kw)  # fmt: skip
            token = token if tok is None else tok
        return kv_state, score_state, pool, token
    for part in rounds(batch):
        kv_state, score_state, pool = fn(part, kv, score, ape, norm, kv_state, score_state, pool, **kw)
    return kv_state, score_state, pool


def pair_rounds(fn: Callable[..., PairOut], batch: RowBatch, first: CompressorArgs, second: CompressorArgs,
                **kw: Any) -> PairOut:  # fmt: skip
    """compressor_pair_rows_inplace a launch a round (`chain_round`), each after the last's token."""
    token = kw.pop("after", None)
    outs: PairOut | None = None
    for j in range(chain_length(batch)):
        outs = fn(batch, first, second, after=token, chain_round=j, **kw)
        a, b, tok = outs
        first = first._replace(kv_state=a[0], score_state=a[1], pool=a[2])
        second = second._replace(kv_state=b[0], score_state=b[1], pool=b[2])
        token = token if tok is None else tok
    assert outs is not None, "pair_rounds: no rows"
    return outs[0], outs[1], token
