"""Incremental detokenizing, stop strings and the reasoning / content split (the prompt encoding is
service/api/encoding.py). Pure Python on the event loop; no mlx."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dsv4_serve.service.api.encoding import END_THINK


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing id list, emitting only the stable new suffix. Text ending in U+FFFD (an
    incomplete UTF-8 sequence) is held back until the next token completes it. Decoding uses a
    sliding window (prefix/read offsets, as vLLM does) so each token costs O(window), not O(n)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end: whatever is still held back (a truly broken tail stays as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def _held_tail(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of any pattern."""
    best = 0
    for p in patterns:
        for k in range(min(len(p) - 1, len(text)), best, -1):
            if text.endswith(p[:k]):
                best = k
                break
    return best


class StopStrings:
    """Applies stop strings to a stream of text deltas; a stop string (or its start) never leaks."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include  # vLLM's include_stop_str_in_output: the text ends with the stop string
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (vLLM's stop_reason)

    def push(self, delta: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else delta
        buf = self.pending + delta
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            self.stopped, self.pending = True, ""
            return buf[: at + len(self.matched) if self.include else at]
        keep = _held_tail(buf, self.stops)
        self.pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class ReasoningSplit:
    """Thinking mode: text before </think> is reasoning_content, after it content."""

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self.pending = ""

    def push(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", delta
        buf = self.pending + delta
        i = buf.find(END_THINK)
        if i >= 0:
            self.in_reasoning, self.pending = False, ""
            return buf[:i], buf[i + len(END_THINK) :]
        keep = _held_tail(buf, [END_THINK])
        self.pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], ""

    def flush(self) -> tuple[str, str]:
        out, self.pending = self.pending, ""
        return (out, "") if self.in_reasoning else ("", out)


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    stopped: bool = False  # a stop string matched: finish with "stop" and abort the request


class TextStream:
    """token ids -> (reasoning, content) deltas: detokenize, stop strings, reasoning split.
    `skip_ids` (EOS, stop token ids) count as generated tokens but add no text; so do `hidden` ids
    (special tokens with skip_special_tokens: `<｜▁pad▁｜>`, `<｜Assistant｜>`, `<think>`, ...), except
    `</think>` while the reasoning split still waits for it (it ends reasoning_content, and never shows)."""

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        thinking: bool = False,
        skip_ids: Iterable[int] = (),
        hidden: dict[int, str] | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.offsets = Utf8Offsets() if token_bytes is not None else None
        self.token_bytes = token_bytes
        self.last_offset = 0  # text_offset of the token pushed last
        self.stop = StopStrings(stop, include_stop)
        self.split = ReasoningSplit(thinking)
        self.skip_ids = set(skip_ids)
        self.hidden = hidden or {}
        self.text_len = 0  # characters emitted so far (reasoning + content)
        self.decoded_len = 0  # characters decoded so far, stop-string hold-back included

    @property
    def offset(self) -> int:
        """The text_offset a token pushed now would start at (the end of the text so far)."""
        return self.decoded_len if self.offsets is None else self.offsets.n

    def _out(self, text: str, stopped: bool = False) -> Delta:
        self.text_len += len(text)
        r, c = self.split.push(text)
        return Delta(r, c, stopped)

    def push(self, token_id: int) -> Delta:
        self.last_offset = self.offset
        if self.stop.stopped or token_id in self.skip_ids:
            return Delta(stopped=self.stop.stopped)
        if token_id in self.hidden and not (self.split.in_reasoning and self.hidden[token_id] == END_THINK):
            return Delta()
        if self.offsets is not None and self.token_bytes is not None:
            self.last_offset = self.offsets.push(self.token_bytes(token_id))
        piece = self.detok.push(token_id)
        self.decoded_len += len(piece)
        text = self.stop.push(piece)
        return self._out(text, self.stop.stopped)

    def finish(self) -> Delta:
        """Flush everything held back (the request ended without a stop string)."""
        if self.stop.stopped:
            return Delta(stopped=True)
        text = self.stop.push(self.detok.flush())
        text += self.stop.flush()
        d = self._out(text, self.stop.stopped)
        r, c = self.split.flush()
        return Delta(d.reasoning + r, d.content + c, d.stopped)


def special_tokens(tokenizer: Any) -> dict[int, str]:
    """id -> text of the tokenizer's special tokens (none for a tokenizer without added tokens)."""
    get = getattr(tokenizer, "get_added_tokens_decoder", None)
    return {i: t.content for i, t in get().items() if t.special} if get else {}


_BYTE_CHARS: dict[str, int] | None = None
# id(tokenizer) -> (the tokenizer, its special ids): get_added_tokens_decoder builds a dict of every added token
# a call (~13 us), and a completion's text offsets ask once a token. The tokenizer is kept so its id stays its own.
_SPECIAL_IDS: dict[int, tuple[Any, frozenset[int]]] = {}


def _special_ids(tokenizer: Any) -> frozenset[int]:
    hit = _SPECIAL_IDS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = _SPECIAL_IDS[id(tokenizer)] = (tokenizer, frozenset(special_tokens(tokenizer)))
    return hit[1]


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes of one token: a byte-level BPE piece maps back through GPT-2's byte alphabet, so a token
    holding part of a UTF-8 sequence gives those bytes, not U+FFFD's."""
    global _BYTE_CHARS
    if _BYTE_CHARS is None:
        from dsv4_serve.model.tokenizer import byte_alphabet

        _BYTE_CHARS = {c: b for b, c in byte_alphabet().items()}
    piece = tokenizer.id_to_token(token_id) if hasattr(tokenizer, "id_to_token") else None
    if piece is None:
        return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
    if token_id in _special_ids(tokenizer) or not all(c in _BYTE_CHARS for c in piece):
        return piece.encode("utf-8")
    return bytes(_BYTE_CHARS[c] for c in piece)


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as logprobs show it: its text, or OpenAI's `bytes:\\xNN` form for a piece of a UTF-8 sequence."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Utf8Offsets:
    """text_offset of each token from its raw bytes: where the first character holding any of its bytes starts.
    A token that continues a character begun before it points at that character; one that follows an
    unfinished sequence it does not continue points past the U+FFFD that sequence became."""

    def __init__(self) -> None:
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.n = 0  # characters decoded so far

    def push(self, raw: bytes) -> int:
        tail = self.dec.getstate()[0]  # an unfinished sequence held from earlier tokens
        piece = self.dec.decode(raw)
        off = self.n
        if tail and piece.startswith("\ufffd") and not (tail + raw).startswith("\ufffd".encode()):
            off += len(tail.decode("utf-8", "replace"))  # the unfinished sequence became U+FFFD: not this token
        self.n += len(piece)
        return off


def text_offsets(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[int]]:
    """(text, per-token character offsets) of a token sequence, as a completion's text_offset counts them."""
    detok, parts, offsets, utf8 = IncrementalDetokenizer(tokenizer), [], [], Utf8Offsets()
    for i in ids:
        offsets.append(utf8.push(token_bytes(tokenizer, i)))
        parts.append(detok.push(i))
    parts.append(detok.flush())
    return "".join(parts), offsets
