"""HTTP endpoints. Each generation request: readiness -> body -> model -> prompt ids -> limits ->
SamplingParams -> worker.submit -> SSE stream or one JSON body."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from service.api import structured
from service.api.chat import TextStream
from service.api.controller import Controller
from service.api.encoding import encode_messages
from service.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    model_card,
    validation_to_api_error,
)
from service.api.streaming import Generation, request_id
from service.api.tools import ToolStream
from service.engine.request import SamplingParams
from service.engine.scheduler import QueueFull
from service.engine.worker import EngineNotReady

router = APIRouter()
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _NoTokenizer:
    """Token-id-only models: generated text is empty; ids are returned in `token_ids`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


def _ctl(request: Request) -> Controller:
    return request.app.state.ctl


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as e:
        raise validation_to_api_error(e) from None


def _check_model(ctl: Controller, name: str | None) -> None:
    if name is not None and name != ctl.settings.served_name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{ctl.settings.served_name}'",
            param="model",
            code="model_not_found",
        )


# OpenAI reasoning_effort -> the encoder's level ("none" turns thinking off: ChatCompletionRequest.thinking).
EFFORT = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh", "max": "max"}


def _encode(ctl: Controller, text: str, param: str) -> list[int]:
    tok = ctl.tokenizer
    if tok is None:
        raise APIError(
            400,
            "This model has no tokenizer: send token ids as 'prompt' to /v1/completions",
            param=param,
            code="no_tokenizer",
        )
    return list(tok.encode(text, add_special_tokens=False).ids)


def _params(ctl: Controller, req: Any, prompt_len: int, param: str, logprobs: int | None) -> SamplingParams:
    limit = ctl.max_model_len
    if prompt_len >= limit:
        raise APIError(
            400,
            f"The prompt has {prompt_len} tokens; this model's context length is {limit} "
            "(the prompt must leave room for at least 1 generated token)",
            param=param,
            code="context_length_exceeded",
        )
    max_tokens = req.limit_tokens if req.limit_tokens is not None else limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. You requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt + {max_tokens} for the "
            "completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop_ids = tuple(req.stop_token_ids or ())
    if any(i >= ctl.vocab_size for i in stop_ids):
        raise APIError(
            400, f"stop_token_ids must be < vocab size {ctl.vocab_size}", param="stop_token_ids"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=None if req.seed is None else req.seed % 2**63,  # engine seeds are non-negative int64
        min_tokens=min(req.min_tokens or 0, max_tokens),
        stop_token_ids=stop_ids,
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        logprobs=logprobs,
    )


async def _generate(
    request: Request,
    ctl: Controller,
    kind: str,
    req: Any,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    thinking: bool = False,
    tools: bool = False,
    t0: float,
) -> Response:
    rid = request_id(kind)
    try:
        events = await ctl.worker.submit(prompt_ids, params, request_id=rid)
    except QueueFull:
        ctl.metrics.outcome("queue_full")
        raise APIError(
            429,
            "The server's waiting queue is full; retry shortly",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
    except EngineNotReady as e:
        raise APIError(503, f"Not accepting requests: {e}", code="not_ready", headers={"Retry-After": "1"}) from None
    except ValueError as e:
        raise APIError(
            400, str(e), param="prompt" if kind == "completion" else "messages", code="invalid_request"
        ) from None
    ctl.active[rid] = None
    ctl.metrics.prompt_tokens.inc(len(prompt_ids))
    tok = ctl.tokenizer or _NoTokenizer()
    skip = set(params.stop_token_ids)
    if ctl.eos_token_id is not None and not params.ignore_eos:
        skip.add(ctl.eos_token_id)
    gen = Generation(
        request_id=rid,
        kind=kind,
        model=ctl.settings.served_name,
        prompt_len=len(prompt_ids),
        events=events,
        text=TextStream(tok, stop=req.stop_list, thinking=thinking, skip_ids=skip),
        abort=ctl.abort,
        metrics=ctl.metrics,
        on_done=lambda r: ctl.active.pop(r, None),
        t0=t0,
        logprobs=params.logprobs is not None,
        thinking=thinking,
        token_str=lambda i: tok.decode([i], skip_special_tokens=False),
        tools=ToolStream() if tools else None,
    )
    if req.stream:
        return StreamingResponse(
            gen.sse(req.include_usage), media_type="text/event-stream", headers=_SSE_HEADERS
        )
    body = await gen.collect(request.is_disconnected)
    return JSONResponse(body)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    t0, ctl = time.perf_counter(), _ctl(request)
    try:
        await ctl.wait_ready()
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        _check_model(ctl, req.model)
        tools = structured.prompt_tools(req)
        effort = EFFORT.get(req.reasoning_effort or "")  # the encoder's levels, as deepseek-recipe maps them
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            text = encode_messages(messages, thinking=req.thinking, tools=tools, reasoning_effort=effort)
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        ids = (
            await asyncio.to_thread(_encode, ctl, text, "messages")
            if len(text) > 20000
            else _encode(ctl, text, "messages")
        )
        params = _params(ctl, req, len(ids), "messages", req.logprobs_k)
        params = replace(params, guide=await structured.guide(ctl, req, thinking=req.thinking))
        return await _generate(request, ctl, "chat", req, ids, params, thinking=req.thinking,
                               tools=tools is not None, t0=t0)  # fmt: skip
    except APIError as e:
        _count_rejection(ctl, e)
        raise


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    t0, ctl = time.perf_counter(), _ctl(request)
    try:
        await ctl.wait_ready()
        req: CompletionRequest = await _parse(request, CompletionRequest)
        _check_model(ctl, req.model)
        if isinstance(req.prompt, str):
            ids = _encode(ctl, req.prompt, "prompt")
        else:
            ids = list(req.prompt)
            bad = [i for i in ids if not 0 <= i < ctl.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"Token id {bad[0]} is out of range [0, {ctl.vocab_size})",
                    param="prompt",
                    code="invalid_token_id",
                )
        params = _params(ctl, req, len(ids), "prompt", req.logprobs)
        params = replace(params, guide=await structured.guide(ctl, req))
        return await _generate(request, ctl, "completion", req, ids, params, t0=t0)
    except APIError as e:
        _count_rejection(ctl, e)
        raise


def _count_rejection(ctl: Controller, e: APIError) -> None:
    if e.status == 503:
        ctl.metrics.outcome("unavailable")
    elif e.status != 429 and 400 <= e.status < 500:
        ctl.metrics.outcome("rejected_4xx")


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctl = _ctl(request)
    card = model_card(ctl.settings.served_name, ctl.settings.model, ctl.max_model_len or None)
    return {"object": "list", "data": [card]}


@router.get("/health")
async def health() -> Response:
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    ctl = _ctl(request)
    try:
        ctl.check_ready()
    except APIError as e:
        return JSONResponse({"status": e.code}, status_code=503, headers=e.headers)
    return JSONResponse({"status": "ready", "model": ctl.settings.served_name})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    data, ctype = _ctl(request).metrics.render()
    return Response(content=data, media_type=ctype)
