"""The engine thread's prompt work before each decode step: the planned prompts' parallel prefill, whole or
a slice of layers at a time.

With decode rows streaming, a forward is built in slices (`Engine.prefill_batch(slice_seconds=)`) and one
decode step of the other rows runs after each slice: a stream waits a slice, not a whole forward (on the
H200 a 2,048-token V4-Flash forward is ~0.33 s against a ~20 ms step). Its requests sit out the decode
steps until the forward is built (`InFlight`); no other prefill starts meanwhile. With no stream to keep
going, or a forward of at most `--prefill-whole-tokens` (256) prompt tokens, the forward is built whole: sliced,
a short forward kept its requests' first tokens 300-700 ms late beside 8 streams for a gap of ~90-150 ms it
spared them (H100, 2026-12-07: docs/performance.md), as vLLM's chunked prefill would run it in one step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsv4_serve.service.engine.prompt_plan import Piece
from dsv4_serve.service.engine.request import Request, RequestStatus, TokenEvent
from dsv4_serve.service.engine.scheduler import Scheduler, needs_sample

if TYPE_CHECKING:
    from dsv4_serve.service.engine.engine import Engine, Handle

log = logging.getLogger(__name__)



@dataclass
class InFlight:
    """A prefill forward the engine is building a slice at a time: its pieces and the host seconds so far."""

    pieces: list[Piece]
    seconds: float = 0.0

    def holds(self, r: Request) -> bool:
        return any(p[0] is r for p in self.pieces)


def _finished(engine: Engine, sched: Scheduler, r: Request, handle: Handle, n: int) -> None:
    """`n` prompt tokens of `r` are fed; a prefix cache snapshot of its state follows."""
    sched.prefilled(r, n)
    snapshot = None if r.canary else getattr(engine, "prefilled", None)  # the canary leaves the cache alone
    if snapshot is not None:
        try:
            snapshot(handle, r.prompt_ids, r.fed, r.namespace)
        except Exception:  # noqa: BLE001 - a snapshot is an optimization: the request goes on
            log.exception("prefix snapshot failed")


def _scores(pieces: list[Piece]) -> list[tuple[int, list[int]] | None]:
    """What `engine.prefill_batch` scores of each piece: (k, the prompt token after each of its tokens) for a
    request asking for prompt logprobs, else None."""
    return [None if r.params.prompt_logprobs is None else (r.params.prompt_logprobs,
            r.prompt_ids[start + 1 : start + 1 + len(tokens)]) for r, _, tokens, start in pieces]  # fmt: skip


def _built(engine: Engine, sched: Scheduler, pieces: list[Piece]) -> tuple[list[TokenEvent], int]:
    """The forward of `pieces` is built: its prompt logprobs (read back) and its requests' tokens accounted
    (those still running); (events, tokens fed)."""
    scored = [None] * len(pieces)
    if any(s is not None for s in _scores(pieces)):
        try:
            scored = engine.prefill_scores()
        except Exception as e:  # noqa: BLE001 - the forward failed: its requests fail, the others keep going
            return _fail(sched, [p for p in pieces if p[0].status is RequestStatus.RUNNING], e), 0
    events, done = [], 0
    for (r, handle, tokens, _), lps in zip(pieces, scored, strict=True):
        if r.status is RequestStatus.RUNNING:
            if lps is not None:
                events.append(sched.scored(r, lps))
            _finished(engine, sched, r, handle, len(tokens))
            done += len(tokens)
    return events, done


def _fail(sched: Scheduler, pieces: list[Piece], e: Exception) -> list[TokenEvent]:
    log.exception("prefill failed (%d requests, %d tokens)", len(pieces), sum(len(p[2]) for p in pieces))
    return sched.fail([p[0].request_id for p in pieces], f"prefill failed: {type(e).__name__}: {e}")


def prefill(engine: Engine, sched: Scheduler, plan: list[Request], budget: int, slice_seconds: float | None = None,
            rows_layers: int | None = None, whole_rows: int = 0,
            ) -> tuple[list[TokenEvent], int, float, InFlight | None]:  # fmt: skip
    """Parallel prefill of the planned prompts, `budget` tokens in all, oldest request first; (events,
    tokens prefilled, seconds, the forward left in flight or None). The prefix cache goes first (a hit
    moves `fed` on). The pieces (one a request; with a cache, a piece short of its prompt's end ends on
    the snapshot interval, and the state is snapshotted after it) go through one shared forward
    (`engine.prefill_batch`), in slices of `slice_seconds` (and `rows_layers`, if given) when another planned
    row samples this step and the pieces hold more than `whole_rows` tokens (a short forward is built whole: the
    streams wait for it once, where its slices held the new requests' first tokens back for many steps); a
    request asking for prompt logprobs has the head over every token of its piece at the forward's end.
    A failed forward fails the requests in it (their state is half-written); the decode rows go on."""
    events: list[TokenEvent] = []
    done, t0 = 0, time.perf_counter()
    for r in plan:
        try:
            sched.reuse_prefix(r)
        except Exception as e:  # noqa: BLE001 - this request fails, the others keep going
            log.exception("prefix reuse failed")
            events += sched.fail([r.request_id], f"prefix reuse failed: {type(e).__name__}: {e}")
    work = sched.prefill_work([r for r in plan if r.status is RequestStatus.RUNNING], budget)
    inflight = None
    if work:
        streams = any(needs_sample(r) for r in plan if not any(w[0] is r for w in work))
        rows = sum(len(tokens) for _, _, tokens, _ in work)
        sliced = streams and bool(slice_seconds) and getattr(engine, "sliced_prefill", False) and rows > whole_rows
        kw: dict[str, Any] = {"slice_seconds": slice_seconds} if sliced else {}
        if sliced and rows_layers:  # paced (pacing.py): the slice's rows x layers
            kw["rows_layers"] = rows_layers
        if any(r.params.prompt_logprobs is not None for r, *_ in work):
            kw["scores"] = _scores(work)
        if getattr(engine, "speculator", None) is not None:  # the MTP ring over the prompt (a piece never ends it)
            kw["next_ids"] = [r.prompt_ids[start + len(tokens)] for r, _, tokens, start in work]
        try:
            built = engine.prefill_batch([(handle, tokens, start) for _, handle, tokens, start in work], **kw)
        except Exception as e:  # noqa: BLE001 - these requests fail, the others keep going
            events += _fail(sched, work, e)
        else:
            if built is False:
                inflight = InFlight(work)
            else:
                ev, done = _built(engine, sched, work)
                events += ev
    dt = time.perf_counter() - t0
    if inflight is not None:
        inflight.seconds = dt
    return events, done, dt if done else 0.0, inflight


def advance(engine: Engine, sched: Scheduler, inflight: InFlight, plan: list[Request], slice_seconds: float | None,
            rows_layers: int | None = None) -> tuple[list[TokenEvent], int, float, InFlight | None]:  # fmt: skip
    """The next slice of the forward in flight (all of it if no row of `plan` outside it samples this step);
    (events, tokens prefilled, seconds, the forward if still in flight)."""
    t0 = time.perf_counter()
    streams = any(needs_sample(r) for r in plan if not inflight.holds(r))
    try:
        paced = (rows_layers,) if streams and rows_layers else ()  # pacing.py's cap, when it gives one
        built = engine.prefill_advance(slice_seconds if streams else None, *paced)
    except Exception as e:  # noqa: BLE001 - its requests fail, the others keep going
        engine.prefill_abandon()
        live = [p for p in inflight.pieces if p[0].status is RequestStatus.RUNNING]
        return _fail(sched, live, e), 0, 0.0, None
    inflight.seconds += time.perf_counter() - t0
    if not built:
        return [], 0, 0.0, inflight
    events, done = _built(engine, sched, inflight.pieces)
    return events, done, inflight.seconds, None
