"""The tiny byte-level BPE: exact size, DeepSeek-V4 special ids, round trips, determinism, files."""

from __future__ import annotations

import json

import pytest

from dsv4_serve.model.tokenizer import BOS, EOS, SPECIAL_TOKENS, build_tiny_tokenizer, load_tokenizer, tokenizer_config


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(512)


def test_size_and_special_ids(tok) -> None:
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    for t in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"):
        assert tok.token_to_id(t) is not None and tok.token_to_id(t) < len(SPECIAL_TOKENS)


def test_round_trip_with_special_tokens(tok) -> None:
    text = f"{BOS}You are terse.<｜User｜>héllo, wörld 😀 3.14<｜Assistant｜></think>The cat sat.{EOS}"
    ids = tok.encode(text).ids
    assert ids[0] == 0 and ids[-1] == 1
    assert ids.count(tok.token_to_id("<｜User｜>")) == 1  # matched whole, never split
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode([0, 1], skip_special_tokens=False) == BOS + EOS


def test_no_bos_added_and_merges_used(tok) -> None:
    ids = tok.encode("the quick brown fox").ids
    assert 0 not in ids
    assert len(ids) < len("the quick brown fox")  # merges really compress common English
    assert max(ids) >= len(SPECIAL_TOKENS) + 256


def test_every_byte_round_trips(tok) -> None:
    raw = bytes(range(256)).decode("latin-1")
    assert tok.decode(tok.encode(raw).ids) == raw


def test_deterministic() -> None:
    assert build_tiny_tokenizer(512).to_str() == build_tiny_tokenizer(512).to_str()
    assert build_tiny_tokenizer(300).get_vocab_size() == 300
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(100)


def test_files_load_in_transformers(tok, tmp_path) -> None:
    assert load_tokenizer(tmp_path) is None
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok)))
    again = load_tokenizer(tmp_path)
    assert again is not None and again.encode("hello there").ids == tok.encode("hello there").ids
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = f"{BOS}<｜User｜>hi<｜Assistant｜>"
    assert hf(text)["input_ids"] == tok.encode(text).ids  # add_bos_token false: no extra BOS
    assert hf.bos_token_id == 0 and hf.eos_token_id == 1
