"""Speculative decoding over HTTP (issue 53, docs/mtp.md): a real server on the built-in tiny model with
`--speculative-config` (k = 1, and k = 3 chained drafts) answers greedy requests with the text a server without it
gives, alone and with 6 concurrent requests; /metrics counts the drafts; a bad config ends the server with the
reason."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import pytest

from tests.e2e.conftest import MODEL, server_command

PROMPTS = ["The tiny model", "Once upon a time", "1 2 3 4", "Speculative decoding drafts", "a", "Hello, world",
           "What comes next?"]  # fmt: skip


@pytest.fixture(scope="module")
def plain_server(start_server):
    plain = start_server()
    yield plain
    plain.stop()


@pytest.fixture(scope="module", params=[1, 3])
def servers(start_server, plain_server, request):
    spec = start_server("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": request.param}))
    yield plain_server, spec
    spec.stop()


async def complete(url: str, prompt: str, max_tokens: int = 24) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "logprobs": 1})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]


def test_greedy_text_equals_the_plain_servers_alone_and_with_6_concurrent(servers) -> None:
    plain, spec = servers
    for p in PROMPTS[:2]:  # alone
        a, b = asyncio.run(complete(plain.url, p)), asyncio.run(complete(spec.url, p))
        assert b["text"] == a["text"] and b["finish_reason"] == a["finish_reason"]
        assert b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
        assert b["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=1e-4)

    async def together(url: str) -> list[dict]:
        return await asyncio.gather(*[complete(url, p, 40) for p in PROMPTS])  # 7 at once: one + 6 concurrent

    want, got = asyncio.run(together(plain.url)), asyncio.run(together(spec.url))
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert all(g["text"] for g in got)
    metrics = httpx.get(f"{spec.url}/metrics").text
    counts = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines()
              if ln.startswith("dsv4_spec_") and not ln.startswith("#")}  # fmt: skip
    assert counts["dsv4_spec_drafted_tokens_total"] > 0 and counts["dsv4_spec_verify_steps_total"] > 0
    assert counts["dsv4_spec_accepted_tokens_total"] <= counts["dsv4_spec_drafted_tokens_total"]
    assert counts["dsv4_spec_mean_accept_length"] >= 1.0
    assert "\ndsv4_spec_drafted_tokens_total 0.0\n" in httpx.get(f"{plain.url}/metrics").text  # no speculation


@pytest.mark.parametrize("config, why", [
    ('{"method": "eagle", "num_speculative_tokens": 1}', "method must be one of mtp"),
    ('{"method": "mtp", "num_speculative_tokens": 4}', "num_speculative_tokens must be 1, 2 or 3"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be 1, 2 or 3"),
    ('{"method": "mtp", "model": "x"}', "unsupported key(s) model"),
    ("mtp", "must be a JSON object"),
])  # fmt: skip
def test_a_bad_speculative_config_ends_the_server_with_the_reason(config, why) -> None:
    done = subprocess.run([*server_command(), "serve", "--port", "1", "--speculative-config", config],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and why in done.stderr, done.stderr[-2000:]
