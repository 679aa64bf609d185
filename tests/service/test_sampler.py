"""Batched sampler vs numpy: greedy, truncation support, penalties, seeds, logprobs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.service.engine.request import SamplingParams as SP
from dsv4_serve.service.engine.sampler import apply_penalties, sample

V = 32


def logits_row(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, V).astype(np.float32)


def run(rows: np.ndarray, params: list[SP], counts: list[int] | None = None, hist=None, eos=None):
    b = len(params)
    return sample(
        mx.array(rows),
        params,
        hist if hist is not None else [[] for _ in range(b)],
        counts if counts is not None else [0] * b,
        eos_token_id=eos,
    )


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def draws(row: np.ndarray, n: int = 400, **kw) -> np.ndarray:
    """n seeded draws of one distribution, all in one batch (one row per seed)."""
    out = run(np.tile(row, (n, 1)), [SP(seed=s, **kw) for s in range(n)])
    return np.array([t for t, _, _ in out])


def test_greedy_is_argmax_lowest_index_on_ties() -> None:
    rows = np.stack([logits_row(i) for i in range(4)])
    rows[2, 5] = rows[2, 9] = rows[2].max() + 1.0
    out = run(rows, [SP(temperature=0.0)] * 3 + [SP(temperature=0.9)])
    assert [t for t, _, _ in out[:3]] == [int(np.argmax(rows[0])), int(np.argmax(rows[1])), 5]


def test_top_k_restricts_support() -> None:
    row = logits_row(1)
    got = set(draws(row, top_k=3).tolist())
    assert got == set(np.argsort(-row)[:3].tolist())


def test_top_p_restricts_support_to_the_nucleus() -> None:
    row = logits_row(2)
    p = np.exp(log_softmax(row))
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    nucleus = set(order[before < 0.6].tolist())
    got = set(draws(row, n=600, top_p=0.6).tolist())
    assert got <= nucleus and len(got) == len(nucleus)


def test_min_p_restricts_support() -> None:
    row = logits_row(3)
    p = np.exp(log_softmax(row))
    allowed = set(np.nonzero(p >= 0.2 * p.max())[0].tolist())
    got = set(draws(row, n=600, min_p=0.2).tolist())
    assert got <= allowed and len(got) == len(allowed)


def test_top_k_and_top_p_combine() -> None:
    row = logits_row(4)
    got = set(draws(row, top_k=5, top_p=0.3).tolist())
    top5 = np.argsort(-row)[:5]
    p = np.exp(log_softmax(row[top5]))
    keep = top5[(np.cumsum(p) - p) < 0.3]
    assert got == set(keep.tolist())


def test_draws_follow_the_tempered_distribution() -> None:
    row = np.array([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4), dtype=np.float32)
    n = 4000
    counts = np.bincount(draws(row, n=n, temperature=0.7), minlength=V)[:4] / n
    expect = np.exp(log_softmax(row / 0.7))[:4]
    np.testing.assert_allclose(counts, expect, atol=0.03)


def test_seeded_row_is_independent_of_its_batch() -> None:
    row = logits_row(5)
    alone = [run(row[None], [SP(seed=1234)], counts=[k])[0][0] for k in range(6)]
    others = np.stack([logits_row(i) for i in range(10, 17)])
    batched = []
    for k in range(6):
        rows = np.concatenate([others[:3], row[None], others[3:]])
        params = [SP(top_k=4), SP(seed=7), SP(temperature=0.0)] + [SP(seed=1234)] + [SP()] * 4
        batched.append(run(rows, params, counts=[k] * 8)[3][0])
    assert alone == batched
    assert len(set(alone)) > 1  # the step index changes the draw


def test_unseeded_rows_vary() -> None:
    row = np.zeros((1, V), dtype=np.float32)
    assert len({run(row, [SP()])[0][0] for _ in range(20)}) > 1


def test_penalties_match_numpy() -> None:
    rows = np.stack([logits_row(i) for i in range(3)])
    prompt = [1, 2, 3]
    gen = [[4, 4, 5, 1], [4, 4, 5, 1], [6]]
    params = [
        SP(repetition_penalty=1.5),
        SP(presence_penalty=0.5, frequency_penalty=0.25),
        SP(),
    ]
    hist = [prompt + g for g in gen]
    got = np.array(apply_penalties(mx.array(rows), params, hist, [len(g) for g in gen]))
    want = rows.copy()
    seen = sorted(set(hist[0]))
    want[0, seen] = np.where(rows[0, seen] > 0, rows[0, seen] / 1.5, rows[0, seen] * 1.5)
    cnt = np.bincount(gen[1], minlength=V)  # generated tokens only: prompt token 2/3 untouched
    want[1] = rows[1] - 0.25 * cnt - 0.5 * (cnt > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_penalty_steers_greedy() -> None:
    row = np.zeros((1, V), dtype=np.float32)
    row[0, 3] = 1.0
    row[0, 4] = 0.9
    out = run(row, [SP(temperature=0.0, frequency_penalty=1.0)], counts=[1], hist=[[9, 3]])
    assert out[0][0] == 4


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    row = np.zeros((1, V), dtype=np.float32)
    row[0, 2] = 9.0  # EOS
    row[0, 7] = 8.0  # a stop id
    p = SP(temperature=0.0, min_tokens=2, stop_token_ids=(7,))
    assert run(row, [p], counts=[0], eos=2)[0][0] not in (2, 7)
    assert run(row, [p], counts=[2], eos=2)[0][0] == 2
    ign = SP(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert run(row, [ign], counts=[0], eos=2)[0][0] == 2  # ignore_eos: EOS is an ordinary token


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_logprobs_match_numpy_log_softmax(temperature: float) -> None:
    rows = np.stack([logits_row(20), logits_row(21)])
    params = [SP(temperature=temperature, logprobs=3, seed=3), SP(temperature=temperature, logprobs=0, seed=4)]
    out = run(rows, params)
    lp = log_softmax(rows / (temperature or 1.0))
    for i, (tok, logprob, _) in enumerate(out):
        assert logprob == pytest.approx(lp[i, tok], abs=1e-5)
    top = out[0][2]
    want = np.argsort(-lp[0], kind="stable")[:3]
    assert [t for t, _ in top] == want.tolist()
    np.testing.assert_allclose([v for _, v in top], lp[0, want], atol=1e-5)
    assert out[1][2] == ()


def test_no_logprobs_requested() -> None:
    out = run(logits_row(0)[None], [SP(temperature=0.0)])
    assert out[0][1] is None and out[0][2] == ()


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        sample(mx.zeros((2, V)), [SP()], [[]], [0])


def test_logit_bias_adds_per_row_and_steers_greedy() -> None:
    rows = np.stack([logits_row(1), logits_row(1), logits_row(2)])
    top = int(np.argmax(rows[0]))
    params = [SP(temperature=0.0, logprobs=0), SP(temperature=0.0, logprobs=0, logit_bias=((top, -100.0),)),
              SP(temperature=0.0, logprobs=0, logit_bias=((3, 100.0), (4, -1.0)))]  # fmt: skip
    out = run(rows, params)
    assert out[0][0] == top and out[1][0] != top and out[2][0] == 3
    biased = rows[1].copy()
    biased[top] -= 100
    assert out[1][0] == int(np.argmax(biased))
    assert abs(out[1][1] - log_softmax(biased)[out[1][0]]) < 1e-5  # logprobs see the bias (processed)
