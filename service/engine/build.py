"""build_engine: the model (embedded tiny, a checkpoint, random weights (`--load-format dummy`), or this rank's
shard of any), its tokenizer and the Engine around it. Runs on the engine thread, where every MLX call happens."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from dsv4_serve.service.engine.engine import Engine
from dsv4_serve.service.engine.follower import LeaderEngine

log = logging.getLogger("dsv4.engine")
P = ParamSpec("P")
R = TypeVar("R")


def distributed_group() -> Any:
    """This process' mx.distributed group (rank 0 of `serve --distributed`); called on the engine thread."""
    import mlx.core as mx

    return mx.distributed.init()


def all_ranks_started(build: Callable[P, R]) -> Callable[P, R]:
    """`build` (its signature kept); on a group of > 1 ranks (its `group`) every rank then learns whether all ranks
    started (`agree_started`), so that no rank waits forever on one that failed."""

    @functools.wraps(build)
    def built_on_every_rank(*args: P.args, **kwargs: P.kwargs) -> R:
        group: Any = kwargs.get("group")
        if group is None or group.size() <= 1:
            return build(*args, **kwargs)
        try:
            out = build(*args, **kwargs)
        except Exception:
            agree_started(group, failed=True)
            raise
        agree_started(group, failed=False)
        return out

    return built_on_every_rank


def agree_started(group: Any, *, failed: bool) -> None:
    """One all_sum of the ranks' start-up outcomes, taken by every rank once its engine is built or has failed:
    a rank whose peers failed raises naming them (else a follower would wait for a plan rank 0 never sends, or
    rank 0 for a follower that is gone); a rank that failed goes on to raise its own error."""
    import mlx.core as mx
    import numpy as np

    flags = np.zeros(group.size(), np.int32)
    flags[group.rank()] = int(failed)
    summed = np.array(mx.distributed.all_sum(mx.array(flags), group=group))
    others = [str(r) for r, f in enumerate(summed) if f and r != group.rank()]
    if others and not failed:
        raise RuntimeError(f"rank {', '.join(others)} cannot start (its log has the reason): rank {group.rank()} "
                           "stops too")


@all_ranks_started
def build_engine(
    model_dir: str | None,
    *,
    max_rows: int = 8,
    max_model_len: int | None = None,
    state_budget_bytes: int | None = None,
    group: object | None = None,
    dequantize: bool = False,
    load_format: str = "auto",
    experts: int | None = None,
    layers: int | None = None,
    prefill_chunk: int | None = None,
    prefix_cache_bytes: int | None = None,
    prefix_interval: int = 128,
    speculative: int = 0,
    decode_graphs: str = "off",
    graph_cache_dir: Path | None = None,
):
    """(Engine, tokenizer or None). No model_dir: the embedded tiny model and tokenizer. load_format
    'dummy': random weights for model_dir, a preset or a config.json (model/dummy.py), cut to
    `experts` / `layers`; its tokenizer is the config directory's tokenizer.json, the tiny one for
    the tiny preset, else none (token-id prompts only).

    group: an mx.distributed group of > 1 ranks: this rank's shard of the model (model/distributed.py);
    rank 0 gets a LeaderEngine (service/engine/follower.py), the others a plain Engine for `follow()`;
    prefill_chunk (the worker's prompt tokens a step) sizes the leader's plan messages. speculative: drafts a step
    with the MTP block (0: off, and a checkpoint's MTP block is not loaded)."""
    from dsv4_serve.model.loader import load_model
    from dsv4_serve.model.tiny import tiny_model
    from dsv4_serve.model.tokenizer import load_tokenizer

    sharded = group is not None and group.size() > 1  # type: ignore[attr-defined]
    if load_format == "dummy":
        model, tokenizer = _dummy(model_dir or "", experts, layers, group if sharded else None, dequantize)
    elif model_dir is None:
        model, _args, tokenizer = tiny_model()
        if sharded:
            from dsv4_serve.model.distributed import shard_model

            shard_model(model, group)
    else:
        if sharded:
            from dsv4_serve.model.distributed import load_sharded

            model, _args = load_sharded(model_dir, group, quantize=not dequantize)
        else:
            # Release FP8/FP4 weights stay quantized (mxfp8 / mxfp4) unless asked to decode them.
            model, _args = load_model(model_dir, quantize=not dequantize, mtp=bool(speculative))
        tokenizer = load_tokenizer(model_dir)
    kw = {"max_rows": max_rows, "max_model_len": max_model_len, "state_budget_bytes": state_budget_bytes,
          "prefix_cache_bytes": 0 if sharded else prefix_cache_bytes, "prefix_interval": prefix_interval}
    if speculative:
        kw["speculative"] = speculative
    if sharded and group.rank() == 0:  # type: ignore[attr-defined]
        from dsv4_serve.model.deepseek_v4 import PREFILL_CHUNK

        return LeaderEngine(model, group, prefill_cap=prefill_chunk or PREFILL_CHUNK, **kw), tokenizer
    if not sharded:  # a shard's step has all_sums between its launches: the MLX step on every rank
        kw.update(decode_graphs=decode_graphs, graph_cache_dir=graph_cache_dir)
    return Engine(model, **kw), tokenizer


def _dummy(spec: str, experts: int | None, layers: int | None, group: object | None, dequantize: bool):
    import time
    from pathlib import Path

    import mlx.core as mx

    from dsv4_serve.model.dummy import PRESETS, dummy_model, resolve_args
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer, load_tokenizer

    args = resolve_args(spec, experts=experts, layers=layers)
    t0 = time.perf_counter()
    model = dummy_model(args, quantize=not dequantize, group=group)
    log.info("dummy weights for %s (%d layers, %d routed experts) in %.1f s: %.2f GiB", spec,
             args.num_hidden_layers, args.n_routed_experts, time.perf_counter() - t0, mx.get_active_memory() / 2**30)
    if spec == "tiny":
        return model, build_tiny_tokenizer(args.vocab_size)
    path = None if spec in PRESETS else Path(spec).expanduser()
    tokenizer = load_tokenizer(path if path.is_dir() else path.parent) if path is not None else None
    if tokenizer is None:
        log.info("no tokenizer.json for %s: prompts must be token ids (/v1/completions)", spec)
    return model, tokenizer
