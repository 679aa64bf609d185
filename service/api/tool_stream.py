"""DSML tool calls parsed as the completion text grows (issue 62): content deltas in -> (content, OpenAI
tool-call deltas) out. A call's first delta (index, id, type, name) goes out as soon as its invoke's name is
complete; then its arguments in pieces as each parameter's value streams, whose concatenation is the arguments
string `tools.parse_completion` (the whole-text twin) builds. A string="true" value streams as it comes (its
JSON escapes piece by piece); any other value is held until its closing tag, then checked as JSON.

Text that may start the tool-calls block is held back. Markup that breaks before any call's name went out is
content, as the text was; once a call went out the block is committed and what breaks it is dropped (as the
reference parser drops it): raw markup never goes out beside calls. A call cut short (max_tokens, or markup
broken mid-call) keeps the arguments sent so far."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dsv4_serve.service.api.encoding import DSML, to_json
from dsv4_serve.service.api.tools import CALLS_END, CALLS_START, call_id

INVOKE_OPEN = f'<{DSML}invoke name="'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f'<{DSML}parameter name="'
PARAM_CLOSE = f"</{DSML}parameter>"
_PARAM_TAILS = {'" string="true">': True, '" string="false">': False}
WAIT, BREAK = "wait", "break"  # a head needs more text / is not DSML


def merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas with a call's consecutive pieces joined into one (one delta a call a chunk)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out


def _held(buf: str, tag: str) -> int:
    """How many of `buf`'s last characters may start `tag` (held until the next text says)."""
    return next((k for k in range(min(len(tag) - 1, len(buf)), 0, -1) if buf.endswith(tag[:k])), 0)


def _head(buf: str, opening: str, tails: dict[str, Any]) -> tuple[str, Any, int] | str:
    """`buf` at `opening` NAME TAIL (a tail from `tails`): (name, tails[tail], length), WAIT or BREAK."""
    if not buf.startswith(opening):
        return WAIT if opening.startswith(buf) else BREAK
    q = buf.find('"', len(opening))
    if q < 0:
        return WAIT
    for tail, val in tails.items():
        if buf.startswith(tail, q):
            return buf[len(opening) : q], val, q + len(tail)
    return WAIT if any(t.startswith(buf[q:]) for t in tails) else BREAK


