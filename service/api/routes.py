"""HTTP endpoints. Each generation request: readiness -> body -> model -> prompt ids -> limits ->
SamplingParams -> worker.submit -> SSE stream or one JSON body."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from dsv4_serve.service.api import structured
from dsv4_serve.service.api.auth import tenant_of
from dsv4_serve.service.api.chat import TextStream, special_tokens, text_offsets, token_bytes, token_text
from dsv4_serve.service.api.chat_prompt import render
from dsv4_serve.service.api.controller import Controller, describe_failure
from dsv4_serve.service.api.fanout import Reply
from dsv4_serve.service.api.limits import StallGuardedStream, check_content_type, check_text_fits, encode, parse_body
from dsv4_serve.service.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    model_card,
)
from dsv4_serve.service.api.streaming import Echo, Generation, request_id
from dsv4_serve.service.api.tool_stream import ToolStream
from dsv4_serve.service.engine.request import SamplingParams
from dsv4_serve.service.engine.scheduler import QueueFull
from dsv4_serve.service.engine.worker import EngineNotReady

router = APIRouter()
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _NoTokenizer:
    """Token-id-only models: generated text is empty; ids are returned in `token_ids`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""

    def id_to_token(self, token_id: int) -> str:
        return ""


def _ctl(request: Request) -> Controller:
    return request.app.state.ctl


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    check_content_type(request.headers.get("content-type"))
    return parse_body(await request.body(), model)  # the body cap is enforced while it is read


def _check_model(ctl: Controller, name: str | None) -> None:
    if name is not None and name != ctl.settings.served_name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{ctl.settings.served_name}'",
            param="model",
            code="model_not_found",
        )


async def _encode(ctl: Controller, text: str, param: str) -> list[int]:
    tok = ctl.tokenizer
    if tok is None:
        raise APIError(
            400,
            "This model has no tokenizer: send token ids as 'prompt' to /v1/completions",
            param=param,
            code="no_tokenizer",
        )
    check_text_fits(tok, text, ctl.max_model_len, param)  # before tokenizing: no work for hopeless text
    return await encode(tok, text)


def _params(ctl: Controller, req: Any, prompt_len: int, param: str, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
    if prompt_logprobs is not None and ctl.settings.distributed:  # the scored forward runs on rank 0 alone
        raise APIError(400, "prompt logprobs (echo with logprobs, prompt_logprobs) are not served with --distributed",
                       param="prompt_logprobs" if req.prompt_logprobs is not None else "echo")  # fmt: skip
    limit = ctl.max_model_len
    if prompt_len >= limit + (req.limit_tokens == 0):
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
    bias = tuple(sorted((int(k), float(v)) for k, v in (req.logit_bias or {}).items()))
    if any(i >= ctl.vocab_size for i, _ in bias):
        raise APIError(400, f"logit_bias token ids must be < vocab size {ctl.vocab_size}", param="logit_bias",
                       code="invalid_value")  # fmt: skip
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
        prompt_logprobs=prompt_logprobs,
        logit_bias=bias,
    )


@dataclass
class _Prompt:
    """One prompt of a request and what its n choices share."""

    ids: list[int]
    params: SamplingParams
    echo: Echo | None = None


async def _submit(request: Request, ctl: Controller, kind: str, req: Any, rid: str, prompts: list[_Prompt],
                  *, thinking: bool = False, tools: bool = False, t0: float) -> Reply:  # fmt: skip
    """Queue every prompt's n choices (choice index = prompt index * n + j; j > 0 gets seed + j, as vLLM)."""
    n, gens = req.n_choices, []
    tok = ctl.tokenizer or _NoTokenizer()
    hidden = special_tokens(tok) if req.skip_special else {}
    skip = set(prompts[0].params.stop_token_ids)
    if ctl.eos_token_id is not None and not prompts[0].params.ignore_eos:
        skip.add(ctl.eos_token_id)
    stop_ids = frozenset(skip - {ctl.eos_token_id})  # vLLM's stop_reason: a stop token id, never EOS
    include_stop = bool(req.include_stop_str_in_output)  # the stop token's text too (hidden if special)
    as_ids = (lambda i: f"token_id:{i}") if req.return_tokens_as_token_ids else None  # vLLM's logprob tokens
    try:
        for pi, p in enumerate(prompts):
            seeds = [p.params.seed if p.params.seed is None else (p.params.seed + j) % 2**63 for j in range(n)]
            rids = [rid] if len(prompts) * n == 1 else [f"{rid}-{pi * n + j}" for j in range(n)]
            streams = await ctl.worker.submit_n(p.ids, [replace(p.params, seed=sd) for sd in seeds], rids,
                                                (tenant_of(request), req.cache_salt or ""))  # fmt: skip
            ctl.metrics.prompt_tokens.inc(len(p.ids))
            for j, (r, events) in enumerate(zip(rids, streams, strict=True)):
                ctl.active[r] = None
                gens.append(Generation(
                    request_id=r, kind=kind, events=events,
                    text=TextStream(tok, stop=req.stop_list, include_stop=include_stop, thinking=thinking,
                                    skip_ids=() if include_stop else skip, hidden=hidden,
                                    token_bytes=lambda i: token_bytes(tok, i)),
                    stop_ids=stop_ids, include_stop=include_stop,
                    abort=ctl.abort, metrics=ctl.metrics, on_done=lambda x: ctl.active.pop(x, None), t0=t0,
                    index=pi * n + j, logprobs=p.params.logprobs is not None, thinking=thinking,
                    token_str=as_ids or (lambda i: token_text(tok, i)),
                    token_bytes=(lambda i: as_ids(i).encode()) if as_ids else (lambda i: token_bytes(tok, i)),
                    echo=p.echo, prompt_ids=p.ids, prompt_logprobs=req.prompt_logprobs is not None,
                    tools=ToolStream() if tools else None,
                ))  # fmt: skip
    except (QueueFull, EngineNotReady, ValueError) as e:
        for g in gens:  # the prompts queued before this one go too
            g.abort(g.request_id)
            asyncio.get_running_loop().create_task(_forget(g))
        if isinstance(e, QueueFull):
            ctl.metrics.outcome("queue_full")
            raise APIError(429, "The server's waiting queue is full; retry shortly", code="queue_full",
                           headers={"Retry-After": "1"}) from None  # fmt: skip
        if isinstance(e, EngineNotReady):
            raise APIError(503, f"Not accepting requests: {e}", code="not_ready",
                           headers={"Retry-After": "1"}) from None  # fmt: skip
        raise APIError(400, str(e), param="prompt" if kind == "completion" else "messages",
                       code="invalid_request") from None  # fmt: skip
    return Reply(rid, kind, ctl.settings.served_name, sum(len(p.ids) for p in prompts), gens)


