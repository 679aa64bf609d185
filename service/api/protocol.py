"""OpenAI request / response / chunk / error models. A field sent as null means absent; unknown
fields are ignored. Validation errors are mapped to 400 with the offending `param`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from dsv4_serve.service.api.chat_protocol import ChatExtras, ChatMessage
from dsv4_serve.service.api.tool_protocol import Guided, ToolFields

_REQ = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # nested objects: clients echo extra keys
# A request body: a field the server does not know is rejected by name (`validation_to_api_error`), never
# silently dropped; one sent as null is absent.
_BODY = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # every float field finite
MAX_N = 8  # choices per request (rows of one step)
# List caps, counted on the parsed JSON before any field is validated (Body) and before any tokenizing; OpenAI's
# where its API reference states one (prompt list: 2,048; tools: 128 functions; stop: up to 4 sequences).
MAX_PROMPTS = 2048  # a completion's prompt list
MAX_MESSAGES = 2048  # chat messages, Responses input items (OpenAI and vLLM state no limit: a generous one)
MAX_TOOLS = 128
MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_CHOICES = 1024  # guided_choice entries (structured.py caps their bytes)
MAX_CONTENT_PARTS = 2048  # content parts of all a request's messages / input items together


class APIError(Exception):
    """Raised anywhere in the API layer; rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_to_api_error(err: ValidationError) -> APIError:
    """First pydantic error -> 400 naming the top-level field (`messages`, `temperature`, ...)."""
    e = err.errors(include_url=False)[0]
    loc = [str(x) for x in e.get("loc", ())]
    if e.get("type") == "json_invalid":
        return APIError(400, f"Malformed JSON body: {e.get('msg')}", code="invalid_json")
    if e.get("type") == "extra_forbidden" and len(loc) == 1:
        return APIError(400, f"Unrecognized request argument supplied: {loc[0]} (this server does not implement "
                        "it)", param=loc[0], code="unsupported_parameter")  # fmt: skip
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"Invalid value for '{where}': {msg}", param=param, code="invalid_value")


class StreamOptions(BaseModel):
    model_config = _REQ
    include_usage: bool | None = None


def check_counts(data: Mapping[str, Any], caps: Mapping[str, int]) -> None:
    """400 naming the first list field over its cap: len() of the parsed JSON, no element looked at."""
    for name, cap in caps.items():
        v = data.get(name)
        if not isinstance(v, list | dict) or len(v) <= cap:
            continue
        if name == "prompt" and not isinstance(v[0], str | list):
            continue  # one prompt of token ids: the context length bounds it
        raise APIError(400, f"'{name}' has {len(v)} entries; the limit is {cap}", param=name, code="invalid_value")


def check_parts(data: Mapping[str, Any], names: tuple[str, ...]) -> None:
    """400 when the items of `data`'s fields `names` (messages, input items, prediction) hold more than
    MAX_CONTENT_PARTS content parts together: counted on the parsed JSON, before any part is validated (100,000
    parts took 0.6 s of the loop)."""
    n = 0
    for name in names:
        items = data.get(name)
        for m in items if isinstance(items, list) else [items]:
            if isinstance(m, dict) and isinstance(c := m.get("content"), list):
                n += len(c)
    if n > MAX_CONTENT_PARTS:
        raise APIError(400, f"'{names[0]}' holds {n} content parts; the limit is {MAX_CONTENT_PARTS}",
                       param=names[0], code="invalid_value")  # fmt: skip


