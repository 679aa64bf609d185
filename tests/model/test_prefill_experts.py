"""A quantized tiny model (mxfp8 dense, mxfp4 routed experts): the parallel prefill, whose routed experts
run grouped (kernels/experts_grouped.py, > 8 rows), ends with the logits of token-by-token decode, whose
experts run per (row, k) pair; and so does the prefill with the grouped path off."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_serve.kernels import experts_grouped as eg
from dsv4_serve.model.quant import quantize_model
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model

LEN = 40


@pytest.fixture(scope="module")
def quantized():
    model, args, _ = tiny_model(seed=1)
    quantize_model(model)
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, args.vocab_size, LEN)]
    pools = StatePools(args, max_slots=1, max_positions=LEN + 8, page_size=8)
    h = pools.alloc(LEN + 8)
    for i, t in enumerate(prompt):
        last = model.decode(pools, [h], [t], [i])[0]
    return model, args, prompt, np.array(last)


@pytest.mark.parametrize("how", ["tiles", "qtiles", "off"])
def test_prefill_with_grouped_experts_ends_as_decode(quantized, how: str, monkeypatch) -> None:
    model, args, prompt, want = quantized
    monkeypatch.setenv(eg.ENV, how)
    model.reset_compiled()  # the compiled segments captured the experts' form of the previous arm
    pools = StatePools(args, max_slots=1, max_positions=LEN + 8, page_size=8)
    got = np.array(model.prefill(pools, pools.alloc(LEN + 8), prompt, 0, chunk=LEN))
    model.reset_compiled()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
