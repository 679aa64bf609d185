"""write_rows: rows of a state pool written in place (prefill's page entries, page and slot copies, imports).

`write_rows(pool, rows, values) -> (pool, token)`: `pool` [a, b, d] seen as a * b rows of d, `rows` [E] int32
distinct row ids in 0..a*b-1, `values` [E, d] in the pool's dtype; row rows[e] becomes values[e].

Why in place: MLX's scatter (`a[idx] = v`, `put_along_axis`) copies the whole pool whenever it cannot donate the
buffer, and on a GPU it almost never can (its encoder keeps the buffers of queued kernels), so every prefill
chunk copied every page pool it wrote: bytes in proportion to the state, not the prompt. And a pool that moved
must be copied back into the buffer the decode graphs replay (docs/cuda_graphs.md#buffers-that-move-under-mlx).
The CUDA path (kernels/cuda/pool_rows.py) writes the rows into the pool's own buffer and returns the pool
itself and a token: a copy of `carry` (an int32 array a reader of the rows takes anyway: a block table, gather
rows) made by the same launch, so the reader that takes it in its place runs after the write at no extra node
(`kernels.rows.ordered` costs ~4 a use); without `carry`, a 1-element token the caller evaluates (`commit`)
before anything else is queued. A token that nothing evaluates is a write that never happens: whoever gets one
must hand it to a reader in the same graph or commit it (a short prompt's forward reads no indexer key, and its
keys' writes went unevaluated on CUDA from 4a73807 until the layer's output was made to depend on them). The
plain twin (the CPU, Metal, `DSV4_KERNELS=reference`) is MLX's functional scatter: a new pool, and `carry` itself
(None without).

`write_slots(pools, slot, values) -> (pools, token)`: one slot of many per-slot pools at once (a slot's reset, load
or copy: V4-Flash has 167 such arrays, each a `write_rows` launch and node before): pools[i] [a_i, b_i, d_i],
values[i] [b_i, d_i] in its dtype; slot `slot`'s b_i rows of pools[i] become values[i]. On CUDA one launch writes
them all in place (kernels/cuda/pool_rows.py) and returns the pools themselves and a 1-element token to commit;
the twin is `write_rows_reference` on each pool (new pools, no token).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx

from dsv4_serve.kernels import backend
from dsv4_serve.kernels.rows import fail

OP = "write_rows"
SLOTS_OP = "write_slots"

# DSV4_PREFILL_STATE_INPLACE (default 1; 0: MLX's scatters into renewed arrays): the per-slot arrays (window rings,
# compressor windows) are written through `write_rows` too: by prefill's forward (model/prefill.py,
# prefill_compress.py) and by a slot's reset, copy and load (model/state_copy.py). Together: either alone leaves the
# other's scatters to move the arrays, and a graph server copies every moved array home before its next replay (167
# a prefill, an 8 ms refresh on the H200; with both in place none: 2026-12-07, 05837ee).
SLOT_ROWS_INPLACE = os.environ.get("DSV4_PREFILL_STATE_INPLACE", "1").strip() != "0"
# DSV4_WRITE_SLOTS=1: a slot's reset, copy and load through `write_slots` (one launch) instead of a `write_rows` a
# per-slot array. Opt-in: on the H100 (2026-12-08) its model-level gpu test failed (tests/model/test_slot_writes.py,
# a slot no write named changed, after other gpu tests in the same process) while its kernel test passed.
WRITE_SLOTS = os.environ.get("DSV4_WRITE_SLOTS", "0").strip() == "1"


def renewed(a: mx.array) -> mx.array:
    """A new Python array over `a`'s value (no graph node), for a scatter (`x[idx] = v`) into a state pool: the
    scatter then replaces the new array's value and leaves `a`'s alone. A scatter into `a` itself keeps the Python
    array and gives it a new buffer unless MLX donates the old one; the decode graphs find the pools MLX moved by
    the array's identity (model/graph_step.py), so that write would be seen only if donated. Through a renewed
    array it is always seen: the old buffer is still `a`'s (never donated), the pool's array is a new one, and the
    next replay copies its bytes home."""
    return a[:]


def check_write_rows(pool: mx.array, rows: mx.array, values: mx.array, carry: mx.array | None = None) -> None:
    for name, a in (("pool", pool), ("rows", rows), ("values", values)):
        if not isinstance(a, mx.array):
            raise fail(OP, name, f"must be an mx.array, got {type(a).__name__}")
    if carry is not None and (not isinstance(carry, mx.array) or carry.dtype != mx.int32 or carry.ndim != 1):
        raise fail(OP, "carry", "must be None or an int32 [C] array")
    if pool.ndim != 3:
        raise fail(OP, "pool", f"must have 3 dims [a, b, d], got shape {tuple(pool.shape)}")
    if rows.dtype != mx.int32 or rows.ndim != 1:
        raise fail(OP, "rows", f"must be int32 [E], got {rows.dtype} {tuple(rows.shape)}")
    want = (rows.shape[0], pool.shape[2])
    if tuple(values.shape) != want:
        raise fail(OP, "values", f"must be [{want[0]}, {want[1]}] (a row per id), got {tuple(values.shape)}")
    if values.dtype != pool.dtype:
        raise fail(OP, "values", f"dtype must be the pool's {pool.dtype}, got {values.dtype}")


def write_rows_reference(pool: mx.array, rows: mx.array, values: mx.array, carry: mx.array | None = None
                         ) -> tuple[mx.array, mx.array | None]:  # fmt: skip
    """MLX's scatter: a new pool (row-major, as the in-place kernels need it) and `carry` as it is."""
    check_write_rows(pool, rows, values, carry)
    if not rows.shape[0]:
        return pool, carry
    a, b, d = pool.shape
    flat = mx.put_along_axis(pool.reshape(a * b, d), rows[:, None], values, axis=0)
    return mx.contiguous(flat.reshape(a, b, d)), carry


