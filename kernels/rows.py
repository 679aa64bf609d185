"""The row contract shared by every row-batched op (after shared/seeds/deepseek_rows.rs.txt).

A `Row` is one request's step: its state slot, the position of the token it decodes, the row of
q/x it reads (and of the output it writes) and its block table per compression ratio. A
`RowBatch` carries 1..8 rows as python ints (for the checks) and as mx arrays (for the ops).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.upload import upload

MAX_ROWS = 8
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Row:
    slot: int
    position: int
    q_row: int
    tables: Mapping[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class RowBatch:
    rows: tuple[Row, ...]
    slots: mx.array  # [B] int32
    positions: mx.array  # [B] int32
    q_rows: mx.array  # [B] int32
    tables: Mapping[int, mx.array]  # ratio -> [B, maxp] int32, padded with the trash page 0
    page_size: int
    # Per-object memo of passed checks and derived values (not a field of the contract: a batch
    # is immutable, so whatever was true of it stays true; `dataclasses.replace` starts afresh).
    _memo: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def chained(self) -> bool:
        """Whether some slot has several rows (consecutive positions of one request: `check_batch(chains=True)`)."""
        return self.once("chained", lambda: len({r.slot for r in self.rows}) < len(self.rows))

    def once(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """`make()` the first time `key` is asked of this batch, the remembered value afterwards.

        For what depends only on the batch (and on `key`): a passed contract check (`make` runs
        the check and returns a token; a failed check raises and remembers nothing) or a derived
        array (built once per step, shared by every layer)."""
        memo = self._memo
        try:
            return memo[key]
        except KeyError:
            value = memo[key] = make()
            return value

    @classmethod
    def build(
        cls, rows: Sequence[Row], page_size: int, table_width: Mapping[int, int] | None = None
    ) -> RowBatch:
        """Python rows -> arrays. `table_width[ratio]` fixes the padded width (static shapes)."""
        rows = tuple(rows)
        widths = dict(table_width or {})
        for r in rows:
            for ratio, t in r.tables.items():
                widths[ratio] = max(widths.get(ratio, 1), len(t), 1)
        tables = {}
        for ratio, w in widths.items():
            padded = [list(r.tables.get(ratio, ())) + [0] * (w - len(r.tables.get(ratio, ()))) for r in rows]
            tables[ratio] = upload(padded) if rows else mx.zeros((0, w), mx.int32)
        # device memory on CUDA (kernels/upload.py): a host-built array costs the GPU a page fault
        return cls(
            rows=rows,
            slots=upload([r.slot for r in rows]),
            positions=upload([r.position for r in rows]),
            q_rows=upload([r.q_row for r in rows]),
            tables=tables,
            page_size=page_size,
        )


# ---- checks (each raises ValueError naming the op and the argument) -------------------------


def fail(op: str, arg: str, why: str) -> ValueError:
    return ValueError(f"{op}: {arg}: {why}")


def _memo_of(batch: RowBatch) -> dict[Hashable, Any] | None:
    memo = getattr(batch, "_memo", None)
    return memo if isinstance(memo, dict) else None


def check_batch(
    op: str, batch: RowBatch, *, slots: int | None = None, q_len: int | None = None, chains: bool = False
) -> None:
    """Row count, int32 ranges, q rows used once, q rows inside the q buffer, and slots used once: or, with
    `chains` (an op that orders a slot's rows causally: the plain twins), a slot's rows adjacent, their
    positions ascending by 1, their block tables the same (one request's consecutive tokens in one step).

    A batch that passed once (with the same `slots` / `q_len` / `chains`) is not walked again."""
    memo = _memo_of(batch)
    key = ("check_batch", type(slots), slots, type(q_len), q_len, chains)
    if memo is not None and key in memo:
        return
    _check_batch(op, batch, slots=slots, q_len=q_len, chains=chains)
    if memo is not None:
        memo[key] = True


def _check_chain(op: str, batch: RowBatch, i: int) -> None:
    """Row i shares an earlier row's slot: it must be the next position of the same request, adjacent."""
    r, prev = batch.rows[i], batch.rows[i - 1] if i else None
    arg = f"row {i} slot"
    if prev is None or prev.slot != r.slot:
        raise fail(op, arg, f"slot {r.slot} is used by two rows that are not adjacent")
    if r.position != prev.position + 1:
        raise fail(op, arg, f"slot {r.slot}'s rows must be consecutive positions: {r.position} after {prev.position}")
    if dict(r.tables) != dict(prev.tables):
        raise fail(op, arg, f"slot {r.slot}'s rows must share their block tables")


def _check_batch(op: str, batch: RowBatch, *, slots: int | None, q_len: int | None, chains: bool = False) -> None:
    n = len(batch.rows)
    if not 1 <= n <= MAX_ROWS:
        raise fail(op, "rows", f"must be 1..={MAX_ROWS}, got {n}")
    seen_q: set[int] = set()
    seen_slot: set[int] = set()
    for i, r in enumerate(batch.rows):
        for name in ("slot", "position", "q_row"):
            v = getattr(r, name)
            if not isinstance(v, int) or not 0 <= v <= INT32_MAX:
                raise fail(op, f"row {i} {name}", f"must be an integer in 0..{INT32_MAX}, got {v!r}")
        if r.q_row in seen_q:
            raise fail(op, f"row {i} q_row", f"q_row {r.q_row} is used twice")
        if r.slot in seen_slot:
            if not chains:
                why = f"slot {r.slot} is used by two rows (a slot's consecutive positions: the plain twins only)"
                raise fail(op, f"row {i} slot", why)
            _check_chain(op, batch, i)
        seen_q.add(r.q_row)
        seen_slot.add(r.slot)
        if slots is not None and r.slot >= slots:
            raise fail(op, f"row {i} slot", f"slot {r.slot} is out of range for {slots} slots")
        if q_len is not None and r.q_row >= q_len:
            raise fail(op, f"row {i} q_row", f"q_row {r.q_row} is out of range: the buffer has {q_len} rows")


def check_tables(op: str, batch: RowBatch, ratio: int, pages: int, entries: Sequence[int]) -> None:
    """Each row's block table covers its `entries`, names real pages, and shares none that a row of another
    slot writes this step (the entry a row emits at position p, when (p + 1) % ratio == 0, is p // ratio). Pages
    no row writes may be in several tables: the prefix cache maps a cached prefix's full pages read-only.

    This walks every page of every row (about 1 ms at 8 rows and 128K context): a batch that
    passed once for (ratio, pages, entries) is not walked again (every layer of a step shares it)."""
    memo = _memo_of(batch)
    key = ("check_tables", type(ratio), ratio, type(pages), pages, tuple(entries))
    if memo is not None and key in memo:
        return
    _check_tables(op, batch, ratio, pages, entries)
    if memo is not None:
        memo[key] = True


def _check_tables(op: str, batch: RowBatch, ratio: int, pages: int, entries: Sequence[int]) -> None:
    page = batch.page_size
    if ratio not in batch.tables:
        raise fail(op, "tables", f"no block table for ratio {ratio}")
    writer: dict[int, int] = {}  # page -> the row that writes an entry into it this step
    for i, (r, n) in enumerate(zip(batch.rows, entries, strict=True)):
        t = r.tables.get(ratio, ())
        if len(t) * page < n:
            raise fail(op, f"row {i} block_table", f"{len(t)} pages of {page} do not cover {n} entries")
        for pg in t:
            if not isinstance(pg, int) or not 1 <= pg < pages:
                raise fail(op, f"row {i} block_table", f"page {pg!r} is out of range 1..{pages - 1}")
        w = r.position // ratio
        if (r.position + 1) % ratio == 0 and w // page < len(t):
            writer[t[w // page]] = i
    for i, r in enumerate(batch.rows):
        for pg in r.tables.get(ratio, ()):
            if writer.get(pg, i) != i and batch.rows[writer[pg]].slot != r.slot:
                why = f"page {pg} is written by row {writer[pg]} and mapped by row {i}"
                raise fail(op, f"row {i} block_table", why)


def check_array(
    op: str, name: str, a: object, dtype: mx.Dtype | Sequence[mx.Dtype], shape: Sequence[int | None]
) -> None:
    """dtype and shape; None in `shape` matches any size."""
    if not isinstance(a, mx.array):
        raise fail(op, name, f"must be an mx.array, got {type(a).__name__}")
    dtypes = (dtype,) if isinstance(dtype, mx.Dtype) else tuple(dtype)
    if a.dtype not in dtypes:
        raise fail(op, name, f"dtype must be {' or '.join(map(str, dtypes))}, got {a.dtype}")
    if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise fail(op, name, f"shape must be {want}, got {list(a.shape)}")


def check_rows_fit(op: str, name: str, a: mx.array, batch: RowBatch) -> None:
    """A per-row buffer needs a row for every q_row (a short buffer is an error)."""
    need = max(r.q_row for r in batch.rows) + 1
    if a.shape[0] < need:
        raise fail(op, name, f"has {a.shape[0]} rows, q_row needs {need}")


def check_after(op: str, after: object) -> None:
    """`after` (the token of an in-place pool write that the op's reads must wait for) is an array or None."""
    if after is not None and not isinstance(after, mx.array):
        raise fail(op, "after", f"must be an mx.array or None, got {type(after).__name__}")


def ordered(x: mx.array, after: mx.array | None) -> mx.array:
    """`x`, computed after `after` on the GPU: an op that takes `after` as an input (MLX orders its
    CUDA-graph nodes by the producers of their inputs; `mx.depends` adds no such edge). The plain-MLX
    readers of a pool written in place route their page tables through it (a few int32s). `after` may
    be any array: its first byte, masked to 0 (no NaN from `inf * 0`), in `x`'s dtype is added."""
    if after is None:
        return x
    return x + (after.reshape(-1)[:1].view(mx.uint8)[:1] & 0).astype(x.dtype)


def check_positive(op: str, name: str, v: float) -> None:
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise fail(op, name, f"must be finite and positive, got {v!r}")


# ---- small shared helpers (additive) ---------------------------------------------------------

FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def rounds(batch: RowBatch) -> list[RowBatch]:
    """A chained batch as sub-batches of distinct slots: round j holds every slot's j-th row (its q rows and
    tables kept, the tables at the batch's widths). An op that updates a slot's state in place applies them
    in order. An unchained batch is its own one round."""

    def split() -> list[RowBatch]:
        if not batch.chained:
            return [batch]
        rank: dict[int, int] = {}
        out: list[list[Row]] = []
        for r in batch.rows:
            j = rank[r.slot] = rank.get(r.slot, -1) + 1
            if j == len(out):
                out.append([])
            out[j].append(r)
        widths = {ratio: t.shape[1] for ratio, t in batch.tables.items()}
        return [RowBatch.build(rows, batch.page_size, widths) for rows in out]

    return batch.once("rounds", split)


def chain_length(batch: RowBatch) -> int:
    """The most rows one slot has in the batch (a chained batch's rounds; 1 unchained)."""

    def count() -> int:
        n: dict[int, int] = {}
        for r in batch.rows:
            n[r.slot] = n.get(r.slot, 0) + 1
        return max(n.values(), default=0)

    return batch.once("chain_length", count)


def row_entries(batch: RowBatch, ratio: int) -> list[int]:
    """Compressed entries each row can see after this step: `(p+1) // ratio` (python ints)."""
    return [(r.position + 1) // ratio for r in batch.rows]


def checked(batch: RowBatch, key: Hashable, check: Callable[[], None], plan: Callable[[], Any]) -> Any:
    """Run an op's contract `check()` once per batch object and `key`, and return `plan()` (made once).

    `key` must hold everything the check reads besides the batch: the argument shapes and dtypes
    and the scalars (with their types: True == 1). Fast paths use it to validate a step's batch
    once for all layers of the same shapes and to keep their per-shape launch parameters."""
    memo = _memo_of(batch)
    if memo is None:
        check()
        return plan()
    try:
        return memo[key]
    except KeyError:
        check()
        value = memo[key] = plan()
        return value


def zeroed_workspace(shape: int | tuple[int, ...]) -> mx.array:
    """A zeroed uint32 array in its own buffer: a fast path's scratch that it writes in place (`workspace=`)."""
    ws = mx.zeros(shape if isinstance(shape, tuple) else (shape,), mx.uint32)
    mx.eval(ws)
    return ws


def check_workspace(op: str, workspace: Any, shape: int | tuple[int, ...], hint: str = "") -> None:
    """A `workspace=` argument: None, or uint32 of `len(shape)` dims, each at least `shape`'s (`hint`: how
    to make one, for the message)."""
    if workspace is None:
        return
    if not isinstance(workspace, mx.array):
        raise fail(op, "workspace", f"must be an mx.array or None, got {type(workspace).__name__}")
    need = shape if isinstance(shape, tuple) else (shape,)
    if workspace.dtype != mx.uint32 or workspace.ndim != len(need) or any(
            w < n for w, n in zip(workspace.shape, need, strict=True)):  # fmt: skip
        want = ", ".join(f">= {n}" for n in need)
        got = f"{str(workspace.dtype).removeprefix('mlx.core.')} {list(workspace.shape)}"
        raise fail(op, "workspace", f"must be uint32 [{want}]{hint}, got {got}")


def emitted(positions: mx.array, ratio: int) -> mx.array:
    """`(p+1) // ratio` on device without forming `p+1` (p may be INT32_MAX)."""
    return positions // ratio + (positions % ratio == ratio - 1).astype(positions.dtype)


def check_width(op: str, name: str, n: int) -> None:
    if n < 1:
        raise fail(op, name, f"zero width: must be >= 1, got {n}")
