"""Grammar compiles, bounded: one compile at a time in a child process (grammar_child.py) that is killed when a
compile outlives `timeout`, so an abandoned compile never keeps the CPU (xgrammar's compile is C++ that cannot
be interrupted: a 100-property schema takes ~16 s at DeepSeek-V4's 129K ids, and its time grows with the
schema's shape, not its size). Requests waiting for the compile slot give up after `timeout` too (429), and a
grammar that timed out is refused at once when sent again. Compiled grammars are kept in an LRU bounded by
their bytes (xgrammar's memory_size_bytes); the event loop only waits, and tokenization (the default thread
pool) never queues behind a compile: the result is read back in a thread of this pool's own."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dsv4_serve.service.api.grammar_child import HEADER
from dsv4_serve.service.api.protocol import APIError
from dsv4_serve.service.api.structured import _bad
from dsv4_serve.service.engine import grammar
from dsv4_serve.service.engine.request import Guide

log = logging.getLogger("dsv4.api")
CACHE_BYTES = 64 * 2**20  # compiled grammars kept for reuse
START_TIMEOUT = 120.0  # seconds the compile process may take to start
SLOW_KEYS = 1024  # grammars that timed out, remembered (digests) to refuse them at once
CHILD = Path(__file__).with_name("grammar_child.py")


def _threads() -> int:
    """xgrammar threads of one compile: at most half the cores (the engine and the event loop keep the rest)."""
    return max(1, (os.cpu_count() or 2) // 2)


class GrammarPool:
    def __init__(self, timeout: float, cache_bytes: int = CACHE_BYTES) -> None:
        self.timeout, self.cache_bytes = timeout, cache_bytes
        self._cache: OrderedDict[str, Any] = OrderedDict()  # digest -> xgrammar.CompiledGrammar
        self._cached = 0  # bytes in _cache
        self._slow: OrderedDict[str, None] = OrderedDict()
        self._slot = asyncio.Lock()  # one compile at a time (FIFO)
        self._proc: asyncio.subprocess.Process | None = None
        self._info: Any = None  # the tokenizer's xgrammar.TokenizerInfo
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    @property
    def cached_bytes(self) -> int:
        return self._cached

    async def compile(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, fmt: dict[str, Any],
                      source: str) -> Guide:  # fmt: skip
        """The compiled grammar of `fmt` (a structural-tag format); 400 naming `source` when it does not
        compile or outlives the timeout, 429 when the compile slot stays busy for the timeout."""
        try:
            text = json.dumps({"type": "structural_tag", "format": fmt}, sort_keys=True)
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise _bad(f"{source} cannot be enforced: {e}", source) from None
        key = hashlib.sha256(text.encode()).hexdigest()
        if (hit := self._hit(key)) is not None:
            return Guide(hit, source)
        if key in self._slow:
            raise self._too_slow(source)
        try:
            await asyncio.wait_for(self._slot.acquire(), self.timeout)
        except TimeoutError:
            raise APIError(429, f"Other grammars are compiling; {source} waited {self.timeout:g}s. Retry shortly",
                           code="grammar_busy", headers={"Retry-After": "1"}) from None  # fmt: skip
        try:
            if (hit := self._hit(key)) is not None:  # compiled while this one waited
                return Guide(hit, source)
            compiled = await self._compile(tokenizer, vocab_size, eos_token_id, text, key, source)
        finally:
            self._slot.release()
        self._store(key, compiled)
        return Guide(compiled, source)

    async def close(self) -> None:
        await self._kill()
        self._thread.shutdown(wait=False)

    # ---- the child process ---------------------------------------------------------------------------
    async def _compile(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, text: str, key: str,
                       source: str) -> Any:  # fmt: skip
        loop = asyncio.get_running_loop()
        if self._info is None:  # the vocabulary scan, once
            try:
                self._info = await loop.run_in_executor(self._thread, grammar.tokenizer_info, tokenizer, vocab_size,
                                                        eos_token_id)  # fmt: skip
            except ModuleNotFoundError:
                raise _bad(f"{source} needs the grammar engine, not installed on this server {grammar.INSTALL}",
                           source) from None  # fmt: skip
        try:
            # The process starts on first use and after a kill (xgrammar imports torch: ~2 s of one core), under
            # a bound of its own: the compile timeout is the compile's alone.
            proc = await asyncio.wait_for(self._child(), START_TIMEOUT)
        except (TimeoutError, asyncio.IncompleteReadError, OSError, RuntimeError) as e:
            await self._kill()
            log.error("the grammar compile process did not start: %r", e)
            raise APIError(503, f"The grammar compiler is not available; {source} cannot be enforced now", param=source,
                           code="grammar_unavailable", headers={"Retry-After": "5"}) from None  # fmt: skip
        except BaseException:
            await self._kill()
            raise
        try:
            reply = await asyncio.wait_for(self._ask(proc, text.encode()), self.timeout)
        except TimeoutError:
            await self._kill()
            self._slow[key] = None
            while len(self._slow) > SLOW_KEYS:
                self._slow.popitem(last=False)
            log.warning("a %s grammar outlived the %gs compile timeout: its compile was killed", source,
                        self.timeout)  # fmt: skip
            raise self._too_slow(source) from None
        except (asyncio.IncompleteReadError, OSError) as e:  # the process died (a crash, the OOM killer)
            await self._kill()
            log.error("the grammar compile process failed on a %s grammar: %r", source, e)
            raise _bad(f"{source} could not be compiled (the compile process failed)", source) from None
        except BaseException:  # the request was cancelled: nobody waits for this compile any more
            await self._kill()
            raise
        if reply[:1] != b"k":
            raise _bad(f"{source} cannot be enforced: {reply[1:].decode(errors='replace')}", source)
        import xgrammar as xgr

        return await loop.run_in_executor(self._thread, xgr.CompiledGrammar.deserialize_json, reply[1:].decode(),
                                          self._info)  # fmt: skip

    async def _ask(self, proc: asyncio.subprocess.Process, payload: bytes) -> bytes:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(HEADER.pack(len(payload)) + payload)
        await proc.stdin.drain()
        return await _read_frame(proc.stdout)

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        proc = await asyncio.create_subprocess_exec(sys.executable, str(CHILD), stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE)  # fmt: skip
        self._proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        cfg = json.dumps({"info": self._info.serialize_json(), "threads": _threads()}).encode()
        proc.stdin.write(HEADER.pack(len(cfg)) + cfg)
        await proc.stdin.drain()
        if await _read_frame(proc.stdout) != b"ready":
            raise RuntimeError("the grammar compile process did not start")
        return proc

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    # ---- the cache -----------------------------------------------------------------------------------
    def _hit(self, key: str) -> Any:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _store(self, key: str, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        if key in self._cache or size > self.cache_bytes:
            return
        self._cache[key] = compiled
        self._cached += size
        while self._cached > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached -= int(old.memory_size_bytes)

    def _too_slow(self, source: str) -> APIError:
        return APIError(400, f"{source} did not compile within {self.timeout:g}s (--grammar-timeout): make it "
                        "smaller or simpler", param=source, code="grammar_too_complex")  # fmt: skip


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return await reader.readexactly(n)