async def _forget(g: Generation) -> None:
    """Read an aborted, never-consumed choice's stream to its end (the worker then drops it)."""
    try:
        await g.collect()
    except APIError:
        pass


async def _respond(request: Request, req: Any, reply: Reply) -> Response:
    if req.stream:
        return StallGuardedStream(reply.sse(req.include_usage), media_type="text/event-stream", headers=_SSE_HEADERS,
                                  stall_timeout=_ctl(request).settings.stream_stall_timeout)  # fmt: skip
    return await reply.json(request.is_disconnected)


async def submit_chat(request: Request, ctl: Controller, req: ChatCompletionRequest, t0: float) -> Reply:
    """Encode a validated chat request and queue its choices (also the Responses API's path)."""
    tools = structured.prompt_tools(req)
    prompt = render(req, tools)
    ids = await _encode(ctl, prompt.text, "messages")
    params = _params(ctl, req, len(ids), "messages", req.logprobs_k, req.prompt_logprobs)
    params = replace(params, guide=await structured.guide(ctl, req, thinking=prompt.reasoning,
                                                          tenant=tenant_of(request)))  # fmt: skip
    echo = None if prompt.echo is None else Echo(prompt.echo, [], [], logprobs=False)
    return await _submit(request, ctl, "chat", req, request_id("chat"), [_Prompt(ids, params, echo)],
                         thinking=prompt.reasoning, tools=tools is not None, t0=t0)  # fmt: skip


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    t0, ctl = time.perf_counter(), _ctl(request)
    try:
        await ctl.wait_ready()
        ctl.check_room()  # a full queue: 429 before the body is read
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        _check_model(ctl, req.model)
        return await _respond(request, req, await submit_chat(request, ctl, req, t0))
    except APIError as e:
        _count_rejection(ctl, e)
        raise


async def _prompt_ids(ctl: Controller, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return await _encode(ctl, prompt, "prompt")
    ids = list(prompt)
    bad = [i for i in ids if not 0 <= i < ctl.vocab_size]
    if bad:
        raise APIError(
            400, f"Token id {bad[0]} is out of range [0, {ctl.vocab_size})", param="prompt", code="invalid_token_id"
        )
    return ids


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    t0, ctl = time.perf_counter(), _ctl(request)
    try:
        await ctl.wait_ready()
        ctl.check_room()  # a full queue: 429 before the body is read
        req: CompletionRequest = await _parse(request, CompletionRequest)
        _check_model(ctl, req.model)
        ctl.check_room(len(req.prompts))  # each prompt is a request of the queue: 429 before any is tokenized
        prompts, guide = [], await structured.guide(ctl, req, tenant=tenant_of(request))
        for prompt in req.prompts:  # all validated before any is queued
            ids = await _prompt_ids(ctl, prompt)
            params = _params(ctl, req, len(ids), "prompt", req.logprobs, req.prompt_logprobs_k)
            params = replace(params, guide=guide)
            echo = None
            if req.echo:
                text, offsets = text_offsets(ctl.tokenizer or _NoTokenizer(), ids)
                echo = Echo(text, ids, offsets, logprobs=req.logprobs is not None)
            prompts.append(_Prompt(ids, params, echo))
        reply = await _submit(request, ctl, "completion", req, request_id("completion"), prompts, t0=t0)
        return await _respond(request, req, reply)
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


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> dict[str, Any]:
    ctl = _ctl(request)
    _check_model(ctl, model_id)
    return model_card(ctl.settings.served_name, ctl.settings.model, ctl.max_model_len or None)


# GET and HEAD as two routes: one route of both methods gives both operations one operationId in /openapi.json,
# which OpenAPI code generators refuse (issue 62); HEAD's stays out of the schema.
@router.head("/health", include_in_schema=False)
@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the server loads or serves; 503 once the engine can never serve (the process is exiting)."""
    failure = _ctl(request).failure
    if failure is not None:
        return JSONResponse({"status": "failed", "error": describe_failure(failure)}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.head("/ready", include_in_schema=False)
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
