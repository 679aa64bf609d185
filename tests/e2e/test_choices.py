"""n > 1 (one prefill, the state copied to n rows), lists of prompts, logit_bias, special tokens kept out of the
text, GET /v1/models/{id}: the openai SDK and httpx against a real server (embedded tiny model)."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from dsv4_serve.model.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer
from dsv4_serve.service.api.chat import token_text
from tests.e2e.conftest import MODEL, Server
from tests.e2e.test_api import metric

PAD, ASSISTANT, THINK = 6, 3, 4  # the tiny tokenizer's ids (model/tokenizer.py: SPECIAL_TOKENS order)
LONG = [int(t) for t in np.random.default_rng(3).integers(7, 512, 300)]  # crosses CSA / HCA boundaries


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _texts(r) -> list[str]:
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


@pytest.mark.parametrize("prompt", [[11, 12, 13], LONG[:40], LONG])
def test_n_greedy_shares_one_prefill(server: Server, client: openai.OpenAI, prompt: list[int]) -> None:
    before = metric(server, "dsv4_prefill_tokens_total")
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    single = metric(server, "dsv4_prefill_tokens_total") - before
    assert single >= min(len(prompt) - 2, 256)  # (a 256-token step budget: one prompt token may go through the step)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=4, logprobs=0)
    second = metric(server, "dsv4_prefill_tokens_total") - before - single
    if r.usage.prompt_tokens_details is None:  # no prefix cache: one prefill, not four
        assert second == single
    else:  # the prefix cache holds the first request's prompt: no prefill at all, not four
        assert r.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1 and second == 0
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert _texts(r) == [one.choices[0].text] * 4  # each row continues from the copied state exactly
    lps = [c.logprobs.token_logprobs for c in r.choices]
    assert all(np.allclose(x, one.choices[0].logprobs.token_logprobs, atol=1e-5) for x in lps)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4 * one.usage.completion_tokens


def test_n_seeded_choice_j_is_seed_plus_j(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": LONG[:50], "max_tokens": 10, "temperature": 1.0}
    r = client.completions.create(n=3, seed=100, **kw)
    singles = [client.completions.create(seed=100 + j, **kw).choices[0].text for j in range(3)]
    assert _texts(r) == singles and len(set(singles)) > 1


def test_n_streamed_chat(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Tell me about the fox."}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0.8, "seed": 5, "n": 2}
    full = client.chat.completions.create(**kw)
    parts: dict[int, str] = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
        if not chunk.choices:
            assert chunk.usage.completion_tokens == full.usage.completion_tokens
    assert parts == {c.index: c.message.content for c in full.choices}


def test_list_of_prompts_one_choice_each(client: openai.OpenAI) -> None:
    prompts = ["The quick brown fox", "Hello, world!", "Numbers: 1 2 3"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert _texts(r) == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    texts = _texts(ids)
    assert texts[0] == texts[1] and texts[2] == texts[3]


def test_logit_bias(client: openai.OpenAI) -> None:
    tok = build_tiny_tokenizer(512)
    ids = {token_text(tok, i): i for i in range(512)}
    kw = {"model": MODEL, "prompt": LONG[:20], "max_tokens": 16, "temperature": 0, "logprobs": 0}
    base = client.completions.create(**kw).choices[0].logprobs.tokens
    assert client.completions.create(**kw).choices[0].logprobs.tokens == base  # greedy repeats
    banned = max(set(base), key=base.count)
    out = client.completions.create(**kw, logit_bias={str(ids[banned]): -100}).choices[0].logprobs.tokens
    assert banned not in out and out != base
    forced = client.completions.create(**kw, logit_bias={"300": 100}).choices[0].logprobs.tokens
    assert forced == [token_text(tok, 300)] * 16


def test_special_tokens_never_in_text(server: Server) -> None:
    bias = {str(PAD): 4.0, str(ASSISTANT): 4.0, str(THINK): 4.0}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 1.0,
            "seed": 11, "logit_bias": bias, "logprobs": True, "chat_template_kwargs": {"thinking": True}}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    msg, lp = r["choices"][0]["message"], r["choices"][0]["logprobs"]["content"]
    generated = {e["token"] for e in lp}
    assert generated & {"<｜▁pad▁｜>", "<｜Assistant｜>", "<think>"}  # the model did emit special tokens
    for text in (msg["content"], msg["reasoning_content"]):
        assert not any(s in text for s in SPECIAL_TOKENS)
    shown = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "skip_special_tokens": False}).json()
    m2 = shown["choices"][0]["message"]
    assert any(s in m2["content"] + m2["reasoning_content"] for s in SPECIAL_TOKENS)
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 30, "temperature": 1.0, "seed": 3, "logit_bias": bias}
    text = httpx.post(f"{server.url}/v1/completions", json=comp).json()["choices"][0]["text"]
    assert not any(s in text for s in SPECIAL_TOKENS)


def test_model_by_id(client: openai.OpenAI, server: Server) -> None:
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert httpx.get(f"{server.url}/v1/models/nope").json()["error"]["param"] == "model"
