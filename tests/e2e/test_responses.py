"""POST /v1/responses through the openai SDK against a real server: text, instructions and message items,
reasoning items in thinking mode, the streamed events in order, and fields rejected by name."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, Server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, messages: list[dict], **kw) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return r.choices[0].message


def test_text_equals_chat(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=8,
                                temperature=0)  # fmt: skip
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text == _chat(client, msgs, max_tokens=8).content
    assert r.output[-1].type == "message" and r.output[-1].role == "assistant"
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 3
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    parts = [{"type": "input_text", "text": "Hello there"}]
    items = [{"role": "system", "content": "Be brief."}, {"type": "message", "role": "user", "content": parts}]
    again = client.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    assert again.output_text == r.output_text


def test_reasoning_item(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=12, temperature=0,
                                reasoning={"effort": "high"})  # fmt: skip
    msg = _chat(client, [{"role": "user", "content": "hi"}], max_tokens=12, reasoning_effort="high")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning = "".join(c.text for c in (r.output[0].content or []))
    assert reasoning == msg.reasoning_content and r.output_text == msg.content


@pytest.mark.parametrize("effort", [None, "high"])
def test_stream_events(client: openai.OpenAI, effort: str | None) -> None:
    kw = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 10, "temperature": 0}
    if effort:
        kw["reasoning"] = {"effort": effort}
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    msg_events = ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                  "response.content_part.done", "response.output_item.done"]  # fmt: skip
    assert [t for t in types if t in msg_events][-5:] == msg_events
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-1].response.output_text
    if effort:
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == "".join(c.text for c in (full.output[0].content or []))


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": "hi", "model": "gpt-4o"}, "model"),
])  # fmt: skip
def test_rejected_by_name(server: Server, body: dict, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_tool_calls_become_function_call_items(client: openai.OpenAI) -> None:
    """tool_choice "required": the chat path's tool calls come back as function_call items, whole and streamed
    alike, their arguments the chat call's (valid JSON for the tool's parameters)."""
    import json

    params = {"type": "object", "properties": {"c": {"type": "string", "maxLength": 3}}, "required": ["c"]}
    tool = {"type": "function", "name": "f", "parameters": params}
    args = {"model": MODEL, "input": "hi", "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 180, "temperature": 0}  # fmt: skip
    whole = client.responses.create(**args)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1, whole.output
    assert calls[0].name == "f" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"c"}
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    i, a = kinds.index("response.function_call_arguments.done"), kinds.index("response.output_item.added")
    # The item opens with its name, the arguments follow in pieces (issue 62), their concatenation the whole.
    assert events[a].item.type == "function_call" and events[a].item.name == "f" and events[a].item.arguments == ""
    assert set(kinds[a + 1 : i]) == {"response.function_call_arguments.delta"} and i - a > 2, kinds
    assert kinds[i + 1] == "response.output_item.done"
    assert "".join(e.delta for e in events[a + 1 : i]) == events[i].arguments == calls[0].arguments  # greedy
    done = events[-1].response
    assert [o.type for o in done.output] == [o.type for o in whole.output]
    assert [e.sequence_number for e in events] == list(range(len(events)))


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer",
        "minimum": 0, "maximum": 99}}, "required": ["city", "n"], "additionalProperties": False}  # fmt: skip


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    """Responses' flat json_schema format (name, schema, strict at the top) constrains the output like chat's."""
    import json

    import jsonschema

    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = client.responses.create(model=MODEL, input="Name a city.", text={"format": fmt}, max_output_tokens=60,
                                temperature=0)  # fmt: skip
    assert r.status == "completed", r.output
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a city."}],
                                          max_tokens=60, temperature=0, response_format={
                                              "type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                                     "strict": True}})  # fmt: skip
    assert r.output_text == chat.choices[0].message.content


def test_parse_into_a_model(client: openai.OpenAI) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=8)
        n: int = Field(ge=0, le=99)

    r = client.responses.parse(model=MODEL, input="Name a city.", text_format=City, max_output_tokens=60,
                               temperature=0)  # fmt: skip
    assert isinstance(r.output_parsed, City), r.output_text


@pytest.mark.parametrize(("text", "says"), [
    ({"format": {"type": "json_schema", "name": "x"}}, "schema"),
    ({"format": {"type": "json_schema", "name": "x", "schema": "object"}}, "schema"),
])  # fmt: skip
def test_json_schema_format_needs_a_schema(server: Server, text: dict, says: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "text": text})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "text.format" and says in err["message"]


def test_harmless_fields_change_nothing(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "input": "Hello there", "max_output_tokens": 8, "temperature": 0}
    plain = client.responses.create(**kw).output_text
    r = client.responses.create(**kw, include=["reasoning.encrypted_content", "file_search_call.results"],
                                truncation="auto", service_tier="auto", prompt_cache_key="k", safety_identifier="u",
                                store=False, metadata={"a": "b"})  # fmt: skip
    assert r.output_text == plain and r.metadata == {"a": "b"}
    assert client.responses.create(**kw, truncation="disabled").output_text == plain


def test_unsupported_include_and_previous_response(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", include=["message.output_text.logprobs"])
    assert e.value.body["param"] == "include" and "logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_abc")
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_reasoning_item_is_the_next_turns_reasoning(client: openai.OpenAI) -> None:
    """A reasoning input item (sent back, as stateless clients do) is the reasoning_content of the assistant turn
    after it: the prompt is the chat request's with that reasoning."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "I should call f."}]}  # fmt: skip
    kw = {"model": MODEL, "tools": [tool], "max_output_tokens": 1, "reasoning": {"effort": "high"}}
    with_item = client.responses.create(input=[{"role": "user", "content": "hi"}, thought, call, out], **kw)
    without = client.responses.create(input=[{"role": "user", "content": "hi"}, call, out], **kw)
    chat_call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [chat_call], "reasoning_content": "I should call f."},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}]  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, reasoning_effort="high",
                                          tools=[{"type": "function", "function": {k: v for k, v in tool.items()
                                                                                   if k != "type"}}])  # fmt: skip
    assert with_item.usage.input_tokens == chat.usage.prompt_tokens > without.usage.input_tokens


def test_named_tool_choice(client: openai.OpenAI) -> None:
    """Responses' named tool_choice is flat ({"type": "function", "name"}); chat's nests the name."""
    params = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k"]}
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}},
             {"type": "function", "name": "g", "parameters": params}]  # fmt: skip
    r = client.responses.create(model=MODEL, input="hi", tools=tools, tool_choice={"type": "function", "name": "g"},
                                parallel_tool_calls=False, max_output_tokens=240, temperature=0)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "g" for c in calls), r.output
