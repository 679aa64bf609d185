"""The parallel prefill (model/prefill.py) against token-by-token decoding (fp32, tiny model).

The reference is the batched decode step fed one token at a time: the same request fed in chunks
of any size must end with the same last-token logits and the same state in every pool (window
ring, compressor windows with their stale rows, compressed entries, indexer keys), to f32
summation order. The tiny model has sliding, CSA (ratio 4, indexer top-4) and HCA (ratio 128)
layers; the 300-token prompt crosses HCA's first window and keeps the indexer selecting.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model

PAGE, LEN = 8, 300


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


@pytest.fixture(scope="module")
def serial(tiny):
    """The prompt fed token by token through decode: (pools, handle, last logits)."""
    model, args = tiny
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, args.vocab_size, LEN)]
    pools = StatePools(args, max_slots=3, max_positions=LEN + 8, page_size=PAGE)
    h = pools.alloc(LEN + 8)
    last = None
    for i, t in enumerate(prompt):
        last = model.decode(pools, [h], [t], [i])[0]
    return prompt, pools, h, np.array(last)


def slot_state(pools: StatePools, h, args) -> dict[str, np.ndarray]:
    """Everything the request owns: its slot's rows and its pages' entries (not the trash page)."""
    out = {}
    for i, w in enumerate(pools.window):
        out[f"window{i}"] = np.array(w[h.slot])
    for name in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
        for layer, arr in getattr(pools, name).items():
            out[f"{name}{layer}"] = np.array(arr[h.slot])
    for name in ("ckv", "ikeys"):
        for layer, arr in getattr(pools, name).items():
            r = args.compress_ratios[layer]
            n = h.capacity and min(LEN, h.capacity) // r
            out[f"{name}{layer}"] = np.concatenate([np.array(arr[p]) for p in h.tables[r]])[:n]
    return out


def assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert np.array_equal(np.isinf(x), np.isinf(y)), k  # -inf scores of windows not yet written
        fin = np.isfinite(x)
        np.testing.assert_allclose(x[fin], y[fin], atol=1e-5, rtol=0, err_msg=k)


@pytest.mark.parametrize("chunks", [[LEN], [1, 2, 3, 294], [7] * 42 + [6], [128, 128, 44], [3, 130, 167]])
def test_prefill_chunks_equal_token_by_token(tiny, serial, chunks) -> None:
    model, args = tiny
    prompt, ref_pools, ref_h, ref_last = serial
    pools = StatePools(args, max_slots=3, max_positions=LEN + 8, page_size=PAGE)
    other = pools.alloc(LEN + 8)  # a neighbour in slot 0 whose state must not move
    model.decode(pools, [other], [11], [0])
    before = slot_state(pools, other, args)
    h = pools.alloc(LEN + 8)
    start, last = 0, None
    for c in chunks:
        last = model.prefill(pools, h, prompt[start : start + c], start, chunk=c)
        start += c
    assert start == LEN
    assert np.max(np.abs(np.array(last) - ref_last)) <= 1e-5
    assert_same_state(slot_state(pools, h, args), slot_state(ref_pools, ref_h, args))
    after = slot_state(pools, other, args)
    for k in before:
        assert np.array_equal(before[k], after[k]), k


@pytest.mark.parametrize("chunks", [[LEN], [7] * 42 + [6], [3, 130, 167]])
def test_compiled_prefill_equals_token_by_token(tiny, serial, monkeypatch, chunks) -> None:
    """DSV4_PREFILL_COMPILE=1 (the layers' compiled segments, the compiled pooled entries and indexer scores):
    the logits and state of token-by-token decoding, as the plain forward leaves them."""
    monkeypatch.setenv("DSV4_PREFILL_COMPILE", "1")
    model, args = tiny
    prompt, ref_pools, ref_h, ref_last = serial
    pools = StatePools(args, max_slots=1, max_positions=LEN + 8, page_size=PAGE)
    h = pools.alloc(LEN + 8)
    start, last = 0, None
    for c in chunks:
        last = model.prefill(pools, h, prompt[start : start + c], start, chunk=c)
        start += c
    assert np.max(np.abs(np.array(last) - ref_last)) <= 1e-5
    assert_same_state(slot_state(pools, h, args), slot_state(ref_pools, ref_h, args))


def test_prefill_indexer_scores_in_blocks(tiny, serial, monkeypatch) -> None:
    """Long contexts score the indexer's queries in blocks (bounded memory): same ids, same logits."""
    import dsv4_serve.kernels.indexer_scores as scores

    model, args = tiny
    prompt, _, _, ref_last = serial
    monkeypatch.setattr(scores, "SCORE_BYTES", args.index_n_heads * 4 * 80 * 7)  # ~7 queries per block
    pools = StatePools(args, max_slots=1, max_positions=LEN + 8, page_size=PAGE)
    h = pools.alloc(LEN + 8)
    last = model.prefill(pools, h, prompt, 0, chunk=LEN)
    assert np.max(np.abs(np.array(last) - ref_last)) <= 1e-5


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 128])
def test_prefill_attends_in_query_blocks(tiny, serial, monkeypatch, block) -> None:
    """Queries attended ATTN_BLOCK at a time (each block over its own window keys): the logits and state of
    token-by-token decoding, blocks that split the window's ring reach and CSA / HCA entries included."""
    import importlib

    pa = importlib.import_module("dsv4_serve.kernels.prefill_attention")  # the module (the package's attribute: the op)

    model, args = tiny
    prompt, ref_pools, ref_h, ref_last = serial
    monkeypatch.setattr(pa, "ATTN_BLOCK", block)
    pools = StatePools(args, max_slots=1, max_positions=LEN + 8, page_size=PAGE)
    h = pools.alloc(LEN + 8)
    model.prefill(pools, h, prompt[:37], 0, chunk=37)  # the second chunk's first block reaches into the ring
    last = model.prefill(pools, h, prompt[37:], 37, chunk=LEN)
    assert np.max(np.abs(np.array(last) - ref_last)) <= 1e-5
    assert_same_state(slot_state(pools, h, args), slot_state(ref_pools, ref_h, args))


