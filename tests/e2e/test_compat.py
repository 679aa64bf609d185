"""OpenAI and vLLM chat / completion fields through the openai SDK against a real server: the fields that change
nothing leave the output as it was, vLLM's prompt shaping (add_generation_prompt, continue_final_message, echo)
gives the prompt written out here by hand, include_stop_str_in_output and stop_reason, and the small cases
(top_logprobs without logprobs, HEAD probes, an image part)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, Server

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _ids(server: Server, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _complete(client: openai.OpenAI, prompt: str, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw).choices[0]


def test_harmless_fields_change_nothing(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**kw).choices[0].message.content
    r = client.chat.completions.create(
        **kw, store=True, metadata={"team": "a"}, service_tier="auto", prompt_cache_key="k", safety_identifier="u1",
        modalities=["text"], prediction={"type": "content", "content": "hello there"}, verbosity="medium", user="u",
    )  # fmt: skip
    assert r.choices[0].message.content == plain


@pytest.mark.parametrize(("field", "value", "says"), [
    ("modalities", ["text", "audio"], "audio"),
    ("verbosity", "low", "verbosity"),
    ("top_logprobs", 2, "logprobs"),
])  # fmt: skip
def test_what_would_change_the_output_is_a_400_naming_it(client: openai.OpenAI, field: str, value, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **{field: value})
    err = e.value.body
    assert err["param"] == field and says in err["message"], err


def test_top_logprobs_with_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=2)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, top_logprobs=0)  # vLLM: 0 is fine
    assert r.choices[0].logprobs is None


def test_continue_final_message_and_echo(server: Server, client: openai.OpenAI) -> None:
    msgs = [*HI, {"role": "assistant", "content": "The quick"}]
    prompt = f"{BOS}{USER}hi{ASSISTANT}</think>The quick"  # the assistant turn left open: no EOS
    assert _ids(server, messages=msgs, continue_final_message=True, add_generation_prompt=False) == _ids(
        server, prompt=prompt)
    want = _complete(client, prompt, max_tokens=6).text
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0}
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(**kw, extra_body=extra)
    assert r.choices[0].message.content == want
    echoed = client.chat.completions.create(**kw, extra_body={**extra, "echo": True}).choices[0].message.content
    assert echoed == "The quick" + want
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**extra, "echo": True}))
    assert chunks[0].choices[0].delta.content == "The quick"  # vLLM: the echoed content first, a chunk of its own
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    # continue_final_message alone implies add_generation_prompt=false; echo of a new turn repeats nothing
    assert client.chat.completions.create(**kw, extra_body={"continue_final_message": True}).choices[
        0].message.content == want
    new_turn = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0)
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, extra_body={
        "echo": True}).choices[0].message.content == new_turn.choices[0].message.content


def test_continue_in_thinking_mode_continues_the_reasoning(server: Server) -> None:
    msgs = [*HI, {"role": "assistant", "content": "", "reasoning_content": "Let me"}]
    kw = {"messages": msgs, "continue_final_message": True, "chat_template_kwargs": {"thinking": True}}
    assert _ids(server, **kw) == _ids(server, prompt=f"{BOS}{USER}hi{ASSISTANT}<think>Let me")
    msgs[-1]["content"] = "Paris"
    assert _ids(server, **{**kw, "messages": msgs}) == _ids(
        server, prompt=f"{BOS}{USER}hi{ASSISTANT}<think>Let me</think>Paris")


def test_add_generation_prompt_false(server: Server, client: openai.OpenAI) -> None:
    prompt = f"{BOS}{USER}hi"  # no <｜Assistant｜></think> after the user turn
    assert _ids(server, messages=HI, add_generation_prompt=False) == _ids(server, prompt=prompt)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0,
                                       extra_body={"add_generation_prompt": False})  # fmt: skip
    assert r.choices[0].message.content == _complete(client, prompt, max_tokens=5).text


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": HI, "continue_final_message": True}, "continue_final_message"),  # the last message is a user's
    ({"messages": [*HI, {"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
])  # fmt: skip
def test_continue_final_message_rejected(server: Server, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stop_string_kept_and_stop_reason(client: openai.OpenAI) -> None:
    free = _complete(client, "The quick brown", max_tokens=24).text
    pairs = [free[i : i + 2] for i in range(3, len(free) - 1)]
    stop = next(p for p in pairs if p.strip() == p and all(c.isprintable() and c != "\ufffd" for c in p))
    at = free.index(stop)
    plain = _complete(client, "The quick brown", max_tokens=24, stop=[stop, "\x00never"])
    assert plain.text == free[:at] and plain.finish_reason == "stop"
    kept = _complete(client, "The quick brown", max_tokens=24, stop=[stop], extra_body={
        "include_stop_str_in_output": True})  # fmt: skip
    assert kept.text == free[: at + len(stop)] and kept.model_extra["stop_reason"] == stop
    assert plain.model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=24, temperature=0,
                                            stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in chunks) == kept.text
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == stop
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    assert chat.choices[0].model_extra["stop_reason"] is None  # length (or EOS): no stop string, no stop id


def test_stop_token_kept_and_stop_reason(server: Server, client: openai.OpenAI) -> None:
    first = _complete(client, "Hello, world", max_tokens=1)
    vocab = 512  # the embedded tiny model; ids 0..6 are its special tokens
    assert first.finish_reason == "length" and first.text  # a plain first token
    stops = list(range(7, vocab))
    plain = _complete(client, "Hello, world", max_tokens=4, extra_body={"stop_token_ids": stops})
    assert plain.text == "" and plain.finish_reason == "stop"
    tid = plain.model_extra["stop_reason"]
    assert isinstance(tid, int) and 7 <= tid < vocab
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [tid]}).json()["prompt"] == first.text
    kept = _complete(client, "Hello, world", max_tokens=4, extra_body={"stop_token_ids": stops,
                                                                       "include_stop_str_in_output": True})
    assert kept.text == first.text and kept.model_extra["stop_reason"] == tid


def test_head_probes(server: Server) -> None:
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert httpx.head(f"{server.url}/ready").status_code == 200


def test_image_part_names_what_is_unsupported(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=2)
    err = e.value.body
    assert err["param"] == "messages" and "image_url" in err["message"] and "text only" in err["message"], err


def test_return_tokens_as_token_ids(server: Server, client: openai.OpenAI) -> None:
    """vLLM's `return_tokens_as_token_ids`: each logprobs token (and each top-k key) is "token_id:<id>", the ids
    the same greedy text gives through /tokenize; chat's `bytes` are the string's. What tools/graph_agree.py
    compares: a server without a tokenizer names every token "" otherwise."""
    plain = _complete(client, "hello", max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
    ids = _complete(client, "hello", max_tokens=6, logprobs=2,
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})  # fmt: skip
    assert ids.text == plain.text
    toks = ids.logprobs.tokens
    assert all(t.startswith("token_id:") for t in toks) and len(toks) == 6
    got = [int(t.split(":", 1)[1]) for t in toks]
    r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": got})
    assert r.status_code == 200 and r.json()["prompt"] == plain.text, r.text
    assert all(len(d) == 2 and all(k.startswith("token_id:") for k in d) for d in ids.logprobs.top_logprobs)
    assert all(t in d for t, d in zip(toks, ids.logprobs.top_logprobs, strict=True))  # greedy: its token is a top-1
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    for c in chat.choices[0].logprobs.content:
        assert c.token.startswith("token_id:") and int(c.token.split(":")[1]) >= 0
        assert c.bytes == list(c.token.encode())
