"""Expert-parallel + tensor-parallel decode over an `mx.distributed` group (ring on CPUs, NCCL on GPUs).

Rank r of N keeps:
- routed experts [r*E/N, (r+1)*E/N) of every layer. Routing is computed identically on every rank from the
  replicated router; a rank runs only its own experts' contributions (other picks get weight 0), and the
  shared expert is split by its intermediate dim; both go into ONE all_sum per MoE layer.
- attention output groups [r*G/N, (r+1)*G/N) (groups are contiguous heads, so also those heads): the rows of
  wq_b and the sinks of its heads, its groups' rows of wo_a and the matching input columns of wo_b, whose
  partial output goes into ONE all_sum per attention layer.
- everything else replicated: embed, head, mHC, norms, wq_a, wkv, the compressors and the indexer.

Decode state: K = V is one shared head (MQA), so every head on every rank reads the same window ring and
compressed pages; the per-head work is what is split and each rank keeps the full per-row state (the part
its shard needs is all of it), updated by its replicated compressor/indexer. Pools therefore stay
identical on every rank as long as every rank admits/frees/steps in the same order (service/engine/
follower.py broadcasts that order from rank 0). Logits come out identical everywhere after the all_sums.

`group=None` / a size-1 group: nothing here is called and the model is the single-process one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.deepseek_v4 import DeepseekV4
from dsv4_serve.model.layers import MoE, hc_post
from dsv4_serve.model.loader import Slice, load_model, take

# (axis, lo, hi) of a parameter's full shape that one rank keeps; None: replicated.


class ShardedMoE(MoE):
    """MoE whose experts are the local range [lo, hi) and whose shared expert is one intermediate slice."""

    lo: int
    hi: int
    group: Any

    def __call__(self, x: mx.array, token_ids: mx.array) -> mx.array:
        idx, w = self.gate(x, token_ids)
        mine = (idx >= self.lo) & (idx < self.hi)
        # Non-local picks read local expert 0 with weight 0: fixed shapes, no data-dependent gather.
        local = mx.where(mine, idx - self.lo, 0)
        part = self.experts(x, local, mx.where(mine, w, 0.0)) + self.shared_experts(x)
        return mx.distributed.all_sum(part, group=self.group).astype(x.dtype)

    def post_mixed(self, x: mx.array, token_ids: mx.array, h: mx.array, post: mx.array, comb: mx.array) -> mx.array:
        return hc_post(self(x, token_ids), h, post, comb)  # the all_sum sits between the combine and the post-mix


def check_shardable(args: ModelArgs, n: int) -> None:
    for key, v in (("n_routed_experts", args.n_routed_experts), ("o_groups", args.o_groups),
                   ("moe_intermediate_size", args.moe_intermediate_size)):
        if v % n:
            raise ValueError(f"distributed: config key '{key}' ({v}) is not divisible by {n} ranks")


def shard_slices(args: ModelArgs, rank: int, n: int) -> Callable[[str], Slice | None]:
    """Parameter name (release name; also `.scales` etc. of a quantized module) -> the local slice."""
    check_shardable(args, n)
    e, g, inter = args.n_routed_experts // n, args.o_groups // n, args.moe_intermediate_size // n
    hd = args.num_attention_heads // args.o_groups * args.head_dim  # rows of wq_b per group
    nh = args.num_attention_heads // n
    r = args.o_lora_rank
    rules: list[tuple[re.Pattern[str], Slice]] = [
        (re.compile(r"ffn\.experts\.w[123](_scales)?$"), (0, rank * e, (rank + 1) * e)),
        (re.compile(r"ffn\.shared_experts\.w[13]\.\w+$"), (0, rank * inter, (rank + 1) * inter)),
        (re.compile(r"ffn\.shared_experts\.w2\.\w+$"), (1, rank * inter, (rank + 1) * inter)),
        (re.compile(r"attn\.wq_b\.\w+$"), (0, rank * g * hd, (rank + 1) * g * hd)),
        (re.compile(r"attn\.attn_sink$"), (0, rank * nh, (rank + 1) * nh)),
        (re.compile(r"attn\.wo_a\.\w+$"), (0, rank * g * r, (rank + 1) * g * r)),
        (re.compile(r"attn\.wo_b\.\w+$"), (1, rank * g * r, (rank + 1) * g * r)),
    ]

    def rule(name: str) -> Slice | None:
        if not name.startswith(("layers.", "mtp.")) or ".indexer." in name:  # the MTP block: as a layer
            return None
        for pat, sl in rules:
            if pat.search(name):
                return sl
        return None

    return rule


def _logical(args: ModelArgs, name: str, axis: int) -> int:
    """The unsharded logical size of a sharded parameter's axis."""
    if ".experts." in name and ".shared_" not in name:
        return args.n_routed_experts
    if ".shared_experts." in name:
        return args.moe_intermediate_size
    if name.endswith("attn_sink"):
        return args.num_attention_heads
    if ".wq_b." in name:
        return args.num_attention_heads * args.head_dim
    return args.o_groups * args.o_lora_rank  # wo_a rows, wo_b columns


def mark_sharded(model: DeepseekV4, group: Any) -> None:
    """Set the local counts and the group on the (already sliced) modules."""
    a, n, rank = model.args, group.size(), group.rank()
    e = a.n_routed_experts // n
    for block in model.blocks():
        block.attn.n_heads = a.num_attention_heads // n
        block.attn.n_groups = a.o_groups // n
        block.attn.group = group
        block.ffn.__class__ = ShardedMoE  # same parameters, the sharded __call__
        block.ffn.lo, block.ffn.hi, block.ffn.group = rank * e, (rank + 1) * e, group
    model.reset_compiled()  # sharded blocks run uncompiled (all_sum inside); drop any traced segments


def shard_model(model: DeepseekV4, group: Any) -> DeepseekV4:
    """Slice an in-memory full model (tiny / random weights, identical on every rank) to this rank's shard."""
    if group is None or group.size() == 1:
        return model
    rule = shard_slices(model.args, group.rank(), group.size())
    new = []
    for name, p in tree_flatten(model.parameters()):
        sl = rule(name)
        if sl is not None:
            new.append((name, take(p, sl, _logical(model.args, name, sl[0]))))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    mark_sharded(model, group)
    return model


def load_sharded(model_dir: str | Path, group: Any, **kw: Any) -> tuple[DeepseekV4, ModelArgs]:
    """load_model reading only this rank's experts (per-expert tensors) and head/group slices."""
    if group is None or group.size() == 1:
        return load_model(model_dir, **kw)
    args = ModelArgs.from_file(Path(model_dir) / "config.json")
    model, args = load_model(model_dir, shard=shard_slices(args, group.rank(), group.size()), **kw)
    mark_sharded(model, group)
    return model, args


# ---- rank 0 -> all: the step plan ----------------------------------------------------------------
def broadcast_ints(values: np.ndarray | None, size: int, group: Any) -> np.ndarray:
    """Rank 0's int32[size] to every rank: an all_sum with zeros elsewhere (no broadcast op in MLX)."""
    buf = np.zeros(size, np.int32)
    if values is not None:
        buf[: len(values)] = values
    out = mx.distributed.all_sum(mx.array(buf), group=group)
    return np.array(out)  # evaluates: every rank takes part now, in the same order
