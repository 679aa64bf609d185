"""Per-token grammar mask cost at 8 rows vs. a CPU tiny-model decode step (issue 33: pick the engine).

Measures, on this host: the tiny model's 8-row `Engine.step` (+ eval), and for 8 rows each walking a JSON
schema grammar (random allowed tokens): the service's xgrammar masks (`grammar.Guides.masks`: accept +
fill) and, with --llguidance, llguidance's (consume + parallel fill), plus applying the packed mask to
[8, V] logits in MLX (`sampler.apply_masks`). Prints one table.

    python tools/grammar_mask.py [--steps 200] [--llguidance] [--regex PATTERN ...]

--regex: one row walking each pattern (random allowed tokens, none with an 'x', which ends the test patterns):
its accept + mask time at tokens 10, 50, 100 and 200 (issue 63: an ambiguous repeat's grows with every token;
service/api/patterns.py refuses those, docs/http.md has the figures).
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
    from dsv4_serve.service.engine.engine import build_engine

    engine, _tok = build_engine(None, max_rows=8, max_model_len=1024)
    engine.warmup()
    handles = [engine.admit(steps + 8) for _ in range(8)]
    ts = []
    for p in range(steps):
        t0 = time.perf_counter()
        mx.eval(engine.step([(h, 5, p) for h in handles]))
        ts.append(time.perf_counter() - t0)
    return med_us(ts[10:])


def xgr_masks(tok, vocab: int, steps: int) -> tuple[float, float]:
    """(median us of service.engine.grammar.Guides.masks for 8 rows, median us of sampler.apply_masks)."""
    from dsv4_serve.service.engine import grammar
    from dsv4_serve.service.engine.request import Request, SamplingParams
    from dsv4_serve.service.engine.sampler import apply_masks

    guide = grammar.compile_guide(tok, vocab, 1, grammar.json_format(SCHEMA), "bench")
    guides = grammar.Guides(vocab, eos_token_id=1)
    rng = np.random.default_rng(0)
    reqs = [Request(f"r{i}", [0], SamplingParams(guide=guide)) for i in range(8)]
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
        for i, r in enumerate(reqs):
            t = int(rng.choice(grammar.tokens_allowed(masks, i, vocab)))
            if t == 1:  # EOS: the object is done; start over
                reqs[i] = Request(r.request_id + "x", [0], r.params)
            else:
                r.output_ids.append(t)
    return med_us(ts), med_us(ta)


def llg_masks(tok, vocab: int, steps: int) -> float:
    """llguidance (not a dependency: pip install llguidance), 8 matchers, parallel fill + consume."""
    import llguidance as llg
    import llguidance.numpy as lln

    lt = llg.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=1)
    g = llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})
    ms = [llg.LLMatcher(lt, g, log_level=0) for _ in range(8)]
    bm, ex = lln.allocate_token_bitmask(8, vocab), llg.LLExecutor()
    rng = np.random.default_rng(0)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], bm)
        dt = time.perf_counter() - t0
        bits = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, m in enumerate(ms):
            t = int(rng.choice(np.flatnonzero(bits[i])))
            t1 = time.perf_counter()
            if t == 1 or m.is_stopped():
                ms[i] = llg.LLMatcher(lt, g, log_level=0)
            else:
                m.consume_token(t)
            dt += time.perf_counter() - t1
        ts.append(dt)
    return med_us(ts)


def regex_growth(tok, vocab: int, pattern: str, steps: int) -> dict[int, float]:
    """token index -> ms of one row's accept + mask there, walking `pattern` (stops at 8 s in all)."""
    import xgrammar as xgr

    from dsv4_serve.service.engine import grammar

    g = grammar.compile_guide(tok, vocab, 1, grammar.regex_format(pattern), "guided_regex")
    m, out = xgr.GrammarMatcher(g.grammar), np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    rng, ts = np.random.default_rng(0), []
    while len(ts) < steps and sum(ts) < 8:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(out, 0)
        allowed = grammar.tokens_allowed(out, 0, vocab)
        ok = [int(t) for t in allowed if t != 1 and "x" not in (tok.id_to_token(int(t)) or "x")]
        if not ok or not m.accept_token(int(rng.choice(ok))):
            break
        ts.append(time.perf_counter() - t0)
    return {i: ts[i - 1] * 1e3 for i in (10, 50, 100, 200) if i <= len(ts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--llguidance", action="store_true", help="also measure llguidance (if installed)")
    ap.add_argument("--regex", nargs="*", default=[], help="mask cost growth of these patterns (one row)")
    a = ap.parse_args()
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer

    if a.regex:
        tok = build_tiny_tokenizer(512)
        for p in a.regex:
            got = regex_growth(tok, 512, p, 200)
            print(f"{p!r:40} " + "  ".join(f"token {i}: {ms:.2f} ms" for i, ms in got.items()))
        return

    step = tiny_step(a.steps)
    print(f"tiny model, 8-row decode step (CPU): {step:9.1f} us")
    tok = build_tiny_tokenizer(512)
    m, ap_ = xgr_masks(tok, 512, a.steps)
    print(f"xgrammar: 8-row accept + mask         {m:9.1f} us  ({100 * m / step:.2f}% of a step)")
    print(f"MLX apply of the packed mask [8, 512] {ap_:9.1f} us  ({100 * ap_ / step:.2f}% of a step)")
    if a.llguidance:
        x = llg_masks(tok, 512, a.steps)
        print(f"llguidance: 8-row consume + mask      {x:9.1f} us  ({100 * x / step:.2f}% of a step)")


if __name__ == "__main__":
    main()
