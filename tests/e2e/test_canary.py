"""The correctness canary (service/engine/canary.py) on a real server: a healthy one counts checks and no failures
while streams run, the canary's row is batched with them and touches neither the prefix cache nor the request
metrics; a weight byte flipped after start-up trips it within an interval (under `fail`: /ready and /health 503,
the failure metric, the ERROR line, a drain and exit status 1; under `warn`: counted and logged, still serving).

The fault tests run `service.__main__.serve` itself on this (the main) thread, as `dsv4-serve serve` runs it, so
its return value is the process's exit status; the test's client runs on a thread, and flips the byte on the
engine thread through the worker's `call` (the app is taken as `create_app` returns it)."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True, "stream": True}


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+|\+Inf)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def stream(url: str, out: list[int], started: threading.Event, stop: threading.Event) -> None:
    """One long completion stream; `out` gets its tokens (from the usage at the end, when it gets there)."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    out.append(1)
                if stop.is_set():
                    return
    except httpx.HTTPError:
        pass  # the server drained and went away


def test_healthy_server_counts_checks_beside_streams(start_server: type[Server]) -> None:
    srv = start_server("--canary-interval", "1", "--max-rows", "8")
    # Idle: the canary runs on its own; no request metric, no prefix cache entry or lookup comes of it.
    wait_for(lambda: metric(srv.url, "dsv4_canary_checks_total") >= 2, 60, "2 checks on an idle server")
    assert metric(srv.url, "dsv4_prompt_tokens_total") == 0 and metric(srv.url, "dsv4_generation_tokens_total") == 0
    assert metric(srv.url, "dsv4_prefix_cache_entries") == 0 and metric(srv.url, "dsv4_prefix_lookups_total") == 0
    assert metric(srv.url, "dsv4_requests_running") == 0
    before = metric(srv.url, "dsv4_canary_checks_total")
    stop, outs = threading.Event(), [[] for _ in range(3)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=stream, args=(srv.url, o, s, stop), daemon=True)
               for o, s in zip(outs, started, strict=True)]  # fmt: skip
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in started)
    wait_for(lambda: metric(srv.url, "dsv4_canary_checks_total") >= before + 2, 60, "2 checks beside 3 streams")
    assert metric(srv.url, "dsv4_requests_running") <= 3  # the canary's row is not a request's
    stop.set()
    for t in threads:
        t.join(30)
    assert metric(srv.url, "dsv4_canary_failures_total") == 0
    # 3 streams hold 3 rows: a step of 4 rows is the canary's batched with them.
    text = httpx.get(f"{srv.url}/metrics").text
    le = {m[0]: float(m[1]) for m in re.findall(r'^dsv4_decode_rows_per_step_bucket\{le="([^"]+)"\} (\S+)$', text,
                                                re.M)}  # fmt: skip
    assert le["4.0"] - le["3.0"] > 0, le
    assert "canary mismatch" not in srv.log_tail(100_000)
    # Stopped now, not with the session's servers: a check a second would take a third of a CI core to the end.
    assert srv.stop() == 0


def flip_norm_byte(engine: Any) -> None:
    """On the engine thread: the high byte of the final RMSNorm's first weight XOR 1 (a f32 1.05 becomes 0.26), in
    place, as a memory fault would: every step reads it from then on."""
    import mlx.core as mx

    w = engine.model.norm.weight
    mx.eval(w)
    raw = memoryview(w).cast("B")
    raw[w.itemsize - 1] ^= 0x01


