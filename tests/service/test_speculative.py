"""Speculative decoding on the engine (service/engine/speculation.py, spec_sampler.py; issue 53 items 2-4).

- Forced accept / reject patterns (every pattern of 4 verify steps, k = 1) through the real Engine and
  Scheduler: the greedy tokens are the plain engine's, and the state each request leaves in the prefix cache
  (every pool array, its pages, the MTP ring) is the plain engine's, f32 summation order apart.
- The rejection sampler against the target distribution on a 32-token tiny model: the emitted token's
  frequencies over 40,000 seeded draws within a 4-sigma total-variation bound of p, computed directly from the
  target logits (the drafts alone are far off: the test can tell), and the acceptance rate sum(min(p, q)).
- Seeds: the same seed gives the same sampled output with speculation on.
"""

from __future__ import annotations

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

TOL = 1e-4
PROMPTS = [[3, 4, 5], [9, 10, 11, 12, 13, 14], [7, 8], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
GREEDY = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


class Forced(Speculator):
    """Drafts the right next token (accept) or a wrong one (reject) as each request's pattern says."""

    def __init__(self, patterns: dict[str, list[bool]], want: dict[str, list[int]]) -> None:
        super().__init__(1, 8)
        self.patterns, self.want = patterns, want

    def propose(self, request: Request, tokens: list[int]) -> list[int]:
        pat, want = self.patterns[request.request_id], self.want[request.request_id]
        n = len(request.output_ids)
        right = want[n] if n < len(want) else 0
        return [right if (pat.pop(0) if pat else True) else (right + 1) % 512]


def drive(engine: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request through the real scheduler and iterations, read back each step -> request id -> events."""
    sched = Scheduler(engine, max_rows=8, max_queue=64, eos_token_id=engine.eos_token_id,
                      max_model_len=engine.max_model_len)  # fmt: skip
    for i, (p, params) in enumerate(reqs):
        sched.add(Request(f"r{i}", list(p), params))
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


def test_every_accept_pattern_gives_the_plain_tokens_and_state(tiny) -> None:
    model, args = tiny[0], tiny[1]
    reqs = [(p, GREEDY) for p in PROMPTS]
    plain = Engine(model, max_rows=8, max_model_len=64, page_size=4)
    want_ev = drive(plain, reqs)
    want = {rid: tokens_of(ev) for rid, ev in want_ev.items()}
    w = args.sliding_window
    rings: dict[str, list[np.ndarray]] = {}
    for code in range(4):  # 16 patterns of 4 verify steps: 4 runs of 4 requests
        spec = Engine(model, max_rows=8, max_model_len=64, page_size=4, speculative=1)
        pats = {f"r{i}": [bool((4 * code + i) >> b & 1) for b in range(4)] for i in range(4)}
        spec.speculator = Forced({k: list(v) for k, v in pats.items()}, want)
        got = drive(spec, reqs)
        assert spec.speculator.verifies >= 12 and spec.speculator.accepted > 0
        for rid in want:
            assert tokens_of(got[rid]) == want[rid], (rid, pats[rid])
            toks, state = cached(spec, rid)
            ref_toks, ref = cached(plain, rid)
            assert toks == ref_toks
            for name, a in ref.items():
                assert close(state[name], a), (rid, pats[rid], name)
            # the MTP ring (window<num_hidden_layers>): rows of positions whose MTP step ran in every pattern
            ring = state[f"window{args.num_hidden_layers}"]
            rows = [q % w for q in range(len(toks) - w, len(toks) - 2)]
            rings.setdefault(rid, []).append(ring[rows])
    for rid, rs in rings.items():
        assert all(close(r, rs[0]) for r in rs[1:]), rid
        assert np.abs(rs[0]).max() > 0  # written


def test_the_same_seed_gives_the_same_sampled_output(tiny) -> None:
    reqs = [(p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7 + i, logprobs=2))
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    runs = [drive(Engine(tiny[0], max_rows=8, max_model_len=64, page_size=4, speculative=1), reqs) for _ in range(2)]
    for rid in runs[0]:
        a, b = runs[0][rid], runs[1][rid]
        assert tokens_of(a) == tokens_of(b) and len(tokens_of(a)) == 12
        assert all(len(e.top_logprobs) == 2 and e.logprob is not None for e in a if e.token_id is not None)


@pytest.fixture(scope="module")
def small():
    """A tiny model of 32 tokens, its target logits at one position and the MTP block's draft logits there."""
    args = ModelArgs.tiny()
    args.vocab_size = 32
    model = DeepseekV4(args)
    model.load_weights(randomize(model, args, 4), strict=True)
    pools = StatePools(args, max_slots=1, max_positions=16, page_size=4, mtp=True)
    h = pools.alloc(16)
    toks = [3, 9, 17, 5, 11]
    for q, t in enumerate(toks):
        batch = model.make_batch(pools, [h], [q])
        hs = model.streams(batch, mx.array([t]), pools)
        target = mx.matmul(model.collapse(hs), model.head.weight.T)
        draft = draft_rows(model, pools, [h], [q], hs, [toks[q + 1] if q + 1 < len(toks) else 1])
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


def test_speculation_backs_off_while_requests_wait_for_a_full_batch(tiny) -> None:
    """max_rows 2, four requests: no draft is verified while two wait for the taken rows; once nobody waits the
    rows speculate (always-right drafts: each verify accepts)."""
    reqs = [(p, GREEDY) for p in PROMPTS]
    want = {rid: tokens_of(ev) for rid, ev in drive(Engine(tiny[0], max_rows=8, max_model_len=64, page_size=4),
                                                    reqs).items()}  # fmt: skip
    eng = Engine(tiny[0], max_rows=2, max_model_len=64, page_size=4, speculative=1)
    eng.speculator = Forced({f"r{i}": [] for i in range(4)}, want)
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
