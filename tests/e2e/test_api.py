"""OpenAI SDK + raw SSE against a real server: chat/completions, streaming framing, batching,
disconnects and a table of bad requests."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import subprocess
import time
from typing import Any

import httpx
import openai
import pytest

from dsv4_serve.model.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer
from dsv4_serve.service.api.chat import token_text
from tests.e2e.conftest import MODEL, ROOT, Server, server_command


def metric(srv: Server, name: str, labels: str = "") -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def sse(srv: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    """Raw SSE: returns the parsed data payloads, checking the framing on the way."""
    out: list[dict[str, Any] | str] = []
    with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == ""  # every event is terminated by a blank line
    for ev in events[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev
        data = ev.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data][0] == MODEL


def test_chat_sdk(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage is not None
    assert 1 <= r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    assert isinstance(r.choices[0].message.content, str)
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: streamed == not streamed


def test_thinking_mode_reasoning_content(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"thinking": True}})
    assert r.status_code == 200 and "reasoning_content" in r.json()["choices"][0]["message"]


def test_completions_sdk(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert r.usage.completion_tokens <= 6 and r.choices[0].finish_reason in ("stop", "length")
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, logprobs=2)
    lp = ids.choices[0].logprobs
    assert len(lp.tokens) == ids.usage.completion_tokens == len(lp.token_logprobs)
    parts = list(
        client.completions.create(
            model=MODEL,
            prompt=[5, 6, 7, 8],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == ids.choices[0].text
    assert parts[-1].usage.completion_tokens == ids.usage.completion_tokens


def test_raw_sse_framing(server: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    token_chunks = [c for c in chunks if "content" in c["choices"][0]["delta"]]
    # One chunk per generated token that adds text (a character's first bytes send nothing: they wait for its
    # last), and the one that finishes.
    assert 0 < len(token_chunks) <= 12 and all(c["choices"][0]["delta"]["content"] for c in token_chunks[:-1])
    assert chunks[0] is token_chunks[0] and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    plain = {**body, "stream": False, "stream_options": None}  # stream_options only with stream: true
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=plain, timeout=60).json()
    assert "".join(c["choices"][0]["delta"]["content"] for c in token_chunks) == whole["choices"][0]["message"][
        "content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)


def _greedy(srv: Server, prompt: list[int], n: int = 24) -> str:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return json.dumps(r.json()["choices"][0]["logprobs"]["tokens"])


def test_eight_concurrent_greedy_streams(server: Server) -> None:
    prompts = [[10 + i, 20 + 3 * i, 30 + i, 40] for i in range(8)]
    alone = [_greedy(server, p) for p in prompts]
    before = metric(server, "dsv4_decode_rows_per_step_bucket", '{le="8.0"}') - metric(
        server, "dsv4_decode_rows_per_step_bucket", '{le="7.0"}'
    )
    ahead = metric(server, "dsv4_decode_steps_ahead_total")
    phases = ("build", "encode", "sample", "wait", "loop")
    host = {ph: metric(server, "dsv4_engine_host_seconds_total", f'{{phase="{ph}"}}') for ph in phases}
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _greedy(server, p), prompts))
    assert together == alone
    # the engine thread's host time by phase: each phase grew, and whole iterations hold the four parts
    spent = {ph: metric(server, "dsv4_engine_host_seconds_total", f'{{phase="{ph}"}}') - host[ph] for ph in phases}
    assert all(v > 0 for v in spent.values()), spent
    assert spent["loop"] >= spent["build"] + spent["encode"] + spent["sample"] + spent["wait"], spent
    after = metric(server, "dsv4_decode_rows_per_step_bucket", '{le="8.0"}') - metric(
        server, "dsv4_decode_rows_per_step_bucket", '{le="7.0"}'
    )
    assert after > before, "no engine step ran 8 rows"
    # pipelined decode (the default): most of the 8 x 24 tokens came from steps queued ahead
    assert metric(server, "dsv4_decode_steps_ahead_total") - ahead >= 20


@pytest.mark.parametrize("prompt", [[10, 20, 30, 40], [0, 7, 7, 7, 300, 12]])
def test_server_greedy_equals_cli_generate(server: Server, prompt: list[int]) -> None:
    """`dsv4-serve generate` (one row, no server) and the batched engine agree token for token."""
    ids = ",".join(map(str, prompt))
    cmd = [*server_command(), "generate", "--prompt-ids", ids, "--max-tokens", "16"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    want = json.loads(out.strip().splitlines()[-1])
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 0}
    got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert got["usage"]["completion_tokens"] == len(want["ids"])
    # The CLI prints every token's text; the API drops special tokens from it (skip_special_tokens).
    text = want["text"]
    for special in SPECIAL_TOKENS:
        text = text.replace(special, "")
    assert got["choices"][0]["text"] == text
    tokens = got["choices"][0]["logprobs"]["tokens"]  # the stop token (EOS) is not one of them
    assert tokens == [token_text(build_tiny_tokenizer(512), i) for i in want["ids"][: len(tokens)]]


def test_long_prompt_goes_through_the_parallel_prefill(server: Server) -> None:
    """A 120-token prompt: all but its last token, less what came from the prefix cache (an earlier
    test's prompt may start with the same ids), are counted by the prefill metrics."""
    before = metric(server, "dsv4_prefill_tokens_total"), metric(server, "dsv4_prefill_seconds_total")
    body = {"prompt": list(range(5, 125)), "max_tokens": 2, "temperature": 0}
    got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert (got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == (120, 2)
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = metric(server, "dsv4_prefill_tokens_total"), metric(server, "dsv4_prefill_seconds_total")
    assert cached < 100 and after[0] - before[0] == 119 - cached and after[1] > before[1]


def test_disconnect_frees_the_row(server: Server) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        got = [line for line in (next(it) for _ in range(10)) if line.startswith("data: ")]
        assert got and metric(server, "dsv4_requests_running") == 1
    deadline = time.monotonic() + 10
    while metric(server, "dsv4_requests_running") != 0:
        assert time.monotonic() < deadline, "the aborted request still holds a row"
        time.sleep(0.05)
    assert metric(server, "dsv4_requests_total", '{outcome="client_disconnect"}') >= 1
    assert _greedy(server, [5, 6, 7], 4)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD: list[tuple[str, Any, int, str | None]] = [
    ("chat", "{not json", 400, None),
    ("chat", "", 400, None),
    ("chat", "[]", 400, None),
    ("chat", {**CHAT, "messages": []}, 400, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat", {**CHAT, "messages": [{"content": "x"}]}, 400, "messages"),
    ("chat", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("chat", {**CHAT, "temperature": "warm"}, 400, "temperature"),
    ("chat", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("chat", {**CHAT, "top_k": -5}, 400, "top_k"),
    ("chat", {**CHAT, "frequency_penalty": 9}, 400, "frequency_penalty"),
    ("chat", {**CHAT, "repetition_penalty": -1}, 400, "repetition_penalty"),
    ("chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 1.5}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("chat", {**CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("chat", {**CHAT, "stop": {"x": 1}}, 400, "stop"),
    ("chat", {**CHAT, "stop_token_ids": ["eos"]}, 400, "stop_token_ids"),
    ("chat", {**CHAT, "n": 9}, 400, "n"),
    ("chat", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("chat", {**CHAT, "seed": "abc"}, 400, "seed"),
    ("chat", {**CHAT, "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ("chat", {**CHAT, "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ("chat", {**CHAT, "model": "gpt-4o"}, 404, "model"),
    ("comp", {"prompt": ["one", ""]}, 400, "prompt"),
    ("comp", {"prompt": ["one", [3] * 9000]}, 400, "prompt"),  # over the tiny model's 8,192 positions
    ("comp", {"prompt": [1, -4]}, 400, "prompt"),
    ("comp", {"prompt": [1, 99999999]}, 400, "prompt"),
    ("comp", {"prompt": [3] * 9000}, 400, "prompt"),
    ("comp", {"prompt": "hello", "logprobs": -1}, 400, "logprobs"),
    ("comp", {"max_tokens": 3}, 400, "prompt"),
]


@pytest.mark.parametrize(("ep", "body", "status", "param"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_request_table(server: Server, ep: str, body: Any, status: int, param: str | None) -> None:
    url = f"{server.url}/v1/{'chat/completions' if ep == 'chat' else 'completions'}"
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url, content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"


def test_healthy_after_bad_requests(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert metric(server, "dsv4_requests_total", '{outcome="error"}') == 0
    assert _greedy(server, [1, 2, 3], 3)