def serve_in_process(action: str, body: Callable[[str, Any], None], monkeypatch: pytest.MonkeyPatch,
                     ready: bool = True, interval: float = 1.0) -> int:  # fmt: skip
    """`serve()` on this thread (its return value: the exit status) with `body(url, ctl)` on a client thread, once
    the server is ready (`ready` False: once the app exists)."""
    from dsv4_serve.service import __main__ as cli
    from dsv4_serve.service.api import app as app_module
    from dsv4_serve.service.settings import Settings

    made: list[Any] = []
    real = app_module.create_app
    monkeypatch.setattr(app_module, "create_app", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    settings = Settings.load({"port": port, "canary_interval": interval, "canary_action": action, "drain_timeout": 2.0,
                              "log_level": "warning"}, env={})  # fmt: skip
    url, errors = f"http://127.0.0.1:{port}", []

    def client() -> None:
        try:
            wait_for(lambda: bool(made), 60, "the app")
            ctl = made[0].state.ctl
            if ready:
                wait_for(lambda: ctl.ready, 120, "ready")
            body(url, ctl)
        except BaseException as e:  # noqa: BLE001 - reported on the test's thread
            errors.append(e)
            if made and made[0].state.ctl.on_fatal is not None:
                made[0].state.ctl.on_fatal()

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    level = logging.getLogger("dsv4").level
    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        rc = cli.serve(settings, sock)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        logging.getLogger("dsv4").setLevel(level)
    t.join(60)
    if errors:
        raise errors[0]
    return rc


def call_on_engine(ctl: Any, fn: Callable[[Any], Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(ctl.worker.call(fn), ctl.loop).result(60)


def test_flipped_weight_trips_the_canary_and_fail_exits_1(monkeypatch, caplog) -> None:
    seen: dict[str, Any] = {}

    def body(url: str, ctl: Any) -> None:
        stop, out, started = threading.Event(), [], threading.Event()
        threading.Thread(target=stream, args=(url, out, started, stop), daemon=True).start()
        assert started.wait(60)
        wait_for(lambda: metric(url, "dsv4_canary_checks_total") >= 1, 60, "a healthy check")
        assert metric(url, "dsv4_canary_failures_total") == 0
        seen["checks"] = metric(url, "dsv4_canary_checks_total")
        call_on_engine(ctl, flip_norm_byte)
        t0 = time.monotonic()
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 503, 60, "/ready 503")
        seen["trip_s"] = time.monotonic() - t0
        seen["health"] = httpx.get(f"{url}/health").status_code
        seen["failures"] = metric(url, "dsv4_canary_failures_total")
        seen["checks_at_trip"] = metric(url, "dsv4_canary_checks_total")
        seen["new_request"] = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code
        stop.set()

    with caplog.at_level(logging.ERROR, logger="dsv4.canary"):
        rc = serve_in_process("fail", body, monkeypatch)
    assert rc == 1
    assert seen["health"] == 503 and seen["new_request"] == 503
    assert seen["failures"] == 1
    assert seen["checks_at_trip"] <= seen["checks"] + 2  # the first check after the flip, or the one it cut into
    assert seen["trip_s"] < 30, seen  # the interval is 1 s; a check is 32 + 16 positions on a shared CPU
    lines = [r.getMessage() for r in caplog.records if r.name == "dsv4.canary" and r.levelno == logging.ERROR]
    assert len(lines) == 1 and "reference ids [" in lines[0] and "max logprob diff" in lines[0], lines


def test_flipped_weight_under_warn_is_counted_and_serving_goes_on(monkeypatch, caplog) -> None:
    seen: dict[str, Any] = {}

    def body(url: str, ctl: Any) -> None:
        wait_for(lambda: metric(url, "dsv4_canary_checks_total") >= 1, 60, "a healthy check")
        assert metric(url, "dsv4_canary_failures_total") == 0
        call_on_engine(ctl, flip_norm_byte)
        wait_for(lambda: metric(url, "dsv4_canary_failures_total") >= 2, 60, "two failed checks")
        seen["ready"] = httpx.get(f"{url}/ready").status_code
        seen["health"] = httpx.get(f"{url}/health").status_code
        seen["completion"] = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).json()
        ctl.on_fatal()  # as a SIGTERM's drain would end: uvicorn stops

    with caplog.at_level(logging.ERROR, logger="dsv4.canary"):
        rc = serve_in_process("warn", body, monkeypatch)
    assert rc == 0
    assert seen["ready"] == 200 and seen["health"] == 200
    assert seen["completion"]["usage"]["completion_tokens"] == 2
    assert sum("canary mismatch" in r.getMessage() for r in caplog.records) >= 2


def wrong_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in the served path alone: every attention output of the parallel prefill doubled (the start-up
    decode, token by token through the step, never runs it)."""
    from dsv4_serve.model import prefill as mprefill

    real = mprefill._attend

    def doubled(*a: Any, **k: Any) -> Any:
        o = real(*a, **k)
        return None if o is None else o * 2

    monkeypatch.setattr(mprefill, "_attend", doubled)


def statuses(url: str) -> dict[str, list[int]]:
    """/ready's, /health's and a completion's status codes, polled until the server is gone."""
    seen: dict[str, list[int]] = {"ready": [], "health": [], "request": []}
    while True:
        try:
            seen["ready"].append(httpx.get(f"{url}/ready", timeout=5).status_code)
            seen["health"].append(httpx.get(f"{url}/health", timeout=5).status_code)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=5)
            seen["request"].append(r.status_code)
        except httpx.HTTPError:
            return seen
        time.sleep(0.05)


