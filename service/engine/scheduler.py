"""Admission and per-step planning for the engine thread: pure Python, no mlx.

Each step every planned request feeds exactly one token through the batched decode step: its next
prompt token while prefilling, else its last generated token, at position `request.fed`. Logits
are sampled only for rows whose fed token is the last prompt token or a generated one
(`needs_sample`). Before the step, `prefill_work` hands out prompt tokens (all but the last) for
the engine's parallel prefill, up to a per-step token budget, oldest request first.

With an engine that has a prefix cache (the optional `reuse` / `retire` / `snapshot_interval` of
Admission), a prefilling request first adopts the longest cached prefix of its prompt (`reuse_prefix`),
a prefill piece that is not the prompt's last ends at a multiple of the snapshot interval (the
snapshot after it then lies on the interval's grid), and a request that ends normally hands the
state of the tokens it fed to the cache (`retire`) instead of just freeing it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from dsv4_serve.service.engine.prompt_plan import PromptPlanning
from dsv4_serve.service.engine.request import FinishReason, PromptLogprob, Request, RequestStatus, TokenEvent

if TYPE_CHECKING:
    from dsv4_serve.model.state import StateHandle

# (token_id, logprob or None, top alternatives) for one row, as sampler.sample returns it.
Sampled = tuple[int, float | None, tuple[tuple[int, float], ...]]


class QueueFull(Exception):
    """The waiting queue is full; the API answers 429."""


class Admission(Protocol):
    """The slice of Engine the scheduler needs (Engine itself satisfies it)."""

    def can_admit(self, n_tokens: int) -> bool: ...
    def admit(self, n_tokens: int) -> StateHandle: ...
    def release(self, handle: StateHandle) -> None: ...
    # Optional (a prefix cache; service/engine/engine.py): prefix_enabled, snapshot_interval,
    # prefix_version(), reuse(handle, prompt_ids, fed, namespace), retire(handle, tokens, request_id, namespace),
    # prefilled(handle, prompt_ids, fed, namespace): the request's namespace (tenant, cache_salt) scopes the cache.


def reserve_tokens(request: Request) -> int:
    """Positions a request may reach: what admission reserves state for."""
    return len(request.prompt_ids) + request.params.max_tokens


def needs_sample(request: Request) -> bool:
    """True when this step's fed token is the last prompt token or a generated token."""
    return request.fed + 1 >= len(request.prompt_ids)


