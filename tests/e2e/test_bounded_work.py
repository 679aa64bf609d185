"""Bounded work against a real server: huge lists and grammars refused before any work while a stream runs
(its token gaps stay small, the server's memory and CPU come back), a grammar compile that outlives
--grammar-timeout killed (no CPU after it), a full queue answered 429 before tokenizing, and the API's
description behind the key."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_hardening import assert_openai_error, rss_bytes

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process and its waited-for children (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> set[int]:
    """The process's live children, from each of its threads' /proc list; a thread that ends between the listing
    and the read has none (its file is gone: a FileNotFoundError here once failed a full-suite run)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out.update(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:
            continue
    return out


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of the process and of its live children (the grammar compile process)."""
    total = cpu_seconds(pid)
    for child in children(pid):
        try:
            total += cpu_seconds(child)
        except FileNotFoundError:  # it ended meanwhile
            continue
    return total


def _quiet(pid: int, timeout: float = 30.0) -> None:
    """Wait for a second in which the process tree uses < 0.2 s of CPU; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c0 = tree_cpu_seconds(pid)
        time.sleep(1)
        if tree_cpu_seconds(pid) - c0 < 0.2:
            return
    pytest.fail(f"the server's process tree kept the CPU busy for {timeout:g}s")


def _stream(srv: Server, times: list[float], started: threading.Event) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 20:
                    started.set()


def _post(srv: Server, path: str, raw: bytes) -> tuple[httpx.Response, float]:
    t = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)
    return r, time.perf_counter() - t


def test_huge_lists_and_grammars_beside_a_stream(start_server: type[Server]) -> None:
    """The issue's scenario: a 30k-entry guided_choice, a 100,000-string prompt list and 60,000 messages, six
    times each, beside a healthy stream: each answered 4xx within 2 s, the stream's
    worst gap under 1 s, RSS within 100 MiB of before, and no CPU burnt after the clients left."""
    srv = start_server()
    pid = srv.proc.pid
    bodies = [  # encoded before the clock starts
        ("chat/completions", json.dumps({**CHAT, "guided_choice": [f"choice {i}" for i in range(30_000)]}).encode(),
         "guided_choice"),
        ("completions", json.dumps({"prompt": ["hello there"] * 100_000, "max_tokens": 2}).encode(), "prompt"),
        ("chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": "x"}] * 60_000}).encode(),
         "messages"),
    ]  # fmt: skip
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    rss_before = rss_bytes(pid)
    times: list[float] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream, args=(srv, times, started))
    reader.start()
    assert started.wait(120)
    w0 = time.perf_counter()
    for _ in range(6):
        for path, raw, param in bodies:
            r, took = _post(srv, path, raw)
            err = assert_openai_error(r, 400)
            assert err["param"] == param and took < 2.0, (param, took, err)
    w1 = time.perf_counter()
    reader.join(300)
    during = [b - a for a, b in zip(times, times[1:], strict=False) if b >= w0 and a <= w1]
    assert during and max(during) < 1.0, max(during)
    assert abs(rss_bytes(pid) - rss_before) < 100 * 2**20, (rss_before, rss_bytes(pid))
    time.sleep(0.5)  # the stream's end settles
    c0 = tree_cpu_seconds(pid)
    time.sleep(3)
    assert tree_cpu_seconds(pid) - c0 < 0.5  # an idle server: nothing left working after the clients left


def _slow_schema() -> dict[str, object]:
    """1,000 optional properties: 61 KB (under the schema cap), ~8 s to compile at the tiny model's 512 ids."""
    props = {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(1000)}
    return {"type": "object", "properties": props}


def test_a_compile_past_the_timeout_is_killed(start_server: type[Server]) -> None:
    srv = start_server("--grammar-timeout", "1")
    ok = {**CHAT, "guided_choice": ["yes", "no"]}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=ok, timeout=120)  # starts the compile processes
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    _quiet(srv.proc.pid)  # every compile process is up (each started in the background)
    before = children(srv.proc.pid)
    body = {**CHAT, "guided_json": _slow_schema()}
    t = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    err = assert_openai_error(r, 400, "grammar_too_complex")
    assert err["param"] == "guided_json" and time.perf_counter() - t < 3
    assert before - children(srv.proc.pid)  # the compiling process was killed (a fresh one replaces it)
    _quiet(srv.proc.pid)  # and nothing keeps the CPU once the fresh one is up (the compile alone is ~8 s)
    t = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)  # known slow: refused at once
    assert_openai_error(r, 400, "grammar_too_complex")
    assert time.perf_counter() - t < 0.5
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={**ok, "guided_choice": ["up", "down"]}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("up", "down"), r.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_choice", [f"c{i}" for i in range(1025)]),
        ("guided_choice", ["x" * 20_000, "y" * 20_000]),  # 40 KB: over the bytes cap
        ("guided_regex", "a" * 20_000),
        ("guided_json", {"type": "object", "description": "d" * 200_000}),
        ("guided_json", "[" * 100_000 + "]" * 100_000),  # a string schema nested past Python's parser
    ],
    ids=["choices-count", "choices-bytes", "regex", "schema", "schema-text"],
)
def test_oversize_grammars_are_refused_by_name(server: Server, field: str, value: object) -> None:
    t = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, field: value}, timeout=30)
    assert assert_openai_error(r, 400)["param"] == field
    assert time.perf_counter() - t < 0.5


def test_a_full_queue_is_429_before_tokenizing(start_server: type[Server]) -> None:
    """One row, a queue of one: a stream running, then 2,048 prompts of text (they could never all wait) get
    their 400 at once (a 429 would be retried forever) instead of being tokenized first; with the queue full, a
    one-prompt request gets its 429 as early."""
    srv = start_server("--max-rows", "1", "--max-queue", "1")
    long = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    streams = [httpx.stream("POST", f"{srv.url}/v1/completions", json=long, timeout=300) for _ in range(2)]
    try:
        streams[0].__enter__()
        raw = json.dumps({"prompt": ["word " * 200] * 2048, "max_tokens": 2}).encode()  # 2 MB of text
        r, took = _post(srv, "completions", raw)
        assert assert_openai_error(r, 400)["param"] == "prompt" and "retry-after" not in r.headers
        assert took < 1.0, took
        streams[1].__enter__()  # waiting: the queue is full
        r, took = _post(srv, "chat/completions", json.dumps(CHAT).encode())
        assert_openai_error(r, 429, "queue_full")
        assert took < 0.5, took
    finally:
        for s in streams:
            s.__exit__(None, None, None)


def test_the_api_description_needs_the_key(start_server: type[Server]) -> None:
    srv = start_server("--api-key", "k1")
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert_openai_error(httpx.get(f"{srv.url}{path}"), 401, "invalid_api_key")
    r = httpx.get(f"{srv.url}/openapi.json", headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
    assert httpx.get(f"{srv.url}/health").status_code == 200
