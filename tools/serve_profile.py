"""Where the service's time goes beside the engine's: the engine alone against the same load over HTTP.

`engine` arm: a real EngineWorker, `--streams` greedy streams read by in-process consumers that do nothing
with the events (the engine's own rate, its bridge included). `http` arm: `dsv4-serve serve` in a subprocess,
`bench/serve.py --url` against it at the same concurrency. Each arm reports output tokens/s and the engine
thread's host ms a step by phase (`worker.stats()` / `/metrics`): build, encode, sample, wait, prefill, loop.
With `--profile`, the http arm's server runs under cProfile (its main thread: the event loop; the engine
thread is not profiled) and the event loop's CPU time a generated token is printed by area (detokenizing,
the choice objects, JSON + SSE framing, the ASGI / socket writes, asyncio's machinery); profiling slows the
loop, so its tokens/s is not a figure. Arms alternate `--reps` times (the host is shared).

    python tools/serve_profile.py [--streams 8] [--output-len 128] [--reps 2] [--profile] [--out profile.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import provenance  # noqa: E402
from bench.serve import engine_host, free_port, host_ms_per_step, start_server  # noqa: E402

PHASES = ("build", "encode", "sample", "wait", "prefill", "loop")
# Event-loop areas by the file a function lives in (first match wins; the rest is "other").
AREAS = (
    ("detokenize", ("api/chat.py", "tokenizers")),
    ("choices", ("api/streaming.py", "api/tools.py")),
    ("sse_json", ("api/fanout.py", "json/")),
    ("asgi_writes", ("starlette/", "uvicorn/", "h11/", "httptools", "fastapi/", "api/limits.py", "api/auth.py")),
    ("bridge", ("engine/streams.py", "engine/worker.py")),
    ("asyncio", ("asyncio/", "selectors.py")),
)


async def _consume(w, i: int, n: int) -> int:
    from dsv4_serve.service.engine.request import SamplingParams

    got = 0
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    async for ev in await w.submit([(7 * i + 3 * j) % 500 + 2 for j in range(32)], params):
        got += ev.token_id is not None
    return got


def engine_arm(streams: int, out_len: int, rounds: int) -> dict:
    """The engine's rate with consumers that do nothing: `rounds` waves of `streams` requests."""
    from dsv4_serve.service.engine.build import build_engine
    from dsv4_serve.service.engine.worker import EngineWorker

    w = EngineWorker(lambda: build_engine(None), max_rows=8)
    w.start()

    async def run() -> tuple[int, float, dict, dict]:
        assert await w.wait_ready(120), w.start_error
        await asyncio.gather(*(_consume(w, i, 8) for i in range(streams)))  # warm-up
        s0, t0 = w.stats(), time.perf_counter()
        n = 0
        for _ in range(rounds):
            n += sum(await asyncio.gather(*(_consume(w, i, out_len) for i in range(streams))))
        return n, time.perf_counter() - t0, s0, w.stats()

    try:
        n, dt, s0, s1 = asyncio.run(run())
    finally:
        w.stop()
    steps = s1["steps_total"] - s0["steps_total"]
    ms = {k: 1e3 * (v - s0["host_seconds_total"].get(k, 0.0)) / steps for k, v in s1["host_seconds_total"].items()}
    ms["prefill"] = 1e3 * (s1["prefill_seconds_total"] - s0["prefill_seconds_total"]) / steps
    ms["loop"] = 1e3 * (s1["engine_loop_seconds_total"] - s0["engine_loop_seconds_total"]) / steps
    ms["step"] = 1e3 * (s1["step_seconds_total"] - s0["step_seconds_total"]) / steps
    return {"arm": "engine", "tokens_per_s": n / dt, "tokens": n, "engine_host_ms_per_step": ms}


def areas(stats_file: str, tokens: int) -> dict[str, float]:
    """The profiled thread's own time (tottime) a generated token, in microseconds, by area."""
    st = pstats.Stats(stats_file)
    out = dict.fromkeys([a for a, _ in AREAS] + ["other"], 0.0)
    for (file, _line, _fn), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        area = next((a for a, keys in AREAS if any(k in file for k in keys)), "other")
        if file == "~":  # a builtin: charge it to its callers' area would need the call graph; keep it apart
            area = "builtins"
            out.setdefault(area, 0.0)
        out[area] += tt
    return {k: round(v / tokens * 1e6, 1) for k, v in out.items()}


def http_arm(streams: int, out_len: int, prompts: int, profile: bool, server_args: list[str]) -> dict:
    port, prof = free_port(), tempfile.mktemp(suffix=".prof")
    pre = ["-m", "cProfile", "-o", prof] if profile else []
    proc = start_server(port, server_args, timeout=180, python_args=pre)
    url = f"http://127.0.0.1:{port}"
    try:
        out = tempfile.mktemp(suffix=".json")
        before = engine_host(url)
        subprocess.run([sys.executable, "bench/serve.py", "--url", url, "--concurrency", str(streams),
                        "--output-len", str(out_len), "--prompts-per-concurrency", str(prompts), "--out", out],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        after = engine_host(url)
        cell = json.loads(Path(out).read_text())["results"][0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    ms = host_ms_per_step(before, after)
    steps = after[0] - before[0]
    res = {"arm": "http_profiled" if profile else "http", "tokens_per_s": cell["output_throughput"],
           "median_tpot_ms": cell["median_tpot_ms"], "median_ttft_ms": cell["median_ttft_ms"],
           "p99_itl_ms": cell["p99_itl_ms"], "steps": steps, "engine_host_ms_per_step": ms}  # fmt: skip
    if profile:
        # Every token the server generated (warm-ups included) went through TextStream.push once.
        st = pstats.Stats(prof)
        tokens = sum(v[1] for (f, _l, fn), v in st.stats.items()  # type: ignore[attr-defined]
                     if f.endswith("api/chat.py") and fn == "push" and 150 < _l < 200)  # fmt: skip
        res["loop_tokens"] = tokens
        res["loop_us_per_token"] = areas(prof, max(tokens, 1))
        res["loop_us_per_token_total"] = round(sum(res["loop_us_per_token"].values()), 1)
        res["top"] = [(f"{Path(f).name}:{fn}", round(v[2] / max(tokens, 1) * 1e6, 2))
                      for (f, _l, fn), v in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:25]]  # type: ignore[attr-defined]
        res["profile_file"] = prof
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-concurrency", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arms", default="engine,http")
    ap.add_argument("--profile", action="store_true", help="one more http arm under cProfile")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--out", default=None)
    opt = ap.parse_args()
    results = []
    for _ in range(opt.reps):
        for arm in opt.arms.split(","):
            if arm == "engine":
                r = engine_arm(opt.streams, opt.output_len, opt.prompts_per_concurrency)
            else:
                r = http_arm(opt.streams, opt.output_len, opt.prompts_per_concurrency, False, opt.server_args.split())
            results.append(r)
            print(json.dumps(r), flush=True)
    if opt.profile:
        r = http_arm(opt.streams, opt.output_len, opt.prompts_per_concurrency, True, opt.server_args.split())
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
    meta = {"streams": opt.streams, "output_len": opt.output_len, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpus": os.cpu_count()} | provenance()  # fmt: skip
    if opt.out:
        Path(opt.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