class Body(BaseModel):
    """A request body: unknown fields are rejected by name; an unknown field sent as null is absent. The
    list fields of LIST_CAPS are counted before any field is validated."""

    model_config = _BODY
    LIST_CAPS: ClassVar[dict[str, int]] = {}
    PARTS: ClassVar[tuple[str, ...]] = ()  # list fields whose items' content parts are counted (check_parts)

    @model_validator(mode="before")
    @classmethod
    def _drop_null_unknowns(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_counts(data, cls.LIST_CAPS)
            check_parts(data, cls.PARTS)
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class _Sampling(Body, Guided):
    """Fields shared by chat and completions (OpenAI + vLLM extras; structured output: tool_protocol)."""

    model_config = _BODY
    LIST_CAPS: ClassVar[dict[str, int]] = {"stop": MAX_STOP, "stop_token_ids": MAX_STOP_TOKEN_IDS,
                                           "logit_bias": MAX_LOGIT_BIAS, "guided_choice": MAX_CHOICES}  # fmt: skip
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    n: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM: logprobs of every prompt token
    skip_special_tokens: bool | None = None  # vLLM: default true, special tokens never reach the text
    include_stop_str_in_output: bool | None = None  # vLLM: the text ends with the stop string (or stop token)
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprobs name each token "token_id:<id>", not its text
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: accepted, carries no behaviour
    # vLLM: the prefix cache is shared only by requests of one API key sending the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return items or None

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(i < 0 for i in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # OpenAI and vLLM: a 400 (issue 62)
            raise ValueError("stream_options can only be set when stream is true")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _penalty_f32(cls, v: float | None) -> float | None:
        # the sampler divides / multiplies logits by it in float32: 1e-300 would be 0 there, 1e39 infinite
        if v is not None and not 1.2e-38 <= v <= 3.4e38:
            raise ValueError(f"repetition_penalty must be a positive float32 (in [1.2e-38, 3.4e38]), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            # ASCII digits only: str.isdigit() also passes "²" (int() fails) and fullwidth "１２" (int() reads 12)
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids (decimal ASCII digits), got {key!r:.40}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    @property
    def n_choices(self) -> int:
        return self.n or 1

    @property
    def skip_special(self) -> bool:
        return self.skip_special_tokens is not False

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling, ToolFields, ChatExtras):
    model_config = _BODY
    LIST_CAPS: ClassVar[dict[str, int]] = {**_Sampling.LIST_CAPS, "messages": MAX_MESSAGES, "tools": MAX_TOOLS}
    PARTS: ClassVar[tuple[str, ...]] = ("messages", "prediction")
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):  # as vLLM: a 400, not alternatives of nothing
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    @property
    def limit_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: None off, else the number of alternatives."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    @property
    def thinking(self) -> bool:
        kw = self.chat_template_kwargs or {}
        for key in ("thinking", "enable_thinking"):
            if key in kw and kw[key] is not None:
                return bool(kw[key])
        return self.reasoning_effort not in (None, "none")


class CompletionRequest(_Sampling):
    LIST_CAPS: ClassVar[dict[str, int]] = {**_Sampling.LIST_CAPS, "prompt": MAX_PROMPTS}
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (echo / prompt_logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str | list) and any(len(p) == 0 for p in v):
            raise ValueError("prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _zero_tokens(self) -> CompletionRequest:
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise ValueError("max_tokens=0 needs echo=true or prompt_logprobs (there is nothing to return)")
        if self.max_tokens == 0 and self.n_choices > 1:
            raise ValueError("max_tokens=0 with n > 1: every choice would be the same prompt")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or token ids (a list of prompts gives one choice each)."""
        v = self.prompt
        if isinstance(v, list) and isinstance(v[0], str | list):
            return list(v)  # type: ignore[arg-type]
        return [v]  # type: ignore[list-item]

    @property
    def prompt_logprobs_k(self) -> int | None:
        """SamplingParams.prompt_logprobs: asked by prompt_logprobs, or by echo with logprobs."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs if self.logprobs is None else max(self.prompt_logprobs, self.logprobs)
        return self.logprobs if self.echo and self.logprobs is not None else None

    @property
    def limit_tokens(self) -> int | None:
        return self.max_tokens


# ---- responses ---------------------------------------------------------------------------------
def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"  # sep "_": Responses' ids (resp_, msg_, rs_) as OpenAI's


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens` when the server has a prefix cache."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def usage_many(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return usage(prompt_tokens, completion_tokens)


def model_card(name: str, root: str | None, max_model_len: int | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": now(),
        "owned_by": "dsv4-serve",
        "root": root or name,
        "parent": None,
        "max_model_len": max_model_len,
    }
