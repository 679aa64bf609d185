"""Chat encoding (spec section 5, format strings written out literally), incremental detokenizing,
stop strings and the reasoning split, on a byte-level tokenizer (one token per UTF-8 byte)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dsv4_serve.service.api.chat import IncrementalDetokenizer, ReasoningSplit, StopStrings, TextStream
from dsv4_serve.service.api.encoding import encode_messages

SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(SPECIAL)
    return t


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


# ---- encoding ----------------------------------------------------------------------------------
def test_chat_mode_single_turn() -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    assert encode_messages(msgs) == "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜></think>"


def test_multi_turn_drops_earlier_reasoning() -> None:
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]},
    ]
    want = (
        "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜>"
        "<｜User｜>and 3+3?<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == want
    thinking = want.removesuffix("</think>") + "<think>"
    assert encode_messages(msgs, thinking=True, reasoning_effort="low") == thinking  # "low": no effort paragraph


def test_tool_messages_fold_into_user_turns() -> None:
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "20C"},
    ]
    want = (
        "<｜begin▁of▁sentence｜><｜User｜>weather?<｜Assistant｜></think>calling<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>20C</tool_result><｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == want


MAX_EFFORT = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"


def test_effort_paragraph_after_bos_before_system() -> None:
    """The V4-Flash release's encoder: "max" in thinking mode puts its paragraph right after BOS; no other
    level, and chat mode, puts none (docs/deepseek_v4.md section 5)."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    bos = "<｜begin▁of▁sentence｜>"
    got = encode_messages(msgs, thinking=True, reasoning_effort="max")
    assert got.startswith(bos + MAX_EFFORT)
    assert got.endswith("unchecked.\n\nS<｜User｜>U<｜Assistant｜><think>")
    for effort in (None, "low", "high", "xhigh"):
        want = f"{bos}S<｜User｜>U<｜Assistant｜><think>"
        assert encode_messages(msgs, thinking=True, reasoning_effort=effort) == want
    assert encode_messages(msgs, thinking=False, reasoning_effort="max") == f"{bos}S<｜User｜>U<｜Assistant｜></think>"
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages(msgs, thinking=True, reasoning_effort="extreme")


# ---- detokenizing ------------------------------------------------------------------------------
TEXT = "héllo wörld 😀 日本語 ok"


def test_detokenizer_never_splits_utf8(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids(tok, TEXT)]
    assert len(ids(tok, TEXT)) > len(TEXT)  # multi-byte characters really span several tokens
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.flush() == TEXT
    assert "" in pieces  # held back while a character was incomplete


def test_detokenizer_flushes_broken_tail(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok)
    b = ids(tok, "a😀")
    out = "".join(d.push(i) for i in b[:-1])
    assert out == "a"
    assert d.flush() == "\ufffd"  # the stream ended mid-character: say so once, at the end


# ---- stop strings --------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", [["STOP"], ["xx", "STOP"], ["😀"]])
def test_stop_string_split_across_tokens_never_leaks(tok: Tokenizer, stop: list[str]) -> None:
    text = "abc ST STO 😁 STOP tail 😀"
    ts = TextStream(tok, stop=stop)
    out, stopped_at = [], None
    for n, i in enumerate(ids(tok, text)):
        d = ts.push(i)
        out.append(d.content)
        if d.stopped:
            stopped_at = n
            break
    assert stopped_at is not None
    got = "".join(out)
    cut = min(text.find(s) for s in stop if s in text)
    assert got == text[:cut]


def test_stop_prefix_released_at_end(tok: Tokenizer) -> None:
    ts = TextStream(tok, stop=["STOP"])
    got = "".join(ts.push(i).content for i in ids(tok, "go ST"))
    assert got == "go "  # "ST" may start "STOP": held back
    fin = ts.finish()
    assert fin.content == "ST" and not fin.stopped


def test_stop_strings_unit() -> None:
    s = StopStrings(["</s>", "END"])
    assert s.push("hello <") == "hello "
    assert s.push("/") == ""
    assert s.push("x") == "</x"
    assert s.push(" EN") == " "
    assert s.push("D more") == "" and s.stopped


# ---- reasoning split -----------------------------------------------------------------------------
def test_reasoning_split_special_token(tok: Tokenizer) -> None:
    ts = TextStream(tok, thinking=True)
    r, c = [], []
    for i in ids(tok, "let me think</think>The answer"):
        d = ts.push(i)
        r.append(d.reasoning)
        c.append(d.content)
    d = ts.finish()
    assert "".join(r) + d.reasoning == "let me think"
    assert "".join(c) + d.content == "The answer"


def test_reasoning_split_across_pieces() -> None:
    s = ReasoningSplit(True)
    assert s.push("abc</th") == ("abc", "")
    assert s.push("ink>de") == ("", "de")
    assert s.push("f</think>") == ("", "f</think>")
    assert ReasoningSplit(False).push("x</think>y") == ("", "x</think>y")


def test_skip_ids_count_but_add_no_text(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    ts = TextStream(tok, skip_ids=[eos])
    got = "".join(ts.push(i).content for i in [*ids(tok, "ok"), eos])
    assert got + ts.finish().content == "ok"


def test_prompt_shaping_as_vllm() -> None:
    """add_generation_prompt=False: no assistant opener after the last user turn; continue_final: the last assistant
    message open (no EOS), in thinking mode without content its reasoning open too (no </think>)."""
    bos, user, asst = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
    hi = [{"role": "user", "content": "Hi"}]
    assert encode_messages(hi, add_generation_prompt=False) == f"{bos}{user}Hi"
    part = [*hi, {"role": "assistant", "content": "Hel"}]
    assert encode_messages(part, continue_final=True) == f"{bos}{user}Hi{asst}</think>Hel"
    assert encode_messages(part) == f"{bos}{user}Hi{asst}</think>Hel<｜end▁of▁sentence｜>"
    thought = [*hi, {"role": "assistant", "content": "", "reasoning_content": "Hmm"}]
    assert encode_messages(thought, thinking=True, continue_final=True) == f"{bos}{user}Hi{asst}<think>Hmm"
    both = [*hi, {"role": "assistant", "content": "Hel", "reasoning_content": "Hmm"}]
    assert encode_messages(both, thinking=True, continue_final=True) == f"{bos}{user}Hi{asst}<think>Hmm</think>Hel"


def test_stop_string_kept_and_named() -> None:
    s = StopStrings(["END", "</s>"], include=True)
    assert s.push("abc</") == "abc" and s.push("s>tail") == "</s>" and s.matched == "</s>" and s.stopped
    plain = StopStrings(["END"])
    assert plain.push("xENDy") == "x" and plain.matched == "END"
