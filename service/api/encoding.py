"""DeepSeek-V4 prompt encoding (spec section 5): the release's `encoding/encoding_dsv4.py` rules for
system / developer / user / assistant turns, tools rendered into the system turn, assistant tool calls
as DSML, tool results folded into user turns, thinking mode and reasoning effort. The output is the
exact string DeepSeek's reference renderer builds (the `deepseek-recipe` package; tests/service/test_dsml.py).

Messages are OpenAI-style dicts: {"role", "content", "reasoning_content", "tool_calls", "tool_call_id"};
`tools` (OpenAI function tools) go into a system turn at the front, as SGLang and vLLM put them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"

# The paragraph right after BOS in thinking mode, by reasoning effort, as the V4-Flash release's encoder renders it
# (docs/deepseek_v4.md section 5): "max" only. DeepSeek's deepseek-recipe 0.2.0 (its V4 Pro encoding) puts this
# text for "high" / "xhigh" / none given and a stronger one for "max"; the tests compare against it with the
# paragraph put back to the release's (tests/service/test_dsml.py).
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
EFFORT_TEXT = {None: "", "low": "", "high": "", "xhigh": "", "max": REASONING_EFFORT_MAX}

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, \
booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside \
{think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


def to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The tools section of the system turn; `tools` are OpenAI tools ({"type", "function": {...}}). Each
    schema is {name, description, parameters}, in that order, "" and {} where missing (as the reference)."""
    fns = [t["function"] for t in tools]
    schemas = "\n".join(to_json({"name": f["name"], "description": f.get("description") or "",
                                  "parameters": f.get("parameters") or {}}) for f in fns)  # fmt: skip
    return TOOLS_TEMPLATE.format(dsml=DSML, think=THINK, end_think=END_THINK, schemas=schemas)


def dsml_parameters(arguments: str | dict[str, Any]) -> str:
    """Tool-call arguments (a JSON object string) -> DSML parameters, one a line. Strings go as is
    (string="true"), everything else as JSON; arguments that are not JSON become one "arguments" string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {"arguments": arguments}
    out = []
    for k, v in arguments.items():  # type: ignore[union-attr]
        s = isinstance(v, str)
        out.append(f'<{DSML}parameter name="{k}" string="{"true" if s else "false"}">'
                   f"{v if s else to_json(v)}</{DSML}parameter>")  # fmt: skip
    return "\n".join(out)


def dsml_tool_calls(calls: list[dict[str, Any]]) -> str:
    """OpenAI tool_calls -> the DSML block an assistant turn ends with (leading blank line included).
    An invoke without parameters is its two tags on two lines."""
    params = [dsml_parameters(c["function"]["arguments"]) for c in calls]
    invokes = [f'<{DSML}invoke name="{c["function"]["name"]}">\n' + (p + "\n" if p else "") + f"</{DSML}invoke>"
               for c, p in zip(calls, params, strict=True)]  # fmt: skip
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


def _tool_result(content: Any) -> str:
    if isinstance(content, list):  # the reference joins a result's parts with a blank line
        content = "\n\n".join(p["text"] if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                              for p in content)  # fmt: skip
    return f"<tool_result>{content or ''}</tool_result>"


def _fold_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages (and user messages right after them) join the user turn before them as blocks;
    a turn's tool results follow the order of the assistant's calls before it."""
    out: list[dict[str, Any]] = []
    order: dict[str, int] = {}
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            order = {c.get("id", ""): i for i, c in enumerate(m["tool_calls"]) if c.get("id")}
        if role == "tool":
            block = ("tool", m.get("tool_call_id") or "", m.get("content"))
            if out and out[-1]["role"] == "user" and "blocks" in out[-1]:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block], "order": order})
        elif role == "user" and out and out[-1]["role"] == "user" and "blocks" in out[-1]:
            out[-1]["blocks"].append(("text", "", m.get("content")))
        elif role == "user":
            out.append({"role": "user", "blocks": [("text", "", m.get("content"))], "order": order})
        else:
            out.append(dict(m))
    for m in out:
        blocks = m.get("blocks")
        results = [b for b in blocks or () if b[0] == "tool"]
        if len(results) > 1 and m["order"]:
            it = iter(sorted(results, key=lambda b: m["order"].get(b[1], 0)))
            m["blocks"] = [next(it) if b[0] == "tool" else b for b in blocks]
    return out


def _last_user(messages: list[dict[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)


def encode_messages(messages: list[dict[str, Any]], *, thinking: bool = False,
                    tools: list[dict[str, Any]] | None = None, reasoning_effort: str | None = None,
                    drop_thinking: bool = True, add_generation_prompt: bool = True,
                    continue_final: bool = False) -> str:  # fmt: skip
    """The V4 prompt of an OpenAI message list, ending in the generation prompt (<Assistant></think>, or
    <Assistant><think> in thinking mode). reasoning_effort (thinking mode only): None, "low", "high", "xhigh"
    or "max", each with its paragraph after BOS (EFFORT_TEXT). vLLM's prompt shaping: add_generation_prompt
    false ends the prompt after a final user turn; continue_final leaves the final assistant message open (no
    EOS; in thinking mode without content, its reasoning too: no </think>)."""
    if reasoning_effort not in EFFORT_TEXT:
        raise ValueError(f"reasoning_effort must be one of low, high, xhigh, max, not {reasoning_effort!r}")
    msgs = copy.deepcopy(list(messages))
    if tools:
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["tools"] = tools
        else:
            msgs.insert(0, {"role": "system", "content": "", "tools": tools})
    msgs = _fold_tools(msgs)
    if any(m.get("tools") for m in msgs):
        drop_thinking = False  # with tools, every turn's reasoning stays
    if thinking and drop_thinking:
        last = _last_user(msgs)
        kept = []
        for i, m in enumerate(msgs):
            if i >= last or m["role"] in ("user", "system"):
                kept.append(m)
            elif m["role"] == "assistant":
                kept.append({k: v for k, v in m.items() if k != "reasoning_content"})
        msgs = kept  # developer turns before the last user turn are dropped
    last = _last_user(msgs)
    out = [BOS]
    for i, m in enumerate(msgs):
        if i == 0 and thinking:
            out.append(EFFORT_TEXT[reasoning_effort])
        role = m["role"]
        if role in ("system", "developer"):
            if role == "developer":
                if not _text(m.get("content")):
                    raise ValueError("a developer message needs content")
                out.append(USER)
            out.append(_text(m.get("content")))
            if m.get("tools"):
                out.append("\n\n" + render_tools(m["tools"]))
            if m.get("response_format"):
                out.append("\n\n" + RESPONSE_FORMAT.format(schema=to_json(m["response_format"])))
        elif role == "user":
            parts = [_text(c) if kind == "text" else _tool_result(c) for kind, _, c in m["blocks"]]
            out.append(USER + "\n\n".join(parts))
        elif role == "assistant":
            open_end = continue_final and i == len(msgs) - 1
            if thinking and (not drop_thinking or i > last):
                still_thinking = open_end and not _text(m.get("content")) and not m.get("tool_calls")
                out.append((m.get("reasoning_content") or "") + ("" if still_thinking else END_THINK))
            out.append(_text(m.get("content")))
            if m.get("tool_calls"):
                out.append(dsml_tool_calls(m["tool_calls"]))
            if not open_end:
                out.append(EOS)
        else:
            raise ValueError(f"unknown role {role!r}")
        nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if role in ("user", "developer") and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            opens = thinking and (not drop_thinking or i >= last)
            out.append(ASSISTANT + (THINK if opens else END_THINK))
    return "".join(out)
