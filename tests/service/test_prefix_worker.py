"""The prefix cache through the real EngineWorker and Engine (tiny model): a 4-turn conversation whose
next prompt is the previous prompt + the generated ids + a new message, with the cache on and off.

The ids are exact here (the worker's events carry them): each turn must adopt the whole state the
previous request left (its prompt and every generated token it fed), run only the rest through the
model (the worker's prompt_tokens_computed counter), and generate what the cache-off engine generates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from model.loader import tiny_model
from service.engine.engine import Engine
from service.engine.request import SamplingParams
from service.engine.worker import EngineWorker

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
