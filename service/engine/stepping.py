"""One iteration of the engine thread after planning: the planned prompts' parallel prefill, then
the batched decode step and the sampling of the rows that need a token. A failure ends only the
requests it touched (a prefill: its request; a step: its rows); everyone else keeps going.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from service.engine.request import Request, SamplingParams, TokenEvent
from service.engine.scheduler import Scheduler, needs_sample

log = logging.getLogger(__name__)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def prefill(engine: Any, sched: Scheduler, plan: list[Request],
            budget: int) -> tuple[list[TokenEvent], int, float]:  # fmt: skip
    """Parallel prefill of the planned prompts, `budget` tokens in all, oldest request first;
    (events, tokens prefilled, seconds)."""
    events: list[TokenEvent] = []
    done, t0 = 0, time.perf_counter()
    for r, handle, tokens, start in sched.prefill_work(plan, budget):
        try:
            engine.prefill(handle, tokens, start)
        except Exception as e:  # noqa: BLE001 - this request fails, the others keep going
            log.exception("prefill failed (%d tokens)", len(tokens))
            events += sched.fail([r.request_id], f"prefill failed: {type(e).__name__}: {e}")
            continue
        sched.prefilled(r, len(tokens))
        done += len(tokens)
    return events, done, time.perf_counter() - t0 if done else 0.0


def decode_step(engine: Any, sched: Scheduler, plan: list[Request],
                sample: Callable[..., Any]) -> tuple[list[TokenEvent], int, float | None]:  # fmt: skip
    """The batched step for `plan` and its sampling; (events, tokens sampled, step seconds or None
    if the step failed)."""
    import mlx.core as mx

    t0 = time.perf_counter()
    try:
        logits = engine.step(sched.feeds(plan))
        idx = [i for i, r in enumerate(plan) if needs_sample(r)]
        sampled = {}
        if idx:
            rows = logits if len(idx) == len(plan) else logits[mx.array(idx)]
            reqs = [plan[i] for i in idx]
            res = sample(
                rows,
                [r.params for r in reqs],
                [r.prompt_ids + r.output_ids if has_penalty(r.params) else [] for r in reqs],
                [len(r.output_ids) for r in reqs],
                eos_token_id=engine.eos_token_id,
            )
            sampled = {r.request_id: x for r, x in zip(reqs, res, strict=True)}
        else:
            mx.eval(logits)  # a prefill-only step still has to run
    except Exception as e:  # noqa: BLE001 - the step's rows fail, everyone else keeps going
        log.exception("engine step failed (%d rows)", len(plan))
        events = sched.fail([r.request_id for r in plan], f"engine step failed: {type(e).__name__}: {e}")
        return events + sched.on_step({}), 0, None
    dt = time.perf_counter() - t0
    return sched.on_step(sampled), len(sampled), dt
