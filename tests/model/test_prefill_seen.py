"""A prefill forward whose queries each see at most the top-k entries (the release's 512 of ratio 4: a prompt's
first 2,048 positions) takes its CSA picks from `every_visible` (made on the host, no scores) and must equal the
prompt fed token by token through the decode step: last-token logits within 1e-4, the same state, the same greedy
ids after (fp32, the tiny model with its index_topk raised past the prompt's entries; the tiny model's own topk of
4 keeps the scored path, tests/model/test_prefill_batch.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dsv4_serve.model import prefill
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.deepseek_v4 import DeepseekV4
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import is_f32_resident, randomize, weights_as_stored
from tests.model.test_prefill import assert_same_state
from tests.model.test_prefill_batch import slot_state

PAGE, LENS, GEN = 8, (150, 61), 12


def model_with_topk(topk: int) -> tuple[DeepseekV4, ModelArgs]:
    args = ModelArgs.tiny()
    args.index_topk = topk
    model = DeepseekV4(args)
    stored = weights_as_stored()
    model.load_weights([(n, w if w.dtype == mx.int32 or is_f32_resident(n, stored) else w.astype(mx.float32))
                        for n, w in randomize(model, args, 0)], strict=True)  # fmt: skip
    mx.eval(model.parameters())
    return model, args


def test_a_forward_whose_queries_keep_every_entry_equals_decoding(monkeypatch) -> None:
    model, args = model_with_topk(64)  # > 150 // 4 entries
    taken = []
    real = prefill.every_visible
    monkeypatch.setattr(prefill, "every_visible", lambda *a: (lambda s: (taken.append(s is not None), s)[1])(real(*a)))
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, args.vocab_size, n)] for n in LENS]
    ref = StatePools(args, max_slots=2, max_positions=max(LENS) + GEN + 8, page_size=PAGE)
    pools = StatePools(args, max_slots=2, max_positions=max(LENS) + GEN + 8, page_size=PAGE)
    hr = [ref.alloc(max(LENS) + GEN) for _ in prompts]
    hp = [pools.alloc(max(LENS) + GEN) for _ in prompts]
    want = []
    for p, h in zip(prompts, hr, strict=True):
        for i, t in enumerate(p):
            last = np.array(model.decode(ref, [h], [t], [i])[0])
        want.append(last)
    got = prefill.prefill_batch(model, pools, [(h, p, 0) for h, p in zip(hp, prompts, strict=True)])
    mx.eval(got, pools.arrays())
    assert taken == [True]
    for g, w, p, a, b in zip(got, want, prompts, hr, hp, strict=True):
        np.testing.assert_allclose(np.array(g), w, atol=1e-4, rtol=0)
        assert_same_state(slot_state(pools, b, args, len(p)), slot_state(ref, a, args, len(p)))
    for pl, hs in ((ref, hr), (pools, hp)):  # the same greedy ids after, both batched
        toks = [int(np.argmax(w)) for w in want]
        out = []
        for i in range(GEN):
            logits = model.decode(pl, hs, toks, [len(p) + i for p in prompts])
            toks = [int(x) for x in np.array(mx.argmax(logits, axis=-1))]
            out.append(toks)
        if pl is ref:
            ref_ids = out
    assert out == ref_ids
