"""vLLM's tokenizer endpoints, as vLLM shapes them (lm-eval's `tokenizer_backend=remote` uses them): POST
/tokenize (a `prompt`, or chat `messages` through the model's prompt encoding), POST /detokenize, GET
/tokenizer_info (the tokenizer's configuration: tokenizer_config.json's fields). They hold for the model like the
generation routes, and take the API key as /v1/* does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from dsv4_serve.service.api import routes, structured
from dsv4_serve.service.api.chat_prompt import render
from dsv4_serve.service.api.limits import check_content_type, check_text_fits, encode, parse_body
from dsv4_serve.service.api.protocol import APIError, Body, ChatCompletionRequest

router = APIRouter()


class TokenizeCompletionRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # default true (vLLM); DeepSeek's tokenizer adds no BOS either way
    return_token_strs: bool | None = None  # the tokens' vocabulary pieces too


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's chat form: the prompt a chat request with these messages (and tools, chat_template_kwargs,
    add_generation_prompt, continue_final_message) would be."""

    add_special_tokens: bool | None = None  # default false (vLLM): the chat encoding writes BOS itself
    return_token_strs: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=2**20)


def _tokenizer(ctl: Any) -> Any:
    if ctl.tokenizer is None:
        raise APIError(400, "This model has no tokenizer", code="no_tokenizer")
    return ctl.tokenizer


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    ctl = routes._ctl(request)
    await ctl.wait_ready()
    check_content_type(request.headers.get("content-type"))
    raw = await request.body()
    chat = isinstance(body := _peek(raw), dict) and "messages" in body
    req = parse_body(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    routes._check_model(ctl, req.model)
    tok = _tokenizer(ctl)
    if chat:
        text, special = render(req, structured.prompt_tools(req)).text, bool(req.add_special_tokens)
    else:
        text, special = req.prompt, req.add_special_tokens is not False
    param = "messages" if chat else "prompt"
    # Bounded as a generation request's prompt: text that cannot fit the context is refused before tokenizing,
    # and more ids than the context holds are never returned (a 3.6 MB text gave 1.8M ids, 0.5 s of the loop)
    check_text_fits(tok, text, ctl.max_model_len, param)
    ids = await encode(tok, text, add_special_tokens=special)
    if len(ids) > ctl.max_model_len:
        raise APIError(400, f"The prompt has {len(ids)} tokens; this model's context length is {ctl.max_model_len}",
                       param=param, code="context_length_exceeded")  # fmt: skip
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctl.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [tok.id_to_token(i) for i in ids]
    return JSONResponse(out)  # json.dumps straight away: FastAPI's encoder walks every id in Python


def _peek(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's parser goes
        return None  # parse_body reports it


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    ctl = routes._ctl(request)
    await ctl.wait_ready()
    req: DetokenizeRequest = await routes._parse(request, DetokenizeRequest)
    routes._check_model(ctl, req.model)
    tok = _tokenizer(ctl)
    bad = [i for i in req.tokens if not 0 <= i < ctl.vocab_size]
    if bad:
        raise APIError(400, f"Token id {bad[0]} is out of range [0, {ctl.vocab_size})", param="tokens",
                       code="invalid_token_id")  # fmt: skip
    text = await asyncio.to_thread(tok.decode, req.tokens, skip_special_tokens=False)
    return {"prompt": text}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """tokenizer_config.json as the model directory has it (vLLM: the tokenizer's init kwargs, file paths
    dropped, added tokens by their text); the release's when the directory has none (the embedded tiny model)."""
    ctl = routes._ctl(request)
    await ctl.wait_ready()
    return await asyncio.to_thread(_config, ctl.settings.model, _tokenizer(ctl))


def _config(model: str | None, tok: Any) -> dict[str, Any]:
    from dsv4_serve.model.tokenizer import BOS, EOS, tokenizer_config

    path = Path(model) / "tokenizer_config.json" if model else None
    if path is not None and path.is_file():
        config = json.loads(path.read_text())
    else:
        config = tokenizer_config(tok)
    for key in ("vocab_file", "merges_file", "tokenizer_file"):
        config.pop(key, None)
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):  # an AddedToken object -> its text
        if isinstance(config.get(key), dict):
            config[key] = config[key].get("content")
    added = config.get("added_tokens_decoder")
    if isinstance(added, dict):
        config["added_tokens_decoder"] = {k: v.get("content") if isinstance(v, dict) else v for k, v in added.items()}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("bos_token", BOS)
    config.setdefault("eos_token", EOS)
    return config
