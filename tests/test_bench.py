"""The benchmark scripts' `--plot`: bench/serve.py end to end on the tiny model (its own server on 127.0.0.1),
and the step / kernels plots from result rows in the scripts' JSON layout. A PNG of the expected size."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from bench.common import plot_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


@pytest.mark.slow
def test_serve_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [sys.executable, "bench/serve.py", "--concurrency", "1,2", "--input-len", "4", "--output-len", "4",
           "--prompts-per-concurrency", "1", "--max-prompts", "2", "--out", str(out), "--plot", str(png)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cells = json.loads(out.read_text())["results"]
    assert [c["concurrency"] for c in cells] == [1, 2]
    assert all(c["failed"] == 0 and c["completed"] > 0 and c["output_throughput"] > 0 for c in cells)
    assert png_size(png) == (1200, 480)  # figsize 10 x 4 in at 120 dpi
    # the 8 fixed prompts' greedy token ids alone (one stream) and two at a time: the same
    assert json.loads(out.read_text())["meta"]["greedy_c1_equals"] == {"2": True}


@pytest.mark.slow
def test_serve_splits_itl_by_a_long_prompt(tmp_path: Path) -> None:
    """--long-prompt: one more prompt sent into the cell; the streams' gaps split by its time in the server."""
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "bench/serve.py", "--concurrency", "2", "--input-len", "4", "--output-len", "24",
           "--prompts-per-concurrency", "1", "--max-prompts", "2", "--long-prompt", "150", "--long-delay", "0.2",
           "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (c,) = json.loads(out.read_text())["results"]
    assert c["long_prompt"] == 150 and c["long_prompt_ok"] and c["long_prompt_s"] > 0
    assert c["itl_during_long"] + c["itl_outside_long"] > 0 and c["failed"] == 0


def test_step_plot(tmp_path: Path) -> None:
    meta = {"device": "Device(gpu, 0)", "git": "89b3f14", "date": "2026-11-30 13:30:16"}
    step = [{"layers": 43, "experts": 32, "context": 4096, "rows": rows, "arm": arm, "ms_per_step": ms,
             "floor_ms": floor} for rows, arm, ms, floor in
            [(1, "fast", 4.47, 1.567), (1, "reference", 15.57, 1.567), (8, "fast", 8.47, 3.721),
             (8, "reference", 23.21, 3.721)]]  # fmt: skip
    assert png_size(plot_step(step, meta, tmp_path / "step.png")) == (600, 480)


@pytest.mark.slow
def test_spec_decode_forced_drafts_keep_the_plain_tokens(tmp_path: Path) -> None:
    """bench/spec_decode.py on the tiny model: with drafts forced right (acceptance 1.0) and forced wrong half the
    time, through both verify forms (the prefill forward, a chained step), each arm's greedy tokens are the plain
    engine's, every forced-right draft is accepted."""
    out = tmp_path / "spec.json"
    cmd = [sys.executable, "bench/spec_decode.py", "--tiny", "--prompt", "8", "--tokens", "10", "--ks", "2",
           "--accept", "1.0,0.5", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cells = json.loads(out.read_text())["results"]
    assert [(c["arm"], c.get("verify")) for c in cells] == [("plain", None)] + [("spec", "forward")] * 2 + \
        [("spec", "rows")] * 2 and all(c["exact"] for c in cells)  # fmt: skip
    for c in cells[1:]:  # the same forced drafts: the same acceptance in both verify forms
        assert (c["accepted_per_draft"] == 1.0) == (c["accept_forced"] == 1.0) and c["ms_per_verify"] > 0


def test_trace_stats_parts_busy_from_idle_and_names_the_longest_gaps() -> None:
    """bench/common.py's CUPTI figures from a hand-made trace of 2 steps: kernels A 0-10 us, B 5-20 (overlapping A),
    a memset 120-130, then C 1,130-1,150 (a 1 ms wait for the host before it); busy 20 + 10 + 20 = 50 us, span
    1,150 us, idle 1,100 us, the longest gap before C, one gap over 100 us; the API time by name."""
    from bench.common import trace_stats

    trace = [{"ph": "X", "cat": "kernel", "name": "A", "ts": 0, "dur": 10},
             {"ph": "X", "cat": "kernel", "name": "B", "ts": 5, "dur": 15},
             {"ph": "X", "cat": "gpu_memset", "name": "M", "ts": 120, "dur": 10},
             {"ph": "X", "cat": "kernel", "name": "C", "ts": 1130, "dur": 20},
             {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 4},
             {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 100, "dur": 6}]  # fmt: skip
    got = trace_stats(trace, steps=2)
    assert got["kernels_per_step"] == 2.0
    assert got["gpu_busy_ms_per_step"] == pytest.approx(0.025)
    assert got["gpu_span_ms_per_step"] == pytest.approx(0.575)
    assert got["gpu_idle_ms_per_step"] == pytest.approx(0.55)
    assert got["gaps_over_100us_per_step"] == 0.5
    assert got["longest_gaps_ms"] == [["C", 1.0], ["M", 0.1]]
    assert got["api_top"] == [["cudaGraphLaunch", 0.005]]