def test_a_served_path_wrong_at_start_up_never_serves_and_exits_1(monkeypatch, caplog) -> None:
    """The canary's first check runs through the served path before /ready: with the prefill wrong, the server is
    never ready (no request is ever served) and exits 1 with the mismatch; the interval (300 s) is not waited for."""
    wrong_prefill(monkeypatch)
    seen: dict[str, Any] = {}

    def body(url: str, ctl: Any) -> None:
        seen.update(statuses(url))

    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="dsv4.canary"):
        rc = serve_in_process("fail", body, monkeypatch, ready=False, interval=300.0)
    assert rc == 1 and time.monotonic() - t0 < 200
    assert seen["ready"] and 200 not in seen["ready"], seen  # answered while loading, never ready
    assert 200 not in seen["request"], seen  # held while loading (503 past the ready timeout), never served
    text = [r.getMessage() for r in caplog.records if r.name == "dsv4.canary"]
    assert any("canary mismatch (check 1)" in m for m in text), text
    assert any("first check through the served path failed" in m for m in text), text


def test_a_served_path_wrong_at_start_up_under_warn_is_counted_and_serves(monkeypatch, caplog) -> None:
    """Under `warn` the first check's failure is logged and counted before /ready, and the server serves."""
    wrong_prefill(monkeypatch)
    seen: dict[str, Any] = {}

    def body(url: str, ctl: Any) -> None:
        seen["failures"] = metric(url, "dsv4_canary_failures_total")
        seen["checks"] = metric(url, "dsv4_canary_checks_total")
        seen["completion"] = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).json()
        ctl.on_fatal()  # as a SIGTERM's drain would end: uvicorn stops

    with caplog.at_level(logging.ERROR, logger="dsv4.canary"):
        rc = serve_in_process("warn", body, monkeypatch, interval=300.0)
    assert rc == 0
    assert seen["failures"] == 1 and seen["checks"] == 1, seen  # the first check, before /ready: none since
    assert seen["completion"]["usage"]["completion_tokens"] == 2


def test_a_served_path_that_errs_at_start_up_never_serves_and_exits_1(monkeypatch, caplog) -> None:
    """The first check's prefill raises (the canary's 31-token piece alone; the warm-up's forwards are other
    shapes): an error is no token, but a path that errs is one that cannot serve: never ready, exit 1."""
    from dsv4_serve.service.engine import canary as canary_module
    from dsv4_serve.service.engine.engine import Engine

    real = Engine.prefill_batch

    def failing(self: Any, work: Any, *a: Any, **k: Any) -> Any:
        if len(work) == 1 and len(work[0][1]) == canary_module.PROMPT_LEN - 1:
            raise RuntimeError("injected prefill fault")
        return real(self, work, *a, **k)

    monkeypatch.setattr(Engine, "prefill_batch", failing)
    seen: dict[str, Any] = {}

    def body(url: str, ctl: Any) -> None:
        seen.update(statuses(url))

    with caplog.at_level(logging.INFO, logger="dsv4.canary"):
        rc = serve_in_process("fail", body, monkeypatch, ready=False, interval=300.0)
    assert rc == 1
    assert seen["ready"] and 200 not in seen["ready"] and 200 not in seen["request"], seen
    text = [r.getMessage() for r in caplog.records if r.name == "dsv4.canary"]
    assert any("first check through the served path failed" in m for m in text), text
