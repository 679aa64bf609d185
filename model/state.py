"""Per-request decode state in per-layer pools: a slot for the fixed-size parts, pages for the growing ones.

Allocated once; a request gets a slot and, per compression ratio, the pages its positions can reach
(prompt + max_tokens) at admission. Nothing is reallocated or copied while it grows; freeing makes the
slot and pages reusable at once. Page 0 of every page pool is the trash page (see docs/state.md).

Pages are reference-counted: the prefix cache (service/engine/prefix_cache.py) holds pages of finished
or running requests and maps full ones read-only into other requests' tables; a page returns to the free
list when its last holder lets go. Copies of slots and pages, in and out, are model/state_copy.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from dsv4_serve.kernels.compressor import new_workspace as new_comp_workspace
from dsv4_serve.kernels.indexer import new_workspace
from dsv4_serve.kernels.rows import MAX_ROWS
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.state_copy import StateCopies


@dataclass(frozen=True)
class StateHandle:
    slot: int
    capacity: int  # positions this request may reach
    tables: dict[int, tuple[int, ...]]  # ratio -> page ids

    def entries(self, ratio: int) -> int:
        return self.capacity // ratio


class StatePools(StateCopies):
    def __init__(
        self,
        args: ModelArgs,
        *,
        max_slots: int,
        max_positions: int,
        page_size: int = 64,
        pages: dict[int, int] | None = None,
        dtype: mx.Dtype = mx.float32,
        mtp: bool = False,
    ):
        if max_slots < 1:
            raise ValueError(f"StatePools: max_slots must be >= 1, got {max_slots}")
        if max_positions < 1:
            raise ValueError(f"StatePools: max_positions must be >= 1, got {max_positions}")
        if page_size < 1:
            raise ValueError(f"StatePools: page_size must be >= 1, got {page_size}")
        self.args, self.dtype, self.page_size = args, dtype, page_size
        self.max_slots, self.max_positions = max_slots, max_positions
        ratios = sorted({r for r in args.compress_ratios if r})
        self.ratios = ratios
        # Default: every slot can reach max_positions (+1 for the trash page).
        self.pages = {r: (pages or {}).get(r, max_slots * self.pages_for(max_positions, r)) + 1 for r in ratios}
        D, Di, W = args.head_dim, args.index_head_dim, args.sliding_window
        # mtp: one more window ring, the MTP block's (model/mtp.py; its layer index is num_hidden_layers)
        if mtp and not args.num_nextn_predict_layers:
            raise ValueError("StatePools: mtp=True, but the model has no MTP block (num_nextn_predict_layers 0)")
        self.mtp = mtp
        n_windows = len(args.compress_ratios) + (args.num_nextn_predict_layers if mtp else 0)
        self.window: list[mx.array] = [mx.zeros((max_slots, W, D), dtype) for _ in range(n_windows)]
        self.comp_kv: dict[int, mx.array] = {}
        self.comp_score: dict[int, mx.array] = {}
        self.idx_kv: dict[int, mx.array] = {}
        self.idx_score: dict[int, mx.array] = {}
        self.ckv: dict[int, mx.array] = {}
        self.ikeys: dict[int, mx.array] = {}
        # Scratch per layer for the fast paths (`workspace=` of kernels.indexer_rows in CSA layers, of
        # kernels.compressor_rows_inplace in HCA layers; the layers' calls are ordered by the step's data
        # flow), for a step's rows: up to max_slots, or MAX_ROWS where a chained step puts a slot's consecutive
        # positions in rows of their own.
        self.idx_ws: dict[int, mx.array] = {}
        self.comp_ws: dict[int, mx.array] = {}  # HCA layers: the in-place compressor's (kernels.compressor)
        ws_rows = max(max_slots, MAX_ROWS)
        for layer, r in enumerate(args.compress_ratios):
            if not r:
                continue
            coff = 2 if r == 4 else 1
            self.comp_kv[layer] = mx.zeros((max_slots, coff * r, coff * D), mx.float32)
            self.comp_score[layer] = mx.full((max_slots, coff * r, coff * D), -mx.inf, mx.float32)
            self.ckv[layer] = mx.zeros((self.pages[r], page_size, D), dtype)
            if r != 4:
                self.comp_ws[layer] = new_comp_workspace(ws_rows, D)
            if r == 4:
                self.idx_kv[layer] = mx.zeros((max_slots, 8, 2 * Di), mx.float32)
                self.idx_score[layer] = mx.full((max_slots, 8, 2 * Di), -mx.inf, mx.float32)
                self.ikeys[layer] = mx.zeros((self.pages[r], page_size, Di), dtype)
                self.idx_ws[layer] = new_workspace(ws_rows, self.table_width(4) * page_size)
        mx.eval(self.arrays())
        self._free_slots = list(range(max_slots))
        self._free_pages = {r: list(range(1, self.pages[r])) for r in ratios}
        self._refs = {r: [0] * self.pages[r] for r in ratios}  # holders of each page (handles + cache)
        self._live: dict[int, StateHandle] = {}

    # ---- sizes -------------------------------------------------------------------------------
    def pages_for(self, positions: int, ratio: int) -> int:
        return -(-(positions // ratio) // self.page_size)

    def table_width(self, ratio: int) -> int:
        return max(1, self.pages_for(self.max_positions, ratio))

    def slot_bytes(self) -> int:
        a, isz = self.args, self.dtype.size
        n = len(self.window) * a.sliding_window * a.head_dim * isz
        for r in a.compress_ratios:
            if r == 4:
                n += 2 * 4 * (8 * 2 * a.head_dim) + 2 * 4 * (8 * 2 * a.index_head_dim)
            elif r == 128:
                n += 2 * 4 * (128 * a.head_dim)
        return n

    def page_bytes(self, ratio: int) -> int:
        """One page of `ratio` across all layers of that ratio (they grow in step)."""
        a, isz = self.args, self.dtype.size
        per_entry = a.head_dim + (a.index_head_dim if ratio == 4 else 0)
        return sum(1 for r in a.compress_ratios if r == ratio) * self.page_size * per_entry * isz

    def bytes_for(self, positions: int) -> int:
        """Decode-state bytes a request reaching `positions` holds (exact, page-rounded)."""
        return self.slot_bytes() + sum(self.pages_for(positions, r) * self.page_bytes(r) for r in self.ratios)

    def bytes_in_use(self) -> int:
        # list(): the metrics scrape reads this from the event-loop thread while the engine admits.
        return sum(self.bytes_for(h.capacity) for h in list(self._live.values()))

    def bytes_total(self) -> int:
        return self.max_slots * self.slot_bytes() + sum((self.pages[r] - 1) * self.page_bytes(r) for r in self.ratios)

    # ---- admission -----------------------------------------------------------------------------
    def can_alloc(self, positions: int) -> bool:
        if not self._free_slots or not 1 <= positions <= self.max_positions:
            return False
        return all(self.pages_for(positions, r) <= len(self._free_pages[r]) for r in self.ratios)

    def alloc(self, positions: int) -> StateHandle:
        if not 1 <= positions <= self.max_positions:
            raise ValueError(f"StatePools.alloc: positions must be in 1..{self.max_positions}, got {positions}")
        if not self.can_alloc(positions):
            raise RuntimeError(f"StatePools.alloc: no free slot or pages for {positions} positions")
        slot = self._free_slots.pop(0)
        tables = {r: self.new_pages(r, self.pages_for(positions, r)) for r in self.ratios}
        self._reset_slot(slot)
        handle = StateHandle(slot=slot, capacity=positions, tables=tables)
        self._live[slot] = handle
        return handle

    def free(self, handle: StateHandle) -> None:
        if self._live.get(handle.slot) is not handle:
            raise ValueError(f"StatePools.free: slot {handle.slot} is not held by this handle")
        del self._live[handle.slot]
        self._free_slots.append(handle.slot)
        for r, t in handle.tables.items():
            self.unref_pages(r, t)

    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    # ---- shared pages --------------------------------------------------------------------------
    def free_pages(self, ratio: int) -> int:
        return len(self._free_pages[ratio])

    def new_pages(self, ratio: int, n: int) -> tuple[int, ...]:
        """n fresh pages of `ratio`, each with one holder (the caller)."""
        if n > len(self._free_pages[ratio]):
            raise RuntimeError(f"StatePools.new_pages: {n} pages of ratio {ratio} wanted, "
                               f"{len(self._free_pages[ratio])} free")  # fmt: skip
        got, self._free_pages[ratio] = tuple(self._free_pages[ratio][:n]), self._free_pages[ratio][n:]
        for p in got:
            self._refs[ratio][p] = 1
        return got

    def ref_pages(self, ratio: int, pages: tuple[int, ...]) -> None:
        """One more holder of each page (it must be held already)."""
        for p in pages:
            if self._refs[ratio][p] < 1:
                raise ValueError(f"StatePools.ref_pages: page {p} of ratio {ratio} is free")
            self._refs[ratio][p] += 1

    def unref_pages(self, ratio: int, pages: tuple[int, ...]) -> None:
        """One holder fewer; a page nobody holds is free again."""
        for p in pages:
            if self._refs[ratio][p] < 1:
                raise ValueError(f"StatePools.unref_pages: page {p} of ratio {ratio} is already free")
            self._refs[ratio][p] -= 1
            if not self._refs[ratio][p]:
                self._free_pages[ratio].append(p)

    def page_refs(self, ratio: int, page: int) -> int:
        return self._refs[ratio][page]

    def rebind(self, handle: StateHandle, tables: dict[int, tuple[int, ...]]) -> StateHandle:
        """The live handle of `handle.slot` with other tables (the caller moved the page references)."""
        if self._live.get(handle.slot) is not handle:
            raise ValueError(f"StatePools.rebind: slot {handle.slot} is not held by this handle")
        new = StateHandle(slot=handle.slot, capacity=handle.capacity, tables=tables)
        self._live[handle.slot] = new
        return new

    def set_array(self, i: int, a: mx.array) -> None:
        """Put `a` where `arrays()[i]` came from (same order)."""
        if i < 0:
            raise IndexError(f"StatePools.set_array: index {i}")
        if i < len(self.window):
            self.window[i] = a
            return
        i -= len(self.window)
        for d in (self.comp_kv, self.comp_score, self.idx_kv, self.idx_score, self.ckv, self.ikeys):
            if i < len(d):
                d[list(d)[i]] = a
                return
            i -= len(d)
        raise IndexError("StatePools.set_array: index past the last array")

    def arrays(self) -> list[mx.array]:
        return [
            *self.window,
            *self.comp_kv.values(),
            *self.comp_score.values(),
            *self.idx_kv.values(),
            *self.idx_score.values(),
            *self.ckv.values(),
            *self.ikeys.values(),
        ]
