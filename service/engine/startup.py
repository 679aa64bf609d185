"""The engine thread's start-up facts about an engine, before it serves: what it gets from the tokenizer and the
grammar masks, and the longest request its state pools can ever hold. Imports no mlx at import time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dsv4_serve.service.engine.engine import Engine

USER_TURN = "<｜User｜>"  # the chat format's user-turn marker (service/api/encoding.py's USER)


def prepare(engine: Engine, tokenizer: Tokenizer | None) -> None:
    """The tokenizer's user-turn id on the engine (a system prompt's prefix snapshot ends before it:
    Scheduler.prefill_work) and the guided rows' token masks (stepping.decode_step), where it has none."""
    user = getattr(tokenizer, "token_to_id", lambda _: None)(USER_TURN)
    if user is not None and hasattr(engine, "snapshot_token"):
        engine.snapshot_token = user
    if getattr(engine, "guides", None) is None:
        from dsv4_serve.service.engine.grammar import Guides

        engine.guides = Guides(engine.vocab_size, engine.eos_token_id)


def max_fit_tokens(engine: Engine) -> int:
    """The most positions one request's decode state can ever have (empty pools): a binary search over
    `fits_ever` (or the state's bytes against the pools' budget)."""
    budget = engine.bytes_budget()
    fits = getattr(engine, "fits_ever", None) or (lambda n: engine.state_bytes_for(n) <= budget)
    lo, hi = 0, engine.max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
