"""Per-request decode state in per-layer pools: a slot for the fixed-size parts, pages for the growing ones.

Allocated once; a request gets a slot and, per compression ratio, the pages its positions can reach
(prompt + max_tokens) at admission. Nothing is reallocated or copied while it grows; freeing makes the
slot and pages reusable at once. Page 0 of every page pool is the trash page (see docs/state.md).

Pages are reference-counted: the prefix cache (service/engine/prefix_cache.py) holds pages of finished
or running requests and maps full ones read-only into other requests' tables; a page returns to the free
list when its last holder lets go. The slot helpers (`slot_state`, `load_slot`) copy a slot's fixed-size
state (window ring + compressor windows) out and back in.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from dsv4_serve.kernels.compressor import new_workspace as new_comp_workspace
from dsv4_serve.kernels.indexer import new_workspace
from dsv4_serve.model.config import ModelArgs


@dataclass(frozen=True)
class StateHandle:
    slot: int
    capacity: int  # positions this request may reach
    tables: dict[int, tuple[int, ...]]  # ratio -> page ids

    def entries(self, ratio: int) -> int:
        return self.capacity // ratio


class StatePools:
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
        # flow), for up to max_slots rows a step.
        self.idx_ws: dict[int, mx.array] = {}
        self.comp_ws: dict[int, mx.array] = {}  # HCA layers: the in-place compressor's (kernels.compressor)
        for layer, r in enumerate(args.compress_ratios):
            if not r:
                continue
            coff = 2 if r == 4 else 1
            self.comp_kv[layer] = mx.zeros((max_slots, coff * r, coff * D), mx.float32)
            self.comp_score[layer] = mx.full((max_slots, coff * r, coff * D), -mx.inf, mx.float32)
            self.ckv[layer] = mx.zeros((self.pages[r], page_size, D), dtype)
            if r != 4:
                self.comp_ws[layer] = new_comp_workspace(max_slots, D)
            if r == 4:
                self.idx_kv[layer] = mx.zeros((max_slots, 8, 2 * Di), mx.float32)
                self.idx_score[layer] = mx.full((max_slots, 8, 2 * Di), -mx.inf, mx.float32)
                self.ikeys[layer] = mx.zeros((self.pages[r], page_size, Di), dtype)
                self.idx_ws[layer] = new_workspace(max_slots, self.table_width(4) * page_size)
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

    def copy_page(self, ratio: int, src: int, dst: int) -> None:
        """Page `src` -> page `dst` in every pool of `ratio` (copy-before-write of a shared partial page)."""
        for _, pools, layer in self._page_fields(ratio):
            page = pools[layer][src] * 1  # its own buffer first: the update may then reuse the pool's
            mx.eval(page)
            pools[layer][dst] = page
            pools[layer] = mx.contiguous(pools[layer])

    def _page_fields(self, ratio: int) -> list[tuple[str, dict[int, mx.array], int]]:
        """(name, pools, layer) of every page pool of `ratio`: `ckv<layer>`, `ikeys<layer>`."""
        return [(f"{name}{layer}", pools, layer) for name, pools in (("ckv", self.ckv), ("ikeys", self.ikeys))
                for layer in pools if self.args.compress_ratios[layer] == ratio]  # fmt: skip

    def page_pools(self, ratio: int) -> dict[str, mx.array]:
        """Every page pool of `ratio` by name, [pages, page_size, d]."""
        return {name: pools[layer] for name, pools, layer in self._page_fields(ratio)}

    def read_entries(self, ratio: int, table: tuple[int, ...], n: int) -> dict[str, mx.array]:
        """The first n entries of `table` in every page pool of `ratio`: name -> [n, d]."""
        ids = mx.arange(n, dtype=mx.int32)
        pages = mx.array(list(table) or [0], dtype=mx.int32)[ids // self.page_size]
        return {name: pools[layer][pages, ids % self.page_size] for name, pools, layer in self._page_fields(ratio)}

    def write_entries(self, ratio: int, table: tuple[int, ...], entries: dict[str, mx.array]) -> None:
        """`read_entries`' inverse: entries [n, d] by name into the first n places of `table`."""
        fields = self._page_fields(ratio)
        if entries.keys() != {f[0] for f in fields}:
            raise ValueError(f"StatePools.write_entries: names do not match the pools of ratio {ratio}")
        for name, pools, layer in fields:
            x = entries[name]
            if not x.shape[0]:
                continue
            ids = mx.arange(x.shape[0], dtype=mx.int32)
            pages = mx.array(list(table) or [0], dtype=mx.int32)[ids // self.page_size]
            pools[layer][pages, ids % self.page_size] = x.astype(self.dtype)
            pools[layer] = mx.contiguous(pools[layer])

    # ---- slot copies ---------------------------------------------------------------------------
    def _slot_fields(self) -> list[tuple[str, list[mx.array] | dict[int, mx.array], int]]:
        """(name, container, key) of every per-slot array: `window<layer>`, `comp_kv<layer>`, ..."""
        out: list[tuple[str, list[mx.array] | dict[int, mx.array], int]] = [
            (f"window{i}", self.window, i) for i in range(len(self.window))
        ]
        for name in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
            pools = getattr(self, name)
            out += [(f"{name}{layer}", pools, layer) for layer in pools]
        return out

    def slot_arrays(self) -> dict[str, mx.array]:
        """Every per-slot array by name, [slots, ...]."""
        return {name: c[k] for name, c, k in self._slot_fields()}

    def slot_state(self, slot: int) -> dict[str, mx.array]:
        """A copy of the slot's fixed-size state (window ring, compressor windows), queued now: later writes to
        the slot (also in-place kernels') run after it on the same stream and leave it alone. Not waited for:
        a snapshot at the end of a prefill forward would otherwise hold the engine thread until the GPU is done."""
        out = {name: c[k][slot] * 1 for name, c, k in self._slot_fields()}  # * 1: a new buffer, not a view
        mx.async_eval(list(out.values()))
        return out

    def load_slot(self, slot: int, state: dict[str, mx.array]) -> None:
        """Write a `slot_state` copy into `slot` (the pools stay row-major buffers, as in _reset_slot)."""
        fields = self._slot_fields()
        if state.keys() != {f[0] for f in fields}:
            raise ValueError("StatePools.load_slot: state does not match these pools' arrays")
        for name, c, k in fields:
            c[k][slot] = state[name]
            c[k] = mx.contiguous(c[k])

    def copy_slot(self, src: StateHandle, dst: StateHandle, positions: int) -> None:
        """Make `dst` hold the state `src` holds after its first `positions` positions (n > 1 sampling: one
        prefill, then a copy per extra row; a prefix cache can reuse it). Copies the slot rows (window ring,
        compressor windows) and the pages holding the entries emitted so far; lazy, like a step's updates.
        Whole-array updates go through mx.contiguous for the in-place compressor (see `_reset_slot`)."""
        for name, h in (("src", src), ("dst", dst)):
            if self._live.get(h.slot) is not h:
                raise ValueError(f"StatePools.copy_slot: {name} slot {h.slot} is not held by this handle")
        if src.slot == dst.slot:
            raise ValueError("StatePools.copy_slot: src and dst are the same slot")
        if not 0 <= positions <= min(src.capacity, dst.capacity):
            raise ValueError(f"StatePools.copy_slot: positions must be in 0..{min(src.capacity, dst.capacity)}, "
                             f"got {positions}")  # fmt: skip
        s, d = src.slot, dst.slot
        for arrays in (self.window, self.comp_kv, self.comp_score, self.idx_kv, self.idx_score):
            for key in range(len(arrays)) if isinstance(arrays, list) else list(arrays):
                arrays[key][d] = arrays[key][s]
                arrays[key] = mx.contiguous(arrays[key])
        ratios = self.args.compress_ratios
        for pools in (self.ckv, self.ikeys):
            for layer in pools:
                n = self.pages_for(positions, ratios[layer])
                if n:
                    r = ratios[layer]
                    from_ = mx.array(src.tables[r][:n], dtype=mx.int32)
                    pools[layer][mx.array(dst.tables[r][:n], dtype=mx.int32)] = pools[layer][from_]
                    pools[layer] = mx.contiguous(pools[layer])

    def _reset_slot(self, slot: int) -> None:
        # A new occupant starts from a clean slot: compressor scores back to -inf (window 0's "previous half"
        # must weigh nothing), and the window ring and compressor values back to 0. Rows a request has not
        # written are read with weight 0 (masked window rows, the previous half), and 0 x NaN is NaN: a
        # predecessor's non-finite or merely old values must never reach it. Pages need no reset: entries
        # a request has not written are masked and their keys zeroed before use. With one slot the
        # update covers the whole array and MLX returns the broadcast scalar itself (strides 0, one
        # element): mx.contiguous gives it a buffer again (a no-op otherwise), since the in-place
        # compressor writes through the buffer and MLX would hand a custom kernel a copy of a broadcast.
        for scores in (self.comp_score, self.idx_score):
            for layer in scores:
                scores[layer][slot] = -mx.inf
                scores[layer] = mx.contiguous(scores[layer])
        for values in (self.comp_kv, self.idx_kv):
            for layer in values:
                values[layer][slot] = 0
                values[layer] = mx.contiguous(values[layer])
        for i in range(len(self.window)):
            self.window[i][slot] = 0
            self.window[i] = mx.contiguous(self.window[i])

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
