"""What a request's structured-output and tool fields ask of the engine: the prompt's tools, and the grammar
(an engine Guide, compiled in a worker thread) that response_format / guided_* / tool_choice "required" or a
named function enforce. Every bad combination is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from dsv4_serve.service.api import tools as dsml
from dsv4_serve.service.api.protocol import APIError
from dsv4_serve.service.engine import grammar
from dsv4_serve.service.engine.request import Guide


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, param=param, code="invalid_value")


def prompt_tools(req: Any) -> list[dict[str, Any]] | None:
    """The tools to render into the prompt: none when tool_choice is "none" (the model is not to call any)."""
    if not getattr(req, "tools", None) or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _named(req: Any) -> str | None:
    choice = getattr(req, "tool_choice", None)
    return None if choice is None or isinstance(choice, str) else choice.function.name


def _format(req: Any, thinking: bool) -> tuple[dict[str, Any], str] | None:
    """(structural-tag format, the field asking for it) or None (unconstrained)."""
    asks: list[tuple[dict[str, Any], str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        asks.append((grammar.json_format({"type": "object"}), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise _bad("response_format of type 'json_schema' needs json_schema.schema", "response_format")
        asks.append((grammar.json_format(rf.json_schema.json_schema), "response_format"))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise _bad("guided_json must be a JSON schema (object or JSON text)", "guided_json") from None
        asks.append((grammar.json_format(schema), "guided_json"))
    if req.guided_regex is not None:
        asks.append((grammar.regex_format(req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        asks.append((grammar.choice_format(req.guided_choice), "guided_choice"))
    choice = getattr(req, "tool_choice", None)
    if choice is not None and choice not in ("auto", "none"):
        if not req.tools:
            raise _bad("tool_choice needs tools", "tool_choice")
        name = _named(req)
        if name is not None and name not in {t.function.name for t in req.tools}:
            raise _bad(f"tool_choice names '{name}', which is not in tools", "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        calls = dsml.calls_format(tools, name, parallel=req.parallel_tool_calls is not False)
        asks.append((grammar.after_reasoning(calls) if thinking else calls, "tool_choice"))
        return _one(asks)
    if thinking and asks:
        asks = [(grammar.after_reasoning(f), src) for f, src in asks]
    return _one(asks)


def _one(asks: list[tuple[dict[str, Any], str]]) -> tuple[dict[str, Any], str] | None:
    if len(asks) > 1:
        raise _bad(f"only one of {', '.join(s for _, s in asks)} may constrain the output", asks[1][1])
    return asks[0] if asks else None


async def guide(ctl: Any, req: Any, *, thinking: bool = False) -> Guide | None:
    """The request's compiled grammar, or None."""
    fmt = _format(req, thinking)
    if fmt is None:
        return None
    if ctl.tokenizer is None:
        raise _bad("structured output needs the model's tokenizer", fmt[1])
    if req.ignore_eos or req.min_tokens:
        raise _bad("ignore_eos and min_tokens cannot be combined with a constrained output", "ignore_eos"
                   if req.ignore_eos else "min_tokens")  # fmt: skip
    try:
        return await asyncio.to_thread(grammar.compile_guide, ctl.tokenizer, ctl.vocab_size, ctl.eos_token_id,
                                       fmt[0], fmt[1])  # fmt: skip
    except ValueError as e:
        raise _bad(str(e), fmt[1]) from None
