"""Batched per-row sampling: one set of mx ops for all rows, one host sync per step.

Order per row (vLLM v1's): logit_bias, repetition penalty (prompt + generated; positive logits divided,
negative multiplied), presence/frequency penalties (OpenAI: generated tokens only), stop tokens
masked while fewer than min_tokens are generated, then greedy argmax (temperature < SAMPLING_EPS,
lowest index on ties) or: temperature, min-p, top-k, top-p, and a Gumbel-max draw.

Logprobs are the *processed* ones: log-softmax after penalties, min-tokens masking and temperature
(temperature 1 for greedy rows) but before min-p/top-k/top-p truncation, so the chosen token's
logprob is always finite; a masked alternative's -inf is read back as LOGPROB_FLOOR (-9999, as
vLLM reports it). `top_logprobs` come sorted best first (lowest id on ties).

Randomness: each row's noise is a counter-based hash of (row key, token id), where a seeded row's
key depends only on (seed, generated_count). A seeded request thus draws the same tokens alone or
beside 7 other rows; unseeded rows get a fresh key from a process-wide RNG every step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.upload import upload
from dsv4_serve.service.engine.request import SamplingParams, finite_logprob
from dsv4_serve.service.engine.scheduler import Sampled

_M64 = (1 << 64) - 1
_rng = random.SystemRandom()


def _mix64(x: int) -> int:
    """splitmix64 finalizer on python ints (host side, per row)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int | None, generated_count: int) -> int:
    """64-bit noise key of one row for one step."""
    if seed is None:
        return _rng.getrandbits(64)
    return _mix64((seed & _M64) ^ _mix64(generated_count))


def _fmix32(h: mx.array) -> mx.array:
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, dtype=mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return h ^ (h >> 16)


def gumbel_noise(keys: Sequence[int], vocab: int) -> mx.array:
    """[B, V] f32 standard Gumbel noise; row b depends only on keys[b]."""
    k = np.asarray(keys, dtype=np.uint64)
    k1 = upload((k & 0xFFFFFFFF).astype(np.uint32), mx.uint32)[:, None]
    k2 = upload((k >> np.uint64(32)).astype(np.uint32), mx.uint32)[:, None]
    idx = mx.arange(vocab, dtype=mx.uint32)[None, :]
    # XOR (not add) the key in: adding would make nearby keys shifted copies of one sequence.
    h = _fmix32((idx * mx.array(0x9E3779B9, dtype=mx.uint32)) ^ k1)
    h = _fmix32(h + k2)
    u = ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return -mx.log(-mx.log(u))


def _row_mask(rows_ids: list[np.ndarray], shape: tuple[int, int], counts: bool = False) -> mx.array:
    """[B, V] f32 with, per row b, the occurrence count (or 1) of each id in rows_ids[b]."""
    b, v = shape
    flat = np.concatenate([ids.astype(np.int64) + i * v for i, ids in enumerate(rows_ids)])
    if flat.size == 0:
        return mx.zeros(shape, dtype=mx.float32)
    if counts:
        out = mx.zeros((b * v,), dtype=mx.float32).at[mx.array(flat)].add(1.0)
    else:
        out = mx.zeros((b * v,), dtype=mx.float32).at[mx.array(flat)].maximum(1.0)
    return out.reshape(b, v)


def _col(values: list[float]) -> mx.array:
    return upload(values, mx.float32)[:, None]


