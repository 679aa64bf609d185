"""Issue 63 (items 1, 2, 6) below the HTTP layer: ambiguous regexes are refused up front and the ones let
through have flat mask costs (measured with xgrammar on the tiny vocabulary); a row whose mask goes over its
budget is reported after its strikes while a cheap row beside it is not; compile workers are shared fairly
among keys; the compile memo is per key."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from dsv4_serve.service.api.grammar_queue import FairSlots
from dsv4_serve.service.api.patterns import ambiguous, schema_patterns

REFUSED = [r"([a-z ]*[a-z ]*)*x", r"([a-y ]+)*x", r"([a-y]*)*x", r"([a-y]+[a-y]+)*x", r"([a-y]+[ ]?)*x",
           r"(a{2,3})+", r"([a-z ]{0,5}[a-z ]{0,5}){0,10}x", r"(.+)*", r"(a+|b)*x",
           r"([\p{L} ]*[\p{L} ]*)*x"]  # ECMAScript classes, as JSON schema patterns write them  # fmt: skip
ACCEPTED = [r"([a-z]+\.)+[a-z]+x", r"([a-y]+ )*x", r"(([a-y]+ )*\.)*x", r"[a-z ]*[a-z ]*x", r"(a|ab|b)*x",
            r"(\d{3})+x", r"(\d{1,3}\.){3}\d{1,3}", r"[A-Z][a-z]+( [A-Z][a-z]+)*x", r"\w+x"]  # fmt: skip


@pytest.mark.parametrize("pattern", REFUSED)
def test_an_ambiguous_repeat_is_refused(pattern: str) -> None:
    assert ambiguous(pattern)


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_an_unambiguous_pattern_is_accepted(pattern: str) -> None:
    assert not ambiguous(pattern)


def test_schema_patterns_are_found_at_any_depth() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"},
              "b": {"type": "array", "items": {"pattern": "(y*)*"}}}, "patternProperties": {"^z+$": {}}}  # fmt: skip
    assert sorted(schema_patterns(schema)) == sorted(["x+", "(y*)*", "^z+$"])


def _no_x(allowed: np.ndarray, tok) -> list[int]:
    """The allowed ids but EOS (1) and tokens holding an 'x' (which ends the test patterns)."""
    return [int(t) for t in allowed if t != 1 and "x" not in (tok.id_to_token(int(t)) or "x")]


def _walk(guide, steps: int, vocab: int, tok) -> list[float]:
    """One matcher walking `steps` random allowed tokens (never 'x', which would end the patterns): the seconds
    of each accept + mask."""
    import xgrammar as xgr

    from dsv4_serve.service.engine import grammar

    m, out, rng, ts = xgr.GrammarMatcher(guide.grammar), np.full((1, (vocab + 31) // 32), -1, np.int32), \
        np.random.default_rng(0), []  # fmt: skip
    for _ in range(steps):
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(out, 0)
        ok = _no_x(grammar.tokens_allowed(out, 0, vocab), tok)
        if not ok or not m.accept_token(int(rng.choice(ok))):
            break
        ts.append(time.perf_counter() - t0)
    return ts


def test_the_refusal_matches_xgrammar_s_own_mask_costs() -> None:
    """The accepted patterns' masks stay flat over 200 tokens (median of the last 50 under 1 ms); the issue's
    pattern, refused, grows past 5 ms within 120 tokens."""
    pytest.importorskip("xgrammar")
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer
    from dsv4_serve.service.engine import grammar

    tok = build_tiny_tokenizer(512)
    for p in ACCEPTED:
        ts = _walk(grammar.compile_guide(tok, 512, 1, grammar.regex_format(p), "guided_regex"), 200, 512, tok)
        assert float(np.median(ts[-50:])) < 1e-3, (p, np.median(ts[-50:]))
    ts = _walk(grammar.compile_guide(tok, 512, 1, grammar.regex_format(REFUSED[0]), "guided_regex"), 120, 512, tok)
    assert max(ts) > 5e-3


def test_a_row_over_its_mask_budget_is_reported_and_a_cheap_row_beside_it_is_not() -> None:
    pytest.importorskip("xgrammar")
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer
    from dsv4_serve.service.engine import grammar
    from dsv4_serve.service.engine.request import Request, SamplingParams

    tok, v = build_tiny_tokenizer(512), 512
    slow = grammar.compile_guide(tok, v, 1, grammar.regex_format(REFUSED[0]), "guided_regex")
    fast = grammar.compile_guide(tok, v, 1, grammar.regex_format("[a-z ]*x"), "guided_json")
    guides = grammar.Guides(v, 1, mask_budget=0.004)
    rows = [Request("slow", [0], SamplingParams(guide=slow)), Request("fast", [0], SamplingParams(guide=fast))]
    rng, over = np.random.default_rng(0), []
    for _ in range(300):
        masks = guides.masks(rows)
        over += guides.over_budget()
        if over:
            break
        for i, r in enumerate(rows):
            ok = _no_x(grammar.tokens_allowed(masks, i, v), tok)
            r.output_ids.append(int(rng.choice(ok)))
    assert [r.request_id for r, _ in over] == ["slow"]
    assert "guided_regex" in over[0][1] and rows[0].guide_state.strikes == grammar.STRIKES
    assert rows[1].guide_state.strikes == 0


def test_one_key_holds_at_most_its_quota_and_waiting_keys_go_round_robin() -> None:
    async def run() -> None:
        slots = FairSlots(2, per_key=1)
        a1 = await slots.acquire("a")
        a2 = asyncio.ensure_future(slots.acquire("a"))  # a's second waits though a worker is free
        a3 = asyncio.ensure_future(slots.acquire("a"))
        await asyncio.sleep(0)
        assert not a2.done() and slots.waiting("a") == 2
        b1 = await asyncio.wait_for(slots.acquire("b"), 1)  # b takes the free worker at once
        assert {a1, b1} == {0, 1}
        c = asyncio.ensure_future(slots.acquire("c"))
        await asyncio.sleep(0)
        slots.release("a", a1)  # a and c wait: a (first in line) gets it, then c before a's third
        await asyncio.sleep(0)
        assert a2.done() and not c.done()
        slots.release("b", b1)
        await asyncio.sleep(0)
        assert c.done() and not a3.done()
        with pytest.raises(TimeoutError):  # a waiter that times out leaves the queue
            await asyncio.wait_for(slots.acquire("d"), 0.05)
        assert slots.waiting("d") == 0
        slots.release("a", a2.result())
        await asyncio.sleep(0)
        assert a3.done()

    asyncio.run(run())


def test_a_key_gets_back_its_own_restarting_worker_and_another_key_the_live_one() -> None:
    """After A's compile was killed (worker 0 restarting), A's next compile takes worker 0 back and waits for
    its start; B takes worker 1, which is up."""
    up = {0: True, 1: True}

    async def run() -> None:
        slots = FairSlots(2, per_key=1, ready=lambda w: up[w])
        w = await slots.acquire("a")
        assert w == 0
        up[0] = False  # A's compile was killed: its process restarts
        slots.release("a", w)
        assert await slots.acquire("a") == 0 and await slots.acquire("b") == 1

    asyncio.run(run())


def test_the_compile_memo_is_per_key() -> None:
    """A's repeat is a hit (the same compiled object); B's same grammar compiles anew (not A's object)."""
    pytest.importorskip("xgrammar")
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer
    from dsv4_serve.service.api.grammar_pool import GrammarPool
    from dsv4_serve.service.engine import grammar

    tok = build_tiny_tokenizer(512)
    fmt = grammar.choice_format(["alpha", "beta"])

    async def run() -> None:
        pool = GrammarPool(timeout=60)
        try:
            a = await pool.compile(tok, 512, 1, fmt, "guided_choice", "tenant-a")
            assert (await pool.compile(tok, 512, 1, fmt, "guided_choice", "tenant-a")).grammar is a.grammar
            b = await pool.compile(tok, 512, 1, fmt, "guided_choice", "tenant-b")
            assert b.grammar is not a.grammar
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_compile_past_its_memory_limit_is_a_400_and_the_pool_goes_on() -> None:
    """A 4,000-property schema under a 64 MiB address-space allowance: refused (400 grammar_too_complex), the
    child's peak address space never above its RLIMIT_AS, and the next compile works, in a fresh process (glibc
    keeps what the failed compile freed mapped: the old one would refuse the next grammar)."""
    pytest.importorskip("xgrammar")
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer
    from dsv4_serve.service.api.grammar_pool import GrammarPool
    from dsv4_serve.service.api.protocol import APIError
    from dsv4_serve.service.engine import grammar

    tok = build_tiny_tokenizer(512)
    big = grammar.json_format({"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(4000)}})

    async def run() -> None:
        pool = GrammarPool(timeout=60, workers=1, memory_bytes=64 * 2**20)
        peaks: list[tuple[int, int]] = []

        async def watch() -> None:
            while True:
                w = pool.workers[0]
                try:
                    if w.up and w.memory_limit and w.proc is not None:
                        with open(f"/proc/{w.proc.pid}/status") as f:
                            peak = int(f.read().split("VmPeak:")[1].split()[0]) * 1024
                        peaks.append((peak, w.memory_limit))
                except (OSError, IndexError):  # the process exited between the check and the read
                    pass
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            await pool.compile(tok, 512, 1, grammar.choice_format(["u", "v"]), "guided_choice", "a")
            pid = pool.workers[0].proc.pid
            with pytest.raises(APIError) as e:
                await pool.compile(tok, 512, 1, big, "guided_json", "a")
            assert e.value.status == 400 and e.value.code == "grammar_too_complex", e.value
            ok = await pool.compile(tok, 512, 1, grammar.choice_format(["x", "y"]), "guided_choice", "b")
            assert ok.grammar is not None and pool.workers[0].proc.pid != pid  # a fresh process: no memory kept
        finally:
            watcher.cancel()
            await pool.close()
        assert peaks and all(p <= lim for p, lim in peaks), peaks[-3:]

    asyncio.run(run())


def test_past_the_memo_s_budget_the_key_holding_the_most_bytes_loses_its_own_first() -> None:
    """B's grammars past the budget evict B's oldest, never A's (a hit keeps its compiled object)."""
    pytest.importorskip("xgrammar")
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer
    from dsv4_serve.service.api.grammar_pool import GrammarPool
    from dsv4_serve.service.engine import grammar

    tok = build_tiny_tokenizer(512)
    fmts = [grammar.choice_format([f"answer {i} {j}" for j in range(50)]) for i in range(6)]

    async def run() -> None:
        pool = GrammarPool(timeout=60)
        try:
            size = int((await pool.compile(tok, 512, 1, fmts[0], "guided_choice", "sizer")).grammar.memory_size_bytes)
        finally:
            await pool.close()
        pool = GrammarPool(timeout=60, cache_bytes=3 * size + size // 2)  # three of these fit, not four
        try:
            a = await pool.compile(tok, 512, 1, fmts[0], "guided_choice", "a")
            b = [await pool.compile(tok, 512, 1, f, "guided_choice", "b") for f in fmts[1:5]]
            assert pool.cached_bytes <= pool.cache_bytes
            assert (await pool.compile(tok, 512, 1, fmts[0], "guided_choice", "a")).grammar is a.grammar  # A's stays
            assert (await pool.compile(tok, 512, 1, fmts[4], "guided_choice", "b")).grammar is b[3].grammar
            assert (await pool.compile(tok, 512, 1, fmts[1], "guided_choice", "b")).grammar is not b[0].grammar
        finally:
            await pool.close()

    asyncio.run(run())


def test_a_compile_past_its_cpu_time_limit_ends_its_process() -> None:
    """RLIMIT_CPU, the backstop of the wall-clock kill: a compile process allowed 1 s of CPU a compile is ended
    by the kernel (SIGXCPU) on a compile that needs ~10 s (200 required integers at 512 ids)."""
    pytest.importorskip("xgrammar")
    import json
    import signal

    from dsv4_serve.service.api.grammar_worker import CompileWorker
    from dsv4_serve.service.engine import grammar

    from dsv4_serve.model.tokenizer import build_tiny_tokenizer  # isort: skip

    info = grammar.tokenizer_info(build_tiny_tokenizer(512), 512, 1)
    props = {f"p{i}": {"type": "integer"} for i in range(200)}
    slow = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    text = json.dumps({"type": "structural_tag", "format": grammar.json_format(slow)}).encode()

    async def run() -> None:
        w = CompileWorker({"threads": 1, "memory": 8 * 2**30, "cpu": 1})
        try:
            proc = await asyncio.wait_for(w.process(info), 120)
            t0 = time.perf_counter()
            with pytest.raises(asyncio.IncompleteReadError):
                await asyncio.wait_for(w.ask(proc, text), 60)
            assert await proc.wait() == -signal.SIGXCPU and time.perf_counter() - t0 < 30
        finally:
            await w.kill(restart=False)

    asyncio.run(run())
