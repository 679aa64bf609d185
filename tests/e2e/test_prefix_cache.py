"""The prefix cache through real servers (tiny model): a cache-on server against a cache-off one
(`--prefix-cache-gib 0`, cold prefills). Greedy outputs must be equal; the cache's effect is read
from usage.prompt_tokens_details.cached_tokens and /metrics."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import struct
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, Server
from tests.e2e.test_api import metric

# The tiny model's decode state (model/config.py ModelArgs.tiny, f32, 64-entry pages): a CSA page holds
# 64 entries of head_dim 32 + index_head_dim 16 in each of its 2 CSA layers, an HCA page 64 x 32 in 1.
CSA_PAGE = 2 * 64 * (32 + 16) * 4
HCA_PAGE = 1 * 64 * 32 * 4


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> str:
    """A state secret file: servers started with it import each other's exports."""
    path = tmp_path_factory.mktemp("secret") / "state.key"
    path.write_bytes(b"e2e-state-secret-" + b"x" * 32)
    return str(path)


@pytest.fixture(scope="module")
def on(start_server, secret: str) -> Server:
    return start_server("--state-secret-file", secret)


@pytest.fixture(scope="module")
def off(start_server) -> Server:
    return start_server("--prefix-cache-gib", "0")


def complete(srv: Server, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(resp: dict[str, Any]) -> tuple[str, list[str]]:
    return resp["choices"][0]["text"], resp["choices"][0]["logprobs"]["tokens"]


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """The same greedy tokens, and logprobs equal to f32 summation order (a cached prefix is summed in other
    chunks than a cold prefill)."""
    lps = [(x["choices"][0]["logprobs"]["token_logprobs"], y["choices"][0]["logprobs"]["token_logprobs"])
           for x, y in zip(a, b, strict=True)]  # fmt: skip
    return [greedy(x) for x in a] == [greedy(y) for y in b] and all(
        len(p) == len(q) and all(abs(u - v) <= 1e-4 for u, v in zip(p, q, strict=True)) for p, q in lps)


def test_four_chat_turns_equal_cold_and_prefill_only_the_rest(on: Server, off: Server) -> None:
    msgs: dict[str, list[dict[str, str]]] = {"on": [{"role": "system", "content": "Four turns. " * 40}],
                                             "off": [{"role": "system", "content": "Four turns. " * 40}]}  # fmt: skip
    prev_prompt = None
    for turn in range(4):
        got = {}
        for name, srv in (("on", on), ("off", off)):
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
            msgs[name].append({"role": "user", "content": f"Question number {turn}: what comes next?"})
            computed = metric(srv, "dsv4_prompt_tokens_computed_total")
            r = client.chat.completions.create(model=MODEL, messages=msgs[name], max_tokens=10, temperature=0)
            got[name] = r
            msgs[name].append({"role": "assistant", "content": r.choices[0].message.content or ""})
            got[name + "_computed"] = metric(srv, "dsv4_prompt_tokens_computed_total") - computed
        assert got["on"].choices[0].message.content == got["off"].choices[0].message.content
        use, cold = got["on"].usage, got["off"].usage
        assert use.prompt_tokens == cold.prompt_tokens and use.completion_tokens == cold.completion_tokens
        assert cold.prompt_tokens_details is None  # no cache, no claim
        cached = use.prompt_tokens_details.cached_tokens
        if prev_prompt is None:
            assert cached == 0
        else:  # at least the previous prompt (its last token is fed by the step that samples, not cached)
            assert cached >= prev_prompt - 1
        assert got["on_computed"] == use.prompt_tokens - cached  # the rest, and only the rest, was computed
        assert got["off_computed"] == use.prompt_tokens
        prev_prompt = use.prompt_tokens


def test_eight_conversations_share_a_system_prompt_once(on: Server, off: Server) -> None:
    """Eight conversations with one 1,000-token system prompt, each then its own user turn (the tiny tokenizer's
    `<｜User｜>`, id 2, and 3 tokens), sent at once: the first one's prefill ends before its user turn and the
    state there is snapshotted; the others adopt it, whenever each arrives."""
    system = [(7 * i) % 500 + 3 for i in range(1000)]
    prompts = [system + [2, 12 + k, 13 + k, 14 + k] for k in range(8)]
    page_bytes, hits = metric(on, "dsv4_prefix_cache_page_bytes"), metric(on, "dsv4_prefix_hits_total")
    with cf.ThreadPoolExecutor(8) as pool:
        warm = list(pool.map(lambda p: complete(on, p, 4), prompts))
        cold = list(pool.map(lambda p: complete(off, p, 4), prompts))
    assert same(warm, cold)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in warm]
    assert sorted(cached)[0] == 0 and all(c == 1000 for c in sorted(cached)[1:]), cached  # the system prompt
    assert metric(on, "dsv4_prefix_hits_total") - hits >= 7
    # Unshared, each conversation's state (1,007 positions) is 4 CSA pages + 1 HCA page. Shared, the
    # system prompt's 3 full CSA pages (entries 0..191) are stored once: each conversation adds its own
    # 4th CSA page and its HCA page (both partial when it was adopted: copied before its writes).
    added = metric(on, "dsv4_prefix_cache_page_bytes") - page_bytes
    assert added <= 3 * CSA_PAGE + 8 * (CSA_PAGE + HCA_PAGE) < 8 * (4 * CSA_PAGE + HCA_PAGE), added
    assert metric(on, "dsv4_prefix_cache_bytes") >= metric(on, "dsv4_prefix_cache_page_bytes")