def apply_logit_bias(logits: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """OpenAI's logit_bias: each row's (token id, bias) pairs added to its logits (rows without any: + 0)."""
    if not any(p.logit_bias for p in params):
        return logits
    b, v = logits.shape
    flat = [i * v + t for i, p in enumerate(params) for t, _ in p.logit_bias]
    vals = [float(x) for p in params for _, x in p.logit_bias]
    bias = mx.zeros((b * v,), dtype=mx.float32).at[mx.array(flat)].add(mx.array(vals, dtype=mx.float32))
    return logits + bias.reshape(b, v)


def apply_penalties(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generated_counts: Sequence[int],
) -> mx.array:
    """Repetition (prompt + generated) then presence/frequency (generated only) penalties."""
    shape = tuple(logits.shape)
    empty = np.zeros(0, dtype=np.int64)
    x = logits
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _row_mask(
            [
                np.asarray(h) if p.repetition_penalty != 1.0 else empty
                for p, h in zip(params, histories, strict=True)
            ],
            shape,
        )
        rp = _col([p.repetition_penalty for p in params])
        x = mx.where(seen > 0, mx.where(x > 0, x / rp, x * rp), x)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        gen = [
            np.asarray(h[len(h) - n :]) if (p.presence_penalty or p.frequency_penalty) and n else empty
            for p, h, n in zip(params, histories, generated_counts, strict=True)
        ]
        cnt = _row_mask(gen, shape, counts=True)
        x = x - _col([p.frequency_penalty for p in params]) * cnt
        x = x - _col([p.presence_penalty for p in params]) * (cnt > 0)
    return x


_bit_cache: dict[int, tuple[mx.array, mx.array]] = {}


def apply_masks(x: mx.array, masks: np.ndarray) -> mx.array:
    """Grammar masks (grammar.Guides.masks: [B, ceil(V / 32)] packed int32, bit v = token v allowed) -> the
    disallowed logits of x [B, V] set to -inf. One upload of B * V / 32 words and three elementwise ops."""
    v = x.shape[-1]
    if v not in _bit_cache:
        ids = mx.arange(v, dtype=mx.uint32)
        _bit_cache[v] = (ids // 32, ids % 32)
        mx.eval(_bit_cache[v])  # shared by every thread: an array not evaluated belongs to its thread's stream
    word, bit = _bit_cache[v]
    packed = upload(masks.view(np.uint32), mx.uint32)
    allowed = (mx.take(packed, word, axis=1) >> bit[None, :]) & 1
    return mx.where(allowed > 0, x, -mx.inf)


def sample(logits: mx.array, *args: Any, **kwargs: Any) -> list[Sampled]:
    """`sample_lazy` and its read-back: one (token, logprob, top) per row."""
    return sample_lazy(logits, *args, **kwargs).result()


class Pending:
    """A sampled step not read back yet: `tokens` [B] int32 is on the device (a pipelined engine feeds it
    to the next step before the host has seen it); `result()` is the one host sync."""

    def __init__(self, outs: list[mx.array], params: Sequence[SamplingParams], k: int) -> None:
        self.tokens = outs[0].astype(mx.int32)
        self._outs, self._params, self._k = outs, params, k

    def result(self) -> list[Sampled]:
        params, k = self._params, self._k
        mx.eval(*self._outs)  # the one host sync
        host = [o.tolist() for o in self._outs]
        result: list[Sampled] = []
        for i, p in enumerate(params):
            top: tuple[tuple[int, float], ...] = ()
            if p.logprobs and k > 0:
                pairs = sorted(zip(host[2][i], host[3][i], strict=True), key=lambda t: (-t[1], t[0]))
                top = tuple((int(t), finite_logprob(float(val))) for t, val in pairs[: p.logprobs])
            logprob = finite_logprob(float(host[1][i])) if p.logprobs is not None else None
            result.append((int(host[0][i]), logprob, top))
        return result


def process(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generated_counts: Sequence[int],
    *,
    eos_token_id: int | None = None,
    masks: np.ndarray | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """A row's logits as sampling sees them: (x: logit_bias, penalties, min_tokens bans and grammar masks applied,
    greedy rows take its argmax; s: x / temperature with min-p / top-k / top-p's cut entries -inf, the
    distribution random rows draw from, softmax(s); lp: the reported logprobs, log_softmax(x / temperature)).
    Speculative decoding's draft and target rows go through the same (service/engine/spec_sampler.py)."""
    b, v = logits.shape
    if not (len(params) == len(histories) == len(generated_counts) == b):
        raise ValueError(f"sample: {b} logit rows but {len(params)} params / {len(histories)} histories")
    x = apply_logit_bias(logits.astype(mx.float32), params)
    x = apply_penalties(x, params, histories, generated_counts)

    # Before min_tokens, EOS (unless ignore_eos) and the stop ids may not be drawn at all.
    banned = [
        np.asarray(
            list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])
            if n < p.min_tokens
            else [],
            dtype=np.int64,
        )
        for p, n in zip(params, generated_counts, strict=True)
    ]
    if any(a.size for a in banned):
        x = mx.where(_row_mask(banned, (b, v)) > 0, -mx.inf, x)
    if masks is not None:
        x = apply_masks(x, masks)
    s = x / _col([1.0 if p.greedy else p.temperature for p in params])
    lp = s - mx.logsumexp(s, axis=-1, keepdims=True)
    random_rows = [not p.greedy for p in params]
    if any(random_rows):
        # min-p: keep p >= min_p * p_max, i.e. s >= s_max + log(min_p).
        log_minp = _col([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params])
        s = mx.where(s < mx.max(s, axis=-1, keepdims=True) + log_minp, -mx.inf, s)
        if any(r and (0 < p.top_k < v or p.top_p < 1.0) for r, p in zip(random_rows, params, strict=True)):
            s = _top_k_top_p(s, params)
    return x, s, lp


def sample_lazy(
    logits: mx.array,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generated_counts: Sequence[int],
    *,
    eos_token_id: int | None = None,
    masks: np.ndarray | None = None,
) -> Pending:
    """Sample one token per row of `logits` [B, V]: the sampling graph, built and queued (async_eval);
    `Pending.result()` reads back (token, logprob, top) per row.

    histories[b]: prompt + generated ids of row b (read only for rows with penalties; pass []
    otherwise). generated_counts[b]: tokens row b has generated so far (seeds, min_tokens).
    logprob is None unless params[b].logprobs is not None. masks: the guided rows' grammar masks
    (grammar.Guides.masks), applied after penalties and min_tokens, before everything else; None: no row
    is guided (nothing is done).
    """
    x, s, lp = process(logits, params, histories, generated_counts, eos_token_id=eos_token_id, masks=masks)
    v = x.shape[-1]
    greedy_tok = mx.argmax(x, axis=-1)  # first max: lowest index on ties
    random_rows = [not p.greedy for p in params]
    if any(random_rows):
        keys = [row_key(p.seed, n) for p, n in zip(params, generated_counts, strict=True)]
        drawn = mx.argmax(s + gumbel_noise(keys, v), axis=-1)
        token = mx.where(upload(random_rows), drawn, greedy_tok)  # int32: nonzero picks `drawn`
    else:
        token = greedy_tok

    return queued(token, lp, params)


def queued(token: mx.array, lp: mx.array, params: Sequence[SamplingParams], *also: mx.array) -> Pending:
    """The rows' tokens with the logprobs their params ask for (lp: log_softmax as `process` gives it), queued
    (async_eval, with `also`) as a Pending."""
    outs = [token]
    if any(p.logprobs is not None for p in params):  # lp stays lazy (never computed) otherwise
        outs.append(mx.take_along_axis(lp, token[:, None].astype(mx.int32), axis=-1)[:, 0])
    k = min(max((p.logprobs or 0) for p in params), lp.shape[-1])
    if k > 0:
        top_idx = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        outs += [top_idx, mx.take_along_axis(lp, top_idx, axis=-1)]
    pending = Pending(outs, params, k)
    mx.async_eval(*also, pending.tokens, *outs)
    return pending


def _top_k_top_p(s: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """Mask entries outside each row's top-k then top-p nucleus (ties at the cut are kept)."""
    v = s.shape[-1]
    srt = -mx.sort(-s, axis=-1)  # descending
    pos = mx.arange(v)[None, :]
    kk = upload([p.top_k if 0 < p.top_k < v else v for p in params])[:, None]
    srt = mx.where(pos < kk, srt, -mx.inf)
    probs = mx.softmax(srt, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above this entry
    top_p = _col([p.top_p for p in params])
    keep = ((before < top_p) | (top_p >= 1.0)) & (srt > -mx.inf)
    n_keep = mx.maximum(keep.astype(mx.int32).sum(axis=-1, keepdims=True), 1)
    threshold = mx.take_along_axis(srt, n_keep - 1, axis=-1)
    return mx.where(s < threshold, -mx.inf, s)
