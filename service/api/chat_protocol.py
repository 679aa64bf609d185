"""Chat request models beyond sampling and tools: the messages (text parts only), and the OpenAI / vLLM chat
fields that change nothing here (accepted), the hints, and vLLM's prompt shaping (add_generation_prompt,
continue_final_message, echo: chat_prompt.py applies them). protocol.py puts them on the chat request."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from dsv4_serve.service.api.tool_protocol import ToolCall

_REQ = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = _REQ
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _REQ
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None  # accepted in history, dropped by the encoder
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        for p in v if isinstance(v, list) else ():
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text only")
        return v

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs content")
        return self


class Prediction(BaseModel):
    model_config = _REQ
    type: Literal["content"]
    content: str | list[TextPart]


class ChatExtras(BaseModel):
    """Fields that change no output here, and vLLM's prompt shaping. A value that would change the output and
    is not supported is a 400 naming the field."""

    model_config = _REQ
    store: bool | None = None  # OpenAI keeps the completion for its dashboard; nothing is kept here either way
    metadata: dict[str, str] | None = None  # tags for that dashboard
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None  # one tier here
    prompt_cache_key: str | None = None  # the prefix cache matches by tokens, with no key
    safety_identifier: str | None = None  # an end-user id, as `user`
    modalities: list[str] | None = None  # ["text"]; any other output modality is a 400
    prediction: Prediction | None = None  # a latency hint (predicted output): the output does not depend on it
    verbosity: Literal["low", "medium", "high"] | None = None  # "medium" (OpenAI's default) only
    add_generation_prompt: bool | None = None  # vLLM: default true (false with continue_final_message)
    continue_final_message: bool | None = None  # vLLM: the last (assistant) message is continued, left open
    echo: bool | None = None  # vLLM: the response repeats the continued message's content first

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v: list[str] | None) -> list[str] | None:
        other = [m for m in v or () if m != "text"]
        if other:
            raise ValueError(f"only text output is supported, not {other[0]!r}")
        return v

    @field_validator("verbosity")
    @classmethod
    def _verbosity(cls, v: str | None) -> str | None:
        if v not in (None, "medium"):
            raise ValueError(f"{v!r} is not supported: this model has no verbosity control (only 'medium', the "
                             "default)")  # fmt: skip
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true (as vLLM)")
        return v

    @property
    def generation_prompt(self) -> bool:
        """add_generation_prompt as given, else true unless the final message is continued."""
        if self.add_generation_prompt is not None:
            return self.add_generation_prompt
        return not self.continue_final_message
