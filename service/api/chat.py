"""Incremental detokenizing, stop strings and the reasoning / content split (the prompt encoding is
service/api/encoding.py). Pure Python on the event loop; no mlx."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
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

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else delta
        buf = self.pending + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[: min(hits)]
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
    `skip_ids` (EOS, stop token ids) count as generated tokens but add no text."""

    def __init__(
        self,
        tokenizer: Decoder,
        *,
        stop: Sequence[str] = (),
        thinking: bool = False,
        skip_ids: Iterable[int] = (),
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopStrings(stop)
        self.split = ReasoningSplit(thinking)
        self.skip_ids = set(skip_ids)
        self.text_len = 0  # characters emitted so far (reasoning + content), for text_offset

    def _out(self, text: str, stopped: bool = False) -> Delta:
        self.text_len += len(text)
        r, c = self.split.push(text)
        return Delta(r, c, stopped)

    def push(self, token_id: int) -> Delta:
        if self.stop.stopped or token_id in self.skip_ids:
            return Delta(stopped=self.stop.stopped)
        text = self.stop.push(self.detok.push(token_id))
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