class Scheduler(PromptPlanning):
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
        self.handles: dict[str, StateHandle] = {}
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
        group = [request, *request.followers]
        if len(group) > self.max_rows:
            raise ValueError(f"n = {len(group)} rows exceed max_rows {self.max_rows}")
        for r in group:
            if self._find(r.request_id) is not None:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            r.status = RequestStatus.WAITING
        for f in request.followers:
            f.leader = request
        self.waiting.append(request)

    def _finish(self, request: Request, fed: list[int] | None = None) -> list[Request]:
        """Leave the running/waiting sets and free the state at once (exactly once). Returns the followers
        that had not forked yet (they end with their leader; the caller gives them their events). `fed`:
        the tokens whose state the request's slot holds, when it ended normally (the prefix cache keeps it)."""
        orphans = [f for f in request.followers if f.status is not RequestStatus.FINISHED]
        request.followers = []
        if request.leader is not None:
            request.leader.followers = [f for f in request.leader.followers if f is not request]
            request.leader = None
        for f in orphans:
            f.leader = None
            self._finish(f)
        request.status = RequestStatus.FINISHED
        # Identity, not ==: Request is a dataclass whose == compares whole prompts.
        self.running = [r for r in self.running if r is not request]
        if any(r is request for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r is not request)
        handle = self.handles.pop(request.request_id, None)
        retire = getattr(self.admission, "retire", None)
        if handle is not None and fed and retire is not None and not request.canary:
            retire(handle, fed, request.request_id, request.namespace)
        elif handle is not None:
            self.admission.release(handle)
        return orphans

    def _find(self, request_id: str) -> Request | None:
        for r in self.running:
            if r.request_id == request_id:
                return r
        for r in self.waiting:
            for x in (r, *r.followers):
                if x.request_id == request_id:
                    return x
        return None

    def abort(self, request_id: str) -> TokenEvent | None:
        """Drop a waiting or running request; None if it is unknown or already finished."""
        events = self.abort_group(request_id)
        return events[0] if events else None

    def abort_group(self, request_id: str) -> list[TokenEvent]:
        """`abort`, and the ABORT events of the followers that end with it (n > 1, before the fork)."""
        request = self._find(request_id)
        if request is None:
            return []
        return [TokenEvent(r.request_id, finish_reason=FinishReason.ABORT) for r in (request, *self._finish(request))]

    def fail(self, request_ids: Iterable[str], error: str, param: str | None = None) -> list[TokenEvent]:
        """End requests with an error event (a failed step; `param`: the request's own field caused it); their
        state is freed, and so is that of their followers not forked yet."""
        events = []
        for rid in request_ids:
            request = self._find(rid)
            if request is not None:
                events += [TokenEvent(r.request_id, error=error, error_param=param)
                           for r in (request, *self._finish(request))]  # fmt: skip
        return events

    # -- one step ----------------------------------------------------------------------------
    def plan(self) -> list[Request]:
        """Admit waiting requests FIFO, then pick the running requests to feed this step."""
        # Strict FIFO: if the head does not fit, nobody behind it jumps the queue (no starvation).
        while self.waiting and self._admit_group(self.waiting[0]):
            self.waiting.popleft()
        plan: list[Request] = []
        prefilling = 0
        for r in self.running:
            if r.leader is not None:  # n > 1: waits for its leader's prompt (`fork`)
                continue
            if r.fed < len(r.prompt_ids) - 1:  # a pure prefill row: its logits are not sampled
                if self.max_prefill_rows is not None and prefilling >= self.max_prefill_rows:
                    continue
                prefilling += 1
            plan.append(r)
        self._last_plan = plan
        return plan

    def _admit_group(self, head: Request) -> bool:
        """Admit the head and its followers, all or none (they share one prefill)."""
        group = [head, *head.followers]
        if len(self.running) + len(group) > self.max_rows:
            return False
        handles = []
        for r in group:
            n = reserve_tokens(r)
            if not self.admission.can_admit(n):
                for h in handles:
                    self.admission.release(h)
                return False
            handles.append(self.admission.admit(n))
        now = time.perf_counter()
        for r, h in zip(group, handles, strict=True):
            self.handles[r.request_id] = h
            r.status = RequestStatus.RUNNING
            r.admitted = now
            if getattr(self.admission, "prefix_enabled", False):
                r.cached = 0
            self.running.append(r)
        return True

    def fork(self, plan: list[Request], copy: Callable[[StateHandle, StateHandle, int], None],
             ) -> tuple[list[Request], list[TokenEvent]]:  # fmt: skip
        """n > 1: a planned leader whose prompt is fed but for its last token gives each follower a copy of its
        state (`copy(src_handle, dst_handle, positions)`); they join this step's plan (they feed the last
        prompt token beside it) and get the prompt logprobs scored so far. (plan, events)"""
        out, events = list(plan), []
        for r in plan:
            if not r.followers or r.fed + 1 < len(r.prompt_ids) or r.status is not RequestStatus.RUNNING:
                continue
            followers, r.followers = r.followers, []
            try:
                for f in followers:
                    copy(self.handles[r.request_id], self.handles[f.request_id], r.fed)
            except Exception as e:  # noqa: BLE001 - the group fails, everyone else keeps going
                r.followers = followers
                events += self.fail([r.request_id], f"state copy failed: {type(e).__name__}: {e}")
                out = [x for x in out if x is not r]
                continue
            for f in followers:
                f.leader, f.fed, f.cached, f.prefilled_at = None, r.fed, r.cached, time.perf_counter()
                if r.scored:
                    events.append(TokenEvent(f.request_id, prompt_logprobs=tuple(r.scored)))
                out.append(f)
            r.scored = []
        self._last_plan = out
        return out, events

    def scored(self, request: Request, entries: list[PromptLogprob]) -> TokenEvent:
        """Prompt logprobs for `request`'s next prompt positions (kept for its followers, if any)."""
        if request.followers:
            request.scored += entries
        return TokenEvent(request.request_id, prompt_logprobs=tuple(entries))

    def finish_scored(self, plan: list[Request]) -> tuple[list[Request], list[TokenEvent]]:
        """max_tokens = 0 (the prompt's logprobs only): a request whose prompt is fed but for its last token
        ends here (that token would only score a completion). (the plan without them, events)"""
        done = [r for r in plan if r.params.max_tokens == 0 and r.fed + 1 >= len(r.prompt_ids)]
        events = []
        for r in done:
            events.append(TokenEvent(r.request_id, finish_reason=FinishReason.LENGTH))
            self._finish(r)
        if done:
            plan = [r for r in plan if r.status is RequestStatus.RUNNING]
            self._last_plan = plan
        return plan, events

    def resume(self, rows: list[Request]) -> list[Request]:
        """The plan of a step for exactly `rows` (running ones, batch order), no admission: a step queued
        ahead, or the plan less the rows whose prompt a prefill forward in flight holds. A row about to sample
        its first token has its prompt fed: its `prefilled_at` stamp (the time to first token's split)."""
        now = 0.0
        for r in rows:
            if not r.prefilled_at and not r.output_ids and needs_sample(r):
                r.prefilled_at = now = now or time.perf_counter()
        self._last_plan = list(rows)
        return self._last_plan

    def will_continue(self, r: Request) -> bool:
        """Will `r` be fed again after this step's token, whatever it is? Not if the token reaches a length
        limit; EOS / stop ids are not known before it is read back (a step queued ahead for a row that
        stops is wasted, not wrong: its state is freed)."""
        return not self._at_length(r, ahead=1)

    def feeds(self, plan: list[Request]) -> list[tuple[StateHandle, int, int]]:
        """(handle, token_id, position) per planned request, in plan order."""
        out = []
        for r in plan:
            token = r.prompt_ids[r.fed] if r.fed < len(r.prompt_ids) else r.output_ids[-1]
            out.append((self.handles[r.request_id], token, r.fed))
        return out

    def on_step(self, sampled: dict[str, Sampled], ahead: frozenset[str] = frozenset()) -> list[TokenEvent]:
        """Account the last plan's step; `sampled` holds the rows whose logits were sampled; `ahead`: the
        rows of a step already queued (fed the token sampled now)."""
        events: list[TokenEvent] = []
        now = 0.0
        for r in self._last_plan:
            if r.status is not RequestStatus.RUNNING:
                continue  # aborted or failed in the meantime
            r.fed += 1
            if r.request_id not in sampled:
                continue
            token, logprob, top = sampled[r.request_id]
            first = None
            if not r.output_ids:  # the first generated token: its way there, for the time to first token's split
                first = r.first_token(now := now or time.perf_counter())
            reason = self._stop_reason(r, token)
            fed = (r.prompt_ids + r.output_ids)[: r.fed]
            if reason is FinishReason.STOP:
                # The stop/EOS token ends the stream without being emitted as text (a step queued ahead fed it).
                events.append(TokenEvent(r.request_id, None, logprob, top, FinishReason.STOP, stop_token=token,
                                         cached_tokens=r.cached, first=first))  # fmt: skip
                self._finish(r, fed + [token] if r.request_id in ahead else fed)
                continue
            r.output_ids.append(token)
            events.append(TokenEvent(r.request_id, token, logprob, top, cached_tokens=r.cached, first=first))
            if self._at_length(r):
                events.append(TokenEvent(r.request_id, finish_reason=FinishReason.LENGTH, cached_tokens=r.cached))
                self._finish(r, fed)
        self._last_plan = []
        return events

    def takes(self, r: Request, tokens: list[int]) -> tuple[int, bool]:
        """How many of `tokens`, generated one after another, `on_step` would take (one a call) before `r` ends,
        and whether it ends with the last of those (speculative decoding keeps the state of those only)."""
        for i, t in enumerate(tokens):
            if self._stop_reason(r, t, ahead=i) is not None or self._at_length(r, ahead=i + 1):
                return i + 1, True
        return len(tokens), False

    def _stop_reason(self, r: Request, token: int, ahead: int = 0) -> FinishReason | None:
        p = r.params
        if len(r.output_ids) + ahead < p.min_tokens:  # stop tokens don't count before min_tokens
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
