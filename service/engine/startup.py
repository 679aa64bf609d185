"""The engine thread's start-up facts about an engine, before it serves: what it gets from the tokenizer and the
grammar masks, and the longest request its state pools can ever hold. Imports no mlx at import time."""

from __future__ import annotations

import time
from typing import Any

USER_TURN = "<｜User｜>"  # the chat format's user-turn marker (service/api/encoding.py's USER)


def prepare(engine: Any, tokenizer: Any) -> None:
    """The tokenizer's user-turn id on the engine (a system prompt's prefix snapshot ends before it:
    Scheduler.prefill_work) and the guided rows' token masks (stepping.decode_step), where it has none."""
    user = getattr(tokenizer, "token_to_id", lambda _: None)(USER_TURN)
    if user is not None and hasattr(engine, "snapshot_token"):
        engine.snapshot_token = user
    if getattr(engine, "guides", None) is None:
        from service.engine.grammar import Guides

        engine.guides = Guides(engine.vocab_size, engine.eos_token_id)


def max_fit_tokens(engine: Any) -> int:
    """The most positions one request's decode state can ever have (empty pools): a binary search over
    `fits_ever` (or the state's bytes against the pools' budget)."""
    budget = engine.bytes_budget()
    fits = getattr(engine, "fits_ever", None) or (lambda n: engine.state_bytes_for(n) <= budget)
    lo, hi = 0, engine.max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def settle(host_seconds: dict[str, float] | None = None) -> None:
    """After warm-up, before serving: the start-up heap (the model's modules, the compiled traces, the
    framework) frozen out of the cyclic collector's reach (`DSV4_GC_FREEZE`, default 1: vLLM does the same
    after its start-up), so a full collection triggered by a step's garbage walks only what serving made;
    Python's GIL switch interval (`DSV4_SWITCH_INTERVAL_MS`, default 5, Python's: how long the engine thread
    may wait for the GIL that the event loop holds); and every collection's time added to `host_seconds["gc"]`
    (the engine's host phases: it overlaps the others)."""
    import gc
    import os
    import sys

    if os.environ.get("DSV4_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()
    ms = float(os.environ.get("DSV4_SWITCH_INTERVAL_MS", "5"))
    if not 0 < ms <= 100:
        raise ValueError(f"DSV4_SWITCH_INTERVAL_MS must be in (0, 100], got {ms}")
    sys.setswitchinterval(ms / 1e3)
    global _sink
    _sink = host_seconds
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


_sink: dict[str, float] | None = None  # the serving engine's host phases (settle)
_gc_started: list[float] = []


def _timed(phase: str, _info: dict) -> None:
    if phase == "start":
        _gc_started.append(time.perf_counter())
    elif _gc_started:
        t = time.perf_counter() - _gc_started.pop()
        if _sink is not None:
            _sink["gc"] = _sink.get("gc", 0.0) + t
