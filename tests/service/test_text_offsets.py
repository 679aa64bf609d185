"""Special tokens kept out of the text, text_offset after partial UTF-8 sequences and held-back stop strings,
byte-true token strings: service/api/chat.py on byte-level tokenizers."""

from __future__ import annotations

import pytest

from dsv4_serve.model.tokenizer import build_tiny_tokenizer
from dsv4_serve.service.api.chat import TextStream, Utf8Offsets, special_tokens, text_offsets, token_bytes, token_text


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(512)


def offsets(pieces: list[bytes]) -> list[int]:
    u = Utf8Offsets()
    return [u.push(p) for p in pieces]


@pytest.mark.parametrize(("pieces", "want"), [
    ([b"a", b"\xc3", b"\xa9", b"b"], [0, 1, 1, 2]),  # the second half of "é" points at its start
    ([b"\xe2", b"\x82", b"\xac", b"z"], [0, 0, 0, 1]),  # "€" in three tokens
    ([b"a", b"\xc3", b"x", b"b"], [0, 1, 2, 3]),  # an unfinished sequence becomes U+FFFD before "x"
    ([b"a", b"\x80", b"x"], [0, 1, 2]),  # a lone continuation byte is U+FFFD at once
    ([b"\xf0\x9f", b"\x98\x80b", b"c"], [0, 0, 2]),  # "😀" split, then "b" in the same token
])  # fmt: skip
def test_utf8_offsets(pieces: list[bytes], want: list[int]) -> None:
    assert offsets(pieces) == want
    text = b"".join(pieces).decode("utf-8", "replace")
    assert all(o <= len(text) for o in want)


def test_token_bytes_and_text(tok) -> None:
    ids = tok.encode("é", add_special_tokens=False).ids
    assert len(ids) == 2 and b"".join(token_bytes(tok, i) for i in ids) == "é".encode()
    assert [token_text(tok, i) for i in ids] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert token_text(tok, 5) == "</think>" and token_bytes(tok, 5) == b"</think>"
    text, offs = text_offsets(tok, tok.encode("aé b", add_special_tokens=False).ids)
    assert text == "aé b" and offs == [s for s, _ in tok.encode("aé b", add_special_tokens=False).offsets]


def test_special_tokens_hidden_but_think_ends_reasoning(tok) -> None:
    hidden = special_tokens(tok)
    assert set(hidden.values()) >= {"<｜▁pad▁｜>", "<｜Assistant｜>", "<think>", "</think>"}
    ids = tok.encode("abc", add_special_tokens=False).ids
    seq = [6, *ids[:1], 3, 4, *ids[1:2], 5, 6, *ids[2:], 4]  # pad a Asst think b /think pad c think
    ts = TextStream(tok, thinking=True, hidden=hidden, token_bytes=lambda i: token_bytes(tok, i))
    parts = [ts.push(i) for i in seq] + [ts.finish()]
    assert "".join(p.reasoning for p in parts) == "ab" and "".join(p.content for p in parts) == "c"
    shown = TextStream(tok, thinking=False)  # skip_special_tokens=false: no hidden ids
    assert "<｜▁pad▁｜>" in "".join(shown.push(i).content for i in seq)


def test_offsets_count_text_held_by_a_stop_string(tok) -> None:
    ids = tok.encode("xS ab", add_special_tokens=False).ids
    ts = TextStream(tok, stop=["STOP"], token_bytes=lambda i: token_bytes(tok, i))
    got = []
    for i in ids:
        ts.push(i)
        got.append(ts.last_offset)
    assert got == [s for s, _ in tok.encode("xS ab", add_special_tokens=False).offsets]
