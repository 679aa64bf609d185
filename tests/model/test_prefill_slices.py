"""A prefill forward built a layer at a time (model/prefill.py `Forward`) with decode steps of another
request between its slices (fp32, tiny model), as the engine runs it while other rows stream.

References, each computed alone: the prompt fed token by token through the decode step, and the other
request's greedy decode. Interleaved, the prompt's state and last-token logits must equal its reference
(the decode steps touch only their own slot, and each layer's pools are read when that layer is built),
and the other request must emit the same ids as alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.prefill import Forward
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from tests.model.test_prefill import assert_same_state
from tests.model.test_prefill_batch import slot_state

PAGE, LEN, STEPS = 8, 150, 12


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


def greedy(model, pools: StatePools, h, first: int, start: int, n: int) -> list[int]:
    out, tok = [], first
    for i in range(n):
        tok = int(mx.argmax(model.decode(pools, [h], [tok], [start + i])[0]).item())
        out.append(tok)
    return out


def test_slices_with_decode_steps_between_equal_each_alone(tiny) -> None:
    model, args = tiny
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, args.vocab_size, LEN)]
    ref_pools = StatePools(args, max_slots=2, max_positions=LEN + 8, page_size=PAGE)
    ref_h = ref_pools.alloc(LEN + 8)
    for i, t in enumerate(prompt):
        ref_last = np.array(model.decode(ref_pools, [ref_h], [t], [i])[0])
    ref_state = slot_state(ref_pools, ref_h, args, LEN)
    # The stream alone: 5 prompt tokens, then greedy steps.
    alone = StatePools(args, max_slots=2, max_positions=LEN + 8, page_size=PAGE)
    s = alone.alloc(64)
    for i, t in enumerate([7, 8, 9, 10]):
        model.decode(alone, [s], [t], [i])
    want = greedy(model, alone, s, 11, 4, STEPS)

    pools = StatePools(args, max_slots=2, max_positions=LEN + 8, page_size=PAGE)
    s = pools.alloc(64)
    for i, t in enumerate([7, 8, 9, 10]):
        model.decode(pools, [s], [t], [i])
    h = pools.alloc(LEN + 8)
    head = Forward(model, pools, [(h, prompt[:-1], 0)], logits=False)  # the engine's form: all but the last
    got, tok, slices = [], 11, 0
    while not head.advance(0.0):  # one layer a slice
        slices += 1
        assert head.built == slices
        tok = int(mx.argmax(model.decode(pools, [s], [tok], [4 + len(got)])[0]).item())
        got.append(tok)
    assert head.out is None and head.built == slices + 1 == args.num_hidden_layers  # the last slice ends it
    last = np.array(model.decode(pools, [h], [prompt[-1]], [LEN - 1])[0])
    got += greedy(model, pools, s, tok, 4 + len(got), STEPS - len(got))
    assert got == want
    np.testing.assert_allclose(last, ref_last, atol=1e-4, rtol=0)
    assert_same_state(slot_state(pools, h, args, LEN), ref_state)


def test_whole_forward_returns_the_logits_and_checks_its_work(tiny) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=2, max_positions=64, page_size=PAGE)
    h = pools.alloc(32)
    fwd = Forward(model, pools, [(h, [1, 2, 3], 0)])
    assert fwd.advance(None) and fwd.built == args.num_hidden_layers and fwd.out[0].shape == (args.vocab_size,)
    assert fwd.advance(0.0)  # built: nothing more to do
    with pytest.raises(ValueError, match="token_ids must not be empty"):
        Forward(model, pools, [(h, [], 0)])


def test_a_slice_stops_at_its_rows_by_layers(tiny) -> None:
    """`rows_layers` bounds a slice's GPU work where its host time does not: 10 rows, 25 -> 2 layers a slice."""
    model, args = tiny
    pools = StatePools(args, max_slots=2, max_positions=64, page_size=PAGE)
    h = pools.alloc(32)
    fwd = Forward(model, pools, [(h, list(range(3, 13)), 0)], logits=False)
    built = []
    while not fwd.advance(1e9, rows_layers=25):
        built.append(fwd.built)
    assert built == list(range(2, args.num_hidden_layers, 2)) and fwd.built == args.num_hidden_layers


def test_a_scored_chunk_in_a_sliced_shared_forward_equals_its_whole_forward(tiny) -> None:
    """`every` one flag a chunk (prompt logprobs through the shared, sliced forward): the scored chunk gets
    every token's logits, the same as its own whole forward `every=True` (the path before), the other chunk
    none; decode steps of a third slot between the slices change neither, and both states are their own."""
    model, args = tiny
    rng = np.random.default_rng(5)
    a, b = ([int(t) for t in rng.integers(0, args.vocab_size, n)] for n in (40, 57))
    alone = StatePools(args, max_slots=2, max_positions=LEN + 8, page_size=PAGE)
    ha, hb = alone.alloc(LEN), alone.alloc(LEN)
    Forward(model, alone, [(ha, a, 0)], logits=False).advance(None)
    whole = Forward(model, alone, [(hb, b, 0)], every=True)
    whole.advance(None)
    want = np.array(whole.out[0])
    mx.eval(alone.arrays())

    pools = StatePools(args, max_slots=3, max_positions=LEN + 8, page_size=PAGE)
    s = pools.alloc(64)
    pa, pb = pools.alloc(LEN), pools.alloc(LEN)
    fwd = Forward(model, pools, [(pa, a, 0), (pb, b, 0)], logits=False, every=[False, True])
    tok, steps = 7, 0
    while not fwd.advance(0.0):  # a layer a slice, then the every-row head alone; a decode step of slot s after each
        tok = int(mx.argmax(model.decode(pools, [s], [tok], [steps])[0]).item())
        steps += 1
    assert steps == args.num_hidden_layers and fwd.built == args.num_hidden_layers
    assert fwd.out[0] is None and fwd.out[1].shape == (len(b), args.vocab_size)
    np.testing.assert_allclose(np.array(fwd.out[1]), want, atol=1e-5, rtol=0)
    mx.eval(pools.arrays())
    for h, g, n in ((pa, ha, len(a)), (pb, hb, len(b))):
        assert_same_state(slot_state(pools, h, args, n), slot_state(alone, g, args, n))
    with pytest.raises(ValueError, match="every has 1 entries for 2 chunks"):
        Forward(model, pools, [(pa, a, 0), (pb, b, 0)], every=[True])