def test_prefill_after_decode_steps_then_decode(tiny) -> None:
    """Decode a few tokens, prefill a chunk from there (start not window-aligned), decode on: the ids
    and logits are those of token-by-token decoding all along."""
    model, args = tiny
    rng = np.random.default_rng(9)
    seq = [int(t) for t in rng.integers(0, args.vocab_size, 150)]
    pools = StatePools(args, max_slots=2, max_positions=200, page_size=PAGE)
    a, b = pools.alloc(200), pools.alloc(200)
    for i, t in enumerate(seq):
        la = model.decode(pools, [a], [t], [i])[0]
    for i, t in enumerate(seq[:5]):
        model.decode(pools, [b], [t], [i])
    lb = model.prefill(pools, b, seq[5:], 5, chunk=61)
    assert np.max(np.abs(np.array(la) - np.array(lb))) <= 1e-5
    nxt = int(np.argmax(np.array(la)))
    for k in range(4):  # both continue greedily, batched together
        out = model.decode(pools, [a, b], [nxt, nxt], [len(seq) + k] * 2)
        assert np.max(np.abs(np.array(out[0]) - np.array(out[1]))) <= 1e-5
        nxt = int(np.argmax(np.array(out[0])))


def test_prefill_rejects_bad_arguments(tiny) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=1, max_positions=32, page_size=PAGE)
    h = pools.alloc(16)
    with pytest.raises(ValueError, match="token_ids must not be empty"):
        model.prefill(pools, h, [], 0)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        model.prefill(pools, h, [1, 2], 0, chunk=0)
    with pytest.raises(ValueError, match="outside the request's capacity 16"):
        model.prefill(pools, h, [1] * 10, 10)


def test_copy_slot_gives_the_same_state_and_continuation(tiny, serial) -> None:
    """StatePools.copy_slot (n > 1 sampling): the copy holds what the source holds after `positions` positions,
    and both rows then decode the same logits; a neighbour's slot does not move."""
    model, args = tiny
    prompt, ref_pools, ref_h, _ = serial
    pools = StatePools(args, max_slots=3, max_positions=LEN + 8, page_size=PAGE)
    src = pools.alloc(LEN + 8)
    other = pools.alloc(LEN + 8)
    model.decode(pools, [other], [11], [0])
    before = slot_state(pools, other, args)
    model.prefill(pools, src, prompt[: LEN - 1], 0)
    dst = pools.alloc(LEN + 8)
    pools.copy_slot(src, dst, LEN - 1)
    a, b = model.decode(pools, [src, dst], [prompt[-1]] * 2, [LEN - 1] * 2)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    assert_same_state(slot_state(pools, dst, args), slot_state(ref_pools, ref_h, args))
    assert_same_state(slot_state(pools, other, args), before)
    with pytest.raises(ValueError, match="positions"):
        pools.copy_slot(src, dst, LEN + 9)
    with pytest.raises(ValueError, match="same slot"):
        pools.copy_slot(src, src, 1)


def test_every_position_logits_equal_the_last_token_logits(tiny, serial) -> None:
    """prefill(every=True) (prompt logprobs): row t is what a prefill ending at token t returns."""
    model, args = tiny
    prompt = serial[0][:40]
    pools = StatePools(args, max_slots=2, max_positions=LEN + 8, page_size=PAGE)
    h = pools.alloc(LEN + 8)
    rows = np.array(model.prefill(pools, h, prompt, 0, chunk=16, every=True))
    assert rows.shape == (40, args.vocab_size)
    for t in (0, 15, 16, 39):
        g = pools.alloc(LEN + 8)
        last = np.array(model.prefill(pools, g, prompt[: t + 1], 0))
        pools.free(g)
        assert np.max(np.abs(rows[t] - last)) <= 1e-5
