"""Progress of a checkpoint load, logged: shards and GB done, GB/s, ETA. A large checkpoint takes minutes to
read; an operator (or a readiness probe's log) should see it move. At most one line every `every` seconds
while loading, and one at the end."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from dsv4_serve.model.checkpoint import TensorInfo

log = logging.getLogger("dsv4.loader")
EVERY_S = 10.0
DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1, "BOOL": 1}  # fmt: skip


def size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def rate(n: float, seconds: float) -> str:
    return f"{n / seconds / 1e9:.2f} GB/s"


def tensor_bytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * DTYPE_BYTES.get(info.dtype, 1)


class LoadProgress:
    """Counts the tensors of `layout` as they are read (`read`) or passed over (`skip`: another rank's
    experts). Tensors named by `ignore` (the unused MTP block) are never read and not counted."""

    def __init__(self, layout: Mapping[str, TensorInfo], ignore: tuple[str, ...] = ("mtp.",),
                 every: float | None = None) -> None:  # fmt: skip
        self._bytes = {n: tensor_bytes(i) for n, i in layout.items() if not n.startswith(ignore)}
        self._file = {n: layout[n].file for n in self._bytes}
        self._left: Counter[Path] = Counter(self._file.values())
        self.shards, self.total = len(self._left), sum(self._bytes.values())
        self.shards_done = self.read_bytes = self.done_bytes = 0
        self.every = EVERY_S if every is None else every
        self.t0 = self._last = time.monotonic()

    def read(self, name: str) -> None:
        self._count(name, read=True)

    def skip(self, name: str) -> None:
        self._count(name, read=False)

    def _count(self, name: str, read: bool) -> None:
        n = self._bytes.pop(name, None)
        if n is None:  # ignored, or counted already
            return
        self.done_bytes += n
        self.read_bytes += n if read else 0
        f = self._file[name]
        self._left[f] -= 1
        if self._left[f] == 0:
            self.shards_done += 1
        now = time.monotonic()
        if now - self._last >= self.every and self._bytes:
            self._last = now
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        dt = max((now or time.monotonic()) - self.t0, 1e-9)
        per_s = self.read_bytes / dt
        eta = f"{(self.total - self.done_bytes) / per_s:.0f} s" if per_s > 0 else "?"
        return (f"loading: {self.shards_done}/{self.shards} shards, {size(self.done_bytes)} of {size(self.total)}, "
                f"{rate(self.read_bytes, dt)}, ETA {eta}")  # fmt: skip

    def finish(self) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        log.info("loaded %s from %d shards in %.1f s (%s)", size(self.read_bytes), self.shards, dt,
                 rate(self.read_bytes, dt))  # fmt: skip
