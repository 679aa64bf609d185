"""Issue 63's hostile key against a real server (tiny model, two API keys): key B attacks (a trickled state
body, 1,100 idle sockets under `ulimit -n 1024`, oversize request heads, /tokenize's deep and long bodies, 100,000
content parts, an 8,000-id prompt_logprobs request, a prompt list longer than the queue) while key A streams.
Through each attack A's streams keep their pace (worst gap under 1 s, at least 0.6x their rate before it), /health
answers within 1 s, and nothing gets a 5xx."""

from __future__ import annotations

import json
import random
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, server_command
from tests.e2e.test_hardening import assert_openai_error
from tests.e2e.test_tenants import K1, K2, auth, complete, export, post_state, prompt_of, secret_file  # noqa: F401

A, B = K1, K2  # A: the victim, streaming; B: the attacker


class Watch:
    """A's `n` streams and a /health prober, each in a thread; `window()` marks an attack. `check()`: during every
    window the worst stream gap < 1 s and /health < 1 s; A's token rate in it >= 0.6x its rate with no attack (the
    lower of the 1.5 s before the first window and the 1.5 s after the last)."""

    def __init__(self, srv: Server, n: int = 2) -> None:
        self.srv, self.stop = srv, threading.Event()
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.health: list[tuple[float, float]] = []
        self.statuses: list[int] = []
        self.windows: list[tuple[str, float, float]] = []
        self.threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(n)]
        self.threads.append(threading.Thread(target=self._probe))

    def _stream(self, i: int) -> None:
        body = {"prompt": [9 + i, 17, 30 + i], "max_tokens": 6000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.srv.url}/v1/completions", json=body, headers=auth(A), timeout=120) as r:
            self.statuses.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times[i].append(time.perf_counter())
                if self.stop.is_set():
                    return

    def _probe(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                self.statuses.append(c.get(f"{self.srv.url}/health").status_code)
                self.health.append((t, time.perf_counter() - t))
                time.sleep(0.05)

    def __enter__(self) -> Watch:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(t) for t in self.times) < 40:  # past the prefills and the pipelined decode's start
            assert time.monotonic() < deadline, "A's streams did not start"
            time.sleep(0.05)
        self.t0 = time.perf_counter()
        time.sleep(1.5)  # the baseline rate
        return self

    def __exit__(self, *exc: object) -> None:
        self.t1 = time.perf_counter()
        if exc[0] is None:
            time.sleep(1.5)  # the rate after every attack: a CPU shared with other work changes pace by itself
        self.t2 = time.perf_counter()
        self.stop.set()
        for t in self.threads:
            t.join(60)

    @contextmanager
    def window(self, name: str) -> Iterator[None]:
        w0 = time.perf_counter()
        yield
        time.sleep(0.5)  # what the attack left behind shows here too (and a short one still gets its probes)
        self.windows.append((name, w0, time.perf_counter()))

    def rate(self, a: float, b: float) -> float:
        return sum(sum(1 for t in ts if a <= t <= b) for ts in self.times) / (b - a)

    def check(self) -> None:
        first = min(w0 for _, w0, _ in self.windows)
        base = min(self.rate(self.t0, first), self.rate(self.t1, self.t2))  # A's pace with no attack
        for name, w0, w1 in self.windows:
            gaps = [y - x for ts in self.times for x, y in zip(ts, ts[1:], strict=False) if y >= w0 and x <= w1]
            health = [d for t, d in self.health if w0 <= t <= w1]
            assert gaps and max(gaps) < 1.0, (name, max(gaps, default=None))
            assert health and max(health) < 1.0, (name, max(health, default=None))
            if w1 - w0 >= 1.0:
                assert self.rate(w0, w1) >= 0.6 * base, (name, self.rate(w0, w1), base)
        assert all(s < 500 for s in self.statuses), sorted(set(self.statuses))


