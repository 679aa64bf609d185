"""The MTP block (model/mtp.py): loaded from the release layout, its draft logits against a float64 NumPy twin
written from DeepSeek's reference (tests/model/mtp_twin.py), its window state, and nothing new by default."""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dsv4_serve.kernels.matmul import f32_linear_rows
from dsv4_serve.model.checkpoint import SINGLE, release_tensors, write_checkpoint, write_safetensors
from dsv4_serve.model.cli import make_tiny_main
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.dummy import dummy_model
from dsv4_serve.model.loader import load_model
from dsv4_serve.model.mtp import draft_step
from dsv4_serve.model.quant import QuantizedExperts
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from tests.model.mtp_twin import MTPTwin, read_safetensors

# Row r joins at step STARTS[r] (position 0 then): a step has 1..8 rows at ragged positions, row 0 reaches
# position STEPS - 1 (the ring of sliding_window 8 wraps twice).
STARTS, STEPS = (0, 1, 2, 3, 5, 8, 11, 13), 22


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for dtype in ("float32", "release"):
        d = tmp_path_factory.mktemp(dtype)
        assert make_tiny_main([str(d), "--seed", "5", "--dtype", dtype]) == 0
        out[dtype] = d
    return out


def run(model, args, pools, tokens, draft: bool, order_seed: int = 0):
    """The staggered schedule: every step the active rows (shuffled) feed tokens[r, p] through the main model,
    then (draft) their streams and tokens[r, p + 1] through the MTP block. -> per step (rows, positions,
    main logits, streams, drafts)."""
    rng = np.random.default_rng(order_seed)
    handles = [pools.alloc(64) for _ in STARTS]
    out = []
    for s in range(STEPS):
        rows = [r for r, t in enumerate(STARTS) if t <= s]
        rows = [rows[i] for i in rng.permutation(len(rows))]
        pos = [s - STARTS[r] for r in rows]
        batch = model.make_batch(pools, [handles[r] for r in rows], pos)
        hs = model.streams(batch, mx.array([int(tokens[r, p]) for r, p in zip(rows, pos, strict=True)]), pools)
        logits = f32_linear_rows(model.collapse(hs), model.head.weight)
        d = None
        if draft:
            d = draft_step(model, batch, hs, mx.array([int(tokens[r, p + 1]) for r, p in zip(rows, pos, strict=True)]),
                           pools)  # fmt: skip
        mx.eval(logits, hs, *([d] if draft else []), pools.arrays())
        out.append((rows, pos, np.array(logits), np.array(hs), None if d is None else np.array(d)))
    return handles, out


@pytest.mark.parametrize("kind", ["float32", "release-quantized"])
def test_draft_logits_match_the_numpy_twin(ckpts, kind) -> None:
    """1..8 rows a step at ragged positions, 22 steps: every draft within 1e-4 of the twin's (f32 against
    f64), and the MTP window ring holds the twin's last W keys of every row."""
    ckpt = ckpts["float32" if kind == "float32" else "release"]
    model, args = load_model(ckpt, dtype=mx.float32, quantize=kind != "float32")
    if kind != "float32":
        assert model.mtp[0].e_proj.mode == "mxfp8" and isinstance(model.mtp[0].ffn.experts, QuantizedExperts)
    twin = MTPTwin(ckpt)
    tokens = np.random.default_rng(11).integers(2, args.vocab_size, (len(STARTS), STEPS + 1))
    pools = StatePools(args, max_slots=len(STARTS), max_positions=64, page_size=16, mtp=True)
    handles, steps = run(model, args, pools, tokens, draft=True)
    worst, sizes = 0.0, set()
    for rows, pos, _, hs, d in steps:
        sizes.add(len(rows))
        for i, (r, p) in enumerate(zip(rows, pos, strict=True)):
            want = twin.step(r, hs[i].astype(np.float64), int(tokens[r, p + 1]), p)
            worst = max(worst, float(np.abs(d[i] - want).max()))
            assert np.abs(d[i] - want).max() <= 1e-4, (r, p)
    assert sizes == set(range(1, 9))
    assert np.std(steps[-1][4], axis=0).mean() > 0.1  # rows' drafts differ: not a constant
    ring = np.array(pools.window[args.num_hidden_layers])
    w = args.sliding_window
    for r, h in enumerate(handles):
        last = STEPS - 1 - STARTS[r]
        for p in range(max(0, last - w + 1), last + 1):
            np.testing.assert_allclose(ring[h.slot, p % w], twin.rings[r][p], atol=1e-5)
    print(f"{kind}: max |draft - twin| {worst:.2e}")


