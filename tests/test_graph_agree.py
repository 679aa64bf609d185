"""tools/graph_agree.py's comparison: equal token ids agree, a differing one is named, and files whose tokens
cannot tell outputs apart (a server without a tokenizer names every token "" unless asked for ids) fail."""

from __future__ import annotations

from tools.graph_agree import compare


def run(*requests: list[str]) -> dict:
    rows = [{"tokens": list(t)} for t in requests]
    return {"joins_and_leaves": rows, "prefix_hits": rows}


def test_equal_ids_agree_and_a_differing_one_is_named() -> None:
    a = run(["token_id:5", "token_id:9"], ["token_id:7"])
    assert compare(a, run(["token_id:5", "token_id:9"], ["token_id:7"])) is None
    why = compare(a, run(["token_id:5", "token_id:8"], ["token_id:7"]))
    assert why is not None and "request 0: token 1 differs" in why


def test_tokens_that_name_nothing_fail() -> None:
    empty = run(["", ""], [""])
    assert compare(empty, empty) is not None  # what every dummy-weight comparison compared before
    one = run(["token_id:3", "token_id:3"], ["token_id:3"])
    assert compare(one, one) is not None
