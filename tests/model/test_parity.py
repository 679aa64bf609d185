"""Parity with transformers' DeepseekV4ForCausalLM on tiny random checkpoints written by make-tiny (fp32).

A ~260-token prompt crosses CSA boundaries and the HCA boundary at position 255 and makes the indexer
really select (65 entries -> 4); then 32 greedy decode steps. Same greedy ids, max |logit diff| <= 1e-4 at
every step, with the prompt prefilled in chunks of 1, 7 and 64 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_serve.model.loader import load_model
from dsv4_serve.model.state import StatePools
from tests.oracle import hf_greedy, hf_load

PROMPT_LEN, STEPS = 262, 32


@pytest.fixture(scope="module", params=[0, 1], ids=["seed0", "seed1"])
def case(request, tmp_path_factory):
    from dsv4_serve.model.cli import make_tiny_main

    seed = request.param
    ckpt = tmp_path_factory.mktemp(f"tiny{seed}")
    make_tiny_main([str(ckpt), "--seed", str(seed), "--dtype", "float32"])
    model, args = load_model(ckpt, clamp_shared_expert=True)  # transformers clamps the shared expert
    rng = np.random.default_rng(100 + seed)
    prompt = [int(t) for t in rng.integers(2, args.vocab_size, PROMPT_LEN)]
    hf_ids, hf_logits = hf_greedy(hf_load(ckpt), prompt, STEPS)
    return model, args, prompt, hf_ids, hf_logits


def run_ours(model, args, prompt, chunk):
    cap = len(prompt) + STEPS + 1
    pools = StatePools(args, max_slots=1, max_positions=cap, page_size=16)
    h = pools.alloc(cap)
    for s in range(0, len(prompt), chunk):
        last = model.prefill(pools, h, prompt[s : s + chunk], s)
    logits = [np.array(last)]
    ids = [int(np.argmax(logits[-1]))]
    for i in range(STEPS):
        lg = np.array(model.decode(pools, [h], [ids[-1]], [len(prompt) + i])[0])
        logits.append(lg)
        ids.append(int(np.argmax(lg)))
    return ids, logits


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_matches_transformers(case, chunk):
    model, args, prompt, hf_ids, hf_logits = case
    ids, logits = run_ours(model, args, prompt, chunk)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(logits, hf_logits, strict=True)]
    print(f"chunk {chunk}: max |logit diff| {max(diffs):.2e} over {len(diffs)} steps")
    assert ids == hf_ids
    assert max(diffs) <= 1e-4
