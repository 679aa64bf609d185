"""Grammar compiles, bounded and shared fairly among API keys. Each compile runs in a child process
(grammar_child.py) that is killed when the compile outlives `timeout` (xgrammar's compile is C++ that cannot be
interrupted: a 100-property schema takes ~16 s at DeepSeek-V4's 129K ids, and its time grows with the schema's
shape, not its size) and that runs under an address-space and a CPU-time limit of its own. There are `workers`
such processes; a key holds at most `per_key` of them at a time and waiting keys are served round robin
(grammar_queue.FairSlots), so one key flooding compiles never starves another's (issue 63). A request waiting
for a worker gives up after `timeout` (429). A compile already under way for the same key and grammar is
joined, not queued again: eight requests sending one new schema wait for one compile, not for seven slots.

The memo (compiled grammars, in an LRU bounded by their bytes, xgrammar's memory_size_bytes; and the grammars
that timed out or ran out of memory, refused at once when sent again) is keyed by the API key's tenant id and
the grammar: a hit or a refusal, and so their timing, never depends on another key's requests (issue 63: B's
exact guess of A's timed-out schema was refused in 0.036 s, a wrong guess took 12.6 s). Past its byte budget
the key holding the most bytes loses its LRU grammar first. The event loop only waits, and tokenization (the
default thread pool) never queues behind a compile: results are read back in this pool's own threads."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dsv4_serve.service.api.grammar_queue import FairSlots
from dsv4_serve.service.api.grammar_worker import START_TIMEOUT, CompileWorker
from dsv4_serve.service.api.protocol import APIError
from dsv4_serve.service.api.structured import _bad
from dsv4_serve.service.engine import grammar
from dsv4_serve.service.engine.request import Guide

log = logging.getLogger("dsv4.api")
CACHE_BYTES = 64 * 2**20  # compiled grammars kept for reuse
SLOW_KEYS = 1024  # grammars that timed out, remembered (digests) to refuse them at once
MEMORY_BYTES = 2048 * 2**20  # a compile process's address space past what it holds once xgrammar is in


def _threads(workers: int) -> int:
    """xgrammar threads of one compile: the workers share half the cores (the engine and the event loop keep the
    rest)."""
    return max(1, (os.cpu_count() or 2) // 2 // workers)


class GrammarPool:
    def __init__(self, timeout: float, cache_bytes: int = CACHE_BYTES, workers: int = 2, per_key: int = 1,
                 memory_bytes: int = MEMORY_BYTES) -> None:  # fmt: skip
        self.timeout, self.cache_bytes = timeout, cache_bytes
        self._cache: OrderedDict[str, tuple[str, Any]] = OrderedDict()  # digest -> (tenant, CompiledGrammar)
        self._cached = 0  # bytes in _cache
        self._tenant_bytes: Counter[str] = Counter()
        self._slow: OrderedDict[str, None] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Any]] = {}  # digest -> the compile under way for it
        self._info: Any = None  # the tokenizer's xgrammar.TokenizerInfo
        self._thread = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        cfg = {"threads": _threads(workers), "memory": memory_bytes, "cpu": 2 * timeout * _threads(workers) + 5}
        self.workers = [CompileWorker(cfg) for _ in range(workers)]
        self._slots = FairSlots(workers, per_key, ready=lambda w: self.workers[w].up)

    @property
    def cached_bytes(self) -> int:
        return self._cached

    async def compile(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, fmt: dict[str, Any],
                      source: str, tenant: str = "") -> Guide:  # fmt: skip
        """The compiled grammar of `fmt` (a structural-tag format) for the key `tenant`; 400 naming `source`
        when it does not compile, outlives the timeout or its memory limit, 429 when no worker comes free for
        this key within the timeout."""
        try:
            text = json.dumps({"type": "structural_tag", "format": fmt}, sort_keys=True)
        except ValueError as e:  # e.g. an integer of more digits than Python converts
            raise _bad(f"{source} cannot be enforced: {e}", source) from None
        key = hashlib.sha256(tenant.encode() + b"\0" + text.encode()).hexdigest()
        while True:
            if (hit := self._hit(key)) is not None:
                return Guide(hit, source)
            if key in self._slow:
                raise self._too_slow(source)
            if (under_way := self._inflight.get(key)) is None:
                break
            try:  # shielded: a follower leaving does not stop the compile others wait for
                return Guide(await asyncio.shield(under_way), source)
            except asyncio.CancelledError:
                if not under_way.cancelled():  # this request was cancelled
                    raise
                # the request that compiled was cancelled (its compile killed): compile for this one
        done = self._inflight[key] = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, so an unwaited error is not logged
        try:
            compiled = await self._compile_once(tokenizer, vocab_size, eos_token_id, text, key, source, tenant)
        except asyncio.CancelledError:
            done.cancel()
            raise
        except BaseException as e:
            done.set_exception(e)
            raise
        else:
            done.set_result(compiled)
        finally:
            del self._inflight[key]
        return Guide(compiled, source)

    async def _compile_once(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, text: str, key: str,
                            source: str, tenant: str) -> Any:  # fmt: skip
        """`text` compiled on a worker this key may use (429 when none comes free within the timeout), memoized."""
        try:
            w = await asyncio.wait_for(self._slots.acquire(tenant), self.timeout)
        except TimeoutError:
            raise APIError(429, f"Other grammars are compiling; {source} waited {self.timeout:g}s. Retry shortly",
                           code="grammar_busy", headers={"Retry-After": "1"}) from None  # fmt: skip
        try:
            compiled = await self._compile(self.workers[w], tokenizer, vocab_size, eos_token_id, text, key, source)
        finally:
            self._slots.release(tenant, w)
        self._store(key, tenant, compiled)
        return compiled

    async def close(self) -> None:
        for w in self.workers:
            await w.kill(restart=False)
        self._thread.shutdown(wait=False)

    # ---- one compile on one worker ---------------------------------------------------------------------
    async def _compile(self, worker: CompileWorker, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                       text: str, key: str, source: str) -> Any:  # fmt: skip
        loop = asyncio.get_running_loop()
        if self._info is None:  # the vocabulary scan, once
            try:
                self._info = await loop.run_in_executor(self._thread, grammar.tokenizer_info, tokenizer, vocab_size,
                                                        eos_token_id)  # fmt: skip
            except ModuleNotFoundError:
                raise _bad(f"{source} needs the grammar engine, not installed on this server {grammar.INSTALL}",
                           source) from None  # fmt: skip
            for w in self.workers:  # every process starts now, in the background: none waits for a start later
                w.start(self._info)
        try:
            # A process starts on first use and after a kill (xgrammar imports torch: ~2 s of one core), under a
            # bound of its own: the compile timeout is the compile's alone.
            proc = await asyncio.wait_for(worker.process(self._info), START_TIMEOUT)
        except (TimeoutError, asyncio.IncompleteReadError, OSError, RuntimeError) as e:
            await worker.kill(restart=False)
            log.error("a grammar compile process did not start: %r", e)
            raise APIError(503, f"The grammar compiler is not available; {source} cannot be enforced now", param=source,
                           code="grammar_unavailable", headers={"Retry-After": "5"}) from None  # fmt: skip
        try:
            reply = await asyncio.wait_for(worker.ask(proc, text.encode()), self.timeout)
        except TimeoutError:
            await worker.kill()
            self._remember_slow(key)
            log.warning("a %s grammar outlived the %gs compile timeout: its compile was killed", source,
                        self.timeout)  # fmt: skip
            raise self._too_slow(source) from None
        except (asyncio.IncompleteReadError, OSError) as e:  # the process died (a crash, its CPU-time limit)
            await worker.kill()
            log.error("the grammar compile process failed on a %s grammar: %r", source, e)
            raise _bad(f"{source} could not be compiled (the compile process failed)", source) from None
        except BaseException:  # the request was cancelled: nobody waits for this compile any more
            await worker.kill()
            raise
        if reply[:1] == b"m":  # past its memory limit: the process exits by itself
            await worker.kill()
            self._remember_slow(key)
            log.warning("a %s grammar needed more than its compile process's memory limit", source)
            raise APIError(400, f"{source} needs more memory to compile than this server allows: make it smaller "
                           "or simpler", param=source, code="grammar_too_complex")  # fmt: skip
        if reply[:1] != b"k":
            raise _bad(f"{source} cannot be enforced: {reply[1:].decode(errors='replace')}", source)
        import xgrammar as xgr

        return await loop.run_in_executor(self._thread, xgr.CompiledGrammar.deserialize_json, reply[1:].decode(),
                                          self._info)  # fmt: skip

    # ---- the memo ------------------------------------------------------------------------------------
    def _hit(self, key: str) -> Any:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit[1]
        return None

    def _store(self, key: str, tenant: str, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        if key in self._cache or size > self.cache_bytes:
            return
        self._cache[key] = (tenant, compiled)
        self._cached += size
        self._tenant_bytes[tenant] += size
        while self._cached > self.cache_bytes:
            # the key holding the most bytes; on a tie, the key storing now
            big = max(self._tenant_bytes, key=lambda t: (self._tenant_bytes[t], t == tenant))
            old = next(k for k, (t, _) in self._cache.items() if t == big)
            size = int(self._cache.pop(old)[1].memory_size_bytes)
            self._cached -= size
            self._tenant_bytes[big] -= size
            self._tenant_bytes = +self._tenant_bytes

    def _remember_slow(self, key: str) -> None:
        self._slow[key] = None
        while len(self._slow) > SLOW_KEYS:
            self._slow.popitem(last=False)

    def _too_slow(self, source: str) -> APIError:
        return APIError(400, f"{source} did not compile within {self.timeout:g}s (--grammar-timeout): make it "
                        "smaller or simpler", param=source, code="grammar_too_complex")  # fmt: skip
