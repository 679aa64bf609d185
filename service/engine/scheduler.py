"""Admission and per-step planning for the engine thread: pure Python, no mlx.

Each step every planned request feeds exactly one token through the batched decode step: its next
prompt token while prefilling, else its last generated token, at position `request.fed`. Logits
are sampled only for rows whose fed token is the last prompt token or a generated one
(`needs_sample`). Before the step, `prefill_work` hands out prompt tokens (all but the last) for
the engine's parallel prefill, up to a per-step token budget, oldest request first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

from service.engine.request import FinishReason, Request, RequestStatus, TokenEvent

# (token_id, logprob or None, top alternatives) for one row, as sampler.sample returns it.
Sampled = tuple[int, float | None, tuple[tuple[int, float], ...]]


class QueueFull(Exception):
    """The waiting queue is full; the API answers 429."""


class Admission(Protocol):
    """The slice of Engine the scheduler needs (Engine itself satisfies it)."""

    def can_admit(self, n_tokens: int) -> bool: ...
    def admit(self, n_tokens: int) -> Any: ...
    def release(self, handle: Any) -> None: ...


def reserve_tokens(request: Request) -> int:
    """Positions a request may reach: what admission reserves state for."""
    return len(request.prompt_ids) + request.params.max_tokens


def needs_sample(request: Request) -> bool:
    """True when this step's fed token is the last prompt token or a generated token."""
    return request.fed + 1 >= len(request.prompt_ids)


class Scheduler:
    def __init__(
        self,
        admission: Admission,
        *,
        max_rows: int,
        max_queue: int,
        eos_token_id: int | None,
        max_model_len: int,
        max_prefill_rows: int | None = None,
    ) -> None:
        if not 1 <= max_rows <= 8:
            raise ValueError(f"max_rows must be in 1..8, got {max_rows}")
        if max_prefill_rows is not None and max_prefill_rows < 1:
            raise ValueError(f"max_prefill_rows must be >= 1 or None, got {max_prefill_rows}")
        self.admission = admission
        self.max_rows = max_rows
        self.max_queue = max_queue
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.max_prefill_rows = max_prefill_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.handles: dict[str, Any] = {}
        self._last_plan: list[Request] = []

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def ids(self) -> list[str]:
        return [r.request_id for r in self.running] + [r.request_id for r in self.waiting]

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"waiting queue full ({self.max_queue} requests)")
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        if self._find(request.request_id) is not None:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _finish(self, request: Request) -> None:
        """Leave the running/waiting sets and free the state at once (exactly once)."""
        request.status = RequestStatus.FINISHED
        # Identity, not ==: Request is a dataclass whose == compares whole prompts.
        self.running = [r for r in self.running if r is not request]
        if any(r is request for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r is not request)
        handle = self.handles.pop(request.request_id, None)
        if handle is not None:
            self.admission.release(handle)

    def _find(self, request_id: str) -> Request | None:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            if r.request_id == request_id:
                return r
        return None

    def abort(self, request_id: str) -> TokenEvent | None:
        """Drop a waiting or running request; None if it is unknown or already finished."""
        request = self._find(request_id)
        if request is None:
            return None
        self._finish(request)
        return TokenEvent(request_id, finish_reason=FinishReason.ABORT)

    def fail(self, request_ids: Iterable[str], error: str) -> list[TokenEvent]:
        """End requests with an error event (a failed step); their state is freed."""
        events = []
        for rid in request_ids:
            request = self._find(rid)
            if request is not None:
                self._finish(request)
                events.append(TokenEvent(rid, error=error))
        return events

    # -- one step ----------------------------------------------------------------------------
    def plan(self) -> list[Request]:
        """Admit waiting requests FIFO, then pick the running requests to feed this step."""
        # Strict FIFO: if the head does not fit, nobody behind it jumps the queue (no starvation).
        while self.waiting and len(self.running) < self.max_rows:
            head = self.waiting[0]
            n = reserve_tokens(head)
            if not self.admission.can_admit(n):
                break
            self.handles[head.request_id] = self.admission.admit(n)
            self.waiting.popleft()
            head.status = RequestStatus.RUNNING
            self.running.append(head)
        plan: list[Request] = []
        prefilling = 0
        for r in self.running:
            if r.fed < len(r.prompt_ids) - 1:  # a pure prefill row: its logits are not sampled
                if self.max_prefill_rows is not None and prefilling >= self.max_prefill_rows:
                    continue
                prefilling += 1
            plan.append(r)
        self._last_plan = plan
        return plan

    def resume(self, rows: list[Request]) -> list[Request]:
        """The plan of a step queued ahead for `rows` (running ones, batch order): no admission."""
        self._last_plan = list(rows)
        return self._last_plan

    def will_continue(self, r: Request) -> bool:
        """Will `r` be fed again after this step's token, whatever it is? Not if the token reaches a length
        limit; EOS / stop ids are not known before it is read back (a step queued ahead for a row that
        stops is wasted, not wrong: its state is freed)."""
        return not self._at_length(r, ahead=1)

    def prefill_work(self, plan: list[Request], budget: int) -> list[tuple[Request, Any, list[int], int]]:
        """(request, handle, prompt tokens, start position) to prefill before this step, at most `budget`
        tokens in all; a prompt's last token is left for the step (its logits are sampled)."""
        work = []
        for r in plan:
            n = min(budget, len(r.prompt_ids) - 1 - r.fed)
            if n > 0:
                work.append((r, self.handles[r.request_id], r.prompt_ids[r.fed : r.fed + n], r.fed))
                budget -= n
        return work

    def prefilled(self, request: Request, n: int) -> None:
        """`n` prompt tokens of `request` were fed by a parallel prefill."""
        request.fed += n

    def feeds(self, plan: list[Request]) -> list[tuple[Any, int, int]]:
        """(handle, token_id, position) per planned request, in plan order."""
        out = []
        for r in plan:
            token = r.prompt_ids[r.fed] if r.fed < len(r.prompt_ids) else r.output_ids[-1]
            out.append((self.handles[r.request_id], token, r.fed))
        return out

    def on_step(self, sampled: dict[str, Sampled]) -> list[TokenEvent]:
        """Account the last plan's step; `sampled` holds the rows whose logits were sampled."""
        events: list[TokenEvent] = []
        for r in self._last_plan:
            if r.status is not RequestStatus.RUNNING:
                continue  # aborted or failed in the meantime
            r.fed += 1
            if r.request_id not in sampled:
                continue
            token, logprob, top = sampled[r.request_id]
            reason = self._stop_reason(r, token)
            if reason is FinishReason.STOP:
                # The stop/EOS token ends the stream without being emitted as text.
                events.append(TokenEvent(r.request_id, finish_reason=FinishReason.STOP))
                self._finish(r)
                continue
            r.output_ids.append(token)
            events.append(TokenEvent(r.request_id, token, logprob, top))
            if self._at_length(r):
                events.append(TokenEvent(r.request_id, finish_reason=FinishReason.LENGTH))
                self._finish(r)
        self._last_plan = []
        return events

    def _stop_reason(self, r: Request, token: int) -> FinishReason | None:
        p = r.params
        if len(r.output_ids) < p.min_tokens:  # stop tokens don't count before min_tokens
            return None
        if not p.ignore_eos and token == self.eos_token_id:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        return None

    def _at_length(self, r: Request, ahead: int = 0) -> bool:
        # The context limit: the newest token could not be fed at position total_len - 1. `ahead`: with
        # that many more tokens.
        n = len(r.output_ids) + ahead
        return n >= r.params.max_tokens or r.total_len + ahead >= self.max_model_len
