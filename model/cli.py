"""`dsv4-serve make-tiny` and `dsv4-serve generate` (dispatched here by service/__main__.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from dsv4_serve.model.checkpoint import write_checkpoint
from dsv4_serve.model.loader import load_model
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.model.tokenizer import load_tokenizer


def make_tiny_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="dsv4-serve make-tiny",
                                description="write the embedded tiny random model + tokenizer to DIR")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "release"), default="float32",
                   help="release: FP8 e4m3 / FP4 e2m1 + UE8M0 scales as the official checkpoint")
    p.add_argument("--shards", type=int, default=1)
    a = p.parse_args(list(argv))
    model, args, tok = tiny_model(a.seed)
    out = write_checkpoint(model, args, a.dir, dtype=a.dtype, shards=a.shards, tokenizer=tok)
    print(f"wrote tiny model (seed {a.seed}, {a.dtype}) to {out}")
    return 0


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"dsv4-serve generate: --prompt-ids must be comma-separated integers, got {text!r}") from None


def generate(model, args, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """Prefill then decode one row; greedy at temperature 0, else sampled from a seeded NumPy RNG."""
    pools = StatePools(args, max_slots=1, max_positions=len(prompt) + max_tokens, page_size=16, dtype=model.dtype)
    handle = pools.alloc(len(prompt) + max_tokens)
    rng = np.random.default_rng(seed)
    logits = model.prefill(pools, handle, prompt, 0)
    out: list[int] = []
    pos = len(prompt)
    while True:
        x = np.array(logits.astype(mx.float32), dtype=np.float64)
        if temperature <= 0:
            tok = int(np.argmax(x))
        else:
            z = (x - x.max()) / temperature
            probs = np.exp(z) / np.exp(z).sum()
            tok = int(rng.choice(len(probs), p=probs))
        out.append(tok)
        if len(out) >= max_tokens or tok == args.eos_token_id:
            break
        logits = model.decode(pools, [handle], [tok], [pos])[0]
        pos += 1
    pools.free(handle)
    return out


def generate_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="dsv4-serve generate", description="generate from a prompt, no server")
    p.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 0,5,17")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", action="store_true", help="keep FP8/FP4 weights as MLX mxfp8/mxfp4")
    a = p.parse_args(list(argv))
    if a.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if a.model:
        try:
            # MLX's CPU gather_mm (routed experts) is float32 only: decode bf16/FP8 checkpoints in f32 there.
            cpu = mx.default_device() == mx.cpu
            model, args = load_model(a.model, dtype=mx.float32 if cpu else None, quantize=a.quantize)
        except ValueError as e:
            print(f"dsv4-serve generate: cannot load {a.model}: {e}", file=sys.stderr)
            return 2
        tok = load_tokenizer(a.model)
    else:
        model, args, tok = tiny_model()
    if a.prompt is not None:
        if tok is None:
            print(f"dsv4-serve generate: {a.model} has no tokenizer.json; use --prompt-ids", file=sys.stderr)
            return 2
        prompt = tok.encode(a.prompt).ids
    else:
        prompt = _ids(a.prompt_ids)
    if not prompt:
        p.error("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < args.vocab_size]
    if bad:
        p.error(f"prompt ids {bad[:5]} are outside the vocabulary 0..{args.vocab_size - 1}")
    if len(prompt) + a.max_tokens > args.max_position_embeddings:
        p.error(f"prompt + max tokens ({len(prompt) + a.max_tokens}) exceed {args.max_position_embeddings}")
    ids = generate(model, args, prompt, a.max_tokens, a.temperature, a.seed)
    result: dict[str, object] = {"ids": ids}
    if tok is not None:
        result["text"] = tok.decode(ids, skip_special_tokens=True)  # as the server: no EOS text (it is in ids)
    print(json.dumps(result, ensure_ascii=False), flush=True)
    return 0
