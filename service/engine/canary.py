"""The correctness canary: a fixed prompt decoded at start-up through the plain path (one row, token by token) is
admitted again every `--canary-interval` seconds as an ordinary row, batched with live traffic through whatever
path serves (the parallel prefill, pipelined steps, speculation, CUDA kernels), and its greedy tokens and top-k
logprobs compared with the start-up ones: a wrong token with a 200 is otherwise invisible (docs/engine.md,
"The correctness canary"). Engine thread only; mlx is imported inside `reference` alone."""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsv4_serve.service.engine.request import FinishReason, Request, RequestStatus, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from dsv4_serve.service.engine.engine import Engine
    from dsv4_serve.service.engine.scheduler import Scheduler

log = logging.getLogger("dsv4.canary")

PROMPT_LEN = 32  # canary prompt ids
TOKENS = 16  # greedy tokens compared
TOP_K = 5  # logprob alternatives recorded a position
# Logprob tolerance (nats) by the model's dtype. f32: the CPU tests hold a row batched with 7 others and the
# parallel prefill to token-by-token decode within 1e-5 of the logits (tests/model/test_decode.py,
# test_prefill.py), logprobs over HTTP within 1e-4 (tests/e2e/test_prefix_cache.py); a log-softmax moves by at
# most twice its logits' error, so 1e-3 leaves 50x. bf16 / f16: the CUDA prefill and decode round in different
# places, agreeing within 5e-2 of the logits' scale (tests/model/test_cuda_prefill.py); 0.25 nats until a GPU
# run's dsv4_canary_max_logprob_diff says better.
TOLERANCE = {"float32": 1e-3}
TOLERANCE_LOW_PRECISION = 0.25
ACTIONS = ("fail", "warn")
RETRY_S = 0.1  # a due canary that found no room (pages the prefix cache holds): an idle engine looks again then


class CanaryMismatch(RuntimeError):
    """The canary's tokens or logprobs left the start-up reference: this engine may be serving wrong tokens."""


@dataclass(frozen=True)
class Decoded:
    """Greedy tokens, each one's logprob and its top-k alternatives (best first), as `TokenEvent`s carry them."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    tops: tuple[tuple[tuple[int, float], ...], ...]


def canary_prompt(vocab_size: int) -> list[int]:
    """PROMPT_LEN fixed ids spread over the vocabulary (Knuth's multiplicative hash of the position)."""
    return [(i * 2654435761 + 97) % vocab_size for i in range(PROMPT_LEN)]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP_K)


def tolerance_for(dtype: Any) -> float:
    name = str(dtype).rsplit(".", 1)[-1]
    return TOLERANCE.get(name, TOLERANCE_LOW_PRECISION)


def reference(engine: Engine, prompt: list[int]) -> Decoded:
    """The plain path: one row alone, every prompt token through the decode step one at a time, no prefix cache,
    no pipelining, no speculation; sampled by the serving sampler (greedy, TOP_K logprobs)."""
    import mlx.core as mx

    from dsv4_serve.service.engine.sampler import sample

    p = params()
    handle = engine.admit(len(prompt) + TOKENS)
    seq, out = list(prompt), []
    try:
        for pos in range(len(prompt) + TOKENS - 1):
            logits = engine.step([(handle, seq[pos], pos)])
            if pos + 1 < len(prompt):
                mx.eval(logits)
                continue
            ((token, lp, top),) = sample(logits, [p], [[]], [len(out)], eos_token_id=engine.eos_token_id)
            out.append((token, float(lp or 0.0), tuple(top)))
            seq.append(token)
    finally:
        engine.release(handle)
    return Decoded(*(tuple(x) for x in zip(*out, strict=True)))  # type: ignore[arg-type]


def _diff(a: float, b: float) -> float:
    d = abs(a - b)
    return d if not math.isnan(d) else math.inf


def compare(ref: Decoded, got: Decoded, tol: float) -> tuple[bool, float, int]:
    """(agrees, the largest logprob difference, positions compared). Ids must be equal, and at each position the
    token's logprob and the sorted top-k logprob values within `tol` (sorted values move by at most the largest
    elementwise difference, so near-tied alternatives trading places do not count). A different id where the
    reference's two best were within 2 * tol of each other is a tie each side may break: the comparison ends
    there (what follows continues another text)."""
    worst, n = 0.0, 0
    for i in range(min(len(ref.tokens), len(got.tokens))):
        r_top, g_top = ref.tops[i], got.tops[i]
        if ref.tokens[i] != got.tokens[i]:
            tied = len(r_top) > 1 and r_top[0][1] - r_top[1][1] < 2 * tol
            return tied and worst <= tol, worst, n
        worst = max(worst, _diff(ref.logprobs[i], got.logprobs[i]),
                    *(_diff(a, b) for (_, a), (_, b) in zip(r_top, g_top, strict=False)))  # fmt: skip
        if len(r_top) != len(g_top):
            worst = math.inf
        n += 1
    if len(got.tokens) != len(ref.tokens):
        worst = math.inf
    return worst <= tol, worst, n


def start(engine: Engine, interval: float, action: str) -> Canary | None:
    """The canary after warm-up (its reference decoded now), or None: off (interval 0), or its prompt and tokens
    can never fit this engine's state (logged)."""
    if interval <= 0:
        return None
    n = PROMPT_LEN + TOKENS
    fits = getattr(engine, "fits_ever", lambda _: True)
    if engine.vocab_size < 2 or engine.max_model_len < n or not fits(n):
        log.warning("canary off: its %d positions never fit this engine (max_model_len %d)", n, engine.max_model_len)
        return None
    return Canary(engine, interval, action)


