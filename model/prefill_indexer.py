"""Prefill's per-request pure parts: the pooled entries and the indexer's picks (scores and top-k), compiled or not
(`DSV4_PREFILL_COMPILE`), and the indexer's keys as rows of the pool. Several requests' picks go through one call
where their scores stay small (`select_all`), exact against a call a request (tests/model/test_prefill_select.py);
where no query sees more entries than the top-k keeps, the picks are every entry seen, made once a forward on the
host (`every_visible`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.compressor import pooled_entry
from dsv4_serve.kernels.indexer import topk_ids
from dsv4_serve.kernels.indexer_scores import indexer_scores
from dsv4_serve.model.prefill_compress import Chunk

KEY_ROWS = 128  # the indexer's keys padded to a multiple of this (kernels/cuda/tiles_mm.py's rows a block)
# The most scores (queries x keys) one indexer call of several requests makes (each query against every request's
# keys, 4 bytes each: 16 MiB); past it a call a request (a long context's keys would make it quadratic).
SELECT_SCORES = 1 << 22


_compiled_fns: dict[tuple[object, ...], Callable[..., mx.array]] = {}


def compiled() -> bool:
    """`DSV4_PREFILL_COMPILE=1`: the forward's layers through their compiled segments (as decode runs them) and
    its per-request pure parts (pooled entries, the indexer's scores and top-k) compiled: 4,272 kernels a
    256-token V4-Flash forward instead of 6,083 by tools/prefill_count.py's count. Off by default: on the
    H200 its warm-up took 150 s (the fused kernels' NVRTC compiles; PART=check, 2f03c20, 2026-12-02)."""
    return os.environ.get("DSV4_PREFILL_COMPILE", "0").strip() == "1" and os.environ.get("DSV4_COMPILE", "1") != "0"


def compiled_fn(key: tuple[object, ...], fn: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """`fn` compiled once per key where `compiled()` (its elementwise ops and reductions fuse into a few
    kernels: prefill's per-request attention part is host-bound at a few hundred tokens), else as is."""
    if not compiled():
        return fn
    got = _compiled_fns.get(key)
    if got is None:
        got = _compiled_fns[key] = mx.compile(fn)
    return got


def _pooling() -> Callable[..., mx.array]:
    """`pooled_entry`, or on CUDA with DSV4_POOLED_KERNEL=1 its one-launch kernel (kernels/cuda/pooled.py: ~33 MLX
    ops a call fewer). Opt-in: its gpu tests passed (H100, a40c3ad) but a 32-token V4-Flash forward took 75.9 ms
    with it against 76.8 ms without (one forward each, ~10 ms of noise): no gain measured yet."""
    if os.environ.get("DSV4_POOLED_KERNEL", "0").strip() == "1" and backend.name() == "cuda":
        from dsv4_serve.kernels.cuda.pooled import pooled_entry_cuda

        return pooled_entry_cuda
    return pooled_entry


def pooled(eps: float, dtype: mx.Dtype) -> Callable[..., mx.array]:
    """`pooled_entry` (vals, gates, norm, cos, sin), compiled per eps and pool dtype."""

    def fn(vals: mx.array, gates: mx.array, norm: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        return _pooling()(vals, gates, norm, eps, cos, sin, dtype)

    return compiled_fn(("pooled_entry", eps, dtype), fn)


def entry_rows(table: Sequence[int], n: int, page: int) -> np.ndarray:
    """The pool rows ([pages x page, d] view) of the request's first n compressed entries, made on the host from
    its table, then the first entry's again up to a multiple of KEY_ROWS: [ceil(n / KEY_ROWS) x KEY_ROWS]. The
    top-k never picks those (each query sees its first vis <= n entries)."""
    rows = (np.asarray(table[: -(-n // page)], dtype=np.int32)[:, None] * page + np.arange(page, dtype=np.int32))
    rows = rows.reshape(-1)[:n]
    return np.concatenate([rows, np.full(-n % KEY_ROWS, rows[0], np.int32)])


_scored = False  # inside `scored()`: every_visible declines


@contextlib.contextmanager
def scored() -> Iterator[None]:
    """Every pick through the scores and the top-k while inside (`every_visible` declines): the engine's warm-up
    builds on a short prompt the path a long context takes (service/engine/warmup.py)."""
    global _scored
    _scored = True
    try:
        yield
    finally:
        _scored = False


def every_visible(spans: Sequence[tuple[int, int]], ratio: int, topk: int) -> np.ndarray | None:
    """The indexer's picks when no query sees more than `topk` entries, made on the host: each query picks every
    entry it sees, so its ids are 0 .. vis - 1 ascending, -1 padded ([T, topk] int32, the requests' rows in order;
    `spans`: each request's (start, tokens)), exactly what `select` returns for any scores (`topk_ids` keeps the
    top min(topk, n) in ascending order); None where a query sees more (its scores decide). A V4-Flash prompt's
    first 2,048 positions (512 entries of ratio 4): no scores, no top-k, for any request of a short prompt."""
    vis = np.concatenate([np.arange(start + 1, start + t + 1) // ratio for start, t in spans])
    if not vis.size or int(vis.max()) > topk or _scored:
        return None
    col = np.arange(topk, dtype=np.int32)[None, :]
    return np.where(col < vis[:, None], col, -1).astype(np.int32)


def select(q: mx.array, w: mx.array, keys: mx.array, vis: mx.array, topk: int, lo: mx.array | None = None,
           ) -> mx.array:  # fmt: skip
    """`indexer_rows` for T queries of one request over its n entries, query t seeing the first `vis[t]`:
    [T, topk] ids, -1 padded. `lo` [T]: several requests' queries over their keys side by side, query t's from
    column lo[t] (its ids counted from there)."""
    score = compiled_fn(("indexer_scores",), indexer_scores)(q, w, keys)  # [T, n] f32
    if lo is None:
        return compiled_fn(("topk_ids", topk), lambda s, v: topk_ids(s, v, topk))(score, vis[:, None])
    return compiled_fn(("topk_ids_lo", topk), lambda s, v, o: topk_ids(s, v, topk, o))(score, vis[:, None], lo[:, None])


def select_all(q: mx.array, w: mx.array, keys: mx.array, chunks: Sequence[Chunk], k_offs: Sequence[int],
               ratio: int, topk: int) -> mx.array | None:  # fmt: skip
    """Every request's picks in one `select` over all their keys side by side ([T, topk], each request's rows
    counted from its own first key), where the scores of every query against every request's keys stay within
    SELECT_SCORES (short prompts: a call a request was ~28 MLX nodes a CSA layer); else None (a call a request)."""
    if len(chunks) < 2 or q.shape[0] * keys.shape[0] > SELECT_SCORES:
        return None
    vis = np.concatenate([np.arange(c.start + 1, c.start + c.b1 - c.b0 + 1) // ratio for c in chunks])
    lo = np.concatenate([np.full(c.b1 - c.b0, k_offs[i]) for i, c in enumerate(chunks)])
    return select(q, w, keys, mx.array(vis.astype(np.int32)), topk, mx.array(lo.astype(np.int32)))
