"""Sharding without a second process: slices, the sharded loader's reads, and the 1-rank no-op."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import model.loader as loader
from model.checkpoint import write_checkpoint
from model.distributed import ShardedMoE, check_shardable, load_sharded, shard_model
from model.loader import load_model, tiny_model


@dataclass
class FakeGroup:
    """Rank/size only: loading and slicing run no collective."""

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


def test_shard_model_slices() -> None:
    full, args, _ = tiny_model()
    ref = dict(tree_flatten(full.parameters()))
    model, _, _ = tiny_model()
    shard_model(model, FakeGroup(1, 2))
    got = dict(tree_flatten(model.parameters()))
    e, hd = args.n_routed_experts // 2, args.num_attention_heads // 2 * args.head_dim
    gr, i = args.o_groups // 2 * args.o_lora_rank, args.moe_intermediate_size // 2
    expect = {
        "layers.0.ffn.experts.w1": ref["layers.0.ffn.experts.w1"][e:],
        "layers.2.ffn.experts.w2": ref["layers.2.ffn.experts.w2"][e:],
        "layers.1.attn.wq_b.weight": ref["layers.1.attn.wq_b.weight"][hd:],
        "layers.1.attn.attn_sink": ref["layers.1.attn.attn_sink"][args.num_attention_heads // 2 :],
        "layers.3.attn.wo_a.weight": ref["layers.3.attn.wo_a.weight"][gr:],
        "layers.3.attn.wo_b.weight": ref["layers.3.attn.wo_b.weight"][:, gr:],
        "layers.0.ffn.shared_experts.w1.weight": ref["layers.0.ffn.shared_experts.w1.weight"][i:],
        "layers.0.ffn.shared_experts.w2.weight": ref["layers.0.ffn.shared_experts.w2.weight"][:, i:],
        "layers.1.attn.indexer.wq_b.weight": ref["layers.1.attn.indexer.wq_b.weight"],  # replicated
        "layers.1.attn.wkv.weight": ref["layers.1.attn.wkv.weight"],
        "layers.1.ffn.gate.weight": ref["layers.1.ffn.gate.weight"],
    }
    for name, want in expect.items():
        assert np.array_equal(np.array(got[name]), np.array(want)), name
    attn, ffn = model.layers[0].attn, model.layers[0].ffn
    assert (attn.n_heads, attn.n_groups) == (args.num_attention_heads // 2, args.o_groups // 2)
    assert isinstance(ffn, ShardedMoE) and (ffn.lo, ffn.hi) == (e, 2 * e)


def test_one_rank_is_a_no_op() -> None:
    model, _, _ = tiny_model()
    shard_model(model, FakeGroup(0, 1))
    assert model.layers[0].attn.group is None and not isinstance(model.layers[0].ffn, ShardedMoE)


def test_not_divisible() -> None:
    _, args, _ = tiny_model()
    with pytest.raises(ValueError, match="o_groups"):
        check_shardable(args, 4)


def test_load_sharded_reads_only_local_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, args, tok = tiny_model()
    write_checkpoint(model, args, tmp_path, dtype="release", tokenizer=tok)
    full, _ = load_model(tmp_path, dtype=mx.float32)
    read: list[str] = []
    orig = loader._Reader.get
    monkeypatch.setattr(loader._Reader, "get", lambda self, name: read.append(name) or orig(self, name))
    shard, _ = load_sharded(tmp_path, FakeGroup(0, 2), dtype=mx.float32)
    experts = {int(n.split(".")[4]) for n in read if ".ffn.experts." in n}
    assert experts == set(range(args.n_routed_experts // 2))
    ref = dict(tree_flatten(shard_model(full, FakeGroup(0, 2)).parameters()))
    for name, p in tree_flatten(shard.parameters()):
        assert np.array_equal(np.array(p), np.array(ref[name])), name
