"""Parameter counts of a config without allocating weights: MLX arrays stay lazy until evaluated."""

from __future__ import annotations

from mlx.utils import tree_flatten

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.deepseek_v4 import DeepseekV4


def parameter_counts(args: ModelArgs) -> dict[str, int]:
    """total: every weight of the main model (tid2eid tables are integer lookups, not parameters; the MTP
    block is counted apart, as the published totals leave it out); active: what one token touches, i.e. all
    but the unselected routed experts and all but one embedding row; mtp: the MTP block's weights."""
    every = [(k, v.size) for k, v in tree_flatten(DeepseekV4(args).parameters()) if "tid2eid" not in k]
    params = [(k, n) for k, n in every if not k.startswith("mtp.")]
    total = sum(n for _, n in params)
    experts = sum(n for k, n in params if ".ffn.experts." in k)
    embed = args.vocab_size * args.hidden_size
    active = total - experts + experts * args.num_experts_per_tok // args.n_routed_experts - embed + args.hidden_size
    mtp = sum(n for k, n in every if k.startswith("mtp."))
    return {"total": total, "active": active, "routed_experts": experts, "embedding": embed, "mtp": mtp}


def flash_args() -> ModelArgs:
    return ModelArgs()  # the defaults are V4-Flash's config.json


def pro_args() -> ModelArgs:
    """V4-Pro's config.json values (spec section 1)."""
    return ModelArgs(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
        n_routed_experts=384, moe_intermediate_size=3072, index_topk=1024, routed_scaling_factor=2.5,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4],
    )
