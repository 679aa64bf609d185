"""DeepSeek-V4 tool calls out of the model: DSML completion text -> OpenAI `tool_calls` (the whole text; as it
grows: tool_stream.py, whose calls equal these), and the grammar (xgrammar structural-tag format) that
`tool_choice` "required" or a named function enforces. The markup (encoding.dsml_tool_calls writes it):

    {content}\\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="f">\\n
    <｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\\n...</｜DSML｜invoke>\\n...</｜DSML｜tool_calls>
    (one line; the parameters are newline-joined)

A string="true" value is raw text, any other a JSON value; arguments become one JSON object string, as the
reference `parse_tool_calls` builds it. Text that breaks the markup is returned as content, unparsed.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from dsv4_serve.service.api.encoding import DSML, to_json
from dsv4_serve.service.engine.grammar import json_format

CALLS_START = f"\n\n<{DSML}tool_calls"  # as the reference parser: the ">" follows
CALLS_END = f"</{DSML}tool_calls>"
_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"]*)">\n(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'\s*<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(body: str) -> str | None:
    """The parameters of one invoke -> a JSON object string (None: not DSML parameters, or bad JSON)."""
    parts, pos, seen = [], 0, set()
    for m in _PARAM.finditer(body):
        if body[pos : m.start()].strip():
            return None
        name, is_str, value = m.groups()
        if name in seen:
            return None
        seen.add(name)
        if is_str == "false":
            try:
                json.loads(value)
            except ValueError:
                return None
        parts.append(f"{to_json(name)}: {to_json(value) if is_str == 'true' else value.strip()}")
        pos = m.end()
    if body[pos:].strip():
        return None
    return "{" + ", ".join(parts) + "}"


def parse_invokes(block: str) -> list[dict[str, str]] | None:
    """The inside of a tool_calls block -> [{"name", "arguments"}] (None if it is not DSML invokes)."""
    calls, pos = [], 0
    for m in _INVOKE.finditer(block):
        if block[pos : m.start()].strip():
            return None
        args = _arguments(m.group(2))
        if args is None:
            return None
        calls.append({"name": m.group(1), "arguments": args})
        pos = m.end()
    return calls if not block[pos:].strip() and calls else None


def openai_calls(calls: list[dict[str, str]], first_index: int = 0) -> list[dict[str, Any]]:
    return [
        {"index": first_index + i, "id": call_id(), "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}}  # fmt: skip
        for i, c in enumerate(calls)
    ]


def parse_completion(text: str) -> tuple[str, list[dict[str, str]]]:
    """An answer's text (reasoning already split off, no EOS) -> (content, calls). No well-formed block:
    (text, [])."""
    i = text.find(CALLS_START)
    if i < 0:
        return text, []
    rest = text[i + len(CALLS_START) :]
    if not rest.startswith(">"):
        return text, []
    j = rest.find(CALLS_END)
    if j < 0 or rest[j + len(CALLS_END) :].strip():
        return text, []
    calls = parse_invokes(rest[1:j])
    return (text[:i], calls) if calls else (text, [])


# ---- the grammar for tool_choice "required" / a named function ------------------------------------
def _const(s: str) -> dict[str, Any]:
    return {"type": "const_string", "value": s}


def _param(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One parameter: a plain string as raw text (string="true"); anything else, or a string with an
    enum, pattern or format, as a JSON value (string="false")."""
    head = f'<{DSML}parameter name="{name}" string='
    end = f"</{DSML}parameter>"
    plain = schema.get("type") == "string" and not ({"enum", "const", "pattern", "format"} & schema.keys())
    if plain:
        # Whole characters other than "<" (which would open the closing tag), within min..maxLength.
        hi = "" if "maxLength" not in schema else int(schema["maxLength"])
        text = {"type": "regex", "pattern": f"[^<]{{{int(schema.get('minLength', 0))},{hi}}}"}
        return {"type": "sequence", "elements": [_const(head + '"true">'), text, _const(end)]}
    value = json_format(schema)
    return {"type": "sequence", "elements": [_const(head + '"false">'), value, _const(end)]}


def _invoke(fn: dict[str, Any]) -> dict[str, Any]:
    """One invoke of `fn`: its properties in schema order, each followed by a newline (the reference's
    newline-joined parameters + the newline before the closing tag); required ones always present."""
    params = fn.get("parameters") or {}
    props: dict[str, Any] = params.get("properties") or {}
    required = set(params.get("required") or ())
    elems: list[dict[str, Any]] = [_const(f'<{DSML}invoke name="{fn["name"]}">\n')]
    for name, schema in props.items():
        one = {"type": "sequence", "elements": [_param(name, schema if isinstance(schema, dict) else {}), _const("\n")]}
        elems.append(one if name in required else {"type": "optional", "content": one})
    elems.append(_const(f"</{DSML}invoke>"))
    return {"type": "sequence", "elements": elems}


def calls_format(tools: list[dict[str, Any]], only: str | None, parallel: bool = True) -> dict[str, Any]:
    """The whole answer as a tool-calls block: one call of `only`, or one (`parallel`: or more) of any tool."""
    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    one = _invoke(fns[0]) if len(fns) == 1 else {"type": "or", "elements": [_invoke(f) for f in fns]}
    elems = [_const(CALLS_START + ">\n"), one]
    if only is None and parallel:
        elems.append({"type": "star", "content": {"type": "sequence", "elements": [_const("\n"), one]}})
    elems.append(_const("\n" + CALLS_END))
    return {"type": "sequence", "elements": elems}
