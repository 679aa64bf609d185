"""The prefix cache (service/engine/prefix_cache.py) on the tiny model (f32, CPU), against cold prefills.

The tiny model has sliding, CSA (ratio 4) and HCA (ratio 128) layers; pages of 8 entries make both full
(shared) and partial (copied) pages occur. A cached prefix of p tokens + a prefill of the rest must give
the logits of one cold prefill of the whole prompt, for p at every offset mod 128."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine.prefix_cache import PrefixCache

PAGE, LEN = 8, 262
CAP = LEN + 6


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


@pytest.fixture(scope="module")
def prompt(tiny):
    return [int(t) for t in np.random.default_rng(7).integers(0, tiny[1].vocab_size, LEN)]


def cold_logits(tiny, tokens: list[int]) -> np.ndarray:
    model, args = tiny
    pools = StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE)
    return np.array(model.prefill(pools, pools.alloc(CAP), tokens, 0, chunk=len(tokens)))


def test_every_offset_mod_128_matches_a_cold_prefill(tiny, prompt) -> None:
    model, args = tiny
    cold = cold_logits(tiny, prompt)
    pools = StatePools(args, max_slots=2, max_positions=CAP, page_size=PAGE)
    cache = PrefixCache(pools, 1 << 30, interval=0)
    src = pools.alloc(CAP)
    model.prefill(pools, src, prompt[:128], 0, chunk=128, logits=False)
    for p in range(128, 256):  # a snapshot after every position: offsets 0..127 past HCA's first window
        cache.store(src, prompt[:p])
        model.prefill(pools, src, prompt[p : p + 1], p, logits=False)
    pools.free(src)  # the cache alone holds its pages now
    assert len(cache) == 128
    worst = 0.0
    for p in range(128, 256):
        entry = cache.lookup(prompt[:p])
        assert entry is not None and entry.length == p
        h = cache.adopt(pools.alloc(CAP), entry)
        got = np.array(model.prefill(pools, h, prompt[p:], p, chunk=LEN))
        worst = max(worst, float(np.max(np.abs(got - cold))))
        pools.free(h)
    assert worst <= 1e-5, worst


def test_a_shared_partial_page_is_copied_before_write(tiny, prompt) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=2, max_positions=CAP, page_size=PAGE)
    cache = PrefixCache(pools, 1 << 30, interval=0)
    p = 150  # CSA: 37 entries = 4 full pages + 5 in a partial one; HCA: 1 entry in a partial page
    src = pools.alloc(CAP)
    model.prefill(pools, src, prompt[:p], 0, chunk=p, logits=False)
    entry = cache.store(src, prompt[:p])
    pools.free(src)
    before = {r: {k: np.array(v) for k, v in pools.read_entries(r, entry.pages[r], PAGE * len(entry.pages[r])).items()}
              for r in pools.ratios}  # fmt: skip
    other = [int(t) for t in np.random.default_rng(8).integers(0, args.vocab_size, LEN - p)]
    h = cache.adopt(pools.alloc(CAP), entry)  # a different continuation writes the partial pages' rest
    assert h.tables[4][:4] == entry.pages[4][:4] and h.tables[4][4] != entry.pages[4][4]
    assert h.tables[128][0] != entry.pages[128][0]
    got_other = np.array(model.prefill(pools, h, other, p, chunk=LEN))
    pools.free(h)
    for r in pools.ratios:
        after = pools.read_entries(r, entry.pages[r], PAGE * len(entry.pages[r]))
        for k, v in after.items():
            assert np.array_equal(np.array(v), before[r][k]), (r, k)  # the cached pages are untouched
    h = cache.adopt(pools.alloc(CAP), cache.lookup(prompt))
    got = np.array(model.prefill(pools, h, prompt[p:], p, chunk=LEN))
    assert np.max(np.abs(got - cold_logits(tiny, prompt))) <= 1e-5
    assert np.max(np.abs(got_other - cold_logits(tiny, prompt[:p] + other))) <= 1e-5


def test_eviction_is_lru_and_never_touches_a_running_request(tiny, prompt) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=3, max_positions=CAP, page_size=PAGE, pages={4: 40, 128: 6})
    one = pools.slot_bytes() + 5 * pools.page_bytes(4) + pools.page_bytes(128)  # a 150..159-token prefix alone
    cache = PrefixCache(pools, 2 * one, interval=0)
    entries = {}
    for i, p in enumerate((150, 152, 154)):
        toks = [i + 1, *prompt[1:p]]  # three unrelated prefixes (first token differs)
        h = pools.alloc(CAP)
        model.prefill(pools, h, toks, 0, chunk=p, logits=False)
        if i == 0:
            entries[p] = cache.store(h, toks)
            pools.free(h)
            running = cache.adopt(pools.alloc(CAP), cache.lookup(toks))  # a request holding entry 150's pages
            run_toks = toks
        else:
            entries[p] = cache.store(h, toks)
            pools.free(h)
        if i == 1:
            assert cache.lookup([1, *prompt[1:150]]) is entries[150]  # 150 is now the most recently used
    # 154 pushed the budget: the LRU entry (152) went, 150 (used last) stayed
    assert cache.evictions == 1 and len(cache) == 2
    assert cache.lookup([2, *prompt[1:152]]) is None and cache.lookup(run_toks) is entries[150]
    cache.clear()  # evict everything: the running request's pages stay held and are never handed out
    held = {r: set(t) for r, t in running.tables.items()}
    assert all(pools.page_refs(r, p) >= 1 for r, ps in held.items() for p in ps)
    while pools.can_alloc(16):
        h = pools.alloc(16)
        assert all(not (set(h.tables[r]) & held[r]) for r in pools.ratios)
    got = np.array(model.prefill(pools, running, prompt[150:LEN], 150, chunk=LEN))
    assert np.max(np.abs(got - cold_logits(tiny, run_toks + prompt[150:LEN]))) <= 1e-5


def test_a_prefix_that_is_not_a_prefix_is_not_found(tiny, prompt) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=2, max_positions=CAP, page_size=PAGE)
    cache = PrefixCache(pools, 1 << 30, interval=0)
    h = pools.alloc(CAP)
    model.prefill(pools, h, prompt[:20], 0, chunk=20, logits=False)
    cache.store(h, prompt[:20])
    assert cache.lookup(prompt[:19]) is None  # shorter than every entry
    assert cache.lookup([prompt[0] + 1, *prompt[1:40]]) is None  # one token differs
    assert cache.lookup(prompt[:40]).length == 20
    assert cache.lookup(prompt[:40], longer_than=20) is None


def test_a_longer_prefix_adopted_later_never_writes_an_own_snapshot_s_page(tiny, prompt) -> None:
    """A request that adopted a prefix (40), computed on (to 44) and left a snapshot of its own, then adopts
    a longer one (46, another request's): the page it writes next is that snapshot's partial page, so the
    copy goes into a fresh page and the snapshot still gives cold logits."""
    model, args = tiny
    pools = StatePools(args, max_slots=3, max_positions=CAP, page_size=PAGE)
    cache = PrefixCache(pools, 1 << 30, interval=0)
    src = pools.alloc(CAP)
    model.prefill(pools, src, prompt[:40], 0, chunk=40, logits=False)
    cache.store(src, prompt[:40])
    model.prefill(pools, src, prompt[40:46], 40, logits=False)
    cache.store(src, prompt[:46])
    pools.free(src)
    h = cache.adopt(pools.alloc(CAP), cache.lookup(prompt[:40]))
    model.prefill(pools, h, prompt[40:44], 40, logits=False)
    own = cache.store(h, prompt[:44])  # CSA entries 0..10: page 1 (entries 8..10) is h's and this entry's
    assert own.pages[4][1] == h.tables[4][1] and pools.page_refs(4, h.tables[4][1]) == 2
    h2 = cache.adopt(h, cache.lookup(prompt[:46], longer_than=44))
    assert h2.tables[4][1] != own.pages[4][1]
    cold = cold_logits(tiny, prompt)
    assert np.max(np.abs(np.array(model.prefill(pools, h2, prompt[46:], 46, chunk=LEN)) - cold)) <= 1e-5
    pools.free(h2)
    h3 = cache.adopt(pools.alloc(CAP), cache.lookup(prompt[:45]))  # the request's own snapshot (44)
    assert np.max(np.abs(np.array(model.prefill(pools, h3, prompt[44:], 44, chunk=LEN)) - cold)) <= 1e-5


def test_an_optional_snapshot_never_evicts(tiny, prompt) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=2, max_positions=CAP, page_size=PAGE)
    one = pools.slot_bytes() + 5 * pools.page_bytes(4) + pools.page_bytes(128)  # a 150-token prefix
    cache = PrefixCache(pools, one + pools.slot_bytes(), interval=0)
    h = pools.alloc(CAP)
    model.prefill(pools, h, prompt[:150], 0, chunk=150, logits=False)
    assert cache.store(h, prompt[:150]) is not None
    other = [1, *prompt[1:150]]  # unrelated: its pages are new
    g = pools.alloc(CAP)
    model.prefill(pools, g, other, 0, chunk=150, logits=False)
    assert cache.store(g, other, optional=True) is None and cache.evictions == 0 and len(cache) == 1
    assert cache.store(g, other) is not None and cache.evictions == 1  # a required one evicts LRU
