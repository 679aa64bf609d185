"""Prefix cache of V4's decode state: a later request whose prompt starts with a cached token prefix
prefills only the rest.

A request's state after p tokens is its slot (window ring + compressor windows: fixed size) and, per
compression ratio r, the first p // r compressed entries (+ indexer keys) in its pages. An `Entry`
is both, keyed by the exact token ids: a copy of the slot (`StatePools.slot_state`) and references
to the pages holding those entries (`StatePools.ref_pages`: shared, read-only, refcounted).
Adopting an entry copies the slot copy into the request's slot, maps the entry's full pages into its
tables in place of its own, and copies the last, partial page into the request's own page (the
request writes its next entries there: copy-before-write). Entries are exact (bytes keys, no hash
collisions) and live in namespaces, (tenant, cache_salt) of the requests that made them: a lookup sees
its own namespace only, so neither a hit nor its timing tells one tenant what another sent (and pages are
shared only inside a namespace). The byte budget is shared fairly: past it, the tenant holding the most
bytes, counted across all its cache_salts, loses its least recently used entry (of any of its salts) first,
so one tenant's stores and imports evict its own entries before anyone else's, whatever salts it sends.
Evicting drops only the cache's page references, so a page a running request maps stays. Engine thread only.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from dsv4_serve.model.state import StateHandle, StatePools
from dsv4_serve.service.engine.request import SHARED, Namespace


def token_key(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


@dataclass
class Entry:
    key: bytes  # the prefix's token ids, int32
    slot: dict[str, mx.array]  # StatePools.slot_state
    pages: dict[int, tuple[int, ...]]  # ratio -> the pages of the prefix's entries (held by the cache)
    ns: Namespace = SHARED  # the (tenant, cache_salt) of the requests that made it: only they find it
    request_ids: set[str] = field(default_factory=set)  # finished requests whose end state this is
    used: int = 0  # the cache's use counter at its last store or lookup: LRU order across a tenant's salts

    @property
    def length(self) -> int:
        return len(self.key) // 4

    def tokens(self) -> list[int]:
        return np.frombuffer(self.key, dtype=np.int32).tolist()


class PrefixCache:
    def __init__(self, pools: StatePools, budget_bytes: int, interval: int = 128) -> None:
        if budget_bytes < 1:
            raise ValueError(f"PrefixCache: budget_bytes must be >= 1, got {budget_bytes}")
        if interval < 0:
            raise ValueError(f"PrefixCache: interval must be >= 0, got {interval}")
        self.pools, self.budget, self.interval = pools, budget_bytes, interval
        self._entries: dict[Namespace, OrderedDict[bytes, Entry]] = {}  # per namespace, LRU first
        self._lengths: dict[Namespace, Counter[int]] = {}
        self._ns_bytes: Counter[Namespace] = Counter()  # each namespace's slot copies + pages
        self._tenant_bytes: Counter[str] = Counter()  # the same summed over each tenant's salts
        self._uses = 0  # Entry.used's clock
        self._page_holds: Counter[tuple[int, int]] = Counter()  # (ratio, page) -> entries holding it
        self._page_ns: dict[tuple[int, int], Namespace] = {}  # (ratio, page) -> the namespace it counts to
        self._by_request: dict[str, tuple[Namespace, bytes]] = {}
        self._count = 0
        self.version = 0  # bumped by every store: a request re-looks up only when something new is there
        self.bytes = 0  # slot copies + distinct pages held
        self.page_bytes = 0  # of which pages (read by /metrics scrapes on another thread: plain ints only)
        self.lookups = self.hits = self.cached_tokens = self.evictions = 0

    # ---- sizes ---------------------------------------------------------------------------------
    def pages_of(self, length: int) -> dict[int, int]:
        """Pages of a `length`-token prefix per ratio (the last one may be partial)."""
        page = self.pools.page_size
        return {r: -(-(length // r) // page) for r in self.pools.ratios}

    def stats(self) -> dict[str, int]:
        return {
            "prefix_lookups_total": self.lookups,
            "prefix_hits_total": self.hits,
            "prefix_cached_tokens_total": self.cached_tokens,
            "prefix_evictions_total": self.evictions,
            "prefix_cache_bytes": self.bytes,
            "prefix_cache_page_bytes": self.page_bytes,
            "prefix_cache_entries": self._count,
        }

    def namespace_bytes(self, ns: Namespace) -> int:
        return self._ns_bytes.get(ns, 0)

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def __len__(self) -> int:
        return self._count

    def has(self, tokens: Sequence[int], ns: Namespace = SHARED) -> bool:
        return token_key(tokens) in self._entries.get(ns, {})

    # ---- lookup / adopt ------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], longer_than: int = 0, ns: Namespace = SHARED) -> Entry | None:
        """The longest entry of namespace `ns` that is a prefix of `tokens` and longer than `longer_than`
        tokens; it becomes the most recently used."""
        self.lookups += 1
        entries = self._entries.get(ns)
        if not entries:
            return None
        buf = token_key(tokens)
        for n in sorted((n for n in self._lengths[ns] if longer_than < n <= len(tokens)), reverse=True):
            entry = entries.get(buf[: 4 * n])
            if entry is not None:
                self._touch(entry)
                return entry
        return None

    def adopt(self, handle: StateHandle, entry: Entry) -> StateHandle | None:
        """Put `entry`'s state into `handle`'s slot and tables; returns the live handle (new tables), or
        None (nothing changed) when a page to copy into is not free."""
        pools, page, n = self.pools, self.pools.page_size, entry.length
        if n > handle.capacity:
            raise ValueError(f"PrefixCache.adopt: a {n}-token prefix exceeds the request's capacity {handle.capacity}")
        # The page the request writes next must be its alone: after an earlier adoption and snapshots of
        # its own, it may be a cached entry's partial page; then a fresh page takes the copy.
        fresh = {r: (n // r) % page and pools.page_refs(r, handle.tables[r][(n // r) // page]) > 1
                 for r in pools.ratios}  # fmt: skip
        if any(f and pools.free_pages(r) < 1 for r, f in fresh.items()):
            return None
        pools.load_slot(handle.slot, entry.slot)
        tables = {}
        for r in pools.ratios:
            full, part = divmod(n // r, page)
            own, shared = handle.tables[r], entry.pages[r][:full]
            pools.ref_pages(r, shared)
            pools.unref_pages(r, own[:full])
            if fresh[r]:
                pools.unref_pages(r, own[full : full + 1])
                own = own[:full] + pools.new_pages(r, 1) + own[full + 1 :]
            if part:  # the request writes entries n // r.. into this page: its own copy
                pools.copy_page(r, entry.pages[r][full], own[full])
            tables[r] = shared + own[full:]
        mx.eval(pools.arrays())
        self.hits += 1
        self.cached_tokens += n
        return pools.rebind(handle, tables)

    # ---- store / evict -------------------------------------------------------------------------
    def store(self, handle: StateHandle, tokens: Sequence[int], request_id: str | None = None,
              optional: bool = False, ns: Namespace = SHARED) -> Entry | None:  # fmt: skip
        """Cache the state `handle` holds after `tokens` (its first len(tokens) positions) in namespace `ns`.
        None when the entry alone would not fit the budget, or, `optional` (a snapshot inside a prompt), when
        it would not fit without evicting another."""
        key = token_key(tokens)
        entry = self._entries.get(ns, {}).get(key)
        if entry is None:
            pages = {r: handle.tables[r][:k] for r, k in self.pages_of(len(tokens)).items()}
            if self._cost(pages) > (self.budget - self.bytes if optional else self.budget):
                return None
            entry = self._add(Entry(key, self.pools.slot_state(handle.slot), pages, ns))
        self._touch(entry)
        if request_id is not None:
            self._by_request[request_id] = (ns, key)
            entry.request_ids.add(request_id)
        self._shrink(entry)
        return entry if self._entries.get(ns, {}).get(key) is entry else None

    def insert(self, tokens: Sequence[int], slot: dict[str, mx.array], pages: dict[int, tuple[int, ...]],
               request_id: str, ns: Namespace = SHARED) -> Entry:  # fmt: skip
        """An entry built elsewhere (an imported state): its pages' one reference passes to the cache. It never
        replaces an entry (ValueError: the caller checks `has` first)."""
        key = token_key(tokens)
        if key in self._entries.get(ns, {}):
            raise ValueError("PrefixCache.insert: an entry for these tokens exists in this namespace")
        entry = self._add(Entry(key, slot, pages, ns), fresh=True)
        self._by_request[request_id] = (ns, key)
        entry.request_ids.add(request_id)
        self._shrink(entry)
        return entry

    def by_request(self, request_id: str) -> Entry | None:
        where = self._by_request.get(request_id)
        return None if where is None else self._entries.get(where[0], {}).get(where[1])

    def reclaimable(self, ratio: int) -> int:
        """Pages of `ratio` that evicting every entry would free (held by the cache alone)."""
        return sum(1 for (r, p), n in self._page_holds.items() if r == ratio and self.pools.page_refs(r, p) == n)

    def evict_one(self, keep: Entry | None = None) -> bool:
        """Drop the least recently used entry (never `keep`) of the tenant holding the most bytes across its
        salts; False when there is none."""
        victim = self._victim(keep)
        if victim is None:
            return False
        self._remove(victim)
        self.evictions += 1
        return True

    def clear(self) -> None:
        for entries in list(self._entries.values()):
            for entry in list(entries.values()):
                self._remove(entry)

    def _victim(self, keep: Entry | None) -> Entry | None:
        """The next entry to evict: the LRU one, over all its salts, of the tenant holding the most bytes
        (never `keep`). Counting per (tenant, salt) instead would let a tenant that sends a fresh salt a
        request never hold the largest namespace, and evict everyone else (issue 63)."""
        heads: dict[str, list[Entry]] = {}  # tenant -> the oldest entry (not `keep`) of each of its salts
        for ns, entries in self._entries.items():
            head = next((e for e in entries.values() if e is not keep), None)
            if head is not None:
                heads.setdefault(ns[0], []).append(head)
        if not heads:
            return None
        mine = None if keep is None else keep.ns[0]  # on a tie, the tenant storing now loses
        tenant = max(heads, key=lambda t: (self._tenant_bytes[t], t == mine))
        return min(heads[tenant], key=lambda e: e.used)

    def _touch(self, entry: Entry) -> None:
        self._entries[entry.ns].move_to_end(entry.key)
        self._uses += 1
        entry.used = self._uses

    def _cost(self, pages: dict[int, tuple[int, ...]]) -> int:
        new = sum(self.pools.page_bytes(r) for r, ps in pages.items() for p in ps if (r, p) not in self._page_holds)
        return self.pools.slot_bytes() + new

    def _add(self, entry: Entry, fresh: bool = False) -> Entry:
        cost = self._cost(entry.pages)
        self.bytes += cost
        self.page_bytes += cost - self.pools.slot_bytes()
        self._ns_bytes[entry.ns] += cost
        self._tenant_bytes[entry.ns[0]] += cost
        for r, ps in entry.pages.items():
            if not fresh:
                self.pools.ref_pages(r, ps)
            for p in ps:
                self._page_ns.setdefault((r, p), entry.ns)
            self._page_holds.update((r, p) for p in ps)
        self._entries.setdefault(entry.ns, OrderedDict())[entry.key] = entry
        self._touch(entry)
        self._lengths.setdefault(entry.ns, Counter())[entry.length] += 1
        self._count += 1
        self.version += 1
        return entry

    def _remove(self, entry: Entry) -> None:
        entries = self._entries[entry.ns]
        del entries[entry.key]
        if not entries:
            del self._entries[entry.ns]
        self._count -= 1
        lengths = self._lengths[entry.ns]
        lengths[entry.length] -= 1
        if not lengths[entry.length]:
            del lengths[entry.length]
        if not lengths:
            del self._lengths[entry.ns]
        for rid in entry.request_ids:
            if self._by_request.get(rid) == (entry.ns, entry.key):
                del self._by_request[rid]
        self.bytes -= self.pools.slot_bytes()
        self._ns_bytes[entry.ns] -= self.pools.slot_bytes()
        self._tenant_bytes[entry.ns[0]] -= self.pools.slot_bytes()
        for r, ps in entry.pages.items():
            for p in ps:
                self._page_holds[(r, p)] -= 1
                if not self._page_holds[(r, p)]:
                    del self._page_holds[(r, p)]
                    self.bytes -= self.pools.page_bytes(r)
                    self.page_bytes -= self.pools.page_bytes(r)
                    owner = self._page_ns.pop((r, p))
                    self._ns_bytes[owner] -= self.pools.page_bytes(r)
                    self._tenant_bytes[owner[0]] -= self.pools.page_bytes(r)
            self.pools.unref_pages(r, ps)
        self._ns_bytes = +self._ns_bytes  # drop namespaces down to 0 bytes
        self._tenant_bytes = +self._tenant_bytes

    def _shrink(self, keep: Entry | None = None) -> None:
        while self.bytes > self.budget and self.evict_one(keep):
            pass