def test_the_main_model_is_untouched(ckpts) -> None:
    """Default pools carry no MTP window; the main model's logits and state are the same bit for bit with MTP
    steps in between; the MTP pools' only extra is one ring a slot."""
    model, args = load_model(ckpts["float32"], dtype=mx.float32)
    tokens = np.random.default_rng(3).integers(2, args.vocab_size, (len(STARTS), STEPS + 1))
    plain = StatePools(args, max_slots=len(STARTS), max_positions=64, page_size=16)
    withm = StatePools(args, max_slots=len(STARTS), max_positions=64, page_size=16, mtp=True)
    assert not plain.mtp and len(plain.window) == args.num_hidden_layers == len(withm.window) - 1
    ring = args.sliding_window * args.head_dim * 4
    assert withm.slot_bytes() - plain.slot_bytes() == ring and withm.bytes_for(40) - plain.bytes_for(40) == ring
    _, a = run(model, args, plain, tokens, draft=False)
    _, b = run(model, args, withm, tokens, draft=True)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x[2], y[2])
    pa, pb = plain.slot_arrays(), withm.slot_arrays()
    assert set(pb) - set(pa) == {f"window{args.num_hidden_layers}"}
    assert all(mx.array_equal(pa[k], pb[k]).item() for k in pa)
    assert all(mx.array_equal(x, y).item() for x, y in zip(plain.ckv.values(), withm.ckv.values(), strict=True))


def test_refusals(ckpts) -> None:
    model, args = load_model(ckpts["float32"], dtype=mx.float32)
    pools = StatePools(args, max_slots=1, max_positions=8, page_size=16)
    batch = model.make_batch(pools, [pools.alloc(8)], [0])
    hs = model.streams(batch, mx.array([3]), pools)
    with pytest.raises(ValueError, match="no MTP window"):
        draft_step(model, batch, hs, mx.array([4]), pools)
    mp = StatePools(args, max_slots=1, max_positions=8, page_size=16, mtp=True)
    with pytest.raises(ValueError, match="expected"):
        draft_step(model, model.make_batch(mp, [mp.alloc(8)], [0]), hs[:, :1], mx.array([4]), mp)
    bare, bargs = load_model(ckpts["float32"], dtype=mx.float32, mtp=False)
    assert bare.mtp == [] and bargs.num_nextn_predict_layers == 0
    with pytest.raises(ValueError, match="no MTP block"):
        StatePools(bargs, max_slots=1, max_positions=8, mtp=True)
    with pytest.raises(ValueError, match="no MTP block"):
        draft_step(bare, batch, hs, mx.array([4]), mp)


