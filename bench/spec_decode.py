"""One user's decode with MTP speculation, drafts forced (issue 61's bench arm): tokens/s of the plain engine
against speculation at k = 1..3 with drafts forced to the target's own greedy tokens (acceptance 1.0, the upper
bound) or each rejected with probability 1 - a (seeded), since random weights accept about 1 draft in 70 and real
weights cannot be had here. Every arm must give the plain engine's greedy tokens (`exact`).

The engines run as the service runs them (service/engine/stepping.py's `iterate` over a Scheduler, the MLX step);
a request's decode time is from its first token to its last, and `ms_per_verify` is that time over its verify
steps (an iteration: verify, sampling, rollback, the MTP drafts). `--verify` picks the verify's forms (docs/mtp.md):
`forward` (the parallel prefill's forward) and `rows` (one decode step with the positions as chained rows; on
CUDA it sets DSV4_CHAINED_ROWS=1, opt-in there), each a cell. `--graph` adds the plain engine with
`--decode-graphs on` (a GPU; last, since it turns the recorder and the glue kernels on for the process): the step
issue 61 measures the verify against.

    python3 bench/spec_decode.py --experts 32 --prompt 4096 --tokens 64 --ks 1,2,3 --accept 1.0,0.7 --graph \
        --verify forward,rows  # GPU
    python bench/spec_decode.py --tiny --prompt 32 --tokens 24                                            # anywhere
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.common import provenance  # noqa: E402
from dsv4_serve.kernels import chained  # noqa: E402
from dsv4_serve.model import speculative  # noqa: E402
from dsv4_serve.service.engine.engine import Engine  # noqa: E402
from dsv4_serve.service.engine.request import Request, SamplingParams  # noqa: E402
from dsv4_serve.service.engine.sampler import sample_lazy  # noqa: E402
from dsv4_serve.service.engine.scheduler import Scheduler  # noqa: E402
from dsv4_serve.service.engine.speculator import Speculator  # noqa: E402
from dsv4_serve.service.engine.stepping import iterate  # noqa: E402


class Forced(Speculator):
    """Drafts the target's next k greedy tokens, each kept right with probability `accept` until the first wrong
    one (from there on wrong: the verify rejects it and the rest)."""

    def __init__(self, k: int, want: list[int], accept: float, seed: int, vocab: int) -> None:
        super().__init__(k, 8)
        self.want, self.accept, self.rng, self.vocab = want, accept, random.Random(seed), vocab

    def propose(self, request: Request, tokens: list[int]) -> list[int]:
        n, out, right = len(request.output_ids), [], True
        for j in range(self.k):
            t = self.want[n + j] if n + j < len(self.want) else 0
            right = right and self.rng.random() < self.accept
            out.append(t if right else (t + 1) % self.vocab)
        return out


def decode(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """One greedy request through the scheduler: (its tokens, seconds from its first token to its last)."""
    sched = Scheduler(engine, max_rows=engine.max_rows, max_queue=4, eos_token_id=engine.eos_token_id,
                      max_model_len=engine.max_model_len)  # fmt: skip
    sched.add(Request("r", list(prompt), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
    got, stamps = [], []
    while sched.has_work():
        out, _, _ = iterate(engine, sched, sample_lazy, 2048, lambda: None)
        now = time.perf_counter()
        for e in out.events:
            if e.token_id is not None:
                got.append(e.token_id)
                stamps.append(now)
    return got, (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model instead of V4-Flash's dims")
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens (the context the decode starts at)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--accept", default="1.0,0.7", help="probability a draft is forced right (per draft)")
    ap.add_argument("--graph", action="store_true", help="also the plain engine with --decode-graphs on (a GPU)")
    ap.add_argument("--verify", default="forward,rows", help="the verify's forms, a cell each: forward, rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "spec_decode.json"))
    opt = ap.parse_args()
    if opt.tiny:
        from dsv4_serve.model.tiny import tiny_model

        model = tiny_model()[0]
    else:
        from bench.step import flash_args, random_model

        model = random_model(flash_args(opt.layers, opt.experts))
    vocab = model.args.vocab_size
    rng = random.Random(opt.seed)
    prompt = [rng.randrange(3, min(vocab, 500)) for _ in range(opt.prompt)]
    length = opt.prompt + opt.tokens + 16

    def engine(**kw) -> Engine:  # noqa: ANN003
        e = Engine(model, max_rows=8, max_model_len=length, prefix_cache_bytes=0, **kw)
        e.warmup()
        return e

    cells = []
    plain = engine()
    want, sec = decode(plain, prompt, opt.tokens)
    base = (len(want) - 1) / sec
    cells.append({"arm": "plain", "k": 0, "tok_s": base, "x_plain": 1.0, "exact": True})
    print(f"plain: {base:.1f} tok/s ({len(want)} tokens)", flush=True)
    del plain
    for form, k, a in itertools.product(opt.verify.split(","), (int(x) for x in opt.ks.split(",")),
                                        [float(x) for x in opt.accept.split(",")]):  # fmt: skip
        speculative.VERIFY_ROWS = form == "rows"
        if form == "rows":
            os.environ[chained.ENV] = "1"
        spec = engine(speculative=k)
        spec.speculator = Forced(k, want, a, opt.seed, vocab)
        got, sec = decode(spec, prompt, opt.tokens)
        s = spec.speculator
        cell = {"arm": "spec", "verify": form, "k": k, "accept_forced": a, "tok_s": (len(got) - 1) / sec,
                "x_plain": (len(got) - 1) / sec / base, "exact": got == want,
                "accepted_per_draft": s.accepted / s.drafted if s.drafted else 0.0, "verifies": s.verifies,
                "ms_per_verify": 1e3 * sec / max(1, s.verifies)}  # fmt: skip
        cells.append(cell)
        print(f"{form} k {k}, drafts right with p {a}: {cell['tok_s']:.1f} tok/s ({cell['x_plain']:.2f}x plain), "
              f"{cell['ms_per_verify']:.1f} ms a verify, accepted {cell['accepted_per_draft']:.2f} a draft, "
              f"exact {cell['exact']}", flush=True)  # fmt: skip
        del spec
    speculative.VERIFY_ROWS = None
    if opt.graph:
        g = engine(decode_graphs="on")
        got, sec = decode(g, prompt, opt.tokens)
        cells.append({"arm": "graph", "k": 0, "tok_s": (len(got) - 1) / sec, "x_plain": (len(got) - 1) / sec / base,
                      "exact": got == want})  # fmt: skip
        print(f"plain, graphs on: {cells[-1]['tok_s']:.1f} tok/s, exact {cells[-1]['exact']}", flush=True)
    meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "tiny": opt.tiny, "prompt": opt.prompt,
            "tokens": opt.tokens, "date": time.strftime("%Y-%m-%d %H:%M:%S")} | provenance()  # fmt: skip
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": cells}, indent=1))
    return 0 if all(c["exact"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
