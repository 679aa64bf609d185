"""Start-up: the server listens at once; while the model loads and warms up /health says 200, /ready 503, and a
generation request waits for readiness instead of failing (a real `dsv4-serve serve` on 127.0.0.1)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.e2e.conftest import Server

SEND_AT_S = 0.05  # after the server process starts


def test_request_sent_right_after_start_gets_a_completion(start_server: type[Server]) -> None:
    start_server  # noqa: B018 - the fixture skips where the engine is not importable
    t0 = time.monotonic()
    srv = Server()
    # The client retries refused connections (as the openai SDK does): the interpreter itself takes a few
    # tens of ms to start before the server's first line runs and binds the port.
    client = httpx.Client(transport=httpx.HTTPTransport(retries=6), timeout=120)
    probes: list[tuple[str, int]] = []
    result: dict[str, httpx.Response] = {}
    try:
        time.sleep(max(0.0, SEND_AT_S - (time.monotonic() - t0)))
        sent = time.monotonic() - t0

        def complete() -> None:
            body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
            result["r"] = client.post(f"{srv.url}/v1/completions", json=body)

        worker = threading.Thread(target=complete, daemon=True)
        worker.start()
        while worker.is_alive():
            for path in ("/health", "/ready"):
                try:
                    probes.append((path, httpx.get(f"{srv.url}{path}", timeout=5).status_code))
                except httpx.ConnectError:
                    pass
            time.sleep(0.02)
        worker.join(120)
        r = result["r"]
        assert r.status_code == 200, (r.status_code, r.text, srv.log_tail())
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
        # The request was in while the server was not ready yet: /ready said 503 while it waited.
        assert ("/ready", 503) in probes, (sent, probes[:5])
        assert {code for path, code in probes if path == "/health"} == {200}
    finally:
        client.close()
        assert srv.stop() == 0, srv.log_tail()