def write_rows(pool: mx.array, rows: mx.array, values: mx.array, carry: mx.array | None = None
               ) -> tuple[mx.array, mx.array | None]:  # fmt: skip
    """-> (the pool after the write, the token its readers take: `carry` after the write, or None / a 1-element
    token without it): see the module's docstring."""
    return backend.pick(OP, write_rows_reference)(pool, rows, values, carry)


def commit(pool: mx.array, token: mx.array | None) -> mx.array:
    """The pool after a write whose readers are not in the same graph: the token queued now (on MLX's stream
    every later evaluation runs after it)."""
    if token is not None:
        mx.async_eval(token)
    return pool


def check_write_slots(pools: Sequence[mx.array], slot: int, values: Sequence[mx.array]) -> None:
    if not isinstance(pools, (list, tuple)) or not pools:
        raise fail(SLOTS_OP, "pools", "must be a non-empty list of mx.array")
    if not isinstance(values, (list, tuple)) or len(values) != len(pools):
        raise fail(SLOTS_OP, "values", f"must be a list of {len(pools)} mx.array (one a pool)")
    if len({id(p) for p in pools}) != len(pools):
        raise fail(SLOTS_OP, "pools", "must be distinct arrays (two writes of one buffer would race)")
    for i, (p, v) in enumerate(zip(pools, values, strict=True)):
        if not isinstance(p, mx.array) or p.ndim != 3:
            raise fail(SLOTS_OP, "pools", f"[{i}] must be an mx.array [a, b, d], got {getattr(p, 'shape', p)!r}")
        if not isinstance(v, mx.array) or tuple(v.shape) != tuple(p.shape[1:]):
            raise fail(SLOTS_OP, "values", f"[{i}] must be [{p.shape[1]}, {p.shape[2]}] (a slot's rows), "
                                            f"got {getattr(v, 'shape', v)!r}")  # fmt: skip
        if v.dtype != p.dtype:
            raise fail(SLOTS_OP, "values", f"[{i}] dtype must be its pool's {p.dtype}, got {v.dtype}")
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < min(p.shape[0] for p in pools):
        raise fail(SLOTS_OP, "slot", f"must be an int in 0..{min(p.shape[0] for p in pools) - 1}, got {slot!r}")


def write_slots_reference(pools: Sequence[mx.array], slot: int, values: Sequence[mx.array]
                          ) -> tuple[list[mx.array], mx.array | None]:  # fmt: skip
    """`write_rows_reference` on each pool: new pools, no token."""
    check_write_slots(pools, slot, values)
    out = []
    for p, v in zip(pools, values, strict=True):
        b = p.shape[1]
        rows = mx.arange(slot * b, (slot + 1) * b, dtype=mx.int32)
        out.append(write_rows_reference(p, rows, v)[0])
    return out, None


def write_slots(pools: Sequence[mx.array], slot: int, values: Sequence[mx.array]
                ) -> tuple[list[mx.array], mx.array | None]:  # fmt: skip
    """-> (the pools after the write, a token to commit or None): see the module's docstring."""
    return backend.pick(SLOTS_OP, write_slots_reference)(pools, slot, values)
