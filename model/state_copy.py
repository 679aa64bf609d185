"""Moving decode state inside the pools and out of them (model/state.py's `StatePools` holds and allocates it).

Slots: a slot's fixed-size state (window ring, compressor windows) copied out (`slot_state`), back in
(`load_slot`), to another slot (`copy_slot`, n > 1 sampling), or reset for a new occupant (`_reset_slot`).
Pages: a page copied before a shared partial page is written (`copy_page`), and a table's entries read and
written by name (`read_entries` / `write_entries`: the prefix cache and state export). Page rows go through
`kernels.write_rows` (in place on CUDA, queued at once). A slot's rows (`_write_slot`: its reset, a copy from another
slot, a cached prefix's slot state) go through `kernels.write_slots`: every per-slot array in one launch on CUDA
(a `write_rows` node each, 167, had made an admission's wait 11.2 ms against 1.8 with the scatters, H200,
2026-12-07), as prefill's forward writes its slot rows in place as well (`kernels.pool_rows.SLOT_ROWS_INPLACE`, the
default); with DSV4_PREFILL_STATE_INPLACE=0 each is MLX's scatter into a
renewed array (`pool_rows.renewed`) and `mx.contiguous`, a new array: on a graph server every admitted request then
moves all 167 per-slot arrays of V4-Flash, which the next replay copies home (a 5.6 ms refresh in a first step of
16-17 ms, H100, 2026-12-07), and the pool's old array, a graph's home, is left as it was.
"""

from __future__ import annotations

import functools
from typing import Protocol

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels import pool_rows
from dsv4_serve.kernels.pool_rows import commit, write_rows, write_slots
from dsv4_serve.kernels.upload import upload
from dsv4_serve.model.config import ModelArgs


