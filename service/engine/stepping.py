"""One iteration of the engine thread: plan (admission), the planned prompts' parallel prefill, then
the batched decode step and the sampling of the rows that need a token. A failure ends only the
requests it touched (admission: the head it admitted; a prefill: its request; a step: its rows);
everyone else keeps going.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsv4_serve.service.engine.prefilling import InFlight, advance, prefill
from dsv4_serve.service.engine.request import Request, RequestStatus, SamplingParams, TokenEvent
from dsv4_serve.service.engine.scheduler import Scheduler, needs_sample

if TYPE_CHECKING:
    import mlx.core as mx

    from dsv4_serve.service.engine.engine import Engine
    from dsv4_serve.service.engine.sampler import Pending

log = logging.getLogger(__name__)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


@dataclass
class Ahead:
    """A decode step already queued for `rows` (batch order), fed the tokens sampled for them in the step
    before while those were still on the device; its logits are not read yet. It is the rows' next
    step whatever happens (their state has moved on): the next iteration samples it, no admission
    in between. `since`: when the step before it was read back (a pipelined step's time runs from there).
    Unverified on CUDA: MLX holds each node's inputs until its graph chunk has run (eval.cpp's
    add_temporary), so a pool that step N's last, still-running kernels read may be copied, not updated
    in place, by step N + 1 (tests/service/test_pipeline.py's in-place test checks it where it runs)."""

    rows: list[Request]
    logits: mx.array
    since: float


def can_pipeline(engine: Engine, sched: Scheduler, plan: list[Request], held: int = 0) -> bool:
    """Queue the next step before reading this one back? Only in pure decode (every running row samples,
    all of them in the plan, none its first token: a first token goes out before the host builds
    another step, or the time to first token grows by that build), and while nobody waiting could be
    admitted at the next plan (a step ahead fixes the next batch): nobody waits, or every row is taken
    and none reaches a length limit now. A row that stops on EOS / a stop id delays the head's
    admission by one step. `held`: running rows left out of the plan by a prefill forward in flight (its
    next slice is built in the iteration that reads the step queued ahead)."""
    if not ((getattr(engine, "pipeline_decode", False) or getattr(engine, "pipeline_host", False))
            and len(plan) + held == sched.num_running
            and all(needs_sample(r) and r.output_ids for r in plan)):  # fmt: skip
        return False
    return not sched.num_waiting or (sched.num_running >= sched.max_rows and all(map(sched.will_continue, plan)))


def queue_host(engine: Engine, sched: Scheduler, plan: list[Request], sampled: dict[str, Any],
               ) -> tuple[Ahead | None, tuple[list[Request], Exception] | None]:  # fmt: skip
    """pipeline_host: the rows' next step, fed the tokens just read back, left running while the host publishes
    this step's (the same rows as the device form: those that continue, a stop token fed as there); (the step
    queued, or the rows it failed with the error)."""
    rows = [r for r in plan if sched.will_continue(r)]
    if not rows:
        return None, None
    try:
        feeds = [(sched.handles[r.request_id], int(sampled[r.request_id][0]), r.fed + 1) for r in rows]
        return Ahead(rows, engine.step(feeds, wait=False), 0.0), None
    except Exception as e:  # noqa: BLE001 - those rows fail after this step's tokens
        log.exception("engine step (queued ahead) failed (%d rows)", len(rows))
        return None, (rows, e)


def decode_step(engine: Engine, sched: Scheduler, plan: list[Request], sample: Callable[..., Pending],
                ahead: tuple[mx.array, float] | None = None, pipeline: bool = False, held: int = 0,
                ) -> tuple[list[TokenEvent], int, float | None, Ahead | None]:  # fmt: skip
    """The batched step for `plan` (or `ahead`: its logits, already queued, and `since`) and its sampling;
    (events, tokens sampled, step seconds or None if the step failed, the next step if one was queued
    ahead). `sample` is sampler.sample_lazy."""
    import mlx.core as mx

    from dsv4_serve.kernels.upload import upload
    from dsv4_serve.service.engine.prompt_logprobs import score_lazy

    t0 = ahead[1] if ahead is not None else time.perf_counter()
    host = getattr(engine, "host_seconds", None)  # Engine.host_seconds: this adds "sample" and "wait"
    nxt: Ahead | None = None
    spec_failed: tuple[list[Request], Exception] | None = None
    try:
        logits = engine.step(sched.feeds(plan)) if ahead is None else ahead[0]
        settle = getattr(engine, "settle", None)
        if settle is not None:  # a replayed step queued ahead (pipeline_host) has run before MLX reads its logits
            settle()
        # Queue the next step ahead (before this one is read back on the device's tokens, or right after on the host's)?
        ahead_next = pipeline and can_pipeline(engine, sched, plan, held)
        idx = [i for i, r in enumerate(plan) if needs_sample(r)]
        sampled = {}
        # A prompt token fed through the step (not the parallel prefill) of a row that scores its prompt.
        scoring = [i for i, r in enumerate(plan) if r.params.prompt_logprobs is not None and not needs_sample(r)]
        prompt_lps = [(plan[i], score_lazy(logits[i : i + 1], [plan[i].prompt_ids[plan[i].fed + 1]],
                                           plan[i].params.prompt_logprobs or 0)) for i in scoring]  # fmt: skip
        if idx:
            rows = logits if len(idx) == len(plan) else logits[upload(idx)]
            reqs = [plan[i] for i in idx]
            guides = getattr(engine, "guides", None)  # grammar.Guides: set by the worker when it has a tokenizer
            masks = guides.masks(reqs) if guides is not None else None
            ts = time.perf_counter()
            pending = sample(
                rows,
                [r.params for r in reqs],
                [r.prompt_ids + r.output_ids if has_penalty(r.params) else [] for r in reqs],
                [len(r.output_ids) for r in reqs],
                eos_token_id=engine.eos_token_id,
                **({"masks": masks} if masks is not None else {}),
            )
            if host is not None:
                host["sample"] += time.perf_counter() - ts
            if ahead_next and getattr(engine, "pipeline_decode", False):
                keep = [i for i, r in enumerate(plan) if sched.will_continue(r)]
                if keep:
                    nrows = [plan[i] for i in keep]
                    tokens = pending.tokens if len(keep) == len(plan) else pending.tokens[upload(keep)]
                    try:
                        feeds = [(sched.handles[r.request_id], None, r.fed + 1) for r in nrows]
                        nxt = Ahead(nrows, engine.step(feeds, tokens=tokens), 0.0)
                    except Exception as e:  # noqa: BLE001 - those rows fail after this step's tokens
                        log.exception("engine step (queued ahead) failed (%d rows)", len(nrows))
                        spec_failed = nrows, e
            tw = time.perf_counter()
            res = pending.result()
            if host is not None:
                host["wait"] += time.perf_counter() - tw
            sampled = {r.request_id: x for r, x in zip(reqs, res, strict=True)}
        else:
            mx.eval(logits)  # a prefill-only step still has to run
        scored = [sched.scored(r, p.result()) for r, p in prompt_lps]
        if ahead_next and nxt is None and getattr(engine, "pipeline_host", False):
            nxt, spec_failed = queue_host(engine, sched, plan, sampled)
    except Exception as e:  # noqa: BLE001 - the step's rows fail, everyone else keeps going
        log.exception("engine step failed (%d rows)", len(plan))
        events = sched.fail([r.request_id for r in plan], f"engine step failed: {type(e).__name__}: {e}")
        return events + sched.on_step({}), 0, None, None
    now = time.perf_counter()
    ahead_ids = frozenset(r.request_id for r in nxt.rows) if nxt is not None else frozenset()
    events = scored + sched.on_step(sampled, ahead_ids)
    if nxt is not None:
        nxt.since = now
    if spec_failed is not None:
        rows_, e = spec_failed
        events += sched.fail([r.request_id for r in rows_], f"engine step failed: {type(e).__name__}: {e}")
    return events, len(sampled), now - t0, nxt


@dataclass
class Outcome:
    """What one iteration did: its events, the prefill work and the decode step (rows 0: none ran)."""

    events: list[TokenEvent]
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prompt_steps: int = 0  # prompt tokens fed through the decode step (each prefilling row's next one)
    rows: int = 0
    sampled: int = 0
    seconds: float = 0.0
    ahead: bool = False  # its step had been queued before the previous one was read back


def held(inflight: InFlight | None) -> int:
    """Running rows whose prompt the forward in flight holds (they sit the steps out)."""
    return 0 if inflight is None else sum(p[0].status is RequestStatus.RUNNING for p in inflight.pieces)


def iterate(engine: Engine, sched: Scheduler, sample: Callable[..., Pending], budget: int,
            admitted: Callable[[], None], ahead: Ahead | None = None, pipeline: bool = False,
            inflight: InFlight | None = None, slice_seconds: float | None = None, rows_layers: int | None = None,
            whole_rows: int = 0) -> tuple[Outcome, Ahead | None, InFlight | None]:  # fmt: skip
    """plan -> prefill (`budget` prompt tokens; or the next slice of the forward `inflight`) -> step + sample
    -> on_step; with `ahead`, its step instead (no admission this time). `admitted()` runs right after
    admission (the worker publishes the new queue counts). Returns the outcome, the step queued ahead, if
    any (`pipeline`), and the prefill forward still in flight, if any (built `slice_seconds` at a time
    while other rows stream, at most `rows_layers` rows x layers if given, unless its prompt tokens are at most
    `whole_rows`: prefilling.py, pacing.py)."""
    live = [i for i, r in enumerate(ahead.rows) if r.status is RequestStatus.RUNNING] if ahead is not None else []
    if ahead is not None and live:  # else every row of it was aborted: nothing to read, plan as usual
        from dsv4_serve.kernels.upload import upload

        plan = sched.resume([ahead.rows[i] for i in live])  # rows aborted since it was queued drop out
        logits = ahead.logits if len(live) == len(ahead.rows) else ahead.logits[upload(live)]
        out = Outcome([], ahead=True)
        if inflight is not None:  # the next slice, queued behind the step ahead (its rows are not in it)
            out.events, out.prefill_tokens, out.prefill_seconds, inflight = advance(
                engine, sched, inflight, plan, slice_seconds, rows_layers)  # fmt: skip
        step_events, sampled, dt, nxt = decode_step(engine, sched, plan, sample, (logits, ahead.since), pipeline,
                                                    held(inflight))  # fmt: skip
        out.events += step_events + end_slow_guides(engine, sched)
        if dt is not None:
            out.rows, out.sampled, out.seconds = len(plan), sampled, dt
        return out, nxt, inflight
    try:
        plan = sched.plan()
    except Exception as e:  # noqa: BLE001 - admission failed: the head it was admitting fails
        log.exception("admission failed")
        head = [sched.waiting[0].request_id] if sched.waiting else []
        return Outcome(sched.fail(head, f"admission failed: {e}")), None, inflight
    admitted()
    if not plan and inflight is None:
        if sched.num_waiting and not sched.num_running:  # the head can't fit even alone
            head = sched.waiting[0].request_id
            return Outcome(sched.fail([head], "request cannot be admitted: not enough free decode state")), None, None
        return Outcome([]), None, None
    if inflight is not None:
        events, n_pre, t_pre, inflight = advance(engine, sched, inflight, plan, slice_seconds, rows_layers)
    else:
        events, n_pre, t_pre, inflight = prefill(engine, sched, plan, budget, slice_seconds, rows_layers, whole_rows)
    out = Outcome(events, n_pre, t_pre)
    # The rows of a forward still in flight sit this step out (their prompt is not fed yet).
    plan = sched.resume([r for r in plan if r.status is RequestStatus.RUNNING
                         and (inflight is None or not inflight.holds(r))])  # fmt: skip
    plan, ev = sched.finish_scored(plan)
    out.events += ev
    if any(r.followers for r in plan):
        plan, ev = sched.fork(plan, engine.copy_state)
        out.events += ev
    if not plan:
        out.events += sched.on_step({})
        return out, None, inflight
    prompt_steps = sum(r.fed < len(r.prompt_ids) for r in plan)
    if getattr(engine, "speculator", None) is not None:  # a verify step instead (speculation.py), never ahead
        from dsv4_serve.service.engine.speculation import spec_step

        step_events, sampled, dt, nxt = spec_step(engine, sched, plan)
    else:
        step_events, sampled, dt, nxt = decode_step(engine, sched, plan, sample, None, pipeline, held(inflight))
    out.events += step_events + end_slow_guides(engine, sched)
    if dt is not None:  # None: the step failed and its rows were failed
        out.rows, out.sampled, out.seconds, out.prompt_steps = len(plan), sampled, dt, prompt_steps
    return out, nxt, inflight


def end_slow_guides(engine: Engine, sched: Scheduler) -> list[TokenEvent]:
    """End the guided rows whose masks went over their budget too often (grammar.Guides.over_budget): an
    error naming the field that asked for the grammar; the batch's other rows go on."""
    guides = getattr(engine, "guides", None)
    events: list[TokenEvent] = []
    for r, msg in guides.over_budget() if guides is not None else ():
        log.warning("request %s ended: %s", r.request_id, msg)
        events += sched.fail([r.request_id], msg, param=r.params.guide.source if r.params.guide else None)
    return events


@dataclass
class Counters:
    """The worker's queue and step accounting (read by `stats()`, `/metrics`, admission); both threads
    touch it under the worker's lock."""

    undrained: int = 0  # submitted, not yet taken from the inbox
    waiting: int = 0  # in the scheduler's queue
    running: int = 0
    last_rows: int = 0
    steps: int = 0
    steps_ahead: int = 0  # steps queued before the previous one was read back (pipelined decode)
    tokens: int = 0
    step_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens fed by the parallel prefill
    prefill_seconds: float = 0.0
    loop_seconds: float = 0.0  # the engine thread's iterations (step, prefill, events), idle waits apart
    prompt_computed: int = 0  # prompt tokens run through the model (prefill + decode step): not from a cache
    rows_hist: list[int] = field(default_factory=lambda: [0] * 9)  # index = rows in a step

    def record(self, out: Outcome) -> None:
        self.prefill_tokens += out.prefill_tokens
        self.prefill_seconds += out.prefill_seconds
        self.prompt_computed += out.prefill_tokens + out.prompt_steps
        if out.rows:
            self.steps += 1
            self.steps_ahead += out.ahead
            self.last_rows = out.rows
            self.rows_hist[min(out.rows, 8)] += 1
            self.tokens += out.sampled
            self.step_seconds += out.seconds

    def snapshot(self, ready: bool) -> dict[str, Any]:
        return {
            "ready": ready,
            "waiting": self.undrained + self.waiting,
            "running": self.running,
            "last_step_rows": self.last_rows,
            "steps_total": self.steps,
            "steps_ahead_total": self.steps_ahead,
            "tokens_total": self.tokens,
            "step_seconds_total": self.step_seconds,
            "prefill_tokens_total": self.prefill_tokens,
            "prefill_seconds_total": self.prefill_seconds,
            "engine_loop_seconds_total": self.loop_seconds,
            "prompt_tokens_computed_total": self.prompt_computed,
            "rows_per_step": list(self.rows_hist),  # rows_per_step[r] = steps with r rows
        }
