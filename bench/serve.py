"""Serving load test with `vllm bench serve` semantics, against a dsv4-serve on 127.0.0.1.

Fixed input/output lengths (random token ids), ignore_eos, temperature 0, streamed completions with
usage; concurrency sweep (default 1, 2, 4, 8, 16) with warm-up requests at each concurrency (prompts of their
own) and at least 10 x concurrency prompts per cell; each cell's requests carry a cache_salt of their own, so no
measured prompt is a prefix-cache hit (up to 2026-12-07 the warm-ups were the first measured prompts, which made
the first wave's TTFT a hit's, and the fixed prompts repeated across cells). TTFT = first chunk with non-empty
choices - send time; ITL = gaps between chunks; TPOT = (latency - TTFT) / (output tokens - 1); E2E = latency.
A greedy correctness check rides along: 8 fixed prompts open every cell and must give the same greedy token ids
(vLLM's return_tokens_as_token_ids: dummy weights stream no text) alone at concurrency 1 as batched in every other
cell (`greedy_c1_equals` in the JSON's meta, printed at the end). Bounded in count and time. Starts its own
server unless --url is given. Per cell
it also reads the server's engine-thread host time a step from /metrics (`dsv4_engine_host_seconds`:
build, encode, sample, wait; the parallel prefill; the rest of each iteration), to set the service against
bench/step.py's build / encode split.

    python bench/serve.py --out bench-serve.json [--concurrency 1,2,4,8,16] [--input-len 32 --output-len 64]
        [--plot serve.png] [--url http://host:8000] [--long-prompt 16384 --long-delay 1]

`--request-rate R` sends the prompts as Poisson arrivals at R requests/s (vLLM's flag; each then waits for a free
slot of the concurrency), for TTFT with arrivals spread over time; every cell also reports the median TTFT of its
first wave (the first `concurrency` requests: a burst when the rate is inf, the default).
`--long-prompt N` sends one N-token prompt into each cell and splits the streams' ITL by its prefill (issue 30's
"7 streams keep streaming while a 16K prompt prefills": `--concurrency 7 --output-len 512 --long-prompt 16384`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import plot_serve, provenance  # noqa: E402
from bench.server_metrics import engine_host, host_ms_per_step, pacing, prefill_split, scrape, ttft_split  # noqa: E402

STARTUP_LINES = ("warm-up took", "decode graph")  # printed once ready: the warm-up after the weights, the graphs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str], timeout: float = 120, python_args: Sequence[str] = (),
                 log: str | os.PathLike | None = None) -> subprocess.Popen:  # fmt: skip
    """`dsv4-serve serve` on 127.0.0.1:port with `extra` flags (and the interpreter's `python_args`, e.g. a
    profiler), returned once /ready says 200; its log (stderr) goes to `log` (default: a temporary file), and its
    start-up's lines are printed (the model's build, the warm-up, each decode graph's capture)."""
    cmd = [sys.executable, *python_args, "-m", "dsv4_serve.service", "serve", "--host", "127.0.0.1",
           "--port", str(port), *extra]  # fmt: skip
    log = Path(log) if log is not None else Path(tempfile.mkstemp(prefix="dsv4-serve-", suffix=".log")[1])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"))  # a file: never fills
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                print(f"server ready in {time.time() - deadline + timeout:.1f} s (log: {log})", flush=True)
                for line in log.read_text(errors="replace").splitlines():
                    if any(k in line for k in STARTUP_LINES):
                        print("  " + line[-200:], flush=True)
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not ready within {timeout} s")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int,
              salt: str | None = None, ids: bool = False) -> dict:  # fmt: skip
    """One streamed greedy completion; `ids`: its token ids too (vLLM's return_tokens_as_token_ids on the sampled
    tokens' logprobs: a server without a tokenizer, dummy weights, streams no text to compare)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": out_len, "logprobs": 0 if ids else None, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
        **({"cache_salt": salt} if salt else {}), **({"return_tokens_as_token_ids": True} if ids else {}),
    }
    t0 = time.perf_counter()
    ttft, stamps, text, usage, got = None, [], [], None, []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    now = time.perf_counter()
                    ttft = ttft if ttft is not None else now - t0
                    stamps.append(now)
                    text.append(chunk["choices"][0].get("text", ""))
                    got += (chunk["choices"][0].get("logprobs") or {}).get("tokens") or []
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    latency = time.perf_counter() - t0
    n = (usage or {}).get("completion_tokens", len(stamps))
    return {
        "ok": True, "ttft": ttft or latency, "latency": latency, "output_tokens": n,
        "input_tokens": (usage or {}).get("prompt_tokens", len(prompt)),
        "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)], "stamps": stamps, "text": "".join(text),
        **({"ids": [int(t.removeprefix("token_id:")) for t in got]} if ids else {}),
    }


async def cell(url, model, prompts, out_len, concurrency, warmups, time_limit, long_prompt=None,
               long_delay=1.0, rate=math.inf, seed=0, salt=None, ids=0) -> tuple[dict, list[dict]]:  # fmt: skip
    """The cell's prompts at `concurrency`; with `long_prompt`, one more request of it (1 output token) sent
    `long_delay` s in, whose prefill the streams' ITL is then split by (`interference`). `rate` (requests/s, as
    vLLM's --request-rate): the prompts arrive as a Poisson process at that rate, each then waiting for a free
    slot of `concurrency`; inf: all at once (the first `concurrency` are a burst). `warmups`: prompts sent first,
    not measured (their own, so no measured prompt is a prefix-cache hit of one); `salt`: every request's
    cache_salt (a cell's own, so no prompt hits what an earlier cell cached); the first `ids` prompts' results carry
    their token ids."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(one(client, url, model, p, out_len, salt) for p in warmups))

        async def guarded(p, at: float, want: bool):
            await asyncio.sleep(at)
            async with sem:
                return await one(client, url, model, p, out_len, salt, want)

        async def long_request() -> tuple[float, float, dict]:
            await asyncio.sleep(long_delay)
            sent = time.perf_counter()
            r = await one(client, url, model, long_prompt, 1, salt)
            return sent, time.perf_counter(), r

        t0 = time.perf_counter()
        long_task = asyncio.create_task(long_request()) if long_prompt else None
        results = await asyncio.wait_for(asyncio.gather(*(guarded(p, at, i < ids) for i, (p, at) in
                                                          enumerate(zip(prompts, arrivals, strict=True)))),
                                         time_limit)  # fmt: skip
        duration = time.perf_counter() - t0
        window = await long_task if long_task else None
    summary = summarize(results, duration, concurrency)
    first = [r["ttft"] for r in results[:concurrency] if r["ok"]]  # the first wave: a burst when rate is inf
    summary |= {"request_rate": rate if math.isfinite(rate) else "inf",
                "median_ttft_first_wave_ms": statistics.median(first) * 1e3 if first else 0.0}
    if window:
        sent, done, long = window
        summary |= interference(results, sent, done, len(long_prompt), long)
    return summary, results


def interference(results: list[dict], sent: float, done: float, n: int, long: dict) -> dict:
    """The streams' inter-token gaps that end while the long prompt is in the server (sent .. its one token)
    against the rest: a chunked prefill's cost to the running streams."""
    during, outside = [], []
    for r in results:
        if r["ok"]:
            for gap, end in zip(r["itl"], r["stamps"][1:], strict=False):
                (during if sent <= end <= done else outside).append(gap)
    base = statistics.median(outside) if outside else 0.0
    return {"long_prompt": n, "long_prompt_ok": long["ok"], "long_prompt_s": done - sent,
            "itl_during_long": len(during), "itl_outside_long": len(outside), "median_itl_outside_ms": base * 1e3,
            "p99_itl_during_ms": pct(during, 99) * 1e3, "median_itl_during_ms": pct(during, 50) * 1e3,
            "itl_p99_during_over_median_outside": pct(during, 99) / base if base and during else None}  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[dict], duration: float, concurrency: int) -> dict:
    ok = [r for r in results if r["ok"]]
    out = {"concurrency": concurrency, "duration": duration, "completed": len(ok), "failed": len(results) - len(ok)}
    out["total_input_tokens"] = sum(r["input_tokens"] for r in ok)
    out["total_output_tokens"] = sum(r["output_tokens"] for r in ok)
    out["request_throughput"] = len(ok) / duration
    out["output_throughput"] = out["total_output_tokens"] / duration
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration
    series = {
        "ttft": [r["ttft"] for r in ok],
        "tpot": [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1],
        "itl": [x for r in ok for x in r["itl"]],
        "e2el": [r["latency"] for r in ok],
    }
    for name, xs in series.items():
        out[f"mean_{name}_ms"] = statistics.fmean(xs) * 1e3 if xs else 0.0
        out[f"median_{name}_ms"] = statistics.median(xs) * 1e3 if xs else 0.0
        for q in (90, 99):
            out[f"p{q}_{name}_ms"] = pct(xs, q) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None, help="a running server; default: start one (embedded tiny model)")
    ap.add_argument("--model", default=None, help="served model id (default: the first of /v1/models)")
    ap.add_argument("--server-args", default="", help="extra args for the server we start")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-concurrency", type=int, default=10)
    ap.add_argument("--max-prompts", type=int, default=160)
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="tokens of one more prompt sent into each cell (its ITL split by its prefill; 0: none)")
    ap.add_argument("--long-delay", type=float, default=1.0, help="seconds into the cell to send it")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s, Poisson arrivals (vLLM's --request-rate), each waiting for a free slot of the "
                    "concurrency; default inf: all at once")
    ap.add_argument("--time-limit", type=float, default=600, help="seconds per cell")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "serve.json"))
    ap.add_argument("--plot", metavar="PNG", help="also draw tokens/s and latency against concurrency")
    opt = ap.parse_args()
    proc = None
    url = opt.url
    if url is None:
        port = free_port()
        proc = start_server(port, opt.server_args.split(), timeout=900,  # a full-size dummy model builds first
                            log=Path(opt.out).with_suffix(".log"))  # fmt: skip
        url = f"http://127.0.0.1:{port}"
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        model = opt.model or models[0]["id"]
        vocab_hi = 500  # token ids of the tiny vocab; real tokenizers have far more
        rng = random.Random(opt.seed)
        cells, check = [], {}
        for c in (int(x) for x in opt.concurrency.split(",")):
            n = min(opt.max_prompts, max(opt.prompts_per_concurrency * c, c))
            prompts = [[rng.randrange(2, vocab_hi) for _ in range(opt.input_len)] for _ in range(n)]
            warmups = [[rng.randrange(2, vocab_hi) for _ in range(opt.input_len)] for _ in range(min(c, 4))]
            fixed = [[(7 * i + 3 * j) % vocab_hi + 2 for j in range(opt.input_len)] for i in range(8)]
            before = scrape(url)
            long_prompt = [rng.randrange(2, vocab_hi) for _ in range(opt.long_prompt)] or None
            summary, results = asyncio.run(
                cell(url, model, fixed + prompts, opt.output_len, c, warmups, opt.time_limit, long_prompt,
                     opt.long_delay, opt.request_rate, opt.seed, salt=f"bench-serve-{opt.seed}-c{c}",
                     ids=len(fixed))  # fmt: skip
            )
            after = scrape(url)
            summary["engine_host_ms_per_step"] = host_ms_per_step(engine_host(before), engine_host(after))
            summary["ttft_phases_ms"], summary["pacing"] = ttft_split(before, after), pacing(before, after)
            summary["prefill_host_ms_a_prompt"] = prefill_split(before, after)
            check[c] = [r.get("ids") for r in results[:8]]  # the fixed prompts' greedy token ids
            cells.append(summary)
            host = " ".join(f"{k} {v:.2f}" for k, v in summary["engine_host_ms_per_step"].items())
            print(f"concurrency {c}: {summary['output_throughput']:.1f} tok/s, "
                  f"TTFT median {summary['median_ttft_ms']:.1f} / p99 {summary['p99_ttft_ms']:.1f} / first wave "
                  f"{summary['median_ttft_first_wave_ms']:.1f} ms, median TPOT {summary['median_tpot_ms']:.2f} ms, "
                  f"ITL p99 {summary['p99_itl_ms']:.1f} ms; engine host ms a step: {host}", flush=True)
            split = ", ".join(f"{p} {v['median_ms']:.1f} / {v['mean_ms']:.1f}"
                              for p, v in summary["ttft_phases_ms"].items())  # fmt: skip
            split += "; a prompt's host ms: " + ", ".join(f"{p} {v:.1f}"
                                                           for p, v in summary["prefill_host_ms_a_prompt"].items())
            pc = summary["pacing"]
            print(f"  TTFT by phase, median / mean ms: {split}; prefill slices beside a step {pc['slices']:.0f}, "
                  f"{pc['layers_a_slice']:.1f} layers each (step {pc['step_ms']:.1f} ms, "
                  f"target {pc['target_ms']:.1f}, slice {pc['fixed_ms']:.1f} + {pc['layer_ms']:.2f} a layer); "
                  f"graph refreshes {pc['graph_refreshes']:.0f} of {pc['graph_refresh_ms']:.2f} ms, "
                  f"{pc['graph_pool_moves']:.0f} pools moved; kernels built late {pc['kernels_late']:.0f}",
                  flush=True)  # fmt: skip
            if "long_prompt" in summary:
                print(f"  with a {opt.long_prompt}-token prompt ({summary['long_prompt_s']:.2f} s): ITL p99 during "
                      f"{summary['p99_itl_during_ms']:.1f} ms over {summary['itl_during_long']} gaps, median "
                      f"outside {summary['median_itl_outside_ms']:.1f} ms", flush=True)  # fmt: skip
        same: dict[str, bool] = {}  # the same 8 fixed prompts open every cell: alone at one stream, batched at more
        if 1 in check and all(check[1]):  # (compared by their ids: dummy weights stream no text)
            same = {str(c): check[1] == ids for c, ids in check.items() if c != 1}
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # a finding, not a reason to lose the cells' figures
                print("the server did not exit within 30 s of SIGTERM: killed", flush=True)
                proc.kill()
                proc.wait(10)
    base = next((c["output_throughput"] for c in cells if c["concurrency"] == 1), None)
    meta = {
        "model": model, "input_len": opt.input_len, "output_len": opt.output_len,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "greedy_c1_equals": same, "greedy_c1_equals_c8": same.get("8"),
    } | provenance()
    try:
        import mlx.core as mx

        meta["mlx"] = mx.__version__
    except ImportError:
        pass
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": cells}, indent=1))
    print(json.dumps(meta))
    if opt.plot:
        plot_serve(cells, meta, opt.plot)
    print(f"{'conc':>4} {'req/s':>6} {'out tok/s':>9} {'x c=1':>6} {'TTFT med':>8} {'TPOT med':>8} "
          f"{'ITL p99':>8} {'E2E med':>8} {'failed':>6}")
    for c in cells:
        ratio = c["output_throughput"] / base if base else float("nan")
        print(f"{c['concurrency']:>4} {c['request_throughput']:>6.2f} {c['output_throughput']:>9.1f} {ratio:>6.2f} "
              f"{c['median_ttft_ms']:>8.1f} {c['median_tpot_ms']:>8.2f} {c['p99_itl_ms']:>8.2f} "
              f"{c['median_e2el_ms']:>8.1f} {c['failed']:>6}")


if __name__ == "__main__":
    main()