@dataclass
class ToolStream:
    """One choice's parser: `push` each content delta, `finish` at the end; both return (content, deltas)."""

    buf: str = ""  # text not yet consumed
    state: str = "text"  # text | head (">" of the block) | block | invoke | value | done | broken
    raw: str = ""  # the block's consumed text while nothing went out: content if the markup breaks
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call so far, arguments accumulated
    cut: bool = False  # the last call is incomplete (cut or broken)
    _param: tuple[str, bool] = ("", True)  # the open parameter: name, string="true"
    _names: set[str] = field(default_factory=set)  # the open invoke's parameter names (a repeat breaks it)
    _value: str = ""  # a JSON value's text, held until its closing tag
    _deltas: list[dict[str, Any]] = field(default_factory=list)

    def push(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if self.state == "broken":
            return delta, []
        if self.state == "done":
            return "", []
        self.buf += delta
        content = ""
        while True:
            before = (self.state, len(self.buf))
            if self.state == "text":
                content += self._text()
            else:
                content += self._step()
            if self.state in ("broken", "done") or (self.state, len(self.buf)) == before:
                break
        return content, self._out()

    def finish(self, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The end of the answer: text held outside the block is content; the block's opening or a block cut
        before any call went out is dropped when `truncated` by max_tokens (content, as broken markup,
        otherwise); an open call gets the JSON value text held so far (its arguments stay cut), never a closing
        tag's start."""
        buf, self.buf = self.buf, ""
        if self.state == "text":  # cut in the block's opening (its blank line and a "<" at least): not content
            return ("" if truncated and "<" in buf else buf), []
        if self.state == "broken":
            return buf, []
        if not self.calls:
            held, self.raw, self.state = self.raw + buf, "", "done"
            return ("" if truncated else held), []
        if self.state == "value" and not self._param[1]:  # a JSON value's text so far (the held tag start aside)
            self._args(self._value.strip())
        if self.state not in ("block", "done"):
            self.cut = True
        self.state = "done"
        return "", self._out()

    # ---- the states -----------------------------------------------------------------------------
    def _text(self) -> str:
        i = self.buf.find(CALLS_START)
        if i < 0:
            keep = _held(self.buf, CALLS_START)
            out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            return out
        out, self.buf, self.state = self.buf[:i], self.buf[i:], "head"
        self._eat(len(CALLS_START))
        return out

    def _step(self) -> str:
        b = self.buf
        if self.state == "head":
            if not b:
                return ""
            if b[0] != ">":
                return self._break()
            self.state = "block"
            return self._eat(1)
        if self.state == "value":
            return self._value_text()
        ws = len(b) - len(b.lstrip())
        if ws:
            return self._eat(ws)
        if not b:
            return ""
        if self.state == "block":
            if b.startswith(CALLS_END):
                if not self.calls:
                    return self._break()  # an empty block is not a tool call: content, as the text was
                self.buf, self.state = "", "done"
                return ""
            if CALLS_END.startswith(b):
                return ""
            head = _head(b, INVOKE_OPEN, {'">\n': None})
            if head == BREAK:
                return self._break()
            if isinstance(head, tuple):
                self._open_call(head[0])
                self._eat(head[2])
            return ""
        # "invoke": a parameter or the invoke's end
        if b.startswith(INVOKE_CLOSE):
            self._args("}" if self._names else "{}")
            self._eat(len(INVOKE_CLOSE))
            self.state = "block"
            return ""
        if INVOKE_CLOSE.startswith(b):
            return ""
        head = _head(b, PARAM_OPEN, _PARAM_TAILS)
        if head == BREAK:
            return self._break()
        if isinstance(head, tuple):
            name, is_str, n = head
            if name in self._names:
                return self._break()  # a repeated parameter: not one JSON object
            self._args(("{" if not self._names else ", ") + to_json(name) + ": " + ('"' if is_str else ""))
            self._names.add(name)
            self._param, self._value = (name, is_str), ""
            self._eat(n)
            self.state = "value"
        return ""

    def _value_text(self) -> str:
        b, is_str = self.buf, self._param[1]
        end = b.find(PARAM_CLOSE)
        text = b[:end] if end >= 0 else b[: len(b) - _held(b, PARAM_CLOSE)]
        if is_str:
            if text:
                self._args(to_json(text)[1:-1])
        else:
            self._value += text
        self.buf = b[len(text) :]
        if end < 0:
            return ""
        if not is_str:
            try:
                json.loads(self._value)
            except ValueError:
                return self._break()
            self._args(self._value.strip())
        self._args('"' if is_str else "")
        self._eat(len(PARAM_CLOSE))
        self.state = "invoke"
        return ""

    # ---- helpers ----------------------------------------------------------------------------------
    def _eat(self, n: int) -> str:
        """Consume `n` characters of the buffer; while no call went out, keep the block's raw text."""
        if not self.calls:
            self.raw += self.buf[:n]
        self.buf = self.buf[n:]
        return ""

    def _break(self) -> str:
        """Not DSML after all: before any call went out, everything held is content from here on; after,
        the block's rest is dropped."""
        if self.calls:
            self.cut = self.state not in ("block",)
            self.buf, self.state = "", "done"
            return ""
        held, self.raw, self.buf, self.state = self.raw + self.buf, "", "", "broken"
        return held

    def _open_call(self, name: str) -> None:
        call = {"index": len(self.calls), "id": call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}  # fmt: skip
        self.calls.append(call)
        self._names, self.raw, self.state = set(), "", "invoke"
        self._deltas.append({**call, "function": dict(call["function"])})

    def _args(self, piece: str) -> None:
        if not piece:
            return
        call = self.calls[-1]
        call["function"]["arguments"] += piece
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == call["index"]:
            last["function"]["arguments"] += piece  # one delta a call a push
        else:
            self._deltas.append({"index": call["index"], "function": {"arguments": piece}})

    def _out(self) -> list[dict[str, Any]]:
        out, self._deltas = self._deltas, []
        return out
