"""Naive per-row float64 NumPy models of the three ops, written from the spec text (sections 2.4-2.7).

Deliberately loop-based and independent of kernels/: one token, one row, one entry at a time.
"""

from __future__ import annotations

import math

import numpy as np


def rope_np(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved RoPE on the last 2*len(cos) dims: pair i = (x[D-rd+2i], x[D-rd+2i+1])."""
    out = np.array(x, dtype=np.float64, copy=True)
    d, half = x.shape[-1], len(cos)
    base = d - 2 * half
    for i in range(half):
        a, b = x[..., base + 2 * i], x[..., base + 2 * i + 1]
        out[..., base + 2 * i] = a * cos[i] - b * sin[i]
        out[..., base + 2 * i + 1] = a * sin[i] + b * cos[i]
    return out


class CompressorNp:
    """One request's compressor (spec 2.5): state KV, S in R^{coff*m x coff*d}, KV=0, S=-inf."""

    def __init__(self, ratio: int, d: int) -> None:
        self.m, self.d = ratio, d
        self.coff = 2 if ratio == 4 else 1
        self.kv = np.zeros((self.coff * ratio, self.coff * d))
        self.s = np.full((self.coff * ratio, self.coff * d), -np.inf)

    def step(self, p, a, s, ape, norm, eps, cos, sin) -> tuple[int, np.ndarray] | None:
        m, d, coff = self.m, self.d, self.coff
        r = (coff - 1) * m + p % m
        self.kv[r] = a
        self.s[r] = s + ape[p % m]
        if (p + 1) % m != 0:
            return None
        if coff == 1:
            vals, gates = self.kv, self.s
        else:
            vals = np.vstack([self.kv[:m, :d], self.kv[m:, d:]])
            gates = np.vstack([self.s[:m, :d], self.s[m:, d:]])
        c = np.zeros(d)
        for f in range(d):  # softmax over the tokens, independently per feature
            g = gates[:, f]
            e = np.exp(g - g.max())
            c[f] = (e / e.sum() * vals[:, f]).sum()
        c = c / math.sqrt((c * c).mean() + eps) * norm
        c = rope_np(c, cos, sin)
        if coff == 2:
            self.kv[:m] = self.kv[m:].copy()
            self.s[:m] = self.s[m:].copy()
        return p // m, c


def indexer_np(q, w, keys, table, page, p, topk) -> list[int]:
    """q [nI, Di], w [nI], keys [P, page, Di]: top min(topk, n) ids (ties to the lowest id) ascending, -1 padded."""
    n = (p + 1) // 4
    scores = []
    for s in range(n):
        k = keys[table[s // page], s % page].astype(np.float64)
        scores.append(sum(float(w[h]) * max(float(q[h] @ k), 0.0) for h in range(q.shape[0])))
    order = sorted(sorted(range(n), key=lambda s: (-scores[s], s))[: min(topk, n)])  # the top k, by id
    return order + [-1] * (topk - len(order))


def attention_np(q, window_slot, pool, ids, table, page, p, ratio, sinks, scale) -> np.ndarray:
    """q [nh, D]; window_slot [W, D]; ids: logical entries (-1 / >= (p+1)//ratio skipped)."""
    w_len = window_slot.shape[0]
    keys = [window_slot[j] for j in range(min(p + 1, w_len))]
    if pool is not None:
        n = (p + 1) // ratio
        keys += [pool[table[i // page], i % page] for i in ids if 0 <= i < n]
    k = np.array(keys, dtype=np.float64)
    out = np.zeros(q.shape)
    for h in range(q.shape[0]):
        logits = k @ q[h].astype(np.float64) * scale
        mu = max(logits.max(), float(sinks[h]))
        e = np.exp(logits - mu)
        out[h] = (e[:, None] * k).sum(0) / (e.sum() + math.exp(float(sinks[h]) - mu))
    return out


def scatter_tables(rng: np.random.Generator, needs: list[int], spare: int = 3) -> tuple[list[list[int]], int]:
    """Non-contiguous, shuffled pages 1..P-1 (page 0 is trash) for rows needing `needs` pages."""
    pages = 1 + sum(needs) + spare
    perm = [int(x) for x in rng.permutation(np.arange(1, pages))]
    tables, at = [], 0
    for n in needs:
        tables.append(perm[at : at + n])
        at += n
    return tables, pages
