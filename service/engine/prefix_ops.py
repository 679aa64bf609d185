"""The Engine's prefix-cache operations (service/engine/prefix_cache.py): adoption, snapshots, retirement. A base
of `Engine` (engine.py), kept apart so that file stays one step's worth of reading; every method runs on the engine
thread and uses the Engine's `prefix_cache`, `touched`, `settle` and `release`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dsv4_serve.model.state import StateHandle as Handle
from dsv4_serve.service.engine.prompt_plan import first_turn
from dsv4_serve.service.engine.request import SHARED, Namespace

if TYPE_CHECKING:
    from dsv4_serve.service.engine.prefix_cache import PrefixCache

log = logging.getLogger("dsv4.engine")


class PrefixOps:
    prefix_cache: PrefixCache | None
    if TYPE_CHECKING:  # the Engine's (engine.py)

        def touched(self) -> None: ...  # MLX is about to write the state

        def settle(self) -> None: ...  # a replayed step left running ends first

        def release(self, handle: Handle) -> None: ...  # free a request's state

    @property
    def prefix_enabled(self) -> bool:
        return self.prefix_cache is not None

    @property
    def snapshot_interval(self) -> int:
        """Prefill pieces end at multiples of this (a snapshot each); 0: no snapshots inside prompts."""
        return self.prefix_cache.interval if self.prefix_cache is not None else 0

    def prefix_version(self) -> int:
        return self.prefix_cache.version if self.prefix_cache is not None else 0

    def reuse(self, handle: Handle, prompt_ids: Sequence[int], fed: int,
              namespace: Namespace = SHARED) -> tuple[Handle, int] | None:  # fmt: skip
        """Adopt the longest cached prefix of the prompt in its namespace (never its last token: the step feeds
        that one) longer than the `fed` tokens the request has; (its new handle, prefix length) or None."""
        cache = self.prefix_cache
        self.touched()  # an adoption copies the entry's slot state in
        entry = None if cache is None else cache.lookup(prompt_ids[:-1], longer_than=fed, ns=namespace)
        new = None if entry is None else cache.adopt(handle, entry)  # type: ignore[union-attr]
        return None if new is None else (new, entry.length)  # type: ignore[union-attr]

    # The first user turn's marker (`<｜User｜>`, set from the tokenizer by the worker): a prefill piece may end
    # right before it (Scheduler.prefill_work), and the state there is snapshotted like an interval boundary's.
    snapshot_token: int | None = None

    def prefilled(self, handle: Handle, prompt_ids: Sequence[int], fed: int, namespace: Namespace = SHARED) -> None:
        """After a prefill piece: a snapshot at the prompt's end, and at every interval boundary and before the
        first user turn if it fits the budget as it is (those never evict another entry)."""
        cache = self.prefix_cache
        if cache is None or not fed:
            return
        t0 = time.perf_counter()
        self.settle()
        if fed == len(prompt_ids) - 1:
            cache.store(handle, prompt_ids[:fed], ns=namespace)
        elif cache.interval and (fed % cache.interval == 0 or fed == first_turn(prompt_ids, self.snapshot_token)):
            cache.store(handle, prompt_ids[:fed], optional=True, ns=namespace)
        if (split := getattr(self, "prefill_ms", None)) is not None:
            split["prefill_snapshot_ms"] += 1e3 * (time.perf_counter() - t0)

    def retire(self, handle: Handle, tokens: Sequence[int], request_id: str, namespace: Namespace = SHARED) -> None:
        """A request ended normally: cache the state of the `tokens` it fed (the next turn's prefix), free it."""
        self.settle()  # a step left running may still write this state (it fed the request's last token)
        try:
            if self.prefix_cache is not None and tokens:
                self.prefix_cache.store(handle, tokens, request_id, ns=namespace)
        except Exception:  # noqa: BLE001 - a failed snapshot must not keep the state
            log.exception("prefix cache store failed")
        self.release(handle)

    def prefix_stats(self) -> dict[str, int]:
        return self.prefix_cache.stats() if self.prefix_cache is not None else {}
