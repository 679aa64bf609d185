"""Time to first token of a conversation's second turn, with the prefix cache's hit against a cold prompt.

Turn 1: --tokens random prompt ids (streamed completion, --output-len tokens, greedy, ignore_eos). Turn 2:
the ids turn 1 left in the cache (read back from GET /v1/state/{id}: its prompt + the generated ids it
fed) + --tail new ids. Cold: another random prompt of turn 2's length on the same server (a miss), or, with
--cold-server-args, the same turn-2 prompt on a second server (cache off). Each TTFT is
the first streamed token's arrival; the figure is cold / warm (the issue's H200 point: >= 10x at 16K,
43 layers, release precision). Starts its own server unless --url is given.

    python bench/prefix_turn.py --server-args "--model DIR --max-model-len 32768" \\
        [--cold-server-args "--model DIR --max-model-len 32768 --prefix-cache-gib 0"] \\
        [--tokens 16384] [--output-len 32] [--tail 64] [--repeats 2] [--out prefix_turn.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import provenance  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402


def ttft(url: str, prompt: list[int], out_len: int) -> dict:
    body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, rid, use = None, None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - t0
            use = chunk.get("usage") or use
    cached = ((use or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"id": rid, "ttft_s": first, "e2e_s": time.perf_counter() - t0, "prompt": len(prompt), "cached": cached}


def state_tokens(url: str, rid: str) -> list[int] | None:
    r = httpx.get(f"{url}/v1/state/{rid}", timeout=600)
    if r.status_code != 200:
        return None
    magic = b"DSV4-STATE\n"
    (n,) = struct.unpack_from("<I", r.content, len(magic))
    return json.loads(r.content[len(magic) + 4 : len(magic) + 4 + n])["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None, help="a running server; default: start one")
    ap.add_argument("--server-args", default="", help="args for the server we start (--model ...)")
    ap.add_argument("--cold-server-args", default="",
                    help="the cold arm on its own server (e.g. the same args + --prefix-cache-gib 0), started after "
                    "the first one stops, fed the same turn-2 prompts; default: a fresh prompt on the same "
                    "server")  # fmt: skip
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--tokens", type=int, default=16384, help="turn 1's prompt length")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--tail", type=int, default=64, help="turn 2's new ids")
    ap.add_argument("--repeats", type=int, default=2, help="conversations (each: turn 1, turn 2, a cold prompt)")
    ap.add_argument("--vocab", type=int, default=None, help="ids drawn below this (default 30000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefix_turn.json"))
    opt = ap.parse_args()
    proc, url = None, opt.url
    if url is None:
        port = free_port()
        proc, url = start_server(port, opt.server_args.split(), opt.ready_timeout), f"http://127.0.0.1:{port}"
    rng = random.Random(opt.seed)
    hi = opt.vocab or 30000

    def ids(n: int) -> list[int]:
        return [rng.randrange(min(1000, hi // 2), hi) for _ in range(n)]

    runs = []
    try:
        for _ in range(opt.repeats):
            t1 = ttft(url, ids(opt.tokens), opt.output_len)
            base = state_tokens(url, t1["id"]) if t1["id"] else None
            second = (base or []) + ids(opt.tail)
            t2 = ttft(url, second, opt.output_len)
            cold = None if opt.cold_server_args else ttft(url, ids(len(second)), opt.output_len)
            runs.append({"turn1": t1, "turn2": t2, "cold": cold, "second_prompt": second})
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    if opt.cold_server_args:  # the same turn-2 prompts on a server started with these args (cache off)
        port = free_port()
        proc = start_server(port, opt.cold_server_args.split(), opt.ready_timeout)
        try:
            for run in runs:
                run["cold"] = ttft(f"http://127.0.0.1:{port}", run["second_prompt"], opt.output_len)
        finally:
            proc.terminate()
            proc.wait(120)
    for run in runs:
        t1, t2, cold = run["turn1"], run["turn2"], run.pop("cold")
        run["cold"], run["speedup"] = cold, cold["ttft_s"] / t2["ttft_s"]
        del run["second_prompt"]
        print(f"turn 1 {t1['ttft_s']:.2f} s | turn 2 {t2['ttft_s']:.3f} s (cached {t2['cached']} of "
              f"{t2['prompt']}) | cold {cold['ttft_s']:.2f} s | {run['speedup']:.1f}x", flush=True)
    meta = {"bench": "prefix_turn", "args": vars(opt), "date": time.strftime("%Y-%m-%d %H:%M:%S")} | provenance()
    out = {"meta": meta, "results": runs}
    Path(opt.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {opt.out}")


if __name__ == "__main__":
    main()
