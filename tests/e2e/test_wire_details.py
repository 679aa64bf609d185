"""What real clients hit on the wire (issue 62), against a real server: /openapi.json validates with unique
operationIds, X-Request-Id on every response (the client's echoed), stream_options without stream and an
out-of-vocabulary logit_bias are 400s as OpenAI's, Responses' ids and its unsupported text.verbosity /
reasoning.summary, and text.format's error on a server without the structured extra."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from openapi_spec_validator import validate

from tests.e2e.conftest import MODEL, ROOT, Server

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_openapi_validates_with_unique_operation_ids(server: Server) -> None:
    spec = httpx.get(f"{server.url}/openapi.json").json()
    ops = [op["operationId"] for path in spec["paths"].values() for op in path.values() if "operationId" in op]
    assert ops and [o for o, n in Counter(ops).items() if n > 1] == []
    assert {"/health", "/ready"} <= set(spec["paths"])
    validate(spec)  # raises on an invalid spec
    # HEAD still answers, outside the schema.
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert httpx.head(f"{server.url}/ready").status_code == 200


def test_request_id(server: Server, client: openai.OpenAI) -> None:
    """A usable client id comes back as sent; none (or an unusable one) gets a fresh req_ id; the SDK sees it;
    errors carry it too."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-42.a"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a"
    ids = [httpx.get(f"{server.url}/v1/models").headers["x-request-id"] for _ in range(2)]
    assert all(i.startswith("req_") for i in ids) and ids[0] != ids[1]
    bad = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "x" * 200}).headers["x-request-id"]
    assert bad.startswith("req_")
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "n": 99}, headers={"X-Request-Id": "e1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e1"
    resp = client.chat.completions.with_raw_response.create(model=MODEL, **CHAT)
    assert resp.headers["x-request-id"].startswith("req_") and resp.parse()._request_id == resp.headers["x-request-id"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_need_stream(server: Server, path: str) -> None:
    base = CHAT if "chat" in path else {"prompt": "hi", "max_tokens": 2}
    for stream in (None, False):
        body = {**base, "stream_options": {"include_usage": True}} | ({} if stream is None else {"stream": stream})
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    ok = httpx.post(f"{server.url}{path}", json={**base, "stream": True, "stream_options": {"include_usage": True}})
    assert ok.status_code == 200 and '"usage"' in ok.text


def test_logit_bias_out_of_vocabulary(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "logit_bias": {"999999999": 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias" and err["code"] == "invalid_value", err


def test_responses_ids(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, reasoning={"effort": "high"})
    assert r.id.startswith("resp_") and [o.id[: o.id.index("_") + 1] for o in r.output] == ["rs_", "msg_"]
    events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=2, stream=True))
    assert events[0].response.id.startswith("resp_") and events[-1].response.output[0].id.startswith("msg_")


@pytest.mark.parametrize(("body", "param"), [
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"text": {"stop": "x"}}, "text.stop"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "high", "summary": "detailed"}}, "reasoning.summary"),
])  # fmt: skip
def test_responses_unsupported_output_fields(server: Server, body: dict, param: str) -> None:
    """A field that would change the output and is not supported is a 400 naming it (was a 200 that changed
    nothing); the defaults pass."""
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = {"input": "hi", "max_output_tokens": 2, "text": {"verbosity": "medium"}, "reasoning": {"summary": None}}
    assert httpx.post(f"{server.url}/v1/responses", json=ok).status_code == 200


@pytest.fixture(scope="module")
def without_extra(start_server: type[Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    """A server whose Python cannot import xgrammar, as one installed without the structured extra."""
    shadow = tmp_path_factory.mktemp("no_xgrammar")
    (shadow / "xgrammar").mkdir()
    (shadow / "xgrammar" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'xgrammar'\", name='xgrammar')\n")
    path = os.pathsep.join([str(shadow), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return start_server("--max-rows", "1", env={"PYTHONPATH": path})


def test_text_format_without_the_extra(without_extra: Server) -> None:
    """Responses' json_schema format on a server without xgrammar: the 400 names text.format (was
    response_format) and says how a checkout installs the extra."""
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}
    r = httpx.post(f"{without_extra.url}/v1/responses", json={"input": "hi", "text": {"format": fmt}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "text.format", err
    assert "pip install -e '.[structured]'" in err["message"] and "response_format" not in err["message"], err
    chat = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}
    r = httpx.post(f"{without_extra.url}/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert Path(ROOT / "pyproject.toml").read_text().count("structured = [") == 1  # the extra the message names
