"""One rank of the 2-rank test (or the single-process reference when imported): greedy decode of 8 rows.

    mlx.launch -n 2 -- python tests/distributed/run_rank.py OUT.json [CHECKPOINT_DIR]
    mlx.launch -n 2 -- python tests/distributed/run_rank.py OUT.json --engine   # LeaderEngine + follow()
    mlx.launch -n 2 -- python tests/distributed/run_rank.py OUT.json --engine-fail   # the same, then FAIL
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402

from dsv4_serve.model.deepseek_v4 import DeepseekV4  # noqa: E402
from dsv4_serve.model.state import StatePools  # noqa: E402

PROMPT_LENS = (1, 2, 3, 5, 7, 9, 11, 12)
STEPS = 20


def prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j + 3) % 500 + 2 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


def greedy(model: DeepseekV4) -> tuple[list[list[int]], list[list[float]]]:
    """8 rows decoded together: each step every row feeds its next prompt token or its last output.
    Returns the generated ids per row and the last step's logits."""
    pools = StatePools(model.args, max_slots=8, max_positions=64, page_size=4, dtype=model.dtype)
    ps = prompts()
    handles = [pools.alloc(64) for _ in ps]
    out: list[list[int]] = [[] for _ in ps]
    for pos in range(STEPS):
        toks = [p[pos] if pos < len(p) else out[i][-1] for i, p in enumerate(ps)]
        logits = model.decode(pools, handles, toks, [pos] * len(ps))
        best = mx.argmax(logits, axis=-1).tolist()
        for i, p in enumerate(ps):
            if pos >= len(p) - 1:
                out[i].append(int(best[i]))
    return out, logits.tolist()


def engine_greedy(engine) -> list[list[int]]:
    """8 rows through an Engine as the worker drives it: each prompt but its last token prefilled in one
    call (a LeaderEngine splits them into pieces of its prefill_cap), then one host-fed step, then
    pipelined steps: step N + 1 queued with step N's argmax still on the device, N read back after."""
    ps = prompts()
    handles = [engine.admit(64) for _ in ps]
    for h, p in zip(handles, ps, strict=True):
        if len(p) > 1:
            engine.prefill(h, p[:-1], 0)
    feeds = [(h, p[-1], len(p) - 1) for h, p in zip(handles, ps, strict=True)]
    tok = mx.argmax(engine.step(feeds), axis=-1).astype(mx.int32)
    out: list[list[int]] = [[] for _ in ps]
    for n in range(STEPS):
        nxt = None
        if n < STEPS - 1:
            feeds = [(h, None, len(p) + n) for h, p in zip(handles, ps, strict=True)]
            nxt = mx.argmax(engine.step(feeds, tokens=tok), axis=-1).astype(mx.int32)
        for i, t in enumerate(tok.tolist()):
            out[i].append(int(t))
        tok = nxt
    for h in handles:
        engine.release(h)
    return out


def main() -> None:
    from dsv4_serve.model.distributed import shard_model
    from dsv4_serve.model.tiny import tiny_model

    group = mx.distributed.init(strict=True)
    if sys.argv[2:] in (["--engine"], ["--engine-fail"]):  # --engine-fail: rank 0 ends as on a failure
        from dsv4_serve.service.engine.engine import Engine
        from dsv4_serve.service.engine.follower import LeaderEngine, follow

        model, _args, _tok = tiny_model(seed=0, dtype=mx.float32)
        shard_model(model, group)
        if group.rank() == 0:
            engine = LeaderEngine(model, group, prefill_cap=5, max_rows=8, max_model_len=64)
            engine.warmup()
            ids = engine_greedy(engine)
            engine.close(failed=sys.argv[2] == "--engine-fail")
            Path(sys.argv[1]).write_text(json.dumps({"size": group.size(), "ids": ids}))
        else:
            follow(Engine(model, max_rows=8, max_model_len=64), group, prefill_cap=5)
        return
    if len(sys.argv) > 2:  # a checkpoint directory: read only this rank's shard of it
        from dsv4_serve.model.distributed import load_sharded

        model, _args = load_sharded(sys.argv[2], group, dtype=mx.float32)
    else:
        model, _args, _tok = tiny_model(seed=0, dtype=mx.float32)
        shard_model(model, group)
    n_experts = model.layers[0].ffn.experts.w1.shape[0]
    ids, logits = greedy(model)
    if group.rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps({"size": group.size(), "experts": n_experts, "ids": ids,
                                                 "logits": logits}))


if __name__ == "__main__":
    main()
