"""The prefix cache through the real EngineWorker and Engine (tiny model): a 4-turn conversation whose
next prompt is the previous prompt + the generated ids + a new message, with the cache on and off.

The ids are exact here (the worker's events carry them): each turn must adopt the whole state the
previous request left (its prompt and every generated token it fed), run only the rest through the
model (the worker's prompt_tokens_computed counter), and generate what the cache-off engine generates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine.engine import Engine
from dsv4_serve.service.engine.request import SamplingParams
from dsv4_serve.service.engine.worker import EngineWorker

PARAMS = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


def conversation(model, cache_bytes: int, turns: list[list[int]], interval: int = 128) -> list[dict]:
    engine = Engine(model, max_rows=8, max_model_len=1024, page_size=16, prefix_cache_bytes=cache_bytes,
                    prefix_interval=interval)  # fmt: skip
    w = EngineWorker(lambda: (engine, None))
    w.start()

    async def main() -> list[dict]:
        assert await w.wait_ready(60), w.start_error
        out, prompt = [], []
        try:
            for msg in turns:
                prompt = prompt + msg
                before = w.stats()["prompt_tokens_computed_total"]
                events = [ev async for ev in await w.submit(prompt, PARAMS)]
                ids = [e.token_id for e in events if e.token_id is not None]
                out.append({"prompt": len(prompt), "ids": ids, "cached": events[-1].cached_tokens,
                            "computed": w.stats()["prompt_tokens_computed_total"] - before})  # fmt: skip
                prompt = prompt + ids
        finally:
            await w.drain(0)
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("interval", [128, 0])
def test_four_turns_reuse_every_fed_token(tiny, interval) -> None:
    rng = np.random.default_rng(3)
    turns = [[int(t) for t in rng.integers(2, 512, n)] for n in (300, 37, 129, 5)]
    cold = conversation(tiny[0], 0, turns)
    warm = conversation(tiny[0], 64 << 20, turns, interval)
    assert [t["ids"] for t in warm] == [t["ids"] for t in cold]
    assert all(t["cached"] is None for t in cold)
    assert all(t["computed"] == t["prompt"] for t in cold)
    assert warm[0]["cached"] == 0 and warm[0]["computed"] == warm[0]["prompt"]
    for prev, t in zip(warm, warm[1:], strict=False):
        # The previous request fed its prompt and all its generated ids but the last one (LENGTH).
        assert t["cached"] == prev["prompt"] + len(prev["ids"]) - 1
        assert t["computed"] == t["prompt"] - t["cached"]  # only the rest went through the model


def test_admission_takes_pages_back_from_the_cache_never_from_a_running_request(tiny) -> None:
    """Pools for 2 rows of 256 positions: a finished request's cached pages go back to admission (LRU
    eviction) when a new request needs them; the full pages a running request maps stay with it."""
    engine = Engine(tiny[0], max_rows=2, max_model_len=256, page_size=16, prefix_cache_bytes=64 << 20)
    pools, cache = engine.pools, engine.prefix_cache
    prompt = [int(t) for t in np.random.default_rng(4).integers(2, 512, 200)]
    h = engine.admit(256)
    engine.prefill(h, prompt, 0)
    engine.retire(h, prompt, "done")  # the cache holds its pages now
    assert len(cache) == 1 and pools.can_alloc(256)  # the other row's pages are still free
    running = engine.admit(256)
    running, n = engine.reuse(running, prompt + [5], 0)  # maps the entry's 3 full CSA pages (48 entries)
    assert n == 200 and running.tables[4][:3] == cache.by_request("done").pages[4][:3]
    assert not pools.can_alloc(256) and engine.can_admit(256)  # by evicting the entry
    assert cache.evictions == 1 and len(cache) == 0
    new = engine.admit(256)
    for r in pools.ratios:  # the running request's pages are still held, and none was handed out again
        assert all(pools.page_refs(r, p) == 1 for p in running.tables[r])
        assert not set(new.tables[r]) & set(running.tables[r])
    assert not engine.can_admit(16)  # both rows taken: nothing to evict for
