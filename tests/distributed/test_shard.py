"""Sharding without a second process: slices, the sharded loader's reads, and the 1-rank no-op."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dsv4_serve.model.loader as loader
from dsv4_serve.model.checkpoint import write_checkpoint
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.distributed import ShardedMoE, check_shardable, load_sharded, shard_model
from dsv4_serve.model.loader import load_model
from dsv4_serve.model.tiny import tiny_model


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


@pytest.mark.parametrize("quantize", [False, True])
def test_load_sharded_reads_only_its_heads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantize: bool) -> None:
    """Dims whose head slices fall on whole FP8 scale blocks (128 rows): a rank reads only its rows of wq_b,
    wo_a and attn_sink (a memory map of their bytes), never the whole tensors; the shard equals the full
    load's slices, mxfp8-packed or decoded."""
    from dataclasses import replace

    from dsv4_serve.model.dummy import dummy_model

    args = replace(ModelArgs.tiny(), num_attention_heads=8, head_dim=64, o_groups=2, o_lora_rank=128,
                   moe_intermediate_size=64)
    write_checkpoint(dummy_model(args, quantize=False), args, tmp_path, dtype="release")
    full, _ = load_model(tmp_path, dtype=mx.float32, quantize=quantize)
    whole: list[str] = []
    by_rows: list[tuple[tuple[int, ...], int, int]] = []
    orig_get, orig_rows = loader._Reader.get, loader.read_rows
    monkeypatch.setattr(loader._Reader, "get", lambda self, name: whole.append(name) or orig_get(self, name))
    monkeypatch.setattr(loader, "read_rows", lambda info, lo, hi: by_rows.append((info.shape, lo, hi))
                        or orig_rows(info, lo, hi))
    for rank in (0, 1):
        whole.clear()
        by_rows.clear()
        shard, _ = load_sharded(tmp_path, FakeGroup(rank, 2), dtype=mx.float32, quantize=quantize)
        for layer in range(args.num_hidden_layers):
            for t in ("wq_b", "wo_a"):
                assert f"layers.{layer}.attn.{t}.weight" not in whole
            assert f"layers.{layer}.attn.attn_sink" not in whole
        rows = 8 * 64 // 2  # wq_b rows a rank
        assert ((8 * 64, 32), rank * rows, (rank + 1) * rows) in by_rows  # its wq_b rows, nothing else
        assert ((8,), rank * 4, rank * 4 + 4) in by_rows  # its sinks
        ref = dict(tree_flatten(shard_model(load_model(tmp_path, dtype=mx.float32, quantize=quantize)[0],
                                            FakeGroup(rank, 2)).parameters()))
        got = dict(tree_flatten(shard.parameters()))
        assert got.keys() == ref.keys()
        for name, p in got.items():
            assert p.dtype == ref[name].dtype and np.array_equal(np.array(p), np.array(ref[name])), name
    del full