def connect(srv: Server, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    if data:
        s.sendall(data)
    return s


def answer_of(s: socket.socket) -> bytes:
    """One HTTP response off `s`: its head and its Content-Length body (or up to the close)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        part = s.recv(65536)
        if not part:
            break
        data += part
    return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def head(path: str, key: str | None, extra: str = "") -> bytes:
    keyed = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{keyed}{extra}".encode()


@pytest.fixture(scope="module")
def hostile(start_server, secret_file: str) -> Server:  # noqa: F811
    return start_server("--api-key", A, "--api-key", B, "--state-secret-file", secret_file, "--body-timeout", "5",
                        "--max-queue", "16", "--head-timeout", "2", "--keep-alive-timeout", "2")  # fmt: skip


def _closed_after(s: socket.socket, drip: bytes = b"", every: float = 0.3, limit: float = 10.0) -> float:
    """Seconds until the server closes `s` (a byte of `drip` sent every `every` s meanwhile)."""
    t0 = time.perf_counter()
    s.settimeout(every)
    for b in drip or b"\0" * 10_000:
        try:
            if s.recv(4096) == b"":
                return time.perf_counter() - t0
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.perf_counter() - t0
        if drip:
            try:
                s.send(bytes([b]))
            except OSError:
                return time.perf_counter() - t0
        if time.perf_counter() - t0 > limit:
            break
    raise AssertionError(f"still open after {time.perf_counter() - t0:.1f} s")


def test_head_and_idle_deadlines_do_not_move_with_trickled_bytes(hostile: Server) -> None:
    """--head-timeout 2 / --keep-alive-timeout 2: a silent socket, a head trickled a byte every 0.3 s, and a
    kept-alive connection trickling its next head are each closed about 2 s in."""
    assert 1.5 <= _closed_after(connect(hostile)) < 4.0
    assert 1.5 <= _closed_after(connect(hostile), drip=b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100) < 4.0
    kept = connect(hostile, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(4096).startswith(b"HTTP/1.1 200 ")
    assert 1.5 <= _closed_after(kept, drip=b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100) < 4.0


def test_a_connection_cap_the_fd_limit_cannot_hold_stops_start_up() -> None:
    """--max-connections past what `ulimit -n 1024` leaves: exit 2 with the reason, before the model loads."""
    srv = Server("--max-connections", "5000", command=["prlimit", "--nofile=1024:1024", *server_command()])
    assert srv.proc.wait(120) == 2
    err = srv.log_tail()
    assert "--max-connections 5000" in err and "ulimit -n" in err, err


def test_a_trickled_import_holds_no_other_keys_import(hostile: Server, start_server, secret_file: str) -> None:  # noqa: F811
    """B trickles a chunked POST /v1/state (a byte every 0.5 s) and stalls a second: A's valid import meanwhile
    takes under 2 s, B's third gets 429 at once (2 bodies a key), the trickle gets 408 once the body is 5 s old
    (--body-timeout 5); a client that leaves mid-body is one info line."""
    origin = start_server("--api-key", A, "--api-key", B, "--state-secret-file", secret_file)
    state = export(origin, A, complete(origin, A, prompt_of(63, 150), 4)["id"]).content
    assert post_state(hostile, B, b"x" * 100).status_code == 400  # the server's first import computes its layout
    with Watch(hostile) as watch:
        trickle = connect(hostile, head("/v1/state", B, "Transfer-Encoding: chunked\r\n"
                                        "Content-Type: application/octet-stream\r\n\r\n"))  # fmt: skip
        t0, sent = time.perf_counter(), threading.Event()

        def drip() -> None:
            try:
                while not sent.is_set():
                    trickle.sendall(b"1\r\nx\r\n")
                    sent.wait(0.5)
            except OSError:
                pass  # the server answered and closed

        dripper = threading.Thread(target=drip)
        with watch.window("trickled state body"):
            dripper.start()
            second = connect(hostile, head("/v1/state", B, "Content-Length: 1000000\r\n\r\n") + b"x")
            time.sleep(1.0)
            third = post_state(hostile, B, b"x" * 100)  # B holds 2 bodies already: refused before a byte is read
            assert_openai_error(third, 429, "imports_busy")
            time.sleep(1.0)
        # A's own import (its check and install are A's work, outside the window) while B still trickles
        t = time.perf_counter()
        r = post_state(hostile, A, state)
        took = time.perf_counter() - t
        assert r.status_code == 200 and took < 2.0, (r.status_code, took, r.text)
        assert time.perf_counter() - t0 < 5.0  # B's trickle was still on
        answer = answer_of(trickle)
        sent.set()
        dripper.join()
        second.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert 5.0 <= time.perf_counter() - t0 < 10.0
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        left = connect(hostile, head("/v1/state", B, "Content-Length: 100000\r\n\r\n") + b"x" * 10)
        time.sleep(0.3)
        left.close()
        time.sleep(1.0)
    watch.check()
    log = hostile.log_tail(200_000)
    assert "the client left before its request body was in" in log
    assert "unhandled error" not in log and "Traceback" not in log


def test_oversize_request_heads_get_431(hostile: Server) -> None:
    big = head("/v1/completions", A, "X-Big: " + "a" * 100_000 + "\r\n\r\n")
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for data in (big, head("/v1/completions", A, "X-A: b\r\n" * 10_000 + "\r\n"), ok + big):  # last: pipelined
        s = connect(hostile, data)
        answer = b""
        while answer.count(b"HTTP/1.1 ") < 1 + data.startswith(ok) or not answer.endswith(b"}"):
            answer += s.recv(65536)
        s.close()
        if data.startswith(ok):  # the pipelined head: /health answered first, then the 431
            first, sep, rest = answer.partition(b"HTTP/1.1 431 ")
            assert first.startswith(b"HTTP/1.1 200 ") and sep, answer[:300]
            answer = sep + rest
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_header_fields_too_large" and err["message"]
    ok = httpx.get(f"{hostile.url}/v1/models", headers={**auth(A), "X-Fine": "a" * 8000})
    assert ok.status_code == 200


def test_bounded_bodies_beside_a_stream(hostile: Server) -> None:
    """/tokenize's 100,000-deep body and its over-long text, 100,000 content parts, a prompt list longer than
    --max-queue, an 8,000-id prompt_logprobs 20 + echo + logprobs 20 request: each a 4xx (or its 200) while A's
    streams and /health keep their pace (the 8,000-id prefill itself stalls streams on this CPU: /health only)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    long_text = json.dumps({"prompt": "hello there " * 300_000}).encode()  # 3.6 MB: more than the context
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 100_000}]}).encode()
    prompts = json.dumps({"prompt": ["hi"] * 17, "max_tokens": 1}).encode()
    rng = random.Random(8)
    scored = {"prompt": [rng.randrange(3, 500) for _ in range(8000)], "max_tokens": 1, "echo": True, "logprobs": 20,
              "prompt_logprobs": 20}  # fmt: skip

    def post(path: str, raw: bytes, key: str = B) -> httpx.Response:
        return httpx.post(f"{hostile.url}{path}", content=raw, timeout=300,
                          headers={**auth(key), "content-type": "application/json"})  # fmt: skip

    with Watch(hostile) as watch:
        with watch.window("tokenize deep"):
            assert_openai_error(post("/tokenize", deep), 400, "invalid_json")
        with watch.window("tokenize long"):
            err = assert_openai_error(post("/tokenize", long_text), 400, "context_length_exceeded")
            assert err["param"] == "prompt"
            # 9,000 characters could fit (the check before tokenizing passes) but are 18,000 ids: refused after
            many = assert_openai_error(post("/tokenize", json.dumps({"prompt": "ü" * 9000}).encode()), 400)
            assert many["code"] == "context_length_exceeded" and "18000 tokens" in many["message"]
        with watch.window("content parts"):
            assert assert_openai_error(post("/v1/chat/completions", parts), 400)["param"] == "messages"
        with watch.window("prompt list"):
            r = post("/v1/completions", prompts)
            assert assert_openai_error(r, 400)["param"] == "prompt" and "retry-after" not in r.headers
        spans = {}
        for name, body in (("plain", {"prompt": scored["prompt"], "max_tokens": 1, "cache_salt": "plain"}),
                           ("scored", scored)):  # fmt: skip
            t = time.perf_counter()
            r = post("/v1/completions", json.dumps(body).encode())
            spans[name] = (t, time.perf_counter())
            assert r.status_code == 200, r.text[:300]
        choice = r.json()["choices"][0]
        assert len(choice["prompt_logprobs"]) == 8000 and len(choice["logprobs"]["top_logprobs"]) == 8001
    watch.check()
    # The 8,000-id prefill itself starves a 2-core CPU: the scored request may stall /health no more than the
    # same request without its logprobs (before issue 63: 2.08 s against 0.6 s, the 16 MB body built on the loop)
    worst = {k: max((d for t, d in watch.health if a <= t <= b), default=0.0) for k, (a, b) in spans.items()}
    assert worst["scored"] < max(1.0, 2 * worst["plain"]), worst
    ok = post("/tokenize", json.dumps({"prompt": "hello there"}).encode())
    assert ok.status_code == 200 and ok.json()["count"] >= 2
    assert "Traceback" not in hostile.log_tail(200_000)


