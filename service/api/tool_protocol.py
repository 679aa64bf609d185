"""Request models of tools, tool calls and structured output (OpenAI shapes + vLLM's guided_* fields);
protocol.py puts them on the chat and completion requests."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_REQ = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class FunctionDef(BaseModel):
    model_config = _REQ
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _REQ
    type: Literal["function"]
    function: FunctionDef


class _Name(BaseModel):
    model_config = _REQ
    name: str


class NamedToolChoice(BaseModel):
    model_config = _REQ
    type: Literal["function"]
    function: _Name


class CallFunction(BaseModel):
    model_config = _REQ
    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant message's earlier tool call (history)."""

    model_config = _REQ
    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True, allow_inf_nan=False)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _REQ
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class Guided(BaseModel):
    """Structured-output fields shared by chat and completions."""

    model_config = _REQ
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or any(c == "" for c in v)):
            raise ValueError("guided_choice must be a non-empty list of non-empty strings")
        return v


class ToolFields(BaseModel):
    """Tool fields of a chat request."""

    model_config = _REQ
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
