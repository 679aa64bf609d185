"""kernels/graph/nvrtc.py `daemon_map`, the NVRTC builds' threads (the graphs' prebuild, MLX's kernel cache):
results in order, the first error raised on the caller's thread, and a process that exits while items are
still queued exits at once (an executor's workers ran every queued item first: a graph server stopped during a
cold start lived on for minutes)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsv4_serve.kernels.graph.nvrtc import daemon_map

ROOT = Path(__file__).resolve().parents[2]


def test_results_come_back_in_the_items_order_from_several_threads() -> None:
    seen: set[str] = set()

    def fn(x: int) -> int:
        seen.add(threading.current_thread().name)
        time.sleep(0.01 * (x % 3))
        return x * x

    assert daemon_map(fn, list(range(20)), workers=4) == [x * x for x in range(20)]
    assert len(seen) > 1 and all(n.startswith("dsv4-build-") for n in seen)
    assert daemon_map(fn, [], workers=4) == []


def test_the_first_error_is_raised_and_the_rest_is_not_started() -> None:
    ran: list[int] = []

    def fn(x: int) -> int:
        ran.append(x)
        if x == 2:
            raise ValueError("unit 2 refused")
        return x

    with pytest.raises(ValueError, match="unit 2 refused"):
        daemon_map(fn, list(range(50)), workers=1)
    assert ran == [0, 1, 2]


def test_a_process_exits_without_running_the_queued_items() -> None:
    code = (
        "import threading, time\n"
        "from dsv4_serve.kernels.graph.nvrtc import daemon_map\n"
        "threading.Thread(target=daemon_map, args=(lambda x: time.sleep(1), list(range(60)), 2), daemon=True).start()\n"
        "time.sleep(0.2)\n"
        "print('main done', flush=True)\n"
    )  # 60 items of 1 s in 2 threads: 30 s if the exit waited for them
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "main done" in out.stdout, out.stderr
    assert time.perf_counter() - t0 < 10
