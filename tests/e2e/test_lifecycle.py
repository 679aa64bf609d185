"""Queue limits and SIGTERM, each on its own server process."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.e2e.conftest import Server
from tests.e2e.test_api import metric

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 900, "ignore_eos": True, "stream": True}


def _hold_stream(srv: Server, started: threading.Event, stop: threading.Event) -> None:
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=LONG, timeout=120) as r:
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_queue_full_gives_429(start_server: type[Server]) -> None:
    srv = start_server("--max-rows", "1", "--max-queue", "1")
    stop = threading.Event()
    running, waiting = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_hold_stream, args=(srv, running, stop), daemon=True)]
    threads[0].start()
    assert running.wait(30)
    threads.append(threading.Thread(target=_hold_stream, args=(srv, waiting, stop), daemon=True))
    threads[1].start()
    deadline = time.monotonic() + 10
    while metric(srv, "dsv4_requests_waiting") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = httpx.post(f"{srv.url}/v1/completions", json={**LONG, "stream": False, "max_tokens": 2})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    stop.set()
    for t in threads:
        t.join(30)
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_sigterm_drains_streams_and_exits_zero(start_server: type[Server]) -> None:
    srv = start_server(env={"DSV4_DRAIN_TIMEOUT": "3"})
    ends: list[str] = []
    errors: list[BaseException] = []
    first = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        try:
            finish = None
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=LONG, timeout=60) as r:
                for line in r.iter_lines():
                    first[i].set()
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])["choices"]
                        finish = (ch[0]["finish_reason"] if ch else None) or finish
            ends.append(finish or "clean close")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in first)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(ends) == 4 and all(e in ("stop", "length", "abort", "clean close") for e in ends), ends
    assert srv.proc.wait(30) == 0, srv.log_tail()
    assert time.monotonic() - t0 < 3 + 10