# B's sockets, from a process of its own (the streams' readers here keep the GIL to themselves): silent, stopped
# mid-head, stopped mid-body with B's key; "ready" once all are tried, then held until stdin closes.
ATTACKER = """
import resource, socket, sys, time
port, key = int(sys.argv[1]), sys.argv[2]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 8192, hard))
kinds = [b"", b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\n",
         b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer " + key.encode()
         + b"\\r\\nContent-Length: 1000\\r\\n\\r\\n{"]
socks, refused = [], 0
for i in range(1100):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if kinds[i % 3]:
            s.sendall(kinds[i % 3])
        socks.append(s)
    except OSError:
        refused += 1
    if i % 100 == 99:
        time.sleep(0.2)
print("ready", len(socks), refused, flush=True)
sys.stdin.read()
"""


def _fd_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def test_idle_sockets_under_ulimit_1024(start_server) -> None:
    """1,100 sockets from B (silent, stopped mid-head, stopped mid-body with B's key) against a server under
    `ulimit -n 1024`: the longest-idle or stalled ones are closed past the cap, so /health and A's streams keep
    their pace; the accept error, if any, is a few log lines."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this test opens 1,100 sockets; the hard open-file limit is {hard}")
    srv = start_server("--api-key", A, "--api-key", B, "--head-timeout", "60",
                       command=["prlimit", "--nofile=1024:1024", *server_command()])  # fmt: skip
    assert "1024" in Path(f"/proc/{srv.proc.pid}/limits").read_text().split("Max open files")[1].split("\n")[0]
    with Watch(srv) as watch:
        with watch.window("1,100 sockets"):
            attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(srv.port), B], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
            try:
                assert attacker.stdout is not None and attacker.stdout.readline().startswith("ready")
                time.sleep(3.0)  # the stalled bodies become spare; the server holds what it held
                assert _fd_count(srv.proc.pid) < 1024
                with watch.window("after"):
                    for _ in range(20):
                        assert httpx.get(f"{srv.url}/v1/models", headers=auth(A), timeout=5).status_code == 200
            finally:
                attacker.communicate("", timeout=60)
    watch.check()
    log = Path(srv.log.name).read_text(errors="replace")
    assert log.count("Too many open files") <= 5 and len(log) < 1 << 20, (log.count("Too many open files"), len(log))


def test_a_large_scored_body_streamed_is_the_one_json_body(hostile: Server) -> None:
    """Past 1,024 scored positions both framings are written off the loop: the streamed first chunk holds what the
    one JSON body holds (echoed prompt logprobs, vLLM's prompt_logprobs)."""
    ids = prompt_of(1100, 1100)
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 3,
            "prompt_logprobs": 3, "cache_salt": "large"}  # fmt: skip
    one = httpx.post(f"{hostile.url}/v1/completions", json=body, headers=auth(A), timeout=300)
    assert one.status_code == 200, one.text[:300]
    whole = one.json()["choices"][0]
    with httpx.stream("POST", f"{hostile.url}/v1/completions", json={**body, "stream": True, "cache_salt": "large2"},
                      headers=auth(A), timeout=300) as r:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert len(whole["prompt_logprobs"]) == 1100 and first["prompt_logprobs"] == whole["prompt_logprobs"]
    lp = whole["logprobs"]
    assert first["logprobs"]["tokens"] == lp["tokens"][:1101] and first["text"].startswith(whole["text"][:200])
    assert [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
