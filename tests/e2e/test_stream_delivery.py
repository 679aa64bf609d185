"""A step's tokens delivered to many streams at once, over a real server: every stream gets all of its own tokens
in order, framed as one SSE event each; /metrics holds the engine's time a step by phase as histograms."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from typing import Any

import httpx

from tests.e2e.conftest import MODEL, Server

STREAMS = 8
TOKENS = 24


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [(7 * i + 3 * j) % 400 + 2 for j in range(12 + i)], "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": 1, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}  # fmt: skip


def _streamed(srv: Server, i: int) -> list[dict[str, Any] | str]:
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=_body(i, True), timeout=120) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    return [e[6:] if e == "data: [DONE]" else json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_concurrent_streams_get_their_tokens_in_order(server: Server) -> None:
    with cf.ThreadPoolExecutor(STREAMS) as ex:
        streamed = list(ex.map(lambda i: _streamed(server, i), range(STREAMS)))
    for i, events in enumerate(streamed):
        alone = httpx.post(f"{server.url}/v1/completions", json=_body(i, False), timeout=120).json()["choices"][0]
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict) and e["choices"]]
        assert len({c["id"] for c in events[:-1] if isinstance(c, dict)}) == 1  # one request's id throughout
        # One token a chunk, none lost, none repeated, in order: the same tokens and text as the request alone.
        assert all(len(c["choices"][0]["logprobs"]["tokens"]) <= 1 for c in chunks)
        tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
        assert len(tokens) == TOKENS and tokens == alone["logprobs"]["tokens"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == alone["text"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finish[-1] == "length" and not any(finish[:-1])
        assert events[-2]["usage"]["completion_tokens"] == TOKENS  # type: ignore[index]


def _series(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}{{phase="(\w+)"}} ([0-9.e+-]+)$', text, re.M)}  # fmt: skip


def _settled(srv: Server) -> str:
    """/metrics once the engine thread's last iteration is observed (it publishes its events, then observes)."""
    last = None
    for _ in range(50):
        text = httpx.get(f"{srv.url}/metrics").text
        if text.count("\n") and last == _series(text, "dsv4_engine_phase_seconds_count"):
            return text
        last = _series(text, "dsv4_engine_phase_seconds_count")
        time.sleep(0.2)
    raise AssertionError("the engine thread never settled")


def test_metrics_hold_the_engine_phases_as_histograms(server: Server) -> None:
    before = httpx.get(f"{server.url}/metrics").text  # the warm-up's build is in the counters, in no iteration
    for i in range(3):
        assert httpx.post(f"{server.url}/v1/completions", json=_body(i, False), timeout=120).status_code == 200
        assert len(_streamed(server, i)) > TOKENS
    text = _settled(server)
    counts = _series(text, "dsv4_engine_phase_seconds_count")
    sums = _series(text, "dsv4_engine_phase_seconds_sum")
    for phase in ("build", "encode", "sample", "wait", "prefill", "schedule", "loop"):
        assert counts.get(phase, 0) > 0, f"no {phase} observations"
        buckets = [float(m.group(1)) for m in re.finditer(
            rf'^dsv4_engine_phase_seconds_bucket{{le="[^"]+",phase="{phase}"}} ([0-9.e+-]+)$', text, re.M)]
        assert len(buckets) >= 10 and buckets == sorted(buckets) and buckets[-1] == counts[phase]
    # An iteration's phases add up to its loop time; the steps' build / encode are all in iterations observed.
    parts = sum(v for k, v in sums.items() if k != "loop")
    assert abs(parts - sums["loop"]) <= 0.01 * sums["loop"]
    host, host0 = _series(text, "dsv4_engine_host_seconds_total"), _series(before, "dsv4_engine_host_seconds_total")
    sums0 = _series(before, "dsv4_engine_phase_seconds_sum")
    for phase in ("build", "encode", "sample", "wait"):
        grew = host[phase] - host0[phase]
        assert grew > 0 and abs(sums[phase] - sums0.get(phase, 0.0) - grew) <= 1e-6 + 1e-3 * grew
    assert counts["loop"] >= float(re.search(r"^dsv4_engine_step_seconds_count ([0-9.e+]+)$", text, re.M).group(1))
