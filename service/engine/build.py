"""build_engine: the model (embedded tiny, a checkpoint, or this rank's shard of either), its tokenizer and
the Engine around it. Runs on the engine thread, where every MLX call happens."""

from __future__ import annotations

from typing import Any

from service.engine.engine import Engine
from service.engine.follower import LeaderEngine


def distributed_group() -> Any:
    """This process' mx.distributed group (rank 0 of `serve --distributed`); called on the engine thread."""
    import mlx.core as mx

    return mx.distributed.init()


def build_engine(
    model_dir: str | None,
    *,
    max_rows: int = 8,
    max_model_len: int | None = None,
    state_budget_bytes: int | None = None,
    group: object | None = None,
    dequantize: bool = False,
    prefix_cache_bytes: int | None = None,
    prefix_interval: int = 128,
):
    """(Engine, tokenizer or None). No model_dir: the embedded tiny model and tokenizer.

    group: an mx.distributed group of > 1 ranks: this rank's shard of the model (model/distributed.py);
    rank 0 gets a LeaderEngine (service/engine/follower.py), the others a plain Engine for `follow()`."""
    from model.loader import load_model, tiny_model
    from model.tokenizer import load_tokenizer

    sharded = group is not None and group.size() > 1  # type: ignore[attr-defined]
    if model_dir is None:
        model, _args, tokenizer = tiny_model()
        if sharded:
            from model.distributed import shard_model

            shard_model(model, group)
    else:
        if sharded:
            from model.distributed import load_sharded

            model, _args = load_sharded(model_dir, group, quantize=not dequantize)
        else:
            # Release FP8/FP4 weights stay quantized (mxfp8 / mxfp4) unless asked to decode them.
            model, _args = load_model(model_dir, quantize=not dequantize)
        tokenizer = load_tokenizer(model_dir)
    kw = {"max_rows": max_rows, "max_model_len": max_model_len, "state_budget_bytes": state_budget_bytes,
          "prefix_cache_bytes": 0 if sharded else prefix_cache_bytes, "prefix_interval": prefix_interval}
    if sharded and group.rank() == 0:  # type: ignore[attr-defined]
        return LeaderEngine(model, group, **kw), tokenizer
    return Engine(model, **kw), tokenizer