class Canary:
    """The engine thread's canary: when it is due and a row is free, `offer` adds its request (admitted by the
    same iteration's plan); `take` pulls its events out of an iteration's before they are published, and
    compares once its TOKENS are in. Its request never touches the prefix cache (`Request.canary`)."""

    def __init__(self, engine: Engine, interval: float, action: str = "fail", tolerance: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if interval <= 0:
            raise ValueError(f"canary interval must be > 0 s, got {interval}")
        if action not in ACTIONS:
            raise ValueError(f"canary action must be one of {', '.join(ACTIONS)}, got {action!r}")
        self.interval, self.action, self.clock = interval, action, clock
        self.tolerance = tolerance if tolerance is not None else tolerance_for(engine.model.dtype)
        self.prompt = canary_prompt(engine.vocab_size)
        t0 = time.perf_counter()
        self.ref = reference(engine, self.prompt)
        margin = min(t[0][1] - t[1][1] for t in self.ref.tops)
        log.info("canary: %d prompt ids, %d greedy tokens %s in %.2f s; smallest top-2 margin %.4f, tolerance %g, "
                 "every %g s (%s)", PROMPT_LEN, TOKENS, list(self.ref.tokens), time.perf_counter() - t0, margin,
                 self.tolerance, interval, action)  # fmt: skip
        self.due = clock() + interval
        self.request: Request | None = None
        self.got: list[tuple[int, float, tuple[tuple[int, float], ...]]] = []
        self.checks = self.failures = 0
        self.last_diff = 0.0
        self.tripped = False  # `fail`: no more checks after a mismatch
        self.declined = False  # the last offer found no free row or pages: an idle thread looks again in RETRY_S
        self.error: str | None = None  # the last check's step error (its rows failed), if any

    def seconds_left(self) -> float | None:
        """How long an idle engine thread may block before the next check is due; None: no check is waiting."""
        if self.request is not None or self.tripped:
            return None
        return max(RETRY_S if self.declined else 0.0, self.due - self.clock())

    def offer(self, sched: Scheduler, engine: Engine) -> None:
        """Before an iteration's plan: add the canary's request if it is due, nobody waits, a row is free and its
        state fits free pages (a prefix cache entry is evicted for it only when it is an interval overdue); else it
        tries next time. A canary still waiting (a step queued ahead held admission) when a request arrives
        withdraws: it never waits before one."""
        r = self.request
        if r is not None and r.status is RequestStatus.WAITING and sched.num_waiting > 1:
            sched.abort(r.request_id)
            self.request = None
        if self.request is not None or self.tripped or self.clock() < self.due:
            return
        pools, n = getattr(engine, "pools", None), PROMPT_LEN + TOKENS
        # Free pages; or, an interval overdue, pages the prefix cache alone holds (LRU entries evicted, as for any
        # request): a cache that keeps every spare page must not starve the canary.
        overdue = self.clock() >= self.due + self.interval
        self.declined = (sched.num_waiting > 0 or sched.num_running >= sched.max_rows or pools is None
                         or not (pools.can_alloc(n) or (overdue and engine.can_admit(n))))  # fmt: skip
        if self.declined:
            return
        self.request = Request(f"canary-{uuid.uuid4().hex}", list(self.prompt), params(), canary=True)
        self.got, self.error = [], None
        sched.add(self.request)

    def rows(self) -> int:
        """Rows the canary holds now (1 or 0): left out of the requests' running count."""
        r = self.request
        return int(r is not None and r.status is RequestStatus.RUNNING)

    def cancel(self, sched: Scheduler) -> None:
        """Drop a check in progress (the engine is stopping); its abort event is taken by `take`."""
        if self.request is not None:
            sched.abort(self.request.request_id)
            self._next()

    def take(self, events: list[TokenEvent], sched: Scheduler) -> tuple[list[TokenEvent], CanaryMismatch | None]:
        """The iteration's events without the canary's; a CanaryMismatch when its check just failed."""
        r = self.request
        if r is None:
            return [e for e in events if not e.request_id.startswith("canary-")], None
        rest, mismatch = [], None
        for e in events:
            if e.request_id != r.request_id:
                if not e.request_id.startswith("canary-"):
                    rest.append(e)
                continue
            if e.token_id is not None:
                self.got.append((e.token_id, float(e.logprob or 0.0), tuple(e.top_logprobs)))
            if e.error is not None:
                log.warning("canary: the check's step failed (%s); the next one in %g s", e.error, self.interval)
                self.error = e.error
                self._next()
            elif e.finish_reason is FinishReason.ABORT:
                self._next()
            elif e.finish_reason is not None:
                mismatch = self._check()
                self._next()
        return rest, mismatch

    def _next(self) -> None:
        self.request, self.due = None, self.clock() + self.interval

    def _check(self) -> CanaryMismatch | None:
        got = Decoded(*(tuple(x) for x in zip(*self.got, strict=True))) if self.got else Decoded((), (), ())
        ok, worst, n = compare(self.ref, got, self.tolerance)
        self.checks += 1
        self.last_diff = worst
        if ok:
            log.debug("canary check %d: %d positions agree, max logprob diff %.2e", self.checks, n, worst)
            return None
        self.failures += 1
        self.tripped = self.action == "fail"
        msg = (f"canary mismatch (check {self.checks}): reference ids {list(self.ref.tokens)}, got "
               f"{list(got.tokens)}; max logprob diff {worst:.4g} (tolerance {self.tolerance:g}) over {n} agreeing "
               f"positions")  # fmt: skip
        log.error("%s; action %s", msg, self.action)
        return CanaryMismatch(msg)

    def stats(self) -> dict[str, float]:
        return {"canary_checks_total": self.checks, "canary_failures_total": self.failures,
                "canary_max_logprob_diff": self.last_diff}  # fmt: skip
