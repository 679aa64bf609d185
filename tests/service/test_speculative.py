"""Speculative decoding on the engine (service/engine/speculation.py, spec_sampler.py; issue 53 items 2-4).

- Forced accept / reject patterns (every pattern of 4 verify steps for k = 1, of 3 for k = 2, of 2 for k = 3)
  through the real Engine and Scheduler: the greedy tokens are the plain engine's, the state each request leaves
  in the prefix cache (every pool array, its pages) is the plain engine's, f32 summation order apart, and its MTP
  ring is the one token-by-token drafting over every position writes (prompt included: chained drafts and
  rejections leave no trace in it).
- The rejection sampler against the target distribution on a 32-token tiny model: the emitted token's
  frequencies over 40,000 seeded draws within a 4-sigma total-variation bound of p, computed directly from the
  target logits (the drafts alone are far off: the test can tell), and the acceptance rate sum(min(p, q));
  for k = 2 with chained drafts, the first position's token follows p1 and, where the first draft was accepted,
  the second's follows p2 given it.
- Seeds: the same seed gives the same sampled output with speculation on.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.deepseek_v4 import DeepseekV4
from dsv4_serve.model.speculative import draft_rows
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import randomize, tiny_model
from dsv4_serve.service.engine.engine import Engine
from dsv4_serve.service.engine.request import Request, SamplingParams
from dsv4_serve.service.engine.sampler import sample_lazy
from dsv4_serve.service.engine.scheduler import Scheduler
from dsv4_serve.service.engine.spec_sampler import draft_lazy, verify_lazy
from dsv4_serve.service.engine.speculator import Speculator
from dsv4_serve.service.engine.stepping import iterate
from tests.model.test_speculative import mtp_by_token

TOL = 1e-4
PROMPTS = [[3, 4, 5], [9, 10, 11, 12, 13, 14], [7, 8], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
GREEDY = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


class Forced(Speculator):
    """Drafts, a verify step at a time, the number of right next tokens each request's pattern says (then wrong
    ones: the first is rejected); `after` right ones once the pattern is used up."""

    def __init__(self, k: int, patterns: dict[str, list[int]], want: dict[str, list[int]], after: int) -> None:
        super().__init__(k, 8)
        self.patterns, self.want, self.after = patterns, want, after

    def propose(self, request: Request, tokens: list[int]) -> list[int]:
        pat, want = self.patterns[request.request_id], self.want[request.request_id]
        n, a = len(request.output_ids), (pat.pop(0) if pat else self.after)
        right = [want[n + j] if n + j < len(want) else 0 for j in range(self.k)]
        return [t if j < a else (t + 1) % 512 for j, t in enumerate(right)]


def drive(engine: Engine, reqs: list[tuple[list[int], SamplingParams]], ids: list[str] | None = None,
          ) -> dict[str, list]:  # fmt: skip
    """Every request (ids: r0, r1, ... unless given) through the real scheduler and iterations, read back each
    step -> request id -> events."""
    sched = Scheduler(engine, max_rows=8, max_queue=64, eos_token_id=engine.eos_token_id,
                      max_model_len=engine.max_model_len)  # fmt: skip
    for i, (p, params) in enumerate(reqs):
        sched.add(Request(ids[i] if ids else f"r{i}", list(p), params))
    events: dict[str, list] = {}
    while sched.has_work():
        out, _, _ = iterate(engine, sched, sample_lazy, 2048, lambda: None)
        for e in out.events:
            events.setdefault(e.request_id, []).append(e)
    return events


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def cached(engine: Engine, rid: str) -> tuple[list[int], dict[str, np.ndarray]]:
    """The prefix cache's entry of a finished request: its tokens and its state (slot arrays, pages)."""
    e = engine.prefix_cache.by_request(rid)  # type: ignore[union-attr]
    out = {n: np.array(a) for n, a in e.slot.items()}
    for r, pages in e.pages.items():
        out |= {n: np.array(a) for n, a in engine.pools.read_entries(r, pages, e.length // r).items()}
    return e.tokens(), out


def close(a: np.ndarray, b: np.ndarray) -> bool:
    fin = np.isfinite(a)
    return bool((fin == np.isfinite(b)).all() and (not fin.any() or np.abs(a[fin] - b[fin]).max() < TOL))


@pytest.mark.parametrize("k, steps", [(1, 4), (2, 3), (3, 2)])
def test_every_accept_pattern_gives_the_plain_tokens_and_state(tiny, k, steps) -> None:
    """Each request's first `steps` verify steps accept 0..k drafts as the pattern says; a run holds as many
    requests as verify a step (max_rows // (k + 1)), so every drafted pattern entry is verified."""
    model, args = tiny[0], tiny[1]
    reqs = [(p, GREEDY) for p in PROMPTS]
    plain = Engine(model, max_rows=8, max_model_len=64, page_size=4)
    want = {rid: tokens_of(ev) for rid, ev in drive(plain, reqs).items()}
    rings = {}
    for rid, toks in ((f"r{i}", p + want[f"r{i}"]) for i, p in enumerate(PROMPTS)):  # every pair (h_q, t_q+1)
        rings[rid] = mtp_by_token(model, args, toks, len(toks) - 1)[0]
    patterns = list(itertools.product(range(k + 1), repeat=steps))
    per = 8 // (k + 1)
    for c in range(0, len(patterns), per):
        spec = Engine(model, max_rows=8, max_model_len=64, page_size=4, speculative=k)
        ids = [(c + j) % 4 for j in range(min(per, len(patterns) - c))]
        pats = {f"r{i}": list(patterns[c + j]) for j, i in enumerate(ids)}
        spec.speculator = Forced(k, {r: list(v) for r, v in pats.items()}, want, 0)  # then rejections to the end
        got = drive(spec, [reqs[i] for i in ids], [f"r{i}" for i in ids])
        assert spec.speculator.verifies >= len(ids) * steps and spec.speculator.accepted >= sum(map(sum,
                                                                                                 pats.values()))
        for rid in pats:
            assert tokens_of(got[rid]) == want[rid], (rid, pats[rid])
            toks, state = cached(spec, rid)
            ref_toks, ref = cached(plain, rid)
            assert toks == ref_toks
            for name, a in ref.items():
                assert close(state[name], a), (rid, pats[rid], name)
            assert close(state[f"window{args.num_hidden_layers}"], rings[rid]), (rid, pats[rid])


@pytest.mark.parametrize("k", [1, 3])
def test_the_mtp_ring_after_a_long_prompt_is_token_by_token_drafting(tiny, k) -> None:
    """A 30-token prompt (the parallel prefill's 29 positions, then the step's) and 2 tokens: the cached MTP ring
    (8 rows: 6 of them the prompt's) is the one token-by-token drafting writes; the tokens are the plain ones."""
    model, args = tiny[0], tiny[1]
    prompt = np.random.default_rng(5).integers(2, args.vocab_size, 30).tolist()
    reqs = [(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))]
    want = tokens_of(drive(Engine(model, max_rows=8, max_model_len=64, page_size=4), reqs)["r0"])
    spec = Engine(model, max_rows=8, max_model_len=64, page_size=4, speculative=k)
    assert tokens_of(drive(spec, reqs)["r0"]) == want
    toks, state = cached(spec, "r0")
    assert toks == prompt + want[:1]
    ring = mtp_by_token(model, args, prompt + want, len(toks))[0]
    assert close(state[f"window{args.num_hidden_layers}"], ring)


def test_the_same_seed_gives_the_same_sampled_output(tiny) -> None:
    reqs = [(p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7 + i, logprobs=2))
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    runs = [drive(Engine(tiny[0], max_rows=8, max_model_len=64, page_size=4, speculative=1), reqs) for _ in range(2)]
    for rid in runs[0]:
        a, b = runs[0][rid], runs[1][rid]
        assert tokens_of(a) == tokens_of(b) and len(tokens_of(a)) == 12
        assert all(len(e.top_logprobs) == 2 and e.logprob is not None for e in a if e.token_id is not None)


def vocab32() -> tuple[DeepseekV4, ModelArgs]:
    """The tiny model cut to 32 tokens (weights from seed 4): small enough to count every token's draws."""
    args = ModelArgs.tiny()
    args.vocab_size = 32
    model = DeepseekV4(args)
    model.load_weights(randomize(model, args, 4), strict=True)
    return model, args


@pytest.fixture(scope="module")
def small():
    """A tiny model of 32 tokens, its target logits at one position and the MTP block's draft logits there."""
    model, args = vocab32()
    pools = StatePools(args, max_slots=1, max_positions=16, page_size=4, mtp=True)
    h = pools.alloc(16)
    toks = [3, 9, 17, 5, 11]
    for q, t in enumerate(toks):
        batch = model.make_batch(pools, [h], [q])
        hs = model.streams(batch, mx.array([t]), pools)
        target = mx.matmul(model.collapse(hs), model.head.weight.T)
        draft, _ = draft_rows(model, pools, [h], [q], hs, [toks[q + 1] if q + 1 < len(toks) else 1])
        mx.eval(target, draft, pools.arrays())
    return np.array(target[0]).astype(np.float64) * 3, np.array(draft[0]).astype(np.float64) * 3  # sharper


def target_p(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    s = logits / temperature
    if top_k:
        s = np.where(s >= np.sort(s)[-top_k], s, -np.inf)
    p = np.exp(s - s.max())
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 8)])
def test_rejection_sampling_follows_the_target_distribution(small, temperature, top_k) -> None:
    target, draft = small
    n, v = 40_000, target.shape[0]
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=s) for s in range(n)]
    counts, hist = [0] * n, [[]] * n
    d, q = draft_lazy(mx.broadcast_to(mx.array(draft, mx.float32), (n, v)), params, hist, counts)
    drafts = np.array(d).tolist()
    pending, accept = verify_lazy(mx.broadcast_to(mx.array(target, mx.float32), (n, v)), params, hist, counts,
                                  drafts, q)  # fmt: skip
    got = np.array([t for t, _, _ in pending.result()])
    p, qd = target_p(target, temperature, top_k), target_p(draft, temperature, top_k)
    freq = np.bincount(got, minlength=v) / n
    bound = 0.5 * np.sum(4 * np.sqrt(p * (1 - p) / n))  # 4 sigma a token
    assert 0.5 * np.abs(freq - p).sum() < bound
    draft_freq = np.bincount(drafts, minlength=v) / n
    assert 0.5 * np.abs(draft_freq - p).sum() > 5 * bound  # the drafts alone would fail it
    assert 0.5 * np.abs(draft_freq - qd).sum() < 0.5 * np.sum(4 * np.sqrt(qd * (1 - qd) / n))
    assert np.array(accept).mean() == pytest.approx(np.minimum(p, qd).sum(), abs=0.02)


