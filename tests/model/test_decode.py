"""Incremental decode vs full recompute, chunked prefill, and batch invariance (fp32, tiny model)."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


def greedy(model, pools, handle, prompt, steps):
    """Prefill then greedy decode; returns ids and the logits that produced each id."""
    logits = [np.array(model.prefill(pools, handle, prompt, 0))]
    ids = [int(np.argmax(logits[-1]))]
    for i in range(steps - 1):
        lg = model.decode(pools, [handle], [ids[-1]], [len(prompt) + i])[0]
        logits.append(np.array(lg))
        ids.append(int(np.argmax(logits[-1])))
    return ids, logits


def test_incremental_equals_full_recompute(tiny):
    """Each decode step's logits equal a fresh request recomputing the whole sequence so far.

    The recompute runs in a reused slot with reused pages, so this also checks that freeing and re-admitting
    leaves no trace of the previous request."""
    model, args = tiny
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, args.vocab_size, 135)]
    pools = StatePools(args, max_slots=2, max_positions=200, page_size=8)
    h = pools.alloc(200)
    ids, logits = greedy(model, pools, h, prompt, 6)
    pools.free(h)
    for k in (0, 3, 5):
        h2 = pools.alloc(200)
        full = np.array(model.prefill(pools, h2, prompt + ids[:k], 0))
        pools.free(h2)
        assert np.max(np.abs(full - logits[k])) <= 1e-5


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_equals_token_by_token(tiny, chunk):
    model, args = tiny
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(0, args.vocab_size, 140)]
    pools = StatePools(args, max_slots=2, max_positions=160, page_size=8)
    a, b = pools.alloc(160), pools.alloc(160)
    for i, t in enumerate(prompt):
        last_a = model.decode(pools, [a], [t], [i])[0]
    for s in range(0, len(prompt), chunk):
        last_b = model.prefill(pools, b, prompt[s : s + chunk], s)
    # The parallel prefill sums in another order: equal to f32 rounding.
    assert np.max(np.abs(np.array(last_a) - np.array(last_b))) <= 1e-5
    # The whole state of the two slots is the same.
    for arr in pools.window:
        np.testing.assert_allclose(np.array(arr[a.slot]), np.array(arr[b.slot]), atol=1e-5, rtol=0)
    for layer, pool in pools.ckv.items():
        r = args.compress_ratios[layer]
        n = len(prompt) // r
        ea = np.concatenate([np.array(pool[p]) for p in a.tables[r]])[:n]
        eb = np.concatenate([np.array(pool[p]) for p in b.tables[r]])[:n]
        np.testing.assert_allclose(ea, eb, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_batch_invariance_8_rows(tiny):
    """8 rows with prompts of 1..300 tokens decoded together (prefilling and decoding rows mixed in one step)
    give each row the ids and logits it gets alone."""
    model, args = tiny
    rng = np.random.default_rng(3)
    lengths = [1, 300, 37, 128, 5, 255, 90, 211]
    prompts = [[int(t) for t in rng.integers(0, args.vocab_size, n)] for n in lengths]
    steps = 32
    cap = max(lengths) + steps
    pools = StatePools(args, max_slots=8, max_positions=cap, page_size=16)
    # Rows in an order unrelated to their slots.
    handles = [pools.alloc(cap) for _ in range(8)][::-1]
    fed = [0] * 8
    out: list[list[int]] = [[] for _ in range(8)]
    out_logits: list[list[np.ndarray]] = [[] for _ in range(8)]
    while any(len(o) < steps for o in out):
        rows = [i for i in range(8) if len(out[i]) < steps]
        toks = [prompts[i][fed[i]] if fed[i] < len(prompts[i]) else out[i][-1] for i in rows]
        lg = model.decode(pools, [handles[i] for i in rows], toks, [fed[i] for i in rows])
        lg = np.array(lg)
        for j, i in enumerate(rows):
            fed[i] += 1
            if fed[i] >= len(prompts[i]):
                out_logits[i].append(lg[j])
                out[i].append(int(np.argmax(lg[j])))
    for h in handles:
        pools.free(h)
    for i in range(8):
        h = pools.alloc(cap)
        ids, logits = greedy(model, pools, h, prompts[i], steps)
        pools.free(h)
        assert ids == out[i], f"row {i} (prompt {lengths[i]})"
        assert max(np.max(np.abs(a - b)) for a, b in zip(logits, out_logits[i], strict=True)) <= 1e-5


def test_state_bytes_exact(tiny):
    """Byte accounting equals the arrays a request actually touches (window + compressor state + its pages)."""
    _, args = tiny
    pools = StatePools(args, max_slots=3, max_positions=300, page_size=8)
    slot = sum(a[0].nbytes for a in pools.window)
    for d in (pools.comp_kv, pools.comp_score, pools.idx_kv, pools.idx_score):
        slot += sum(a[0].nbytes for a in d.values())
    assert pools.slot_bytes() == slot
    h = pools.alloc(300)
    pages = sum(pool[0].nbytes * len(h.tables[args.compress_ratios[layer]]) for layer, pool in pools.ckv.items())
    pages += sum(pool[0].nbytes * len(h.tables[4]) for pool in pools.ikeys.values())
    assert pools.bytes_in_use() == slot + pages
    pools.free(h)
    assert pools.bytes_in_use() == 0
    assert pools.can_alloc(300)
    with pytest.raises(ValueError, match="positions"):
        pools.alloc(301)



@pytest.mark.parametrize("slots", [1, 3])
def test_state_arrays_stay_row_contiguous_buffers(tiny, slots):
    """The in-place compressor (kernels.compressor_rows_inplace) writes through the state arrays' buffers,
    and MLX hands a custom kernel a copy of any array that is not row-contiguous, so the writes would be
    lost. Every state / pool array is a full row-major buffer after creation and after a slot reset (with
    one slot MLX's whole-array slice update returns a broadcast scalar: strides 0)."""
    import mlx.core as mx

    model, args = tiny
    pools = StatePools(args, max_slots=slots, max_positions=64, page_size=8)
    for step in ("created", "slot reset", "prefill"):
        if step == "slot reset":
            h = pools.alloc(16)
        if step == "prefill":
            model.prefill(pools, h, list(range(3, 12)), 0, logits=False)
        for name in ("comp_kv", "comp_score", "idx_kv", "idx_score", "ckv", "ikeys"):
            for layer, a in getattr(pools, name).items():
                mx.eval(a)
                got = memoryview(a).strides
                want = [int(np.prod(a.shape[i + 1 :])) * a.itemsize for i in range(a.ndim)]
                big = [i for i, n in enumerate(a.shape) if n > 1]  # a dimension of size 1 may have any stride
                assert [got[i] for i in big] == [want[i] for i in big], (step, name, layer, got)
