"""Probe (GPU): the tiny model's greedy tokens, token-serial decode vs parallel prefill + decode, with the
in-place compressor and with the functional CUDA one. Prints each arm's tokens (all four must agree).

    PYTHONPATH=/tmp/mlxsite:$PWD python3 tests/kernels/inplace_model.py [--diverge | --strides]

`--diverge`: after each token-serial step, the state / pool arrays that differ between the two compressors.
`--strides`: the state arrays' strides as created and after a slot reset (is any input copied by MLX?).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402

from dsv4_serve.kernels import backend  # noqa: E402
from dsv4_serve.model.state import StatePools  # noqa: E402
from dsv4_serve.model.tiny import tiny_model  # noqa: E402


def functional(*args, after=None, workspace=None, **kw):
    """The functional CUDA compressor (kernel + pool scatter, new arrays) in the in-place op's shape (its calls
    return no token, so `after` is always None; it has no scratch, so `workspace` goes unused)."""
    import dsv4_serve.kernels.cuda as kc

    assert after is None, "functional: the functional op does not wait for an in-place write"
    return (*kc.compressor_rows_cuda(*args, **kw), None)


def run(model, args, prompt: list[int], prefill: bool, n: int = 6, settle: bool = False) -> list[int]:
    pools = StatePools(args, max_slots=1, max_positions=128, page_size=64, dtype=model.dtype)
    h = pools.alloc(len(prompt) + n)
    if settle:  # the slot's reset (a lazy slice update) evaluated before the first in-place step
        mx.eval(pools.arrays())
    if prefill:
        model.prefill(pools, h, prompt[:-1], 0, logits=False)
        logits = model.decode(pools, [h], [prompt[-1]], [len(prompt) - 1])
    else:
        for i, t in enumerate(prompt):
            logits = model.decode(pools, [h], [t], [i])
    out = []
    for i in range(n):
        if i:
            logits = model.decode(pools, [h], [out[-1]], [len(prompt) + i - 1])
        out.append(int(mx.argmax(logits[0]).item()))
    return out


def diverge(model, args, prompt: list[int]) -> None:
    """Token-serial steps with the in-place and with the functional compressor: after each step, every
    state / pool array that differs between the two (max abs difference, the rows that differ)."""
    import numpy as np

    import dsv4_serve.model.attention as att

    snaps: dict[bool, list[dict[str, np.ndarray]]] = {}
    default = att.INPLACE_COMPRESSOR
    for inplace in (False, True):
        att.INPLACE_COMPRESSOR = inplace
        pools = StatePools(args, max_slots=1, max_positions=128, page_size=64, dtype=model.dtype)
        h = pools.alloc(len(prompt) + 2)
        snaps[inplace] = []
        for i, t in enumerate(prompt):
            model.decode(pools, [h], [t], [i])
            named = {f"{k}[{layer}]": a for k in ("comp_kv", "comp_score", "idx_kv", "idx_score", "ckv", "ikeys")
                     for layer, a in getattr(pools, k).items()}  # fmt: skip
            named |= {f"window[{j}]": a for j, a in enumerate(pools.window)}
            snaps[inplace].append({k: np.array(a.astype(mx.float32)) for k, a in named.items()})
    att.INPLACE_COMPRESSOR = default
    for i, (a, b) in enumerate(zip(snaps[False], snaps[True], strict=True)):
        for k in a:
            x, y = a[k], b[k]
            both = np.isfinite(x) == np.isfinite(y)
            d = np.where(both & np.isfinite(x), np.abs(x - y), 0).max()
            if d > 0 or not both.all():
                rows = sorted({tuple(ix[:-1]) for ix in np.argwhere((np.abs(np.nan_to_num(x - y)) > 0) | ~both)})[:6]
                print(f"step {i} (pos {i}): {k} differs, max {d:.3g}, at {rows}", flush=True)


def strides(args) -> None:
    """Each state array's strides (memoryview: MLX's own) after creation and after a slot's reset: a
    non-row-contiguous input is copied by MLX for a custom kernel, and in-place writes land in the copy."""
    pools = StatePools(args, max_slots=1, max_positions=128, page_size=64, dtype=mx.float32)
    for when in ("created", "after alloc (slot reset)"):
        if when != "created":
            pools.alloc(16)
            mx.eval(pools.arrays())
        for k in ("comp_kv", "comp_score", "idx_kv", "idx_score", "ckv", "ikeys"):
            for layer, a in getattr(pools, k).items():
                print(f"{when}: {k}[{layer}] shape {a.shape} strides {memoryview(a).strides}", flush=True)


def main() -> None:
    model, args, _ = tiny_model(seed=0)
    if "--strides" in sys.argv:
        strides(args)
        return
    if "--diverge" in sys.argv:
        diverge(model, args, [3, 4, 5, 6, 7, 8, 9, 10, 11])
        return
    print(mx.default_device(), backend.name(), args.compress_ratios)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    import dsv4_serve.model.attention as att

    att.INPLACE_COMPRESSOR = True
    res = {}
    for arm in ("inplace", "functional"):
        if arm == "functional":
            backend.register("compressor_rows_inplace", functional)
        for prefill, settle in ((False, False), (False, True), (True, False)):
            res[(arm, prefill, settle)] = run(model, args, prompt, prefill, settle=settle)
            print(arm, "prefill" if prefill else "serial ", "settled" if settle else "", res[(arm, prefill, settle)],
                  flush=True)  # fmt: skip
    print("all equal:", len(set(map(tuple, res.values()))) == 1)


if __name__ == "__main__":
    main()