def test_release_layout(ckpts) -> None:
    """make-tiny --dtype release writes mtp.0.* as the V4-Flash release does (39 tensors + 6 an expert; FP8
    e_proj / h_proj, FP4 experts, F32 hc_head_* and router bias, BF16 norms, no embed / head of its own)."""
    t = read_safetensors(ckpts["release"] / SINGLE)
    mtp = {k: dt for k, (dt, _) in t.items() if k.startswith("mtp.")}
    args = ModelArgs.tiny()
    assert len(mtp) == 39 + 6 * args.n_routed_experts
    for k in ("e_proj", "h_proj", "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b",
              "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"):  # fmt: skip
        assert (mtp[f"mtp.0.{k}.weight"], mtp[f"mtp.0.{k}.scale"]) == ("F8_E4M3", "F8_E8M0"), k
    assert mtp["mtp.0.ffn.experts.7.w2.weight"] == "I8" and mtp["mtp.0.ffn.experts.7.w2.scale"] == "F8_E8M0"
    for k in ("hc_head_fn", "hc_head_base", "hc_head_scale", "hc_attn_fn", "hc_ffn_scale", "attn.attn_sink",
              "ffn.gate.bias"):  # fmt: skip
        assert mtp[f"mtp.0.{k}"] == "F32", k
    for k in ("enorm", "hnorm", "norm", "attn_norm", "ffn_norm", "attn.q_norm", "attn.kv_norm", "ffn.gate"):
        assert mtp[f"mtp.0.{k}.weight"] == "BF16", k
    assert not [k for k in mtp if "embed" in k or "head.weight" in k or "tid2eid" in k or "compressor" in k]
    cfg = json.loads((ckpts["release"] / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["compress_ratios"] == args.compress_ratios + [0]


def test_checkpoint_without_mtp_or_with_part_of_it(tmp_path, caplog) -> None:
    model, args, _ = tiny_model(seed=2)
    write_checkpoint(model, args, tmp_path)
    full = list(release_tensors(model, args, "float32"))
    write_safetensors(tmp_path / SINGLE, [t for t in full if not t[0].startswith("mtp.")])
    with caplog.at_level(logging.INFO, logger="dsv4.loader"):
        bare, bargs = load_model(tmp_path, dtype=mx.float32)
    assert bare.mtp == [] and bargs.num_nextn_predict_layers == 0
    assert any("no MTP block" in r.message for r in caplog.records)
    write_safetensors(tmp_path / SINGLE, [t for t in full if t[0] != "mtp.0.hnorm.weight"])
    with pytest.raises(ValueError, match=r"mtp\.0\.hnorm\.weight"):
        load_model(tmp_path, dtype=mx.float32)


def test_dummy_and_tiny_include_it() -> None:
    """--load-format dummy draws the block quantized as the layers (mxfp8 dense, mxfp4 experts); the built-in
    tiny model has it; a step runs on both."""
    for model, args in ((dummy_model(ModelArgs.tiny()), ModelArgs.tiny()), tiny_model()[:2]):
        names = {k for k, _ in tree_flatten(model.parameters())}
        assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.gate.bias"} <= names
        pools = StatePools(args, max_slots=2, max_positions=16, page_size=16, mtp=True)
        batch = model.make_batch(pools, [pools.alloc(16), pools.alloc(16)], [0, 0])
        d = draft_step(model, batch, model.streams(batch, mx.array([3, 4]), pools), mx.array([5, 6]), pools)
        assert d.shape == (2, args.vocab_size) and bool(mx.all(mx.isfinite(d)))
    dm = dummy_model(ModelArgs.tiny())
    assert dm.mtp[0].e_proj.mode == dm.mtp[0].attn.wq_b.mode == "mxfp8"
    assert isinstance(dm.mtp[0].ffn.experts, QuantizedExperts)


def test_config_keys() -> None:
    cfg = ModelArgs.tiny().to_config_json()
    assert ModelArgs.from_dict(cfg).num_nextn_predict_layers == 1
    assert ModelArgs.from_dict({**cfg, "num_nextn_predict_layers": 0}).num_nextn_predict_layers == 0
    with pytest.raises(ValueError, match="MTP layers' entries"):
        ModelArgs.from_dict({**cfg, "compress_ratios": [*cfg["compress_ratios"][:-1], 4]})
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        ModelArgs.from_dict({**cfg, "num_nextn_predict_layers": 2})
