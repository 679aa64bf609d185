"""What a decode step puts in MLX's graph: at <= 8 rows the step is host-bound and every node costs host
time (tools/step_nodes.py counts them per layer part); these pin the structural wins."""

from __future__ import annotations

import collections
import re

import mlx.core as mx
from mlx.utils import tree_flatten

from dsv4_serve.kernels.matmul import weights_as_stored
from dsv4_serve.model.checkpoint import is_f32_compute, is_f32_resident
from dsv4_serve.model.tiny import tiny_model


def graph_nodes(tmp_path, *outs: mx.array) -> collections.Counter:
    path = tmp_path / "g.dot"
    mx.export_to_dot(str(path), *outs)
    return collections.Counter(re.findall(r'\[label ="?([^"\]]*)"?, shape=rectangle', path.read_text()))


def test_bf16_model_keeps_the_f32_multiplied_weights_f32() -> None:
    """The compressors' projections, the router and the head are f32 products in REF: kept f32 (a bf16 step
    then casts none of them: each cast would be a node and a full f32 copy of the weight per step), unless
    the skinny CUDA kernels read them as stored (kernels.matmul.weights_as_stored; never on the CPU)."""
    model, _, _ = tiny_model(dtype=mx.bfloat16)
    kept = [(n, p.dtype) for n, p in tree_flatten(model.parameters()) if is_f32_compute(n)]
    names = [n for n, _ in kept]
    for want in ("attn.compressor.wkv.weight", "ffn.gate.weight", "attn.indexer.compressor.wgate.weight"):
        assert any(n.endswith(want) for n in names), want
    assert "head.weight" in names
    assert all(dt == mx.float32 for _, dt in kept)
    assert model.layers[1].attn.wkv.weight.dtype == mx.bfloat16  # the rest: the model dtype


def test_f32_residency_follows_the_kernel_choice() -> None:
    assert is_f32_resident("head.weight") and not is_f32_resident("head.weight", as_stored=True)
    assert is_f32_resident("layers.0.hc_attn_fn", as_stored=True)  # f32 in the release: always f32
    assert not weights_as_stored()  # the CPU: MLX multiplies, the weights stay f32


def test_compressor_projection_is_the_f32_product_of_the_upcast_weight() -> None:
    """bf16 model: kv / score are the f32 products of x and the upcast bf16 weights (REF), to the bit."""
    model, args, _ = tiny_model(dtype=mx.bfloat16)
    comp = model.layers[1].attn.compressor
    x = mx.random.normal((2, args.hidden_size)).astype(mx.bfloat16)
    cos = mx.ones((2, args.qk_rope_head_dim // 2))
    kv, score, _, _ = comp.project(x, cos, cos)
    assert kv.dtype == mx.float32 and score.dtype == mx.float32
    xf = x.astype(mx.float32)
    assert mx.array_equal(kv, xf @ comp.wkv.weight.astype(mx.float32).T).item()
    assert mx.array_equal(score, xf @ comp.wgate.weight.astype(mx.float32).T).item()


def test_routed_experts_build_no_index_arrays(tmp_path) -> None:
    """gather_mm's default lhs indices are an arange + a cast per call; the model passes constants."""
    model, args, _ = tiny_model()
    for layer in (0, 3):  # a hash-routed and a score-routed layer
        ffn = model.layers[layer].ffn
        x = mx.random.normal((3, args.hidden_size))
        out = ffn(x, mx.array([1, 2, 3], dtype=mx.int32))
        nodes = graph_nodes(tmp_path, out)
        assert nodes["GatherMM"] == 3 and nodes["Arange"] == 0, nodes


def test_rope_is_one_fused_kernel(tmp_path) -> None:
    """The interleaved RoPE, compiled as the model runs it: one fused elementwise kernel and few views
    (it was 18 nodes with the pairs unstacked and restacked; a CSA layer applies it 4 times)."""
    from dsv4_serve.kernels.rope import rope

    q = mx.random.normal((8, 64, 512)).astype(mx.bfloat16)
    ang = mx.random.uniform(-3, 3, (8, 32))
    cos, sin = mx.cos(ang), mx.sin(ang)
    mx.eval(q, cos, sin)
    f = mx.compile(rope)
    mx.eval(f(q, cos, sin))
    nodes = graph_nodes(tmp_path, f(q, cos, sin))
    assert sum(v for k, v in nodes.items() if k.startswith("Compiled")) == 1
    assert sum(nodes.values()) <= 13, nodes


def test_rope_tables_form_is_one_fused_kernel_and_few_views(tmp_path) -> None:
    """The model applies RoPE 3-4 times per layer with tables made once per step (`rope_angles`): each
    application is the pair swap's views and one fused kernel (13 nodes with the op's own angle layout,
    slice and concatenate)."""
    from dsv4_serve.kernels.rope import rope_apply, rope_tables

    q = mx.random.normal((8, 64, 512)).astype(mx.bfloat16)
    ang = mx.random.uniform(-3, 3, (8, 32))
    c, s = rope_tables(mx.cos(ang), mx.sin(ang), 512)
    mx.eval(q, c, s)
    f = mx.compile(rope_apply)
    mx.eval(f(q, c, s))
    nodes = graph_nodes(tmp_path, f(q, c, s))
    assert sum(v for k, v in nodes.items() if k.startswith("Compiled")) == 1
    assert "Concatenate" not in nodes and sum(nodes.values()) <= 6, nodes
