"""fanout._pieces (a large JSON body written a piece at a time, off the event loop) against its plain twin, the
one json.dumps call JSONResponse makes."""

from __future__ import annotations

import json
import math
import random

import pytest

from dsv4_serve.service.api.fanout import _pieces


def plain(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def test_pieces_are_the_plain_body_byte_for_byte() -> None:
    rng = random.Random(63)
    tops = [{str(rng.randrange(512)): {"logprob": -rng.random() * 9, "rank": r, "decoded_token": "é\n\"x"}
             for r in range(20)} for _ in range(300)]  # fmt: skip
    body = {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "héllo\u2028", "finish_reason": "length", "stop_reason": None,
                     "logprobs": {"tokens": ["a"] * 500, "token_logprobs": [None, *(-1.5,) * 499],
                                  "top_logprobs": [None, *({"a": -0.25, "b": -3e-12} for _ in range(499))],
                                  "text_offset": list(range(500))},
                     "prompt_logprobs": [None, *tops]}],
        "usage": {"prompt_tokens": 500, "completion_tokens": 0, "total_tokens": 500},
        "empty": {}, "none": [], "nested": [[1, 2], [], {}], 7: True,
    }  # fmt: skip
    got = "".join(_pieces(body))
    assert got == plain(body)
    sse = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # the SSE chunks' encoder
    assert "".join(_pieces(body, sse)) == sse(body)
    assert len(list(_pieces(body))) > 1000  # in pieces, not one call


def test_a_non_finite_number_is_refused_as_json_response_refuses_it() -> None:
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            plain({"x": [bad]})
        with pytest.raises(ValueError):
            "".join(_pieces({"x": [0.0] * 100 + [bad]}))
