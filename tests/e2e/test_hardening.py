"""Hardening against a real server: limits before work while streams run, finite numbers on the wire,
a drain clients can see, API keys, and readers that stop reading."""

from __future__ import annotations

import json
import math
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, Server
from tests.e2e.test_api import metric

MB10 = 10 * 2**20
LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 900, "ignore_eos": True, "stream": True}


def strict_json(text: str) -> Any:
    def no_constant(c: str) -> None:
        raise AssertionError(f"non-finite number {c} on the wire")

    return json.loads(text, parse_constant=no_constant)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = strict_json(r.text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ---- limits before any work, while 8 streams run ------------------------------------------------
def _stream_times(srv: Server, i: int, out: list[list[float]], started: threading.Event) -> None:
    body = {"prompt": [9 + i, 17, 30 + i], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out[i].append(time.perf_counter())
                if len(out[i]) == 20:  # past the prefills and the pipelined decode's start
                    started.set()


def _big_bodies() -> list[tuple[str, str, Any]]:
    """Three 10 MB bodies, built before the clock starts: Content-Length (chat, completions) and chunked."""
    text = "a" * MB10
    chat = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    comp = json.dumps({"prompt": text}).encode()
    pieces = [comp[i : i + 2**20] for i in range(0, len(comp), 2**20)]
    return [("chat", "chat/completions", chat), ("comp", "completions", comp), ("chunked", "completions", pieces)]


def _post_raw(srv: Server, path: str, content: bytes | list[bytes]) -> tuple[int, bytes]:
    """POST over a plain socket (sendall in C, the GIL released): httpx's writer re-slices what is left
    of a 10 MB body after every send, holding the GIL of this process, where the 8 readers time tokens."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        head = f"POST /v1/{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        if isinstance(content, bytes):
            s.sendall(f"{head}Content-Length: {len(content)}\r\n\r\n".encode() + content)
        else:
            s.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            try:
                for piece in content:
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                s.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed before the whole body was sent
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
            chunk = s.recv(65536)
            assert chunk, f"the connection closed before the whole answer: {data[:300]!r}"
            data += chunk
    head_raw, _, body = data.partition(b"\r\n\r\n")
    return int(head_raw.split()[1]), body


def _content_length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].lower()
    return int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]) if b"content-length: " in head else 0


def _send(srv: Server, bodies: list[tuple[str, str, Any]], pause: float = 0.0) -> list[tuple[str, float, float]]:
    """Each body in turn, `pause` s apart: (kind, start, end) per body, each answered 413."""
    res = []
    for kind, path, content in bodies:
        t = time.perf_counter()
        status, body = _post_raw(srv, path, content)
        res.append((kind, t, time.perf_counter()))
        assert status == 413, body
        err = strict_json(body.decode())["error"]
        assert err["code"] == "request_too_large" and set(err) == {"message", "type", "param", "code"}
        time.sleep(pause)
    return res


def _one_round(server: Server, bodies: list[tuple[str, str, Any]]) -> list[str]:
    """8 streams; one 10 MB body at a time once they run. Returns what broke the criterion, if anything."""
    times: list[list[float]] = [[] for _ in range(8)]
    started = [threading.Event() for _ in range(8)]
    threads = [threading.Thread(target=_stream_times, args=(server, i, times, started[i])) for i in range(8)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    time.sleep(0.3)
    res = _send(server, bodies, pause=0.3)
    for t in threads:
        t.join(120)
    assert all(len(t) >= 200 for t in times), [len(t) for t in times]  # + the finish chunk
    broken = []
    for kind, w0, w1 in res:
        assert w1 - w0 < 0.5, (kind, w1 - w0)  # the 4xx itself is never late
        for ts in (t[:200] for t in times):
            med = statistics.median(b - a for a, b in zip(ts[1:], ts[2:], strict=False))
            during = [b - a for a, b in zip(ts, ts[1:], strict=False) if b >= w0 and a <= w1]
            assert during
            if max(during) > 3 * med:
                broken.append(f"{kind}: a {max(during):.3f}s gap, median {med:.3f}s")
    return broken


def test_ten_mb_bodies_are_turned_away_at_once_while_streams_run(server: Server) -> None:
    """The token-gap bound is a timing on a shared CPU: a round is repeated (at most 3) when a gap broke it;
    a server that stalls on big bodies (the 9 s of tokenizing one before) breaks every round."""
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    bodies = _big_bodies()
    rss_before = rss_bytes(server.proc.pid)
    rounds = []
    for _ in range(3):
        rounds.append(_one_round(server, bodies))
        if not rounds[-1]:
            break
    assert not rounds[-1], rounds
    rss_after = rss_bytes(server.proc.pid)
    assert abs(rss_after - rss_before) <= 0.2 * rss_before, (rss_before, rss_after)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_text_that_cannot_fit_is_rejected_before_tokenizing(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "word " * 200_000}]}  # 1 MB, under the body cap
    t = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    err = assert_openai_error(r, 400, "context_length_exceeded")
    assert err["param"] == "messages" and time.perf_counter() - t < 0.5


# ---- numbers ------------------------------------------------------------------------------------
def _logprobs(chunks: list[dict[str, Any]]) -> list[float]:
    out = []
    for c in chunks:
        for ch in c["choices"]:
            lp = ch.get("logprobs") or {}
            out += lp.get("token_logprobs") or []
            out += [v for d in lp.get("top_logprobs") or [] for v in d.values()]
            for e in lp.get("content") or []:
                out += [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "comp"])
def test_tiny_temperature_is_greedy_with_finite_logprobs(server: Server, kind: str, stream: bool) -> None:
    if kind == "chat":
        path, base = "chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "logprobs": True,
                                          "top_logprobs": 5}  # fmt: skip
    else:
        path, base = "completions", {"prompt": "Hello there", "logprobs": 5}
    base = {**base, "max_tokens": 6, "ignore_eos": True, "stream": stream}

    def run(temperature: float) -> tuple[list[dict[str, Any]], str]:
        r = httpx.post(f"{server.url}/v1/{path}", json={**base, "temperature": temperature}, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            body = strict_json(r.text)
            ch = body["choices"][0]
            return [body], ch["message"]["content"] if kind == "chat" else ch["text"]
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [strict_json(e) for e in events[:-1]]
        key = "delta" if kind == "chat" else None
        text = "".join((c["choices"][0][key].get("content") or "") if key else c["choices"][0]["text"]
                       for c in chunks if c["choices"])  # fmt: skip
        return chunks, text

    chunks, text = run(1e-300)
    lps = _logprobs(chunks)
    assert lps and all(math.isfinite(v) for v in lps)
    assert text == run(0.0)[1]  # below the epsilon: greedy


# ---- drain ----------------------------------------------------------------------------------------
def test_drain_answers_503_then_aborts_streams_and_exits_zero(start_server: type[Server]) -> None:
    srv = start_server(env={"DSV4_DRAIN_TIMEOUT": "2"})
    keep = httpx.Client(base_url=srv.url, timeout=10)
    assert keep.get("/ready").status_code == 200  # a keep-alive connection from before the drain
    finish: list[str | None] = []
    first = threading.Event()

    def hold() -> None:
        last = None
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=LONG, timeout=60) as r:
            for line in r.iter_lines():
                first.set()
                if line.startswith("data: {"):
                    last = strict_json(line[6:])["choices"][0]["finish_reason"] or last
        finish.append(last)

    t = threading.Thread(target=hold)
    t.start()
    assert first.wait(30)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 1.5
    while keep.get("/ready").status_code != 503:
        assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
        time.sleep(0.02)
    assert keep.get("/health").status_code == 200  # alive, only not ready
    new = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert_openai_error(new, 503, "draining")
    assert int(new.headers["retry-after"]) >= 1
    again = keep.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(again, 503, "draining")
    assert time.monotonic() - t0 < 2, "checks must run inside the drain"
    t.join(30)
    assert finish == ["abort"]
    assert srv.proc.wait(30) == 0, srv.log_tail()
    keep.close()


# ---- API keys -----------------------------------------------------------------------------------
def test_api_keys(start_server: type[Server], tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# from a secret\nfile-key\n")
    srv = start_server("--api-key", "flag-key", "--metrics-key", "scrape",
                       env={"DSV4_API_KEY_FILE": str(key_file)})  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    url = f"{srv.url}/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic flag-key"},
                    {"Authorization": "flag-key"}, {"Authorization": "Bearer flag-keyX"}):  # fmt: skip
        err = assert_openai_error(httpx.post(url, json=chat, headers=headers), 401, "invalid_api_key")
        assert err["type"] == "invalid_request_error"
    assert_openai_error(httpx.get(f"{srv.url}/v1/models"), 401, "invalid_api_key")
    big = httpx.post(url, content=b"x" * MB10, headers={"content-type": "application/json"})
    assert big.status_code == 401  # no key: turned away before the body is read
    for key in ("flag-key", "file-key"):
        assert httpx.post(url, json=chat, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert httpx.get(f"{srv.url}/ready").status_code == 200
    assert httpx.get(f"{srv.url}/metrics").status_code == 401
    assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer flag-key"}).status_code == 401
    assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer scrape"}).status_code == 200
    good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="file-key", max_retries=0)
    r = good.chat.completions.create(model=MODEL, messages=chat["messages"], max_tokens=3, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens >= 1
    assert [m.id for m in good.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()


# ---- a reader that stops reading ------------------------------------------------------------------
# The server's sockets get a small send buffer (accepted sockets inherit the listener's), so a client
# that stops reading fills them within a few dozen tokens, as it would over a real network; loopback's
# autotuned buffers would take megabytes first, more than the tiny model's context can produce.
SMALL_SNDBUF = [sys.executable, "-c", (
    "import socket, sys\n"
    "_bind = socket.socket.bind\n"
    "def bind(self, addr):\n"
    "    self.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)\n"
    "    return _bind(self, addr)\n"
    "socket.socket.bind = bind\n"
    "from dsv4_serve.service.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)]  # fmt: skip


def _stalled_client(srv: Server) -> socket.socket:
    """A streaming request (large chunks: 20 top logprobs a token) whose client then reads nothing."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    body = json.dumps({**LONG, "logprobs": 20}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    s.sendall(head.encode() + b"\r\n\r\n" + body)
    return s


def _read_to_eof(s: socket.socket) -> bytes:
    s.settimeout(10)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _wait_row_freed(srv: Server, limit: float) -> tuple[float, float]:
    """Seconds until no row runs, and the most token events queued seen on the way."""
    t0, peak = time.monotonic(), 0.0
    while metric(srv, "dsv4_requests_running") != 0:
        peak = max(peak, metric(srv, "dsv4_stream_events_queued"))
        assert time.monotonic() - t0 < limit, "the stalled request still holds its row"
        time.sleep(0.1)
    return time.monotonic() - t0, peak


def test_a_stalled_reader_holds_at_most_its_queue(start_server: type[Server]) -> None:
    srv = start_server("--stream-queue", "16", "--stream-stall-timeout", "120", command=SMALL_SNDBUF)
    s = _stalled_client(srv)
    _, peak = _wait_row_freed(srv, 60)
    assert peak <= 16
    assert metric(srv, "dsv4_generation_tokens_total") < 900
    s.close()
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200


def test_a_stalled_reader_is_aborted_after_the_stall_timeout(start_server: type[Server]) -> None:
    srv = start_server("--stream-queue", "100000", "--stream-stall-timeout", "2", command=SMALL_SNDBUF)
    s = _stalled_client(srv)
    seconds, peak = _wait_row_freed(srv, 40)
    assert seconds >= 2 and peak > 16  # the queue took what the socket would not, until the timeout
    assert metric(srv, "dsv4_generation_tokens_total") < 900
    data = _read_to_eof(s)  # the server closed the connection: the stream ends unfinished
    s.close()
    assert data.startswith(b"HTTP/1.1 200") and b"data: {" in data and b"[DONE]" not in data
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
