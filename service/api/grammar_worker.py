"""One grammar compile process (grammar_child.py) of the GrammarPool: started in the background as soon as
the tokenizer is known and again right after every kill, so a compile rarely waits for xgrammar's import
(~2 s of one core); framed requests and replies over its pipes. Event loop only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dsv4_serve.service.api.grammar_child import HEADER

log = logging.getLogger("dsv4.api")
START_TIMEOUT = 120.0  # seconds a compile process may take to start
CHILD = Path(__file__).with_name("grammar_child.py")


class CompileWorker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg  # threads, memory (bytes past its start), cpu (seconds a compile)
        self.proc: asyncio.subprocess.Process | None = None
        self.memory_limit: int | None = None  # its RLIMIT_AS, as it reported it
        self._starting: asyncio.Task[asyncio.subprocess.Process] | None = None
        self._info: Any = None

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def start(self, info: Any) -> None:
        """Start the process in the background (nothing when it is up or starting)."""
        self._info = info
        if not self.up and (self._starting is None or self._starting.done()):
            self._starting = asyncio.get_running_loop().create_task(self._start())
            self._starting.add_done_callback(_quiet)

    async def process(self, info: Any) -> asyncio.subprocess.Process:
        """The running process, started (or its start awaited) if it is not up."""
        if self.up:
            assert self.proc is not None
            return self.proc
        if self._starting is not None and self._starting.done() and not self.up:
            self._starting = None  # a start that failed, or a process that died since: start again
        self.start(info)
        assert self._starting is not None
        return await asyncio.shield(self._starting)  # one waiter's timeout does not end the start

    async def ask(self, proc: asyncio.subprocess.Process, payload: bytes) -> bytes:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(HEADER.pack(len(payload)) + payload)
        await proc.stdin.drain()
        return await _read_frame(proc.stdout)

    async def kill(self, restart: bool = True) -> None:
        """End the process (a compile nobody waits for any more, a timeout, a failure); `restart`: start a
        fresh one in the background."""
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        if restart and self._info is not None:
            self.start(self._info)

    async def _start(self) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(sys.executable, str(CHILD), stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE)  # fmt: skip
        try:
            assert proc.stdin is not None and proc.stdout is not None
            cfg = json.dumps({"info": self._info.serialize_json(), **self.cfg}).encode()
            proc.stdin.write(HEADER.pack(len(cfg)) + cfg)
            await proc.stdin.drain()
            ready = await _read_frame(proc.stdout)
            if not ready.startswith(b"ready"):
                raise RuntimeError("the grammar compile process did not start")
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        self.memory_limit = int(ready[5:])
        self.proc = proc
        return proc


def _quiet(task: asyncio.Task[Any]) -> None:
    """A background start's failure is logged here; the compile that needs the process reports it."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a grammar compile process did not start: %r", task.exception())


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return await reader.readexactly(n)
