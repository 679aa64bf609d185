"""Greedy tokens of a served scenario, to compare two servers (`serve --decode-graphs on` against `off`): they
must be equal token for token.

The scenario (fixed prompts, temperature 0, ignore_eos): 8 requests of ~4K-token prompts, two groups of four
sharing a 3,584-token prefix, sent 0.25 s apart with 64..256 output tokens, so rows join and leave a running
batch at every row count; then the same 8 prompts again, all at once, 256 tokens each: prefix-cache hits (their
`cached_tokens` recorded). The token ids come from each stream's logprobs, named "token_id:<id>"
(`return_tokens_as_token_ids`): without it a server with no tokenizer (`--load-format dummy`) names every token "",
and every comparison before 2026-12-07 compared those empty strings. A file whose tokens are not ids, or all one,
compares as a failure.

    python tools/graph_agree.py --server-args "--load-format dummy --model flash --layers 8 --experts 16 \
        --decode-graphs on" --out on.json
    python tools/graph_agree.py --compare on.json off.json      # exit 1 at the first differing token
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import provenance  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402

PREFIX, SUFFIX = 3584, 512


def prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [[rng.randrange(2, vocab) for _ in range(PREFIX)] for _ in range(2)]
    return [shared[i // 4] + [rng.randrange(2, vocab) for _ in range(SUFFIX)] for i in range(8)]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], n: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "stream_options": {"include_usage": True},
            "return_tokens_as_token_ids": True}  # fmt: skip
    tokens: list[str] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                tokens += (c.get("logprobs") or {}).get("tokens") or []
            usage = chunk.get("usage") or usage
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"tokens": tokens, "cached_tokens": cached}


async def scenario(url: str, model: str, ps: list[list[int]]) -> dict:
    async with httpx.AsyncClient() as client:
        lens = [256, 64, 192, 128, 256, 96, 160, 256]
        t0 = time.perf_counter()
        first = await asyncio.gather(*(one(client, url, model, p, n, 0.25 * i)
                                       for i, (p, n) in enumerate(zip(ps, lens, strict=True))))  # fmt: skip
        t1 = time.perf_counter()
        again = await asyncio.gather(*(one(client, url, model, p, 256, 0.0) for p in ps))
        return {"joins_and_leaves": first, "prefix_hits": again, "seconds": [t1 - t0, time.perf_counter() - t1]}


def vacuous(a: dict) -> bool:
    """Tokens that could not tell two outputs apart: none, not ids, or all one id."""
    toks = [t for part in ("joins_and_leaves", "prefix_hits") for r in a[part] for t in r.get("tokens", ())]
    return not toks or not all(t.startswith("token_id:") for t in toks) or len(set(toks)) < 2


def compare(a: dict, b: dict) -> str | None:
    """None if every request's tokens are equal, else where they first differ."""
    if vacuous(a) or vacuous(b):
        return "no token ids to compare (a server without return_tokens_as_token_ids, or one token throughout)"
    for part in ("joins_and_leaves", "prefix_hits"):
        for i, (x, y) in enumerate(zip(a[part], b[part], strict=True)):
            if "error" in x or "error" in y:
                return f"{part} request {i}: {x.get('error') or y.get('error')}"
            tx, ty = x["tokens"], y["tokens"]
            if tx != ty:
                at = next((k for k, (u, v) in enumerate(zip(tx, ty, strict=False)) if u != v), min(len(tx), len(ty)))
                return f"{part} request {i}: token {at} differs ({tx[at:at + 3]} vs {ty[at:at + 3]})"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--url", default=None, help="a running server instead of starting one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="graph_agree.json")
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    opt = ap.parse_args()
    if opt.compare:
        a, b = (json.loads(Path(p).read_text()) for p in opt.compare)
        why = compare(a, b)
        n = sum(len(r.get("tokens", ())) for part in ("joins_and_leaves", "prefix_hits") for r in a[part])
        print(f"{opt.compare[0]} vs {opt.compare[1]}: " + (f"{n} greedy tokens equal" if why is None else why))
        return 0 if why is None else 1
    proc, url = None, opt.url
    if url is None:
        port = free_port()
        proc = start_server(port, opt.server_args.split(), timeout=900, log=Path(opt.out).with_suffix(".log"))
        url = f"http://127.0.0.1:{port}"
    try:
        info = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        vocab = 500  # ids every tokenizer has (the tiny one's 512 too)
        got = asyncio.run(scenario(url, info["id"], prompts(opt.seed, vocab)))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    graph = {ln.split()[0]: float(ln.split()[-1]) for ln in metrics.splitlines()
             if ln.startswith(("dsv4_graph", "dsv4_decode_steps_ahead")) and not ln.startswith("#")}  # fmt: skip
    got["meta"] = {"server_args": opt.server_args, "graph_metrics": graph} | provenance()
    Path(opt.out).write_text(json.dumps(got))
    errors = [r["error"] for part in ("joins_and_leaves", "prefix_hits") for r in got[part] if "error" in r]
    print(f"{opt.out}: {got['seconds'][0]:.1f} + {got['seconds'][1]:.1f} s; cached tokens "
          f"{[r.get('cached_tokens') for r in got['prefix_hits']]}; {graph}; errors {errors[:2]}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
