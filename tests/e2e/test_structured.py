"""Structured output and tool calls through a real server and the openai SDK: on the tiny random model,
constrained outputs still parse and validate, streamed and whole answers agree, bad requests get 400s."""

from __future__ import annotations

import concurrent.futures as cf
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL, Server, joined

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "n", "ok"],
    "additionalProperties": False,
}
# The tiny tokenizer spends a token on nearly every DSML character: the tools section takes ~800 of the tiny
# model's 8,192 positions; a short parameter keeps a call within a few hundred tokens.
TOOL_PARAMS = {"type": "object", "properties": {"c": {"type": "string", "maxLength": 3}}, "required": ["c"]}
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": TOOL_PARAMS}},
    {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k"]}}},
]
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def both(client: openai.OpenAI, seed: int, **kw: Any) -> tuple[Any, list[Any]]:
    """One seeded request whole and streamed."""
    args = {"model": MODEL, "messages": MSGS, "temperature": 1.0, "seed": seed, **kw}
    return client.chat.completions.create(**args), list(client.chat.completions.create(**args, stream=True))


def test_json_schema_20_seeds(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda s: both(client, s, response_format=rf, max_tokens=120), range(20)))
    for whole, chunks in results:
        choice = whole.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice_required_20_seeds(client: openai.OpenAI) -> None:
    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda s: both(client, s, tools=TOOLS[:1], tool_choice="required", max_tokens=180,
                                             parallel_tool_calls=False), range(20)))  # fmt: skip
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for whole, chunks in results:
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
        streamed = joined([ch.choices[0] for ch in chunks if ch.choices])  # id + name, then argument pieces
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_tool_choice(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "g"}}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS[1:], tool_choice=choice, seed=3,
                                       max_tokens=180)  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["g"]
    assert 0 <= json.loads(calls[0].function.arguments)["k"] <= 9


def test_tool_choice_none_renders_no_tools(client: openai.OpenAI) -> None:
    with_tools = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none",
                                                max_tokens=1)  # fmt: skip
    plain = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens


def test_guided_fields_on_completions(server: Server) -> None:
    url = f"{server.url}/v1/completions"
    for seed in range(5):
        body = {"prompt": "The answer:", "max_tokens": 40, "temperature": 1.0, "seed": seed}
        r = httpx.post(url, json={**body, "guided_choice": ["yes", "no", "maybe"]}, timeout=120).json()
        assert r["choices"][0]["text"] in ("yes", "no", "maybe") and r["choices"][0]["finish_reason"] == "stop"
        r = httpx.post(url, json={**body, "guided_regex": "[a-c]{2}-[0-9]{3}"}, timeout=120).json()
        assert __import__("re").fullmatch("[a-c]{2}-[0-9]{3}", r["choices"][0]["text"])
        r = httpx.post(url, json={**body, "max_tokens": 100, "response_format": {"type": "json_object"}},
                       timeout=120).json()  # fmt: skip
        if r["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(r["choices"][0]["text"]), dict)
        r = httpx.post(url, json={**body, "guided_json": SCHEMA, "max_tokens": 120}, timeout=120).json()
        jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)


def test_constrained_row_at_max_tokens_is_length(client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, response_format=rf, max_tokens=3, seed=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_regex": "(["}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"guided_regex": "([a-z ]*[a-z ]*)*x"}, "guided_regex"),  # ambiguous repeats (issue 63)
        ({"guided_json": {"type": "string", "pattern": "^(a+)+$"}}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "patternProperties": {"^([a-z]+[0-9]?)*$": {}}}}}}, "response_format"),
    ],
)
def test_bad_structured_requests(server: Server, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
