"""Checkpoint write -> load round trips (fp32, bf16, sharded, release FP8/FP4) and malformed checkpoints."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dsv4_serve.model.checkpoint import (
    SINGLE,
    is_f32_compute,
    is_f32_param,
    release_tensors,
    write_checkpoint,
    write_safetensors,
)
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.loader import load_model
from dsv4_serve.model.quant import dequant_fp4, dequant_fp8
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model

Tensors = list[tuple[str, str, np.ndarray]]


@pytest.fixture(scope="module")
def tiny():
    model, args, tok = tiny_model(seed=3)
    return model, args, tok


def params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) if v.dtype != mx.int32 else np.array(v)
            for k, v in tree_flatten(model.parameters())}


def test_tiny_model_is_random_and_deterministic(tiny) -> None:
    model, args, _ = tiny
    p = params(model)
    assert all(np.any(v != 0) for v in p.values())  # nothing left at its zero init
    assert all(np.std(v) > 0 for k, v in p.items() if v.size > 1 and not k.endswith("tid2eid"))
    t = p["layers.0.ffn.gate.tid2eid"]
    assert t.dtype == np.int32 and all(len(set(r)) == args.num_experts_per_tok for r in t)
    again = params(tiny_model(seed=3)[0])
    assert all(np.array_equal(p[k], again[k]) for k in p)
    assert not np.array_equal(p["embed.weight"], params(tiny_model(seed=4)[0])["embed.weight"])


@pytest.mark.parametrize("dtype,shards", [("float32", 1), ("float32", 3), ("bfloat16", 1), ("bfloat16", 2)])
def test_round_trip_identical(tiny, tmp_path, dtype: str, shards: int) -> None:
    model, args, tok = tiny
    write_checkpoint(model, args, tmp_path, dtype=dtype, shards=shards, tokenizer=tok)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards > 1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["compress_ratios"] == args.compress_ratios + [0]
    want_dt = mx.float32 if dtype == "float32" else mx.bfloat16
    loaded, args2 = load_model(tmp_path, dtype=want_dt)
    assert args2.compress_ratios == args.compress_ratios and args2.vocab_size == args.vocab_size
    ref = dict(tree_flatten(model.parameters()))
    for k, v in tree_flatten(loaded.parameters()):
        exp = ref[k] if ref[k].dtype == mx.int32 or is_f32_param(k) else ref[k].astype(want_dt)
        if is_f32_compute(k):  # stored in the checkpoint dtype, kept f32 in memory
            exp = exp.astype(mx.float32)
        assert v.dtype == exp.dtype, k
        assert mx.array_equal(v, exp).item(), k


def test_release_format_matches_decoded_bytes(tiny, tmp_path) -> None:
    model, args, tok = tiny
    write_checkpoint(model, args, tmp_path, dtype="release", shards=2, tokenizer=tok)
    written = {n: (dt, a) for n, dt, a in release_tensors(model, args, "release")}
    assert written["layers.1.attn.wq_a.weight"][0] == "F8_E4M3"
    assert written["layers.1.attn.wq_a.scale"][0] == "F8_E8M0"
    assert written["layers.1.ffn.experts.7.w2.weight"][0] == "I8"
    assert written["layers.1.ffn.experts.7.w2.weight"][1].shape == (args.hidden_size, args.moe_intermediate_size // 2)
    assert written["layers.1.attn.compressor.wkv.weight"][0] == "BF16"
    assert written["layers.1.hc_attn_fn"][0] == "F32" and written["layers.0.ffn.gate.tid2eid"][0] == "I64"
    loaded, _ = load_model(tmp_path, dtype=mx.float32)
    p = dict(tree_flatten(loaded.parameters()))
    q, s = written["layers.2.attn.wo_b.weight"][1], written["layers.2.attn.wo_b.scale"][1]
    assert mx.array_equal(p["layers.2.attn.wo_b.weight"], dequant_fp8(mx.array(q), mx.array(s))).item()
    e = [dequant_fp4(mx.array(written[f"layers.3.ffn.experts.{i}.w1.weight"][1]),
                     mx.array(written[f"layers.3.ffn.experts.{i}.w1.scale"][1])) for i in range(8)]
    assert mx.array_equal(p["layers.3.ffn.experts.w1"], mx.stack(e)).item()


def _logits(model, args, prompt: list[int]) -> np.ndarray:
    pools = StatePools(args, max_slots=1, max_positions=len(prompt), page_size=16, dtype=mx.float32)
    return np.array(model.prefill(pools, pools.alloc(len(prompt)), prompt, 0))


def test_quantized_load_matches_dequantized(tiny, tmp_path) -> None:
    model, args, _ = tiny
    write_checkpoint(model, args, tmp_path, dtype="release")
    deq, _ = load_model(tmp_path, dtype=mx.float32)
    qnt, _ = load_model(tmp_path, dtype=mx.float32, quantize=True)
    names = {k for k, _ in tree_flatten(qnt.parameters())}
    assert "layers.1.attn.wq_b.scales" in names and "layers.1.ffn.experts.w1_scales" in names
    assert qnt.layers[1].attn.wq_b.mode == "mxfp8" and qnt.layers[1].attn.wo_a.mode == "mxfp8"  # wo_a: by groups
    prompt = list(range(2, 42))
    np.testing.assert_allclose(_logits(qnt, args, prompt), _logits(deq, args, prompt), atol=1e-4)


def test_scale_inv_spelling_is_accepted_and_mtp_skipped_on_request(tiny, tmp_path, caplog) -> None:
    # The MTP block is loaded now (tests/model/test_mtp.py): mtp.* is skipped, with a log line, only on request.
    model, args, _ = tiny
    write_checkpoint(model, args, tmp_path, dtype="release")
    ref = params(load_model(tmp_path, dtype=mx.float32)[0])
    t = [(n.replace(".scale", ".weight_scale_inv") if n.endswith(("attn.wkv.scale", "e_proj.scale")) else n, d, a)
         for n, d, a in release_tensors(model, args, "release")]
    write_safetensors(tmp_path / SINGLE, t)
    got = params(load_model(tmp_path, dtype=mx.float32)[0])
    assert "mtp.0.e_proj.weight" in got and set(got) == set(ref)
    assert all(np.array_equal(ref[k], got[k], equal_nan=True) for k in ref)
    with caplog.at_level(logging.INFO, logger="dsv4.loader"):
        bare = params(load_model(tmp_path, dtype=mx.float32, mtp=False)[0])
    assert any("skipping" in r.message and "mtp" in r.message for r in caplog.records)
    assert set(bare) == {k for k in ref if not k.startswith("mtp.")}


# ---- malformed checkpoints: (id, mutation, text that must be in the error) ------------------------
def _edit(fn: Callable[[Tensors], Tensors], dtype: str = "float32"):
    def mutate(model, args, d: Path) -> None:
        write_checkpoint(model, args, d, dtype=dtype)
        write_safetensors(d / SINGLE, fn(list(release_tensors(model, args, dtype))))
    return mutate


def _replace(name: str, new: Callable[[str, np.ndarray], tuple[str, np.ndarray]]):
    return lambda ts: [(n, *new(d, a)) if n == name else (n, d, a) for n, d, a in ts]


def _sharded_missing(model, args, d: Path) -> None:
    write_checkpoint(model, args, d, shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()


def _config(key: str, value):
    def mutate(model, args, d: Path) -> None:
        write_checkpoint(model, args, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
    return mutate


def _truncated(model, args, d: Path) -> None:
    write_checkpoint(model, args, d)
    data = (d / SINGLE).read_bytes()
    (d / SINGLE).write_bytes(data[:-100])


MALFORMED = [
    ("missing tensor", _edit(lambda ts: [t for t in ts if t[0] != "layers.1.attn.wq_a.weight"]),
     "layers.1.attn.wq_a.weight"),
    ("missing expert", _edit(lambda ts: [t for t in ts if t[0] != "layers.2.ffn.experts.5.w3.weight"]),
     "layers.2.ffn.experts.5.w3.weight"),
    ("wrong shape", _edit(_replace("layers.2.attn.wkv.weight", lambda d, a: (d, np.zeros((33, 64), a.dtype)))),
     "layers.2.attn.wkv.weight"),
    ("missing shard", _sharded_missing, "model-00002-of-00003.safetensors"),
    ("config hidden_size contradicts weights", _config("hidden_size", 128), "hidden_size"),
    ("config vocab contradicts weights", _config("vocab_size", 600), "embed.weight"),
    ("float tid2eid", _edit(_replace("layers.0.ffn.gate.tid2eid", lambda d, a: ("F32", a.astype(np.float32)))),
     "layers.0.ffn.gate.tid2eid"),
    ("tid2eid out of range", _edit(_replace("layers.1.ffn.gate.tid2eid", lambda d, a: (d, a + 8))),
     "layers.1.ffn.gate.tid2eid"),
    ("int weight", _edit(_replace("head.weight", lambda d, a: ("I32", a.astype(np.int32)))), "head.weight"),
    ("truncated shard", _truncated, "tensor mtp.0.hc_head_fn"),  # the last 100 bytes: the MTP block's hc_head_fn
    ("scale grid mismatch", _edit(_replace("layers.1.attn.wq_a.scale", lambda d, a: (d, np.zeros((2, 2), a.dtype))),
                                  "release"), "layers.1.attn.wq_a.scale"),
    ("missing scale", _edit(lambda ts: [t for t in ts if t[0] != "layers.3.ffn.experts.0.w2.scale"], "release"),
     "layers.3.ffn.experts.0.w2.scale"),
    ("NaN scale", _edit(_replace("layers.1.attn.wkv.scale", lambda d, a: (d, np.full_like(a, 255))), "release"),
     "layers.1.attn.wkv.scale"),
    ("FP4 packed shape", _edit(_replace("layers.1.ffn.experts.2.w1.weight", lambda d, a: (d, a[:, :-1])), "release"),
     "layers.1.ffn.experts.2.w1.weight"),
    ("extra tensor", _edit(lambda ts: ts + [("layers.1.attn.bogus.weight", "F32", np.ones((2, 2), np.float32))]),
     "layers.1.attn.bogus.weight"),
    ("extra layer", _edit(lambda ts: ts + [("layers.4.attn_norm.weight", "F32", np.ones(64, np.float32))]),
     "layers.4.attn_norm.weight"),
]


@pytest.mark.parametrize("mutate,needle", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_checkpoint_names_the_culprit(tiny, tmp_path, mutate, needle: str) -> None:
    model, args, _ = tiny
    mutate(model, args, tmp_path)
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    assert needle in str(err.value)


def test_config_error_names_tensor_and_key(tiny, tmp_path) -> None:
    model, args, _ = tiny
    _config("hidden_size", 128)(model, args, tmp_path)
    with pytest.raises(ValueError, match=r"tensor \S+: shape .*hidden_size=128"):
        load_model(tmp_path)


# ---- peak memory while loading a ~350 MB release-format checkpoint (issue 5) ------------------------
def _write_big_release(d: Path) -> int:
    """Random release bytes written directly (no encoding): FP4 experts dominate, 4 shards of ~100 MB."""
    from dataclasses import replace

    from dsv4_serve.model.checkpoint import expert_param, is_fp8_weight, scale_names
    from dsv4_serve.model.deepseek_v4 import DeepseekV4
    from dsv4_serve.model.quant import fp8_grid

    args = replace(ModelArgs.tiny(), vocab_size=4096, hidden_size=1024, moe_intermediate_size=1024,
                   n_routed_experts=64, num_hidden_layers=3, compress_ratios=[0, 4, 128], num_hash_layers=1)
    rng = np.random.default_rng(0)
    ts: Tensors = []
    for name, p in tree_flatten(DeepseekV4(args).parameters()):  # shapes only; never evaluated
        shape, ex = tuple(p.shape), expert_param(name)
        if name.endswith("tid2eid"):
            ts.append((name, "I64", rng.integers(0, args.n_routed_experts, shape).astype(np.int64)))
        elif ex:
            for k in range(shape[0]):
                stem = f"{ex[0]}.{k}.{ex[1]}"
                ts.append((f"{stem}.weight", "I8", rng.integers(-128, 128, (shape[1], shape[2] // 2), dtype=np.int8)))
                ts.append((f"{stem}.scale", "F8_E8M0", rng.integers(118, 124, (shape[1], shape[2] // 32), np.uint8)))
        elif is_fp8_weight(name):
            q = rng.integers(0, 256, shape, dtype=np.uint8)
            q[(q & 0x7F) == 0x7F] = 0
            s = rng.integers(118, 124, fp8_grid(shape), np.uint8)
            ts += [(name, "F8_E4M3", q), (scale_names(name)[0], "F8_E8M0", s)]
        elif is_f32_param(name):
            ts.append((name, "F32", rng.standard_normal(shape, dtype=np.float32) * 0.05))
        else:
            ts.append((name, "BF16", ((rng.standard_normal(shape, dtype=np.float32) * 0.05).view(np.uint32) >> 16)
                       .astype(np.uint16)))
    (d / "config.json").write_text(json.dumps(args.to_config_json()))
    total, weight_map, groups, cur = sum(t[2].nbytes for t in ts), {}, [], []
    for t in ts:
        cur.append(t)
        if sum(x[2].nbytes for x in cur) >= 100 << 20:
            groups.append(cur)
            cur = []
    groups.append(cur)
    for i, g in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(d / file, g)
        weight_map.update({n: file for n, _, _ in g})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


_MEASURE = """
import json, resource, sys, mlx.core as mx
from mlx.utils import tree_flatten
from dsv4_serve.model.loader import load_model
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
m, _ = load_model(sys.argv[1], quantize=True, dtype=mx.bfloat16)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "bytes": sum(v.nbytes for _, v in tree_flatten(m.parameters()))}))
"""


def test_quantized_load_peak_rss_within_1_2x(tmp_path) -> None:
    import subprocess
    import sys

    size = _write_big_release(tmp_path)
    assert size > 300e6
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["bytes"] > 0.95 * size  # kept quantized: about the size on disk
    assert m["peak"] - m["base"] <= 1.2 * m["bytes"], m


def test_release_quantized_matches_transformers_on_dequantized(tiny, tmp_path) -> None:
    """Issue 5: mxfp8/mxfp4 weights vs transformers on the decoded fp32 weights, 262-token prompt + 32 steps."""
    from tests.oracle import hf_greedy, hf_load

    model, args, _ = tiny
    write_checkpoint(model, args, tmp_path / "rel", dtype="release")
    qm, _ = load_model(tmp_path / "rel", quantize=True, clamp_shared_expert=True)
    write_checkpoint(load_model(tmp_path / "rel", dtype=mx.float32)[0], args, tmp_path / "deq")
    prompt = [int(t) for t in np.random.default_rng(7).integers(2, args.vocab_size, 262)]
    hf_ids, hf_logits = hf_greedy(hf_load(tmp_path / "deq"), prompt, 32)
    pools = StatePools(args, max_slots=1, max_positions=len(prompt) + 32, page_size=16)
    h = pools.alloc(len(prompt) + 32)
    logits = [np.array(qm.prefill(pools, h, prompt, 0))]
    ids = [int(np.argmax(logits[0]))]
    for i in range(31):
        logits.append(np.array(qm.decode(pools, [h], [ids[-1]], [len(prompt) + i])[0]))
        ids.append(int(np.argmax(logits[-1])))
    assert ids == hf_ids[:32]
    assert max(float(np.abs(a - b).max()) for a, b in zip(logits, hf_logits, strict=False)) <= 1e-3
