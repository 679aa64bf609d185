"""Grammar masks: the packed mask applied in MLX against a numpy twin, guided rows in the batched sampler,
and a guided row driven by its masks staying inside its grammar."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from dsv4_serve.model.tokenizer import build_tiny_tokenizer
from dsv4_serve.service.engine import grammar
from dsv4_serve.service.engine.request import Request, SamplingParams
from dsv4_serve.service.engine.sampler import apply_masks, sample

V = 512


def test_apply_masks_equals_numpy_twin() -> None:
    rng = np.random.default_rng(0)
    masks = rng.integers(-(2**31), 2**31, size=(3, V // 32), dtype=np.int64).astype(np.int32)
    x = rng.standard_normal((3, V)).astype(np.float32)
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    np.testing.assert_array_equal(np.array(apply_masks(mx.array(x), masks)), np.where(bits, x, -np.inf))


def test_sampler_masks_only_guided_rows() -> None:
    logits = mx.array(np.random.default_rng(1).standard_normal((2, V)).astype(np.float32))
    masks = np.full((2, V // 32), -1, dtype=np.int32)
    masks[0] = 0
    masks.view(np.uint32)[0, 300 // 32] = 1 << (300 % 32)  # row 0: only token 300
    p = SamplingParams(temperature=0.0)
    out = sample(logits, [p, p], [[], []], [0, 0], masks=masks)
    assert out[0][0] == 300
    assert out[1][0] == int(np.argmax(np.array(logits[1])))  # row 1 untouched


def test_masks_keep_a_row_in_its_grammar() -> None:
    tok = build_tiny_tokenizer(V)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    guide = grammar.compile_guide(tok, V, 1, grammar.json_format(schema), "response_format")
    guides = grammar.Guides(V, 1)
    plain = Request("p", [0], SamplingParams())
    for seed in range(5):
        r, rng = Request(f"r{seed}", [0], SamplingParams(guide=guide)), np.random.default_rng(seed)
        while True:
            masks = guides.masks([plain, r])
            assert masks is not None and (masks[0] == -1).all()
            t = int(rng.choice(grammar.tokens_allowed(masks, 1, V)))
            if t == 1:
                break
            r.output_ids.append(t)
        value = json.loads(tok.decode(r.output_ids))
        assert isinstance(value["a"], int) and len(value["b"]) <= 4
    assert guides.masks([plain]) is None  # no guided row: no mask at all
