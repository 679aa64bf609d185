"""GrammarPool against the real compile process: the compiled-grammar cache stays within its byte budget,
least recently used first out, a compiled grammar enforces its choices, and requests for a grammar
already compiling wait for that compile."""

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


def _counted(pool: GrammarPool) -> list[str]:
    """The keys `pool` runs a compile process for, in order (the real compile runs)."""
    keys: list[str] = []
    real = pool._compile

    async def compile_(worker, tokenizer, vocab_size, eos, text, key, source):  # type: ignore[no-untyped-def]
        keys.append(key)
        return await real(worker, tokenizer, vocab_size, eos, text, key, source)

    pool._compile = compile_  # type: ignore[method-assign]
    return keys


def test_requests_for_a_grammar_under_way_join_its_compile_and_other_keys_do_not() -> None:
    """Eight requests of one key sending one new schema at once: one compile (the key may hold two workers, so
    without joining two would run, and under load the rest waited out --grammar-timeout for a slot: a 429); the
    same schema from another key compiles on its own."""
    tok = build_tiny_tokenizer(V)
    fmt = grammar.choice_format([f"option {i}" for i in range(40)])

    async def run() -> None:
        pool = GrammarPool(timeout=60, workers=2, per_key=2)
        keys = _counted(pool)
        try:
            a = pool.compile(tok, V, 1, fmt, "response_format", "tenant-a")
            guides = await asyncio.gather(*[pool.compile(tok, V, 1, fmt, "response_format", "tenant-a")
                                            for _ in range(7)], a, pool.compile(tok, V, 1, fmt, "guided_choice", "b"))
            assert len(keys) == 2 and keys[0] != keys[1]
            assert all(g.grammar is guides[0].grammar for g in guides[:8])
            assert guides[8].grammar is not guides[0].grammar
            assert [g.source for g in guides[7:]] == ["response_format", "guided_choice"]
            import xgrammar as xgr

            assert xgr.GrammarMatcher(guides[3].grammar).accept_string("option 17")
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_request_whose_compile_others_joined_is_cancelled_and_one_of_them_compiles() -> None:
    tok = build_tiny_tokenizer(V)
    fmt = grammar.choice_format(["left", "right"])

    async def run() -> None:
        pool = GrammarPool(timeout=60)
        keys = _counted(pool)
        try:
            first = asyncio.ensure_future(pool.compile(tok, V, 1, fmt, "guided_choice"))
            while not keys:  # until its compile is under way on a worker
                await asyncio.sleep(0.001)
            second = asyncio.ensure_future(pool.compile(tok, V, 1, fmt, "guided_choice"))
            await asyncio.sleep(0.01)
            assert not second.done() and len(keys) == 1  # joined
            first.cancel()
            guide = await asyncio.wait_for(second, 60)
            assert first.cancelled() and len(keys) == 2  # the first's compile was killed; the second compiled again
            import xgrammar as xgr

            assert xgr.GrammarMatcher(guide.grammar).accept_string("right")
            assert (await pool.compile(tok, V, 1, fmt, "guided_choice")).grammar is guide.grammar  # memoized
        finally:
            await pool.close()

    asyncio.run(run())