def test_eviction_past_the_budget_spares_a_running_request(start_server, off: Server) -> None:
    small = start_server("--prefix-cache-gib", "0.0004")  # ~430 KB: a few snapshots of ~48 KB + pages
    base = [(5 * i) % 400 + 9 for i in range(300)]
    complete(small, base, 2)  # cache the base prompt
    long_prompt = base + [3, 4, 5]
    body = {"prompt": long_prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: httpx.post(f"{small.url}/v1/completions", json=body, timeout=300).json())
        evictions = metric(small, "dsv4_prefix_evictions_total")
        for k in range(6):  # unrelated prompts fill the cache past its budget while the long one runs
            complete(small, [(3 * i + k) % 450 + 20 for i in range(260)], 2)
        assert metric(small, "dsv4_requests_running") == 1  # still running through all the evictions
        got = running.result()
    assert metric(small, "dsv4_prefix_evictions_total") > evictions
    assert metric(small, "dsv4_prefix_cache_bytes") <= int(0.0004 * 2**30)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
    assert same([got], [complete(off, long_prompt, 200)])


def _header(state: bytes) -> tuple[dict[str, Any], list[int], int]:
    """The header, the token ids (the payload's first array) and where the payload starts (format 2)."""
    magic = b"DSV4-STATE\n"
    assert state.startswith(magic)
    version, n = struct.unpack_from("<II", state, len(magic))
    assert version == 2
    head = json.loads(state[len(magic) + 8 : len(magic) + 8 + n])
    start = len(magic) + 8 + n
    return head, list(struct.unpack_from(f"<{head['tokens']}i", state, start)), start


def test_export_then_import_on_a_fresh_server_continues_the_same(on: Server, off: Server, start_server,
                                                                 secret: str) -> None:  # fmt: skip
    first = [(11 * i) % 480 + 5 for i in range(200)]
    r1 = complete(on, first, 8)
    state = httpx.get(f"{on.url}/v1/state/{r1['id']}", timeout=60)
    assert state.status_code == 200 and state.headers["content-type"] == "application/octet-stream"
    head, tokens, start = _header(state.content)
    assert tokens[:200] == first and len(tokens) == 207
    fresh = start_server("--state-secret-file", secret)
    imported = httpx.post(f"{fresh.url}/v1/state", content=state.content,
                          headers={"content-type": "application/octet-stream"}, timeout=60)  # fmt: skip
    assert imported.status_code == 200, imported.text
    assert imported.json()["tokens"] == 207
    # The next turn: the state's tokens (the prompt + what was generated) + a new message.
    second = tokens + [9, 8, 7, 6]
    on2, fresh2, cold2 = complete(on, second, 12), complete(fresh, second, 12), complete(off, second, 12)
    assert same([fresh2, on2], [on2, cold2])
    assert fresh2["usage"]["prompt_tokens_details"]["cached_tokens"] == 207
    # A moved state can move on again: export it from the fresh server, under its new id.
    again = httpx.get(f"{fresh.url}/v1/state/{imported.json()['id']}", timeout=60)
    assert again.status_code == 200 and _header(again.content)[1] == tokens

    def post(data: bytes) -> httpx.Response:
        return httpx.post(f"{fresh.url}/v1/state", content=data, timeout=60)

    # Anything altered is refused by its signature, including a header resealed with a plain SHA-256 (the
    # format-1 trailer, which anyone could recompute).
    payload = state.content[start:-32]
    corrupt = bytearray(state.content)
    corrupt[start + 10] ^= 0xFF
    raw = json.dumps({**head, "model": "0" * 64}).encode()
    body = b"DSV4-STATE\n" + struct.pack("<II", 2, len(raw)) + raw + payload
    foreign = body + hashlib.sha256(body).digest()
    future = state.content[:11] + struct.pack("<I", 3) + state.content[15:]
    for data, why in ((bytes(corrupt), "signature"), (foreign, "signature"), (future, "version"),
                      (state.content[:-4], "signature"), (b"hello", "magic"), (b"", "body")):  # fmt: skip
        r = post(data)
        assert r.status_code == 400, (why, r.text)
        assert why in r.json()["error"]["message"], (why, r.text)
    assert httpx.get(f"{fresh.url}/v1/state/cmpl-unknown", timeout=30).status_code == 404
    assert httpx.get(f"{off.url}/v1/state/{r1['id']}", timeout=30).status_code == 400  # no cache there
    assert complete(fresh, [5, 6, 7], 2)["usage"]["completion_tokens"] == 2  # still serving