@pytest.fixture(scope="module")
def chained():
    """k = 2 on the 32-token tiny model after tokens 3, 9, 17, 5 (11 sampled): p1 (the target for the token after
    11), q1 (the MTP block's draft of it) and, for every first token x, p2[x] (the target after x) and q2[x] (the
    block chained on its own streams with x). Logits x 3 (sharper), f64."""
    model, args = vocab32()
    pools = StatePools(args, max_slots=2, max_positions=16, page_size=4, mtp=True)
    h = pools.alloc(16)
    toks = [3, 9, 17, 5, 11]
    for q in range(4):
        hs = model.streams(model.make_batch(pools, [h], [q]), mx.array([toks[q]]), pools)
        q1, g = draft_rows(model, pools, [h], [q], hs, [toks[q + 1]])
        mx.eval(q1, g, pools.arrays())
    p1 = model.step(model.make_batch(pools, [h], [4]), mx.array([11]), pools)
    mx.eval(p1, pools.arrays())
    p2, q2 = [], []
    for x in range(32):
        d = pools.alloc(16)
        pools.copy_slot(h, d, 5)
        t = model.step(model.make_batch(pools, [d], [5]), mx.array([x]), pools)
        c, _ = draft_rows(model, pools, [d], [4], g, [x])  # the chained step: at 4, the block's streams, x
        mx.eval(t, c, pools.arrays())
        p2.append(np.array(t[0]))
        q2.append(np.array(c[0]))
        pools.free(d)
    f = [np.array(x, dtype=np.float64) * 3 for x in (p1[0], q1[0], np.stack(p2), np.stack(q2))]
    return tuple(f)


