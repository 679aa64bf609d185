"""Per-token grammar mask cost at 8 rows vs. a CPU tiny-model decode step (issue 33: pick the engine).

Measures, on this host: the tiny model's 8-row `Engine.step` (+ eval), and for 8 rows each walking a JSON
schema grammar (random allowed tokens): llguidance (consume + parallel mask fill) and xgrammar (accept +
fill), plus applying the packed mask to [8, V] logits in MLX (sampler.apply_masks). Prints one table.

    python bench/grammar_mask.py [--steps 200] [--xgrammar]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def med_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def tiny_step(steps: int) -> float:
    from service.engine.engine import build_engine

    engine, _tok = build_engine(None, max_rows=8, max_model_len=1024)
    engine.warmup()
    handles = [engine.admit(steps + 8) for _ in range(8)]
    ts = []
    for p in range(steps):
        t0 = time.perf_counter()
        mx.eval(engine.step([(h, 5, p) for h in handles]))
        ts.append(time.perf_counter() - t0)
    return med_us(ts[10:])


def llg_masks(tok, vocab: int, steps: int) -> tuple[float, float]:
    """(median us per 8-row mask step via service.engine.grammar, median us of the MLX apply)."""
    from service.engine.grammar import Guides, json_grammar
    from service.engine.request import Request, SamplingParams
    from service.engine.sampler import apply_masks

    guides = Guides(tok, vocab, eos_token_id=1)
    rng = np.random.default_rng(0)
    spec = json_grammar(SCHEMA)
    reqs = [Request(f"r{i}", [0], SamplingParams(guide=spec)) for i in range(8)]
    logits = mx.random.normal((8, vocab))
    mx.eval(logits)
    ts, ta = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        masks = guides.masks(reqs)
        ts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx.eval(apply_masks(logits, masks))
        ta.append(time.perf_counter() - t0)
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, r in enumerate(reqs):
            allowed = np.flatnonzero(bits[i])
            t = int(rng.choice(allowed))
            if t == 1:  # EOS: the object is done; start over
                reqs[i] = Request(r.request_id + "x", [0], r.params)
            else:
                r.output_ids.append(t)
    return med_us(ts), med_us(ta)


def xgr_masks(tok, vocab: int, steps: int) -> float:
    import xgrammar as xgr

    enc = [tok.id_to_token(i) for i in range(vocab)]
    info = xgr.TokenizerInfo(enc, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    ms = [xgr.GrammarMatcher(compiled) for _ in range(8)]
    bm = xgr.allocate_token_bitmask(8, vocab)
    rng = np.random.default_rng(0)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bm, i)
        ts.append(time.perf_counter() - t0)
        bits = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, m in enumerate(ms):
            t = int(rng.choice(np.flatnonzero(bits[i])))
            if t == 1 or m.is_terminated():
                m.reset()
            else:
                t1 = time.perf_counter()
                m.accept_token(t)
                ts[-1] += time.perf_counter() - t1
    return med_us(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--xgrammar", action="store_true", help="also measure xgrammar (imports torch)")
    a = ap.parse_args()
    from model.tokenizer import build_tiny_tokenizer

    step = tiny_step(a.steps)
    print(f"tiny model, 8-row decode step (CPU): {step:9.1f} us")
    tok = build_tiny_tokenizer(512)
    m, ap_ = llg_masks(tok, 512, a.steps)
    print(f"llguidance: 8-row consume + mask      {m:9.1f} us  ({100 * m / step:.2f}% of a step)")
    print(f"MLX apply of the packed mask [8, 512] {ap_:9.1f} us  ({100 * ap_ / step:.2f}% of a step)")
    if a.xgrammar:
        x = xgr_masks(tok, 512, a.steps)
        print(f"xgrammar:  8-row accept + mask        {x:9.1f} us  ({100 * x / step:.2f}% of a step)")


if __name__ == "__main__":
    main()
