"""A chat request -> its prompt text (the DeepSeek-V4 encoding), with vLLM's prompt shaping: whether the generated
text starts in reasoning_content, and what `echo` repeats before it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4_serve.service.api.encoding import encode_messages
from dsv4_serve.service.api.protocol import APIError, ChatCompletionRequest

# OpenAI reasoning_effort -> the encoder's level ("none" turns thinking off: ChatCompletionRequest.thinking).
EFFORT = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh", "max": "max"}


@dataclass
class ChatPrompt:
    text: str
    reasoning: bool  # the generated text starts in reasoning_content (thinking mode, reasoning still open)
    echo: str | None  # vLLM's chat echo: the continued message's content, repeated before the generated text


def render(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> ChatPrompt:
    """400 naming the field for a message list the shaping cannot apply to."""
    last = req.messages[-1]
    cont = bool(req.continue_final_message)
    if cont and (last.role != "assistant" or last.tool_calls):
        raise APIError(400, "continue_final_message needs the last message to be an assistant message without "
                       "tool calls", param="continue_final_message", code="invalid_value")  # fmt: skip
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = encode_messages(messages, thinking=req.thinking, tools=tools,
                               reasoning_effort=EFFORT.get(req.reasoning_effort or ""),
                               add_generation_prompt=req.generation_prompt, continue_final=cont)  # fmt: skip
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    # Continuing a message with content continues its content; one without, in thinking mode, its reasoning.
    reasoning = req.thinking and not (cont and last.text)
    # vLLM: the response's role is "assistant" with a generation prompt, else the last message's; echo repeats
    # the last message's content when the roles agree.
    echo = last.text if req.echo and (last.role == "assistant" or not req.generation_prompt) else None
    return ChatPrompt(text, reasoning, echo)
