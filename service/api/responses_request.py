"""The /v1/responses request and the chat completion request it means: instructions -> system, input items ->
messages (reasoning items give the next assistant turn its reasoning_content; function_call / function_call_output
items become tool calls and tool messages), max_output_tokens, reasoning.effort -> thinking, text.format ->
response_format, Responses' flat function tools and named tool_choice -> chat's nested shapes.

Fields that change nothing here are accepted; `include` takes the values that add nothing this server could
return; `previous_response_id` is OpenAI's 400 for an unknown id, naming it (no response is stored)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from dsv4_serve.service.api.protocol import _REQ, MAX_MESSAGES, MAX_TOOLS, APIError, Body, ChatCompletionRequest

# `include` values that add nothing to what this server returns: it runs no built-in tools and reads no images,
# and its reasoning items carry the reasoning text in full (sent back as an input item, it is the turn's
# reasoning again), so there is no encrypted copy to add. Anything else (output_text logprobs) is a 400.
INCLUDE_OK = frozenset({
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "message.input_image.image_url",
})  # fmt: skip


class Reasoning(BaseModel):
    model_config = _REQ
    effort: Literal["none", "minimal", "low", "medium", "high", "max"] | None = None
    # No summarizer here (the reasoning item carries the text in full): a summary asked for is a 400 naming it.
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Body):
    LIST_CAPS: ClassVar[dict[str, int]] = {"input": MAX_MESSAGES, "tools": MAX_TOOLS}
    PARTS: ClassVar[tuple[str, ...]] = ("input",)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text"}}; other formats go to response_format
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # nothing is stored: only false is accepted
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's: see protocol._Sampling
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None  # one tier here
    prompt_cache_key: str | None = None  # the prefix cache matches by tokens, with no key
    safety_identifier: str | None = None  # an end-user id, as `user`
    include: list[str] | None = None  # INCLUDE_OK only
    # "auto" drops the oldest input items of an input over the context: with an input that fits (the only kind
    # served: one that does not is a 400 either way) it changes nothing.
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None  # no response is stored: OpenAI's 400 for an unknown id


def _has(field: str) -> bool:
    return field in ChatCompletionRequest.model_fields


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise APIError(400, f"{where}: only text content parts are supported", param="input")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise APIError(400, f"{where}: content must be a string or a list of text parts", param="input")


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning input item's text: its content, else its summary (an encrypted_content alone has none)."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


def _check(req: ResponsesRequest) -> None:
    if req.store:
        raise APIError(400, "store=true is not supported: this server keeps no responses", param="store")
    if req.previous_response_id is not None:
        raise APIError(400, f"Previous response with id '{req.previous_response_id}' not found: this server stores "
                       "no responses (send the conversation as input items)", param="previous_response_id",
                       code="previous_response_not_found")  # fmt: skip
    if req.reasoning is not None and req.reasoning.summary is not None:
        raise APIError(400, f"reasoning.summary {req.reasoning.summary!r} is not supported: this server writes no "
                       "reasoning summaries (the reasoning item holds the reasoning text in full)",
                       param="reasoning.summary", code="unsupported_value")  # fmt: skip
    for key, value in (req.text or {}).items():
        if key == "verbosity" and value not in (None, "medium"):  # as chat's `verbosity`
            raise APIError(400, f"text.verbosity {value!r} is not supported: this model has no verbosity control "
                           "(only 'medium', the default)", param="text.verbosity", code="unsupported_value")
        if key not in ("format", "verbosity"):
            raise APIError(400, f"text.{key} is not supported", param=f"text.{key}", code="unsupported_parameter")
    bad = [v for v in req.include or () if v not in INCLUDE_OK]
    if bad:
        raise APIError(400, f"include value {bad[0]!r} is not supported", param="include", code="invalid_value")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning = ""  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role"), "content": _content(item.get("content"), f"input[{i}]")})
        elif kind == "reasoning":
            reasoning += _reasoning_text(item)
            continue
        elif kind == "function_call" and _has("tools"):
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and _has("tools"):
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output", "")})
        else:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported", param="input")
        if reasoning and msgs[-1]["role"] == "assistant":
            msgs[-1]["reasoning_content"], reasoning = reasoning, ""
    return msgs


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> chat's response_format: Responses' json_schema format is flat ({type, name, schema,
    strict, description}), chat's nests those under `json_schema`."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if not _has("response_format"):
        raise APIError(400, f"text.format of type {kind!r} is not supported", param="text.format")
    if kind != "json_schema":
        return fmt
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format of type 'json_schema' needs 'schema' (a JSON schema object)",
                       param="text.format", code="invalid_value")  # fmt: skip
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request body this Responses request means."""
    _check(req)
    body: dict[str, Any] = {"messages": _messages(req), "model": req.model, "stream": req.stream, "user": req.user,
                            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "response_format": _response_format(req.text),
                            "cache_salt": req.cache_salt}  # fmt: skip
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        value = getattr(req, field)
        if value is None:
            continue
        if not _has(field):
            raise APIError(400, f"'{field}' is not supported on /v1/responses yet", param=field)
        if field == "tools":
            value = [_chat_tool(t) for t in value]
        elif field == "tool_choice" and isinstance(value, dict) and "name" in value:  # {"type", "name"}
            value = {"type": value.get("type"), "function": {"name": value["name"]}}
        body[field] = value
    return {k: v for k, v in body.items() if v is not None}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """Responses' flat function tool -> chat completions' {"type": "function", "function": {...}}."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools of type {tool.get('type')!r} are not supported", param="tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
