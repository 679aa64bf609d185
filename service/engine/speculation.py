"""Speculative decoding with the MTP block on the engine thread (issue 53; docs/mtp.md).

With `--speculative-config` an iteration's step is `spec_step`: every planned row's chunk, [its fed token] or
[its last token, its k drafts], goes through ONE verify pass (model/speculative.py: a decode step with the chunks'
positions as chained rows, or the parallel prefill's forward; causal within a chunk; every position's logits and
final streams kept). The target rows are sampled with the drafts
checked (spec_sampler.py), the accepted tokens go through `Scheduler.on_step` one round a token, the rejected
draft positions are rolled back before anything reads or caches the state, and the MTP block runs on every
accepted position's streams (its window ring never holds a rejected position) and drafts the next k tokens of
each row that may speculate next time (chained on its own streams; the ring rows the chain writes are put back).
Speculation backs off (no draft verified) while requests wait for a row and every row is taken; at most
max_rows // (k + 1) requests verify drafts a step; guided rows never draft.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from dsv4_serve.model.speculative import Snapshot, draft_rows, mtp_rows, restore_mtp_rows, rollback, snapshot, verify
from dsv4_serve.service.engine.request import Request, RequestStatus, TokenEvent
from dsv4_serve.service.engine.scheduler import Scheduler, needs_sample
from dsv4_serve.service.engine.spec_sampler import draft_lazy, verify_lazy
from dsv4_serve.service.engine.speculator import Draft, Speculator

if TYPE_CHECKING:  # engine.py builds the Speculator: a type-checking import only, no import cycle
    from dsv4_serve.service.engine.engine import Engine

log = logging.getLogger(__name__)


def _history(r: Request, extra: list[int]) -> list[int]:
    p = r.params
    return r.prompt_ids + r.output_ids + extra if p.repetition_penalty != 1.0 or p.presence_penalty or \
        p.frequency_penalty else []  # fmt: skip


def spec_step(engine: Engine, sched: Scheduler, plan: list[Request],
              ) -> tuple[list[TokenEvent], int, float | None, None]:  # fmt: skip
    """The verify step for `plan` and its sampling; (events, tokens emitted, seconds or None if it failed, None)."""
    from dsv4_serve.service.engine.prompt_logprobs import score_lazy

    spec: Speculator = engine.speculator  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    host = engine.host_seconds
    backoff = sched.num_waiting > 0 and sched.num_running >= sched.max_rows
    chunks: list[list[int]] = []
    drafts: list[Draft | None] = []
    snaps: dict[int, Snapshot] = {}
    feeds = sched.feeds(plan)
    live = {r.request_id for r in sched.running}
    for rid in [rid for rid in spec.drafts if rid not in live]:  # ended since they drafted
        del spec.drafts[rid]
    try:
        for i, (r, (h, tok, pos)) in enumerate(zip(plan, feeds, strict=True)):
            d = spec.drafts.pop(r.request_id, None)
            use = (d is not None and d.position == pos and not backoff and len(snaps) < spec.max_spec
                   and pos + len(d.tokens) < h.capacity and needs_sample(r) and r.params.guide is None)  # fmt: skip
            chunks.append([tok] + (d.tokens if use else []))  # type: ignore[union-attr]
            drafts.append(d if use else None)
            if use:
                snaps[i] = snapshot(engine.pools, h, pos + 1, pos + len(d.tokens))  # type: ignore[union-attr]
        logits, streams = verify(engine.model, engine.pools, [(f[0], c, f[2]) for f, c in zip(feeds, chunks,
                                                                                              strict=True)])
        mx.async_eval(logits, streams, engine.pools.arrays())
        t1 = time.perf_counter()
        host["build"] += t1 - t0
        scoring = [i for i, r in enumerate(plan) if r.params.prompt_logprobs is not None and not needs_sample(r)]
        prompt_lps = [(plan[i], score_lazy(logits[i][:1], [plan[i].prompt_ids[plan[i].fed + 1]],
                                           plan[i].params.prompt_logprobs or 0)) for i in scoring]  # fmt: skip
        idx = [i for i, r in enumerate(plan) if needs_sample(r)]
        emitted: dict[int, list] = {}
        accepted_n: dict[int, int] = {}
        if idx:
            emitted, accepted_n = _sample(engine, plan, idx, chunks, drafts, logits)
        host["sample"] += time.perf_counter() - t1
        scored = [sched.scored(r, p.result()) for r, p in prompt_lps]
        kept: dict[int, int] = {}
        for i in idx:
            r, toks = plan[i], [e[0] for e in emitted[i]]
            c, ends = sched.takes(r, toks)
            emitted[i] = emitted[i][:c]
            kept[i] = min(accepted_n[i], c - 1 if ends else c)
            if i in snaps:
                rollback(engine.pools, snaps[i], kept[i])
                spec.drafted += len(chunks[i]) - 1
                spec.accepted += accepted_n[i]
                spec.verifies += 1
    except Exception as e:  # noqa: BLE001 - the step's rows fail, everyone else keeps going
        log.exception("speculative step failed (%d rows)", len(plan))
        events = sched.fail([r.request_id for r in plan], f"engine step failed: {type(e).__name__}: {e}")
        return events + sched.on_step({}), 0, None, None
    events = scored
    try:  # before on_step: a request that ends now caches its state with its last pairs' MTP rows too
        last = _mtp_final(engine, sched, plan, feeds, chunks, kept, emitted, streams)
    except Exception:  # noqa: BLE001 - no drafts next step: the rows go on without speculating
        log.exception("MTP block failed (%d rows)", len(plan))
        last = {}
    # One on_step round a token: round 0 feeds every planned row, round j the rows with a j-th token.
    rounds = max((len(v) for v in emitted.values()), default=1)
    for j in range(rounds):
        rows = [r for i, r in enumerate(plan) if (j == 0 or len(emitted.get(i, ())) > j)
                and r.status is RequestStatus.RUNNING]  # fmt: skip
        sched.resume(rows)
        events += sched.on_step({plan[i].request_id: emitted[i][j] for i in emitted if len(emitted[i]) > j
                                 and plan[i].status is RequestStatus.RUNNING})  # fmt: skip
    try:
        _draft_next(engine, sched, spec, plan, last)
    except Exception:  # noqa: BLE001 - no drafts next step: the rows go on without speculating
        log.exception("MTP draft failed (%d rows)", len(plan))
        spec.drafts.clear()
    return events, sum(len(v) for v in emitted.values()), time.perf_counter() - t0, None


def _sample(engine: Engine, plan: list[Request], idx: list[int], chunks: list[list[int]],
            drafts: list[Draft | None], logits: list[mx.array]) -> tuple[dict[int, list], dict[int, int]]:  # fmt: skip
    """Every sampled row's target rows (one a chunk position) checked against its drafts: (row -> the tokens
    it emits as (token, logprob, top), row -> drafts accepted)."""
    rows, params, hist, counts, want, qs, owner = [], [], [], [], [], [], []
    v = engine.vocab_size
    for i in idx:
        r, toks, d = plan[i], chunks[i], drafts[i]
        rows.append(logits[i])  # [len(toks), vocab]: one target row a chunk position
        for j in range(len(toks)):
            params.append(r.params)
            hist.append(_history(r, toks[1 : j + 1]))
            counts.append(len(r.output_ids) + j)
            want.append(toks[j + 1] if j + 1 < len(toks) else -1)
            qs.append(d.q[j : j + 1] if d is not None and j + 1 < len(toks) else None)
            owner.append(i)
    q = None
    if any(x is not None for x in qs) and not all(p.greedy for p in params):
        q = mx.concatenate([x if x is not None else mx.zeros((1, v), mx.float32) for x in qs])
    guides = getattr(engine, "guides", None)
    masks = guides.masks([plan[i] for i in idx]) if guides is not None else None
    if masks is not None:
        masks = np.repeat(masks, [len(chunks[i]) for i in idx], axis=0)
    pending, accept = verify_lazy(mx.concatenate(rows), params, hist, counts, want, q,
                                  eos_token_id=engine.eos_token_id, masks=masks)  # fmt: skip
    tw = time.perf_counter()
    res, acc = pending.result(), np.array(accept).tolist()
    engine.host_seconds["wait"] += time.perf_counter() - tw
    emitted: dict[int, list] = {}
    accepted: dict[int, int] = {}
    for i, s, a in zip(owner, res, acc, strict=True):
        if i in emitted and (accepted[i] < len(emitted[i])):
            continue  # after a rejection: the rest of this row's target rows are discarded
        emitted.setdefault(i, []).append(s)
        accepted[i] = accepted.get(i, 0) + bool(a)
    return emitted, accepted


def _mtp_final(engine: Engine, sched: Scheduler, plan: list[Request], feeds: list, chunks: list[list[int]],
               kept: dict[int, int], emitted: dict[int, list],
               streams: mx.array) -> dict[int, tuple[mx.array, mx.array]]:  # fmt: skip
    """The MTP block over each row's positions that are now final (the fed one and the kept drafts), a round a
    position; -> row -> its last pair's (draft logits, the block's output streams)."""
    offsets = np.cumsum([0, *map(len, chunks)]).tolist()
    pairs: dict[int, list[tuple[int, int, int]]] = {}  # row -> (streams row, position, the token after it)
    for i, (r, (_, _, pos)) in enumerate(zip(plan, feeds, strict=True)):
        if r.status is not RequestStatus.RUNNING:
            continue
        n = kept.get(i, 0)
        after = [*chunks[i][1 : n + 1], emitted[i][n][0]] if i in emitted else [r.prompt_ids[pos + 1]]
        pairs[i] = [(offsets[i] + j, pos + j, after[j]) for j in range(n + 1)]
    last: dict[int, tuple[mx.array, mx.array]] = {}  # row -> its last pair's (draft logits, block streams)
    for j in range(max((len(p) for p in pairs.values()), default=0)):
        rows = [i for i, p in pairs.items() if len(p) > j]
        out, hs = draft_rows(engine.model, engine.pools, [sched.handles[plan[i].request_id] for i in rows],
                             [pairs[i][j][1] for i in rows], streams[mx.array([pairs[i][j][0] for i in rows])],
                             [pairs[i][j][2] for i in rows])  # fmt: skip
        for b, i in enumerate(rows):
            last[i] = (out[b : b + 1], hs[b : b + 1])
    mx.async_eval(engine.pools.arrays())
    return last


def _draft_next(engine: Engine, sched: Scheduler, spec: Speculator, plan: list[Request],
                last: dict[int, tuple[mx.array, mx.array]]) -> None:  # fmt: skip
    """The next k tokens of each row that may speculate next step: the first from its last pair's logits, each
    further one chained (the block on its own streams and draft, at the next position)."""
    go = [i for i in last if plan[i].output_ids and needs_sample(plan[i]) and plan[i].params.guide is None
          and sched.will_continue(plan[i]) and plan[i].fed + spec.k < sched.handles[plan[i].request_id].capacity]
    if not go:
        return
    reqs = [plan[i] for i in go]
    params, counts = [r.params for r in reqs], [len(r.output_ids) for r in reqs]
    hist = [_history(r, []) for r in reqs]
    tokens, q = draft_lazy(mx.concatenate([last[i][0] for i in go]), params, hist, counts,
                           eos_token_id=engine.eos_token_id)  # fmt: skip
    toks, qs = [tokens], [q]
    if spec.k > 1:  # chained: draft j + 1 from the block's streams after draft j, at the position after it
        handles = [sched.handles[r.request_id] for r in reqs]
        at = [r.fed - 1 for r in reqs]  # each row's last pair's position (the one `last` holds)
        chain = [(h.slot, p + j) for h, p in zip(handles, at, strict=True) for j in range(1, spec.k)]
        saved = mtp_rows(engine.pools, [c[0] for c in chain], [c[1] for c in chain])
        hs = mx.concatenate([last[i][1] for i in go])
        for j in range(1, spec.k):
            if any(hist):  # penalties: the drafts join the history (on the host)
                hist = [h + [int(t)] if h else h for h, t in zip(hist, tokens.tolist(), strict=True)]
            out, hs = draft_rows(engine.model, engine.pools, handles, [p + j for p in at], hs, tokens)
            tokens, q = draft_lazy(out, params, hist, [n + j for n in counts], eos_token_id=engine.eos_token_id)
            toks.append(tokens)
            qs.append(q)
        restore_mtp_rows(engine.pools, saved)
        mx.async_eval(engine.pools.arrays())
    drafted, dist = mx.stack(toks, axis=1).tolist(), mx.stack(qs, axis=1)  # [B, k], [B, k, V]
    for b, r in enumerate(reqs):
        spec.drafts[r.request_id] = Draft(r.fed, spec.propose(r, [int(t) for t in drafted[b]]), dist[b])
