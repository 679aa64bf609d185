"""Request validation, error bodies, settings and CLI; the app runs in-process on a fake worker
(the real engine is covered by tests/e2e)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dsv4_serve.service.__main__ import build_parser
from dsv4_serve.service.api.app import create_app
from dsv4_serve.service.api.protocol import ChatCompletionRequest, CompletionRequest
from dsv4_serve.service.engine.request import FinishReason, SamplingParams, TokenEvent
from dsv4_serve.service.engine.scheduler import QueueFull
from dsv4_serve.service.settings import Settings

ANSWER = "Hello wörld 😀 STOP tail"


class FakeWorker:
    """The EngineWorker surface the API uses; emits ANSWER's bytes as tokens."""

    def __init__(self, queue_full: bool = False) -> None:
        vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        self.tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self.tokenizer.decoder = decoders.ByteLevel()
        self.tokenizer.add_special_tokens(["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "</think>"])
        self.max_model_len, self.vocab_size, self.eos_token_id = 64, self.tokenizer.get_vocab_size(), None
        self.ready, self.queue_full = False, queue_full
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.namespaces: list[tuple[str, str]] = []  # (tenant, cache_salt) of each submit_n

    def start(self) -> None:
        self.ready = True

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None):
        if self.queue_full:
            raise QueueFull("full")
        self.submitted.append((prompt_ids, params))
        return self._events(request_id or "x", params)

    async def submit_n(self, prompt_ids: list[int], params: list[SamplingParams], request_ids: list[str],
                       namespace: tuple[str, str] = ("", "")):  # fmt: skip
        self.namespaces.append(namespace)
        return [await self.submit(prompt_ids, p, r) for p, r in zip(params, request_ids, strict=True)]

    async def _events(self, rid: str, params: SamplingParams) -> AsyncIterator[TokenEvent]:
        out = self.tokenizer.encode(ANSWER, add_special_tokens=False).ids[: params.max_tokens]
        for n, t in enumerate(out):
            await asyncio.sleep(0)
            last = n == len(out) - 1
            yield TokenEvent(rid, t, -0.25, ((t, -0.25),), FinishReason.LENGTH if last else None)

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def stats(self) -> dict[str, Any]:
        return {"waiting": 0, "running": 0, "rows_per_step": [0, 3, 0, 0, 0, 0, 0, 0, 2]}

    async def drain(self, timeout: float) -> None:
        self.ready = False


def make_client(worker: FakeWorker, settings: Settings | None = None) -> TestClient:
    return TestClient(create_app(settings or Settings(), worker_builder=lambda s, c: worker))


@pytest.fixture
def client() -> Any:
    with make_client(FakeWorker()) as c:
        yield c


CHAT = {"model": "deepseek-v4-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD: list[tuple[str, dict[str, Any] | str, int, str | None]] = [
    ("chat", "{not json", 400, None),
    ("chat", "[1, 2]", 400, None),
    ("chat", {**CHAT, "messages": []}, 400, "messages"),
    ("chat", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages"),
    ("chat", {**CHAT, "temperature": 2.5}, 400, "temperature"),
    ("chat", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("chat", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("chat", {**CHAT, "top_k": -2}, 400, "top_k"),
    ("chat", {**CHAT, "min_p": 1.5}, 400, "min_p"),
    ("chat", {**CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("chat", {**CHAT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 1000}, 400, "max_tokens"),
    ("chat", {**CHAT, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("chat", {**CHAT, "stop": [""]}, 400, "stop"),
    ("chat", {**CHAT, "stop": 5}, 400, "stop"),
    ("chat", {**CHAT, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("chat", {**CHAT, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("chat", {**CHAT, "n": 9}, 400, "n"),
    ("chat", {**CHAT, "n": 0}, 400, "n"),
    ("chat", {**CHAT, "frobnicate": 3}, 400, "frobnicate"),
    ("chat", {**CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("chat", {**CHAT, "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("chat", {**CHAT, "modalities": ["audio"]}, 400, "modalities"),  # chat echo is vLLM's (tests/e2e/test_compat.py)
    ("chat", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("chat", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("comp", {"prompt": ["a", ""]}, 400, "prompt"),
    ("comp", {"prompt": "hi", "max_tokens": 0}, 400, None),
    ("comp", {"prompt": "hi", "max_tokens": 0, "echo": True, "n": 2}, 400, None),
    ("comp", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("comp", {"prompt": []}, 400, "prompt"),
    ("comp", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("comp", {"prompt": "x" * 80}, 400, "prompt"),
    ("comp", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
]


@pytest.mark.parametrize(("ep", "body", "status", "param"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests(client: TestClient, ep: str, body: Any, status: int, param: str | None) -> None:
    url = "/v1/chat/completions" if ep == "chat" else "/v1/completions"
    data = body if isinstance(body, str) else json.dumps(body)
    r = client.post(url, content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"


def test_nulls_are_absent_and_unknown_nulls_ignored(client: TestClient) -> None:
    body = {**CHAT, "temperature": None, "stop": None, "n": None, "frobnicate": None, "max_tokens": None}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    w: FakeWorker = client.app.state.ctl.worker  # type: ignore[attr-defined]
    prompt, params = w.submitted[-1]
    assert params.temperature == 1.0 and params.max_tokens == 64 - len(prompt)


def test_chat_stop_string_and_usage(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "stop": "STOP"})
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Hello wörld 😀 "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(ANSWER[: ANSWER.index("STOP") + 4].encode())
    assert client.app.state.ctl.worker.aborted  # type: ignore[attr-defined]  # the engine row is freed


def test_stream_one_chunk_per_token(client: TestClient) -> None:
    body = {**CHAT, "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    assert len(token_chunks) == 20 == chunks[-1]["usage"]["completion_tokens"]
    assert token_chunks[0]["choices"][0]["delta"]["content"] != ""
    assert [c["choices"][0]["finish_reason"] for c in token_chunks][-2:] == [None, "length"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in token_chunks)
    assert text == ANSWER.encode()[:20].decode("utf-8", "replace") and "\ufffd" not in text
    lp = token_chunks[0]["choices"][0]["logprobs"]["content"][0]
    assert lp["logprob"] == -0.25 and lp["token"] == "H" and lp["bytes"] == [72]


def test_completion_logprobs_shape(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"] and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"] == [-0.25] * 3 and lp["top_logprobs"][0] == {"H": -0.25}


def test_queue_full_429() -> None:
    with make_client(FakeWorker(queue_full=True)) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 429 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "rate_limit_error"


def test_not_ready_503_and_models_metrics() -> None:
    w = FakeWorker()
    w.start = lambda: None  # type: ignore[method-assign]  # stays loading
    with make_client(w, Settings(ready_timeout=0.3)) as c:
        r = c.get("/ready")
        assert r.status_code == 503 and "retry-after" in r.headers
        t = time.monotonic()
        r = c.post("/v1/chat/completions", json=CHAT)  # held for the bound, then 503
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "not_ready" and time.monotonic() - t >= 0.3
        assert c.get("/health").status_code == 200
        assert c.get("/v1/models").json()["data"][0]["id"] == "deepseek-v4-tiny"
        m = c.get("/metrics").text
        assert 'dsv4_decode_rows_per_step_bucket{le="7.0"} 3.0' in m
        assert 'dsv4_decode_rows_per_step_bucket{le="8.0"} 5.0' in m


def test_requests_wait_for_readiness() -> None:
    """A request sent while the model loads is held and answered once the engine is ready; /health is 200
    meanwhile. A failed start answers the held requests at once."""
    w = FakeWorker()
    w.start = lambda: None  # type: ignore[method-assign]
    with make_client(w, Settings(ready_timeout=30)) as c:
        timer = threading.Timer(0.3, lambda: setattr(w, "ready", True))
        timer.start()
        t = time.monotonic()
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert time.monotonic() - t >= 0.3
        timer.join()
    w = FakeWorker()
    w.start = lambda: None  # type: ignore[method-assign]
    with make_client(w, Settings(ready_timeout=30)) as c:
        threading.Timer(0.1, lambda: setattr(w, "start_error", RuntimeError("no weights"))).start()
        t = time.monotonic()
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 503 and "no weights" in r.json()["error"]["message"]
        assert time.monotonic() - t < 10


def test_health_is_503_once_the_engine_cannot_serve() -> None:
    """/health is 200 while the model loads, 503 with the reason once start-up failed or the engine thread
    died (a liveness probe then restarts the server, which exits on its own: tests/e2e/test_failed_start.py)."""
    for attr in ("start_error", "died"):
        w = FakeWorker()
        w.start = lambda: None  # type: ignore[method-assign]  # stays loading
        with make_client(w) as c:
            assert c.get("/health").status_code == 200
            setattr(w, attr, MemoryError("out of memory"))
            r = c.get("/health")
            assert r.status_code == 503
            assert r.json() == {"status": "failed", "error": "MemoryError: out of memory"}


def test_request_models() -> None:
    r = ChatCompletionRequest.model_validate_json(json.dumps({**CHAT, "reasoning_effort": "high"}))
    assert r.thinking
    r = ChatCompletionRequest.model_validate({**CHAT, "chat_template_kwargs": {"thinking": True}, "logprobs": True})
    assert r.thinking and r.logprobs_k == 0
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).prompts == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2]]}).prompts == [[1], [2]]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts == [[1, 2]]
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [[1], []]})


def test_settings_env_and_flags() -> None:
    env = {"DSV4_PORT": "9001", "DSV4_MAX_ROWS": "4", "DSV4_MODEL": "/models/DeepSeek-V4-Flash", "DSV4_HOST": ""}
    s = Settings.load({"max_rows": 2}, env=env)
    assert (s.port, s.max_rows, s.host, s.served_name) == (9001, 2, "127.0.0.1", "DeepSeek-V4-Flash")
    assert Settings().served_name == "deepseek-v4-tiny"
    with pytest.raises(ValidationError):
        Settings.load({"max_rows": 9}, env={})
    with pytest.raises(ValidationError):
        Settings.load(env={"DSV4_PORT": "http"})
    names = set(Settings.env_names().values())
    assert {"DSV4_MAX_QUEUE", "DSV4_MAX_MODEL_LEN", "DSV4_PREFILL_CHUNK", "DSV4_SERVED_MODEL_NAME"} <= names


def test_cli_flags_map_to_settings() -> None:
    args = build_parser().parse_args(["serve", "--max-rows", "3", "--served-model-name", "x", "--port", "1"])
    given = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    assert given == {"max_rows": 3, "served_model_name": "x", "port": 1}
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}  # type: ignore[union-attr]
    assert set(Settings.model_fields) <= flags


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 2049}]}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1500}] * 2,
                  "max_tokens": 2}, "messages"),  # fmt: skip
        ("chat", {"messages": [{"role": "user", "content": "hi"}],
                  "prediction": {"type": "content", "content": [{"type": "bogus"}] * 2049}}, "messages"),  # fmt: skip
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 2049}]}, "input"),
    ],
    ids=["one-message", "two-messages", "prediction", "responses"],
)
def test_content_parts_are_counted_before_validation(model: str, body: dict[str, Any], param: str) -> None:
    """Past 2,048 content parts in a request: a 400 naming the list, before any part is validated (the
    prediction's bogus parts would fail validation with another message)."""
    from dsv4_serve.service.api.limits import parse_body
    from dsv4_serve.service.api.protocol import MAX_CONTENT_PARTS, APIError
    from dsv4_serve.service.api.responses_request import ResponsesRequest

    cls = ChatCompletionRequest if model == "chat" else ResponsesRequest
    with pytest.raises(APIError) as e:
        parse_body(json.dumps(body).encode(), cls)
    assert e.value.status == 400 and e.value.param == param and f"limit is {MAX_CONTENT_PARTS}" in e.value.message
    fits = {**body, **({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 2048}]}
                       if model == "chat" else {"input": [{"role": "user", "content": "x"}]})}  # fmt: skip
    fits.pop("prediction", None)
    parse_body(json.dumps(fits).encode(), cls)  # at the cap: accepted