def tv_bound(p: np.ndarray, n: int) -> float:
    return 0.5 * np.sum(4 * np.sqrt(p * (1 - p) / n))  # 4 sigma a token


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (1.5, 16)])  # (top-8 sets of p1 and q1 do not meet)
def test_two_chained_drafts_keep_the_target_distribution_at_each_position(chained, temperature, top_k) -> None:
    """40,000 requests draft d1 ~ q1 and d2 ~ q2[d1] (draft_lazy, counts 0 and 1) and verify [p1, p2[d1]]: the
    first token follows p1; where d1 was accepted the second token (this step's) follows p2 given d1 (the
    mixture of p2[d1] over those rows), the drafts d2 alone do not, and d2's acceptance is sum(min(p2, q2))."""
    p1l, q1l, p2l, q2l = chained
    n, v = 40_000, p1l.shape[0]
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=s) for s in range(n)]
    d1, q1 = draft_lazy(mx.broadcast_to(mx.array(q1l, mx.float32), (n, v)), params, [[]] * n, [0] * n)
    d1n = np.array(d1)
    d2, q2 = draft_lazy(mx.array(q2l[d1n], mx.float32), params, [[]] * n, [1] * n)
    d2n = np.array(d2)
    target = np.stack([np.broadcast_to(p1l, (n, v)), p2l[d1n]], axis=1).reshape(2 * n, v)
    pending, accept = verify_lazy(mx.array(target, mx.float32), [p for p in params for _ in range(2)],
                                  [[]] * (2 * n), [0, 1] * n, np.stack([d1n, d2n], 1).reshape(-1).tolist(),
                                  mx.stack([q1, q2], axis=1).reshape(2 * n, v))  # fmt: skip
    tok = np.array([t for t, _, _ in pending.result()]).reshape(n, 2)
    acc = np.array(accept).reshape(n, 2).astype(bool)
    p1 = target_p(p1l, temperature, top_k)
    p2 = np.stack([target_p(x, temperature, top_k) for x in p2l])
    q2p = np.stack([target_p(x, temperature, top_k) for x in q2l])
    assert 0.5 * np.abs(np.bincount(tok[:, 0], minlength=v) / n - p1).sum() < tv_bound(p1, n)
    a = acc[:, 0]
    m = int(a.sum())
    assert m > 2000 and (tok[a, 0] == d1n[a]).all()
    mix = p2[d1n[a]].mean(axis=0)
    assert 0.5 * np.abs(np.bincount(tok[a, 1], minlength=v) / m - mix).sum() < tv_bound(mix, m)
    assert 0.5 * np.abs(np.bincount(d2n[a], minlength=v) / m - mix).sum() > 3 * tv_bound(mix, m)  # can tell
    want = np.minimum(p2, q2p).sum(axis=1)[d1n[a]].mean()
    assert acc[a, 1].mean() == pytest.approx(want, abs=0.02)


