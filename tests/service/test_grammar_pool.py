"""GrammarPool against the real compile process: the compiled-grammar cache stays within its byte budget,
least recently used first out, and a compiled grammar enforces its choices."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("xgrammar")

from dsv4_serve.model.tokenizer import build_tiny_tokenizer  # noqa: E402
from dsv4_serve.service.api.grammar_pool import GrammarPool  # noqa: E402
from dsv4_serve.service.engine import grammar  # noqa: E402

V = 512


def test_the_cache_is_bounded_by_bytes_lru() -> None:
    tok = build_tiny_tokenizer(V)

    async def run() -> None:
        fmts = [grammar.choice_format([f"answer {i} {j}" for j in range(50)]) for i in range(4)]
        sizer = GrammarPool(timeout=60)
        try:
            size = int((await sizer.compile(tok, V, 1, fmts[0], "guided_choice")).grammar.memory_size_bytes)
        finally:
            await sizer.close()
        pool = GrammarPool(timeout=60, cache_bytes=2 * size + size // 2)  # two of these grammars fit, not three
        try:
            guides = [await pool.compile(tok, V, 1, f, "guided_choice") for f in fmts]
            assert 0 < pool.cached_bytes <= pool.cache_bytes
            again = await pool.compile(tok, V, 1, fmts[3], "guided_choice")  # the newest: still cached
            assert again.grammar is guides[3].grammar
            evicted = await pool.compile(tok, V, 1, fmts[0], "guided_choice")  # the oldest: compiled again
            assert evicted.grammar is not guides[0].grammar
            assert pool.cached_bytes <= pool.cache_bytes
            import xgrammar as xgr

            m = xgr.GrammarMatcher(guides[2].grammar)
            assert m.accept_string("answer 2 17") and not xgr.GrammarMatcher(guides[2].grammar).accept_string("x")
        finally:
            await pool.close()

    asyncio.run(run())