class StateHandle(Protocol):
    """What a copy reads of model/state.py's `StateHandle` (not imported: state.py builds on this module)."""

    @property
    def slot(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def tables(self) -> dict[int, tuple[int, ...]]: ...


class StateCopies:
    """`StatePools`' copies and resets (a mixin: the pools and the live handles are StatePools')."""

    args: ModelArgs
    dtype: mx.Dtype
    page_size: int
    window: list[mx.array]
    comp_kv: dict[int, mx.array]
    comp_score: dict[int, mx.array]
    idx_kv: dict[int, mx.array]
    idx_score: dict[int, mx.array]
    ckv: dict[int, mx.array]
    ikeys: dict[int, mx.array]
    _live: dict[int, StateHandle]

    def pages_for(self, positions: int, ratio: int) -> int:
        raise NotImplementedError  # StatePools'

    def _write_rows(self, pools: dict[int, mx.array], layer: int, rows: mx.array, values: mx.array) -> None:
        """Rows of a page pool written (in place on CUDA: no copy of the whole pool, and the decode graphs' buffer
        stays the pool's); the write is queued now, so whatever is evaluated later reads it."""
        pools[layer] = commit(*write_rows(pools[layer], rows, values.astype(self.dtype)))

    def _page_rows(self, pages: list[int] | tuple[int, ...]) -> mx.array:
        """The flat rows ([pages x page_size, d] view) of whole pages."""
        p = self.page_size
        return mx.array([q * p + i for q in pages for i in range(p)], dtype=mx.int32)

    def copy_page(self, ratio: int, src: int, dst: int) -> None:
        """Page `src` -> page `dst` in every pool of `ratio` (copy-before-write of a shared partial page)."""
        src_rows, dst_rows = self._page_rows([src]), self._page_rows([dst])
        for _, pools, layer in self._page_fields(ratio):
            d = pools[layer].shape[-1]
            self._write_rows(pools, layer, dst_rows, pools[layer].reshape(-1, d)[src_rows])

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
            rows = mx.array(list(table) or [0], dtype=mx.int32)[ids // self.page_size] * self.page_size
            self._write_rows(pools, layer, rows + ids % self.page_size, x)

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
        # an integer index is MLX's `take` with an index array, a gather into a buffer of its own (not a view: the
        # H100 read such a row at its own address, tests/kernels/test_cuda_address.py), so no copy on top of it
        out = {name: c[k][slot] for name, c, k in self._slot_fields()}
        mx.async_eval(list(out.values()))
        return out

    def load_slot(self, slot: int, state: dict[str, mx.array]) -> None:
        """Write a `slot_state` copy into `slot` (`_write_slot`)."""
        fields = self._slot_fields()
        if state.keys() != {f[0] for f in fields}:
            raise ValueError("StatePools.load_slot: state does not match these pools' arrays")
        self._write_slot(slot, [(c, k, state[name]) for name, c, k in fields])

    def copy_slot(self, src: StateHandle, dst: StateHandle, positions: int) -> None:
        """Make `dst` hold the state `src` holds after its first `positions` positions (n > 1 sampling: one
        prefill, then a copy per extra row; a prefix cache can reuse it). Copies the slot rows (window ring,
        compressor windows: `_write_slot`) and the pages holding the entries emitted so far, queued now."""
        for name, h in (("src", src), ("dst", dst)):
            if self._live.get(h.slot) is not h:
                raise ValueError(f"StatePools.copy_slot: {name} slot {h.slot} is not held by this handle")
        if src.slot == dst.slot:
            raise ValueError("StatePools.copy_slot: src and dst are the same slot")
        if not 0 <= positions <= min(src.capacity, dst.capacity):
            raise ValueError(f"StatePools.copy_slot: positions must be in 0..{min(src.capacity, dst.capacity)}, "
                             f"got {positions}")  # fmt: skip
        s, d = src.slot, dst.slot
        self._write_slot(d, [(c, k, c[k][s]) for _, c, k in self._slot_fields()])
        ratios = self.args.compress_ratios
        for pools in (self.ckv, self.ikeys):
            for layer in pools:
                n = self.pages_for(positions, ratios[layer])
                if n:
                    r, d = ratios[layer], pools[layer].shape[-1]
                    from_ = pools[layer].reshape(-1, d)[self._page_rows(src.tables[r][:n])]
                    self._write_rows(pools, layer, self._page_rows(dst.tables[r][:n]), from_)

    def _reset_slot(self, slot: int) -> None:
        # A new occupant starts from a clean slot: compressor scores back to -inf (window 0's "previous half"
        # must weigh nothing), and the window ring and compressor values back to 0. Rows a request has not
        # written are read with weight 0 (masked window rows, the previous half), and 0 x NaN is NaN: a
        # predecessor's non-finite or merely old values must never reach it. Pages need no reset: entries
        # a request has not written are masked and their keys zeroed before use.
        self._write_slot(slot, [(c, k, self._fill(c[k], -mx.inf if "score" in name else 0.0))
                                for name, c, k in self._slot_fields()])  # fmt: skip

    def _write_slot(self, slot: int, writes: list[tuple[list[mx.array] | dict[int, mx.array], int, mx.array]]
                    ) -> None:  # fmt: skip
        """Slot `slot`'s rows of each per-slot array `c[k]` [slots, b, d] set to its `values` [b, d], for every
        (c, k, values) of `writes`. With SLOT_ROWS_INPLACE through `write_slots`, all in one launch: in place on
        CUDA (each array keeps its buffer, so the decode graphs' home stays the pool's and nothing is copied home),
        MLX's scatters elsewhere; the write is queued now. Else (DSV4_PREFILL_STATE_INPLACE=0) MLX's scatter into a
        new array each (module doc)."""
        if not pool_rows.SLOT_ROWS_INPLACE:  # a new array: the graphs see the pool as moved, its home keeps its buffer
            for c, k, values in writes:
                new = pool_rows.renewed(c[k])
                new[slot] = values.astype(c[k].dtype)
                c[k] = mx.contiguous(new)  # (a one-slot pool's full update is a broadcast: a buffer again)
            return
        if not pool_rows.WRITE_SLOTS:  # a write_rows a per-slot array, their tokens queued together
            tokens = []
            for c, k, values in writes:
                b = c[k].shape[1]
                rows = upload(np.arange(slot * b, (slot + 1) * b, dtype=np.int32))  # cached by content
                c[k], token = write_rows(c[k], rows, values.astype(c[k].dtype))
                if token is not None:
                    tokens.append(token)
            if tokens:
                mx.async_eval(tokens)
            return
        pools = [c[k] for c, k, _ in writes]
        out, token = write_slots(pools, slot, [v.astype(p.dtype) for p, (_, _, v) in zip(pools, writes, strict=True)])
        for (c, k, _), a in zip(writes, out, strict=True):
            c[k] = a
        commit(out[0], token)

    @staticmethod
    def _fill(a: mx.array, value: float) -> mx.array:
        """A [b, d] array of `value` in `a`'s dtype (a reset's rows), made once per shape."""
        return _fill_rows(a.shape[1], a.shape[2], a.dtype, value)


@functools.cache
def _fill_rows(b: int, d: int, dtype: mx.Dtype, value: float) -> mx.array:
    out = mx.full((b, d), value, dtype)
    mx.eval(out)
    return out
