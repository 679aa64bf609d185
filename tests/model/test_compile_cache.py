"""A compiled segment never replays another model's trace (issue 57; docs/mlx_compile_cache_bug.md).

MLX keys a compiled function's traces by the address of its Python callable, in a cache per thread, and a freed
compiled function erases its traces from the last calling thread's cache only. Forced here as the issue found it:
a seed-1 tiny model decodes on the main thread, then on another thread (the engine thread's pattern), and is
freed; the seed-0 model's segments are made again and again until the callables they compile land on the freed
addresses. Before the fix its plain engine then gave other greedy tokens than a fresh process ([91, 316],
[168, 79], [300, 306] in three runs, where [300, 76] is right). A block's compiled segments are now one pair per
thread: each is freed with the block or on its thread's end and erases its traces from the one cache holding them,
so a new callable at its address finds none.
"""

from __future__ import annotations

import gc
import threading

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine.engine import Engine
from dsv4_serve.service.engine.request import SamplingParams
from tests.service.test_speculative import drive, tokens_of

GREEDY2 = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def decode_some(model, args) -> None:
    pools = StatePools(args, max_slots=1, max_positions=32, page_size=4, dtype=model.dtype)
    h = pools.alloc(8)
    for i, t in enumerate([3, 4, 5, 6]):
        model.decode(pools, [h], [t], [i])
    pools.free(h)


def plain_tokens(model, prompt: list[int]) -> list[int]:
    return tokens_of(drive(Engine(model, max_rows=8, max_model_len=64, page_size=4), [(prompt, GREEDY2)])["r0"])


def by_token(model, args, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by token-by-token decode with the segments not compiled (DSV4_COMPILE=0)."""
    pools = StatePools(args, max_slots=1, max_positions=64, page_size=4, dtype=model.dtype)
    h = pools.alloc(len(prompt) + n)
    out: list[int] = []
    for i, t in enumerate(prompt + [None] * (n - 1)):
        logits = model.decode(pools, [h], [t if t is not None else out[-1]], [i])
        if i >= len(prompt) - 1:
            out.append(int(mx.argmax(logits[0]).item()))
    return out


def test_a_freed_models_traces_never_reach_a_new_model(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[int] = []  # the address of every callable handed to mx.compile (MLX's key of its traces)
    real = mx.compile

    def spy(fn, *a, **kw):
        compiled.append(id(fn))
        return real(fn, *a, **kw)

    monkeypatch.setattr(mx, "compile", spy)
    old, old_args, _ = tiny_model(seed=1)
    decode_some(old, old_args)  # main thread
    t = threading.Thread(target=decode_some, args=(old, old_args))
    t.start()
    t.join()  # the engine thread's pattern: the last caller is another thread
    model, args, _ = tiny_model(seed=0)  # made before the old one is freed, as a reload would
    freed = set(compiled)
    del old
    gc.collect()
    held, landed = [], 0
    for block in model.blocks():
        for _ in range(2000):
            n = len(compiled)
            block.reset_compiled()
            block._segments()
            hit = freed.intersection(compiled[n:])
            if hit:
                landed += 1
                freed -= hit
                break
            held.append(block.__dict__["_compiled"])  # kept: the allocator moves on to other addresses
    prompt = np.random.default_rng(5).integers(2, args.vocab_size, 30).tolist()
    got = plain_tokens(model, prompt)
    monkeypatch.setenv("DSV4_COMPILE", "0")
    fresh, fresh_args, _ = tiny_model(seed=0)
    want = by_token(fresh, fresh_args, prompt, 2)
    assert want == [300, 76]  # a fresh process's tokens (issue 57), by a clear margin
    assert got == want, f"{landed} blocks' segments landed on a freed compiled callable's address"
