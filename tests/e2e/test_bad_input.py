"""The bad-input table against a real server: every field with wrong types, out of range, non-finite,
oversize; malformed JSON, wrong content types, invalid UTF-8, out-of-vocab ids. Each case gets its
4xx with an OpenAI error body, and a greedy request after it returns the same tokens as before."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from dsv4_serve.service.api import limits
from dsv4_serve.service.api.protocol import ChatCompletionRequest, CompletionRequest
from tests.e2e.conftest import MODEL, Server
from tests.e2e.test_api import metric

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
BASES = {"chat": CHAT, "comp": COMP}
ANY = object()  # the case's `param` is not checked


def with_literal(base: dict[str, Any], field: str, literal: str) -> str:
    """base as JSON text with `field` set to a raw JSON literal (NaN, 1e999, ...)."""
    rest = {k: v for k, v in base.items() if k != field}
    return json.dumps(rest)[:-1] + f', "{field}": {literal}}}'


Case = tuple[str, str | bytes, int, Any, str]  # endpoint, body, status, param, content type
CASES: list[tuple[str, Case]] = []


def add(name: str, ep: str, body: Any, status: int = 400, param: Any = ANY, ctype: str = "application/json") -> None:
    raw = body if isinstance(body, str | bytes) else json.dumps(body)
    CASES.append((f"{len(CASES)}-{name}", (ep, raw, status, param, ctype)))


NONFINITE = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999")
WRONG_NUMBER = ('"0.5"', "true", "[0.5]", '{"v": 0.5}')
FLOATS = {  # field: values out of its range
    "temperature": ("-0.1", "2.5"),
    "top_p": ("0", "1.5"),
    "min_p": ("-0.1", "1.1"),
    "presence_penalty": ("-2.5", "2.5"),
    "frequency_penalty": ("-3", "3"),
    "repetition_penalty": ("0", "-1"),
}
for ep, base in BASES.items():
    # The sampling fields are one model for both endpoints: the whole grid on chat, a sample on completions.
    full = ep == "chat"
    for field, out_of_range in FLOATS.items():
        for lit in out_of_range if full else out_of_range[:1]:
            add(f"{ep}-{field}-range-{lit}", ep, with_literal(base, field, lit), param=field)
        # NaN / Infinity literals: 400 as malformed JSON; 1e999 overflows to inf: 400 naming the field
        for lit in NONFINITE if full else NONFINITE[::3]:
            add(f"{ep}-{field}-{lit}", ep, with_literal(base, field, lit), param=None if "e999" not in lit else field)
        for lit in WRONG_NUMBER if full else WRONG_NUMBER[:1]:
            add(f"{ep}-{field}-type-{lit}", ep, with_literal(base, field, lit), param=field)
    ints = {
        "max_tokens": ("0", "-1", "1.5", '"4"', "true", "[4]", "10000000"),
        "top_k": ("-2", "1.5", '"5"', "false"),
        "seed": ('"7"', "1.5", str(2**64), str(-(2**63) - 1)),
        "min_tokens": ("-1", "0.5", '"1"'),
        "n": ("0", "-1", '"1"', "1.5"),
    }
    for field, lits in ints.items():
        for lit in lits if full else lits[1:3]:  # (completions: max_tokens=0 is valid with echo)
            add(f"{ep}-{field}-{lit}", ep, with_literal(base, field, lit), param=field)
    for lit in ('"yes"', "1", "[true]") if full else ('"yes"',):
        add(f"{ep}-ignore_eos-{lit}", ep, with_literal(base, "ignore_eos", lit), param="ignore_eos")
        add(f"{ep}-stream-{lit}", ep, with_literal(base, "stream", lit), param="stream")
    stops = (["a", "b", "c", "d", "e"], "", [""], {"x": 1}, [1], ["a", 2], "x" * (limits.MAX_STOP_CHARS + 1))
    for v in stops if full else stops[::3]:
        add(f"{ep}-stop-{str(v)[:12]}", ep, {**base, "stop": v}, param="stop")
    stop_ids = (["eos"], [-1], [10**6], "1", [1.5], list(range(limits.MAX_STOP_TOKEN_IDS + 1)))
    for v in stop_ids if full else stop_ids[1::2]:
        add(f"{ep}-stop_token_ids-{str(v)[:12]}", ep, {**base, "stop_token_ids": v}, param="stop_token_ids")
    for v in ({"include_usage": "yes"}, "x", [True]):
        add(f"{ep}-stream_options-{v}", ep, {**base, "stream": True, "stream_options": v}, param="stream_options")
    add(f"{ep}-model-unknown", ep, {**base, "model": "gpt-4o"}, 404, "model")
    add(f"{ep}-model-type", ep, {**base, "model": 5}, param="model")
    add(f"{ep}-user-type", ep, {**base, "user": 5}, param="user")
    # oversize and malformed bodies
    add(f"{ep}-body-5mb", ep, json.dumps({**base, "user": "u" * (5 * 2**20)}), 413, None)
    malformed = ("{not json", "", "[]", "null", "5", '"x"', '{"max_tokens": 2,}', "{'max_tokens': 2}", '{"a": 1')
    for raw in malformed if full else malformed[::3]:
        add(f"{ep}-json-{raw[:10]}", ep, raw, param=None if raw not in ("[]", "null", "5", '"x"') else ANY)
    add(f"{ep}-utf8-bare", ep, b"\xff\xfe\x00{", param=None)
    add(f"{ep}-utf8-in-string", ep, json.dumps(base)[:-1].encode() + b', "user": "\xff\xc3("}', param=ANY)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        add(f"{ep}-ctype-{ctype[:12]}", ep, base, 415, None, ctype)
    if "logit_bias" in (ChatCompletionRequest if ep == "chat" else CompletionRequest).model_fields:
        big = {str(i): 1.0 for i in range(limits.MAX_LOGIT_BIAS + 1)}
        add(f"{ep}-logit_bias-oversize", ep, {**base, "logit_bias": big}, param="logit_bias")
        add(f"{ep}-logit_bias-nan", ep, with_literal(base, "logit_bias", '{"5": NaN}'), param=None)
        # "²" passes str.isdigit() and fails int(); fullwidth "１２" would read as token 12; 5,000 digits fail int()
        for key in ("²", "１２", "9" * 5000, "-1", " 1"):
            add(f"{ep}-logit_bias-key-{key[:6]}", ep, {**base, "logit_bias": {key: 1.0}}, param="logit_bias")
    for lit in ("1e-300", "1e-45", "1e39"):  # float32 (the sampler's): 0, a subnormal (1 / it: inf), inf
        add(f"{ep}-repetition_penalty-f32-{lit}", ep, with_literal(base, "repetition_penalty", lit),
            param="repetition_penalty")  # fmt: skip
    add(f"{ep}-json-deep", ep, json.dumps(base)[:-1] + ', "user": ' + "[" * 100_000 + "]" * 100_000 + "}", param=None)
    add(f"{ep}-json-bigint", ep, with_literal(base, "seed", "9" * 5000), param=None)
    add(f"{ep}-guided_json-bigint", ep, json.dumps(base)[:-1] + ', "guided_json": {"maximum": ' + "9" * 5000 + "}}",
        param=None)  # fmt: skip

# chat only
for v in ([], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user"}],
          [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "text"}]}],
          [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
          [{"role": "user", "content": [{"type": "text", "text": 5}]}], [5], None):  # fmt: skip
    add(f"chat-messages-{str(v)[:16]}", "chat", {**CHAT, "messages": v}, param="messages")
add("chat-messages-missing", "chat", {"model": MODEL}, param="messages")
add("chat-messages-too-long", "chat", {**CHAT, "messages": [{"role": "user", "content": "word " * 10000}]},
    param="messages")  # fmt: skip
for lit in ('"yes"', "1", "[true]"):
    add(f"chat-logprobs-{lit}", "chat", with_literal(CHAT, "logprobs", lit), param="logprobs")
for lit in ("21", "-1", '"3"', "1.5"):
    add(f"chat-top_logprobs-{lit}", "chat", with_literal({**CHAT, "logprobs": True}, "top_logprobs", lit),
        param="top_logprobs")  # fmt: skip
for lit in ("0", "-3", '"8"'):
    add(f"chat-max_completion_tokens-{lit}", "chat", with_literal(CHAT, "max_completion_tokens", lit),
        param="max_completion_tokens")  # fmt: skip
for v in ("extreme", 5):
    add(f"chat-reasoning_effort-{v}", "chat", {**CHAT, "reasoning_effort": v}, param="reasoning_effort")
for v in ("x", [1]):
    add(f"chat-chat_template_kwargs-{v}", "chat", {**CHAT, "chat_template_kwargs": v}, param="chat_template_kwargs")
if "tools" in ChatCompletionRequest.model_fields:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    add("chat-tools-oversize", "chat", {**CHAT, "tools": [tool] * (limits.MAX_TOOLS + 1)}, param="tools")
# completions only
for v in ([], "", [-1], [10**6], [1.5], {"a": 1}, ["a", [1]], [[1], []], True, None, [3] * 9000,
          "word " * 10000, [True]):  # fmt: skip
    add(f"comp-prompt-{str(v)[:16]}", "comp", {**COMP, "prompt": v}, param="prompt")
add("comp-prompt-missing", "comp", {"model": MODEL}, param="prompt")
for lit in ("-1", "21", '"2"', "true", "1.5"):
    add(f"comp-logprobs-{lit}", "comp", with_literal(COMP, "logprobs", lit), param="logprobs")


def greedy(srv: Server) -> list[str]:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def reference(server: Server) -> list[str]:
    return greedy(server)


def test_the_table_is_large() -> None:
    assert len(CASES) >= 150 and len({n for n, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_bad_input(server: Server, reference: list[str], case: Case) -> None:
    ep, raw, status, param, ctype = case
    url = f"{server.url}/v1/{'chat/completions' if ep == 'chat' else 'completions'}"
    r = httpx.post(url, content=raw, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and (err["code"] is None or isinstance(err["code"], str))
    if param is not ANY:
        assert err["param"] == param, err
    assert greedy(server) == reference  # one bad request never disturbs others


def test_no_server_error_after_the_table(server: Server) -> None:
    assert metric(server, "dsv4_requests_total", '{outcome="error"}') == 0
    assert httpx.get(f"{server.url}/ready").status_code == 200