def test_speculation_backs_off_while_requests_wait_for_a_full_batch(tiny) -> None:
    """max_rows 2, four requests: no draft is verified while two wait for the taken rows; once nobody waits the
    rows speculate (always-right drafts: each verify accepts)."""
    reqs = [(p, GREEDY) for p in PROMPTS]
    want = {rid: tokens_of(ev) for rid, ev in drive(Engine(tiny[0], max_rows=8, max_model_len=64, page_size=4),
                                                    reqs).items()}  # fmt: skip
    eng = Engine(tiny[0], max_rows=2, max_model_len=64, page_size=4, speculative=1)
    eng.speculator = Forced(1, {f"r{i}": [] for i in range(4)}, want, 1)
    sched = Scheduler(eng, max_rows=2, max_queue=64, eos_token_id=eng.eos_token_id, max_model_len=64)
    for i, (p, params) in enumerate(reqs):
        sched.add(Request(f"r{i}", list(p), params))
    got: dict[str, list[int]] = {}
    verified = {True: 0, False: 0}  # by "requests waited for a full batch"
    while sched.has_work():
        full = bool(sched.num_waiting) and sched.num_running >= 2
        before = eng.speculator.verifies
        out, _, _ = iterate(eng, sched, sample_lazy, 2048, lambda: None)
        verified[full] += eng.speculator.verifies - before
        for e in out.events:
            if e.token_id is not None:
                got.setdefault(e.request_id, []).append(e.token_id)
    assert got == want
    assert verified[True] == 0 and verified[False] > 0 and eng.speculator.accepted == eng.speculator.verifies
