"""What tokenizing a long prompt costs the streams beside it (CPU, the embedded tiny model).

8 greedy streams run on a real EngineWorker; meanwhile a prompt of --mb MB is tokenized by the API's
path (`service.api.limits.encode`: `encode_batch` in a worker thread) and by its plain twin
(`tokenizer.encode` on the event loop). Reported per arm: the tokenize time, the event loop's
longest tick gap, and the streams' longest gap between tokens against their median.

    python tools/tokenize_stall.py --mb 1 [--reps 3] [--out tokenize_stall.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import provenance  # noqa: E402
from dsv4_serve.service.api.limits import encode  # noqa: E402
from dsv4_serve.service.engine.build import build_engine  # noqa: E402
from dsv4_serve.service.engine.request import SamplingParams  # noqa: E402
from dsv4_serve.service.engine.worker import EngineWorker  # noqa: E402


async def _stream(w: EngineWorker, i: int, n: int, times: list[float]) -> None:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    async for ev in await w.submit([9 + i, 17, 30 + i], params):
        if ev.token_id is not None:
            times.append(time.perf_counter())


async def _ticker(stop: asyncio.Event, ticks: list[float]) -> None:
    while not stop.is_set():
        ticks.append(time.perf_counter())
        await asyncio.sleep(0.001)


async def arm(w: EngineWorker, tok, text: str, off_loop: bool, tokens: int) -> dict[str, float]:
    times: list[list[float]] = [[] for _ in range(8)]
    ticks: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_ticker(stop, ticks))
    streams = [asyncio.create_task(_stream(w, i, tokens, times[i])) for i in range(8)]
    while min(len(t) for t in times) < 10:
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    ids = await encode(tok, text) if off_loop else tok.encode(text, add_special_tokens=False).ids
    t1 = time.perf_counter()
    await asyncio.gather(*streams)
    stop.set()
    await ticker
    worst = 0.0
    for ts in times:
        gaps = [b - a for a, b in zip(ts[1:], ts[2:], strict=False)]
        during = [b - a for a, b in zip(ts, ts[1:], strict=False) if b >= t0 and a <= t1]
        worst = max(worst, max(during, default=0.0) / statistics.median(gaps))
    loop_gap = max((b - a for a, b in zip(ticks, ticks[1:], strict=False) if b >= t0 and a <= t1), default=0.0)
    return {"tokens": len(ids), "tokenize_s": t1 - t0, "loop_max_gap_s": loop_gap, "stream_gap_over_median": worst}


async def main_async(mb: float, tokens: int, reps: int) -> list[dict]:
    engine, tok = build_engine(None, max_rows=8)
    w = EngineWorker(lambda: (engine, tok), max_rows=8)
    w.start()
    assert await w.wait_ready(120), w.start_error
    text = ("The quick brown fox jumps over the lazy dog. " * (int(mb * 2**20) // 45 + 1))[: int(mb * 2**20)]
    rows = []
    try:
        for rep in range(reps):  # the arms alternate: drift hits both alike
            for off_loop in (True, False):
                r = await arm(w, tok, text, off_loop, tokens)
                name = "thread" if off_loop else "loop"  # limits.encode / tokenizer.encode on the loop
                rows.append({"rep": rep, "arm": name, "mb": mb, **{k: round(v, 4) for k, v in r.items()}})
                print(json.dumps(rows[-1]))
    finally:
        await w.drain(0)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=1.0, help="prompt size in MiB")
    p.add_argument("--tokens", type=int, default=150, help="tokens each of the 8 streams generates")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tokenize_stall.json"))
    a = p.parse_args()
    rows = asyncio.run(main_async(a.mb, a.tokens, a.reps))
    meta = {"device": f"cpu ({os.cpu_count()} cores, {platform.machine()})", "date": time.strftime("%F %T"),
            **provenance()}
    Path(a.out).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
