"""Speculative sampling (issue 53; docs/mtp.md): drafting from the MTP block's logits and verifying the drafts
against the target's, as Leviathan et al. (2023) do, so that every emitted token follows the target distribution.

Draft and target rows go through the sampler's own processing (`sampler.process`: logit_bias, penalties,
min_tokens, grammar masks, temperature, min-p, top-k, top-p) with the same parameters, history and generated
count, so q (the draft distribution) and p (the target's) are the two distributions the proof needs:
- a greedy row drafts argmax q and accepts the draft iff it is argmax p (the token it emits is argmax p either
  way: greedy output is the target's);
- a random row draws d ~ q, accepts it with probability min(1, p(d) / q(d)), else draws from the residual
  max(0, p - q) normalized; the bonus row (after every draft accepted) and rows without a draft draw from p.
Randomness: a seeded row's draws hang on (seed, generated count) as `sampler.row_key` (each of the three draws
from a key of its own), so the same seed gives the same output with speculation on; it is not the output of the
same seed without it (vLLM's is not either). Logprobs are the target's (`lp`) at the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.upload import upload
from dsv4_serve.service.engine.request import SamplingParams
from dsv4_serve.service.engine.sampler import Pending, _mix64, gumbel_noise, process, queued, row_key

DRAFT_KEY, ACCEPT_KEY, RESIDUAL_KEY = 0xD1, 0xAC, 0x5E  # one draw a key: drafts, accept tests, residuals


def _keys(params: Sequence[SamplingParams], counts: Sequence[int], which: int) -> list[int]:
    return [_mix64(row_key(p.seed, n) ^ which) for p, n in zip(params, counts, strict=True)]


def draft_lazy(logits: mx.array, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
               counts: Sequence[int], *, eos_token_id: int | None = None) -> tuple[mx.array, mx.array]:  # fmt: skip
    """Draft one token a row from the MTP block's logits [B, V]: (tokens [B] int32, q [B, V] f32: the
    distribution each was drawn from; a greedy row's q is not used). Queued, not read back."""
    x, s, _ = process(logits, params, histories, counts, eos_token_id=eos_token_id)
    greedy = mx.argmax(x, axis=-1)
    if all(p.greedy for p in params):
        token, q = greedy, mx.zeros_like(x)
    else:
        drawn = mx.argmax(s + gumbel_noise(_keys(params, counts, DRAFT_KEY), x.shape[-1]), axis=-1)
        token = mx.where(upload([not p.greedy for p in params]), drawn, greedy)
        q = mx.softmax(s, axis=-1)
    token = token.astype(mx.int32)
    mx.async_eval(token, q)
    return token, q


def verify_lazy(logits: mx.array, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]],
                counts: Sequence[int], drafts: Sequence[int], q: mx.array | None, *, eos_token_id: int | None = None,
                masks: np.ndarray | None = None) -> tuple[Pending, mx.array]:  # fmt: skip
    """Target rows [R, V]: row i verifies drafts[i] (-1: no draft; it samples as `sample_lazy` does: a bonus
    row or a row without drafts) against q[i] (the draft's distribution, [R, V]; any row where drafts[i] is -1
    or the row is greedy). -> (a Pending of the token each row emits: the draft if accepted, else the
    correction (greedy: argmax p; random: from the residual); logprobs as `sample_lazy`), accepted [R] bool)."""
    x, s, lp = process(logits, params, histories, counts, eos_token_id=eos_token_id, masks=masks)
    r, v = x.shape
    greedy_rows = upload([p.greedy for p in params])
    has = upload([d >= 0 for d in drafts])
    d = upload([max(int(t), 0) for t in drafts])[:, None]
    greedy = mx.argmax(x, axis=-1)
    if all(p.greedy for p in params):
        accept = (greedy == d[:, 0]) & has
        token = greedy
    else:
        q = mx.zeros_like(x) if q is None else q
        p_ = mx.softmax(s, axis=-1)
        drawn = mx.argmax(s + gumbel_noise([row_key(p.seed, n) for p, n in zip(params, counts, strict=True)], v),
                          axis=-1)  # as sample_lazy draws
        pd, qd = mx.take_along_axis(p_, d, axis=-1)[:, 0], mx.take_along_axis(q, d, axis=-1)[:, 0]
        u = mx.exp(-mx.exp(-gumbel_noise(_keys(params, counts, ACCEPT_KEY), 1)[:, 0]))  # uniform in (0, 1)
        residual = mx.maximum(p_ - q, 0.0)
        res = mx.argmax(mx.log(residual) + gumbel_noise(_keys(params, counts, RESIDUAL_KEY), v), axis=-1)
        res = mx.where(residual.sum(axis=-1) > 0, res, drawn)  # p == q: nothing left over (the draft's accepted)
        accept = mx.where(greedy_rows, greedy == d[:, 0], u * qd < pd) & has
        token = mx.where(greedy_rows, greedy, mx.where(has, res, drawn))
    token = mx.where(accept, d[:, 0], token)
    return queued(token, lp, params, accept), accept
