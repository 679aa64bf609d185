"""Every request field in the schema is implemented or rejected by name, never silently dropped: the test walks
each request model's JSON schema and sends every field to a real server. A field added to protocol.py (or
responses.py) without a row here fails `test_every_field_has_a_row`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from dsv4_serve.service.api.protocol import ChatCompletionRequest, CompletionRequest
from dsv4_serve.service.api.responses_request import ResponsesRequest
from tests.e2e.conftest import MODEL, Server

OK, REJECTED = "ok", "rejected"
FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
CHAT_TOOLS = OK if "tools" in ChatCompletionRequest.model_fields else REJECTED  # /v1/responses translates them

SHARED: dict[str, tuple[Any, str]] = {
    "model": (MODEL, OK),
    "max_tokens": (2, OK),
    "temperature": (0.5, OK),
    "top_p": (0.9, OK),
    "top_k": (5, OK),
    "min_p": (0.1, OK),
    "seed": (1, OK),
    "stop": (["x"], OK),
    "stop_token_ids": ([5], OK),
    "ignore_eos": (True, OK),
    "min_tokens": (1, OK),
    "presence_penalty": (0.5, OK),
    "frequency_penalty": (0.5, OK),
    "repetition_penalty": (1.1, OK),
    "n": (2, OK),
    "logit_bias": ({"5": 1.5}, OK),
    "prompt_logprobs": (1, OK),
    "skip_special_tokens": (False, OK),
    "include_stop_str_in_output": (True, OK),
    "return_tokens_as_token_ids": (True, OK),  # what it does: test_compat.py
    "cache_salt": ("salt-1", OK),
    "stream": (True, OK),
    "stream_options": ({"include_usage": True}, REJECTED),  # without stream: true (as OpenAI); with: test_api.py
    "user": ("someone", OK),
    "response_format": ({"type": "json_object"}, OK),
    "guided_json": ({"type": "object"}, OK),
    "guided_regex": ("[a-z]+", OK),
    "guided_choice": (["yes", "no"], OK),
}
CHAT_FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
HI = [{"role": "user", "content": "hi"}]
CASES: dict[str, tuple[type, dict[str, Any], dict[str, tuple[Any, str]]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": HI, "max_tokens": 2}, {
        **SHARED,
        "messages": ([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], OK),
        "max_completion_tokens": (2, OK),
        "logprobs": (True, OK),
        "top_logprobs": (0, OK),  # > 0 needs logprobs: test_compat.py
        "reasoning_effort": ("high", OK),
        "chat_template_kwargs": ({"thinking": True}, OK),
        "tools": ([CHAT_FN], OK),
        "tool_choice": ("none", OK),
        "parallel_tool_calls": (True, OK),
        "store": (True, OK),
        "metadata": ({"k": "v"}, OK),
        "service_tier": ("auto", OK),
        "prompt_cache_key": ("k", OK),
        "safety_identifier": ("someone", OK),
        "modalities": (["text"], OK),
        "prediction": ({"type": "content", "content": "hi"}, OK),
        "verbosity": ("low", REJECTED),  # "medium" only: test_compat.py
        "add_generation_prompt": (False, OK),
        "continue_final_message": (True, REJECTED),  # the last message is a user's: test_compat.py continues one
        "echo": (True, OK),
    }),
    "/v1/completions": (CompletionRequest, {"prompt": "hi", "max_tokens": 2}, {
        **SHARED,
        "prompt": ([[5, 6], [7]], OK),
        "logprobs": (2, OK),
        "echo": (True, OK),
    }),
    "/v1/responses": (ResponsesRequest, {"input": "hi", "max_output_tokens": 2}, {
        "model": (MODEL, OK),
        "input": ([{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], OK),
        "instructions": ("Be brief.", OK),
        "max_output_tokens": (3, OK),
        "temperature": (0.5, OK),
        "top_p": (0.9, OK),
        "stream": (True, OK),
        "reasoning": ({"effort": "low"}, OK),  # a summary is rejected by name: test_wire_details.py
        "text": ({"format": {"type": "text"}}, OK),
        "tools": ([FN], CHAT_TOOLS),
        "tool_choice": ("auto", CHAT_TOOLS),
        "parallel_tool_calls": (True, CHAT_TOOLS),
        "store": (False, OK),
        "metadata": ({"k": "v"}, OK),
        "user": ("someone", OK),
        "service_tier": ("default", OK),
        "prompt_cache_key": ("k", OK),
        "safety_identifier": ("someone", OK),
        "include": (["reasoning.encrypted_content"], OK),
        "truncation": ("auto", OK),
        "previous_response_id": ("resp_1", REJECTED),  # nothing is stored: OpenAI's 400 for an unknown id
        "cache_salt": ("salt-1", OK),
    }),
}  # fmt: skip
ROWS = [(path, field) for path, (_, _, table) in CASES.items() for field in table]


@pytest.mark.parametrize("path", list(CASES))
def test_every_field_has_a_row(path: str) -> None:
    model, _, table = CASES[path]
    assert set(model.model_json_schema()["properties"]) == set(table)


@pytest.mark.parametrize(("path", "field"), ROWS, ids=[f"{p.rsplit('/', 1)[1]}-{f}" for p, f in ROWS])
def test_field_is_implemented_or_rejected_by_name(server: Server, path: str, field: str) -> None:
    _, base, table = CASES[path]
    value, expect = table[field]
    r = httpx.post(f"{server.url}{path}", json={**base, field: value}, timeout=60)
    if expect == OK:
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            assert "[DONE]" in r.text or "response.completed" in r.text or "response.incomplete" in r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("path", list(CASES))
def test_unknown_field_rejected_by_name(server: Server, path: str) -> None:
    _, base, _ = CASES[path]
    r = httpx.post(f"{server.url}{path}", json={**base, "frequency_boost": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "frequency_boost" and "frequency_boost" in err["message"]
    assert httpx.post(f"{server.url}{path}", json={**base, "frequency_boost": None}).status_code == 200  # null: absent
