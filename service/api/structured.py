"""What a request's structured-output and tool fields ask of the engine: the prompt's tools, and the grammar
(an engine Guide, compiled by the controller's GrammarPool) that response_format / guided_* / tool_choice
"required" or a named function enforce. Every bad combination, and a schema, regex or choice list over its size
cap, is a 400 naming the field, before any compile."""

from __future__ import annotations

import json
from typing import Any

from dsv4_serve.service.api import tools as dsml
from dsv4_serve.service.api.patterns import ambiguous, schema_patterns
from dsv4_serve.service.api.protocol import MAX_CHOICES, APIError
from dsv4_serve.service.engine import grammar
from dsv4_serve.service.engine.request import Guide

# Size caps. A choice list or a regex at its cap compiles in about a second or less on one core (measured on the
# 2-core CI-like machine, 512 ids and a 129K-id vocabulary alike: 1,024 choices of 32 bytes 0.2-0.6 s, 2,048
# 0.6-1.0 s, a 16K-character regex 0.3 s; 20,000 choices took 42 s). A schema's compile time follows its shape
# more than its size (61 KB of 1,000 optional properties: 7.8 s at 512 ids; 6 KB of 100: 16 s at 129K ids), so
# the compile timeout (grammar_pool.py) bounds what the cap lets through. OpenAI's own structured-output quota
# is 120,000 characters of names and enum values, 5,000 properties (its structured-outputs guide).
MAX_CHOICE_BYTES = 32 * 1024  # guided_choice, all entries in UTF-8
MAX_SCHEMA_BYTES = 128 * 1024  # a JSON schema as JSON text
MAX_REGEX_CHARS = 16 * 1024


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, param=param, code="invalid_value")


def _over(param: str, size: int, cap: int, unit: str) -> None:
    if size > cap:
        raise _bad(f"'{param}' has {size} {unit}; the limit is {cap}", param)


def _unambiguous(param: str, pattern: str) -> None:
    """A regex whose repeats can split a text in more than one way is refused: its token mask's cost grows with
    every generated token (patterns.py)."""
    if ambiguous(pattern):
        raise _bad(f"'{param}' has a repeat of a repeat that can match one text in more than one way ({pattern[:80]!r}"
                   "): its token mask cannot be bounded. Make it unambiguous, e.g. with a separator between the "
                   "repeated parts", param)  # fmt: skip


def _schema_format(schema: Any, param: str) -> dict[str, Any]:
    try:
        size = len(json.dumps(schema))
    except ValueError as e:  # an integer of more digits than Python converts
        raise _bad(f"{param} is not a usable JSON schema: {e}", param) from None
    _over(param, size, MAX_SCHEMA_BYTES, "bytes as JSON")
    for pattern in schema_patterns(schema):
        _unambiguous(param, pattern)
    return grammar.json_format(schema)


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
        asks.append((_schema_format(rf.json_schema.json_schema, "response_format"), "response_format"))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            _over("guided_json", len(schema), MAX_SCHEMA_BYTES, "characters")
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's parser goes
                raise _bad("guided_json must be a JSON schema (object or JSON text)", "guided_json") from None
        asks.append((_schema_format(schema, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        _over("guided_regex", len(req.guided_regex), MAX_REGEX_CHARS, "characters")
        _unambiguous("guided_regex", req.guided_regex)
        asks.append((grammar.regex_format(req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        _over("guided_choice", len(req.guided_choice), MAX_CHOICES, "entries")
        _over("guided_choice", sum(len(c.encode()) for c in req.guided_choice), MAX_CHOICE_BYTES, "bytes")
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


async def guide(ctl: Any, req: Any, *, thinking: bool = False, tenant: str = "") -> Guide | None:
    """The request's compiled grammar, or None; `tenant`: the API key's id (the compile memo is per key)."""
    fmt = _format(req, thinking)
    if fmt is None:
        return None
    if ctl.tokenizer is None:
        raise _bad("structured output needs the model's tokenizer", fmt[1])
    if req.ignore_eos or req.min_tokens:
        raise _bad("ignore_eos and min_tokens cannot be combined with a constrained output", "ignore_eos"
                   if req.ignore_eos else "min_tokens")  # fmt: skip
    return await ctl.grammars.compile(ctl.tokenizer, ctl.vocab_size, ctl.eos_token_id, fmt[0], fmt[1], tenant)
