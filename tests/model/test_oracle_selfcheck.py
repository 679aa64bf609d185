"""Self-check of the transformers oracle (tests/oracle.py) on a tiny random DeepSeek-V4 checkpoint.

The checkpoint is made here with transformers itself (random init of every parameter and buffer), so this
test does not depend on the project's checkpoint writer. It checks:

* cached decode == full recompute (HF's own incremental state is exact, spec section 6);
* ``save_pretrained`` -> ``hf_load`` round trip gives identical logits;
* a directory in the *release* naming (spec section 4, no ``model.`` prefix, per-expert tensors, written with
  ``hf_state_dict_to_release``) loads through ``hf_load`` with every tensor verified, and gives identical
  logits: this validates ``hf_to_release_name`` as the exact inverse of transformers' conversion mapping;
* ``hf_load`` fails loudly when a tensor is missing and when ``tid2eid`` has the wrong values.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

# tests/model has no __init__.py (yet): under plain `pytest` the repo root is then not on sys.path.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.oracle import (  # noqa: E402
    hf_full_logits,
    hf_greedy,
    hf_load,
    hf_state_dict_to_release,
    hf_to_release_name,
    normalize_checkpoint_name,
    read_checkpoint,
)

transformers = pytest.importorskip("transformers")

#: Spec section 6 tiny config (vocab 512), in the release config.json spelling (legacy keys).
TINY_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "compress_ratios": [0, 4, 128, 4, 0],
    "num_hash_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 5,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

PROMPT_LEN = 260  # crosses CSA boundaries every 4 tokens and the HCA boundary at 255; 65 CSA entries -> top 4
N_STEPS = 8


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values for every parameter and persistent buffer, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)

    def randn(shape, std):
        return torch.randn(shape, generator=g) * std

    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("embed_tokens.weight"):
                val = randn(shape, 1.0)
            elif name.endswith(("norm.weight",)):
                val = 1.0 + randn(shape, 0.1)
            elif name.endswith("sinks"):
                val = randn(shape, 1.0)
            elif name.endswith("position_bias"):
                val = randn(shape, 0.5)
            elif name.endswith(("hc.fn", "hc_head.hc_fn")):
                val = randn(shape, 0.5 / np.sqrt(shape[1]))
            elif name.endswith(("hc.base", "hc_head.hc_base")):
                val = randn(shape, 0.5)
            elif name.endswith(("hc.scale", "hc_head.hc_scale")):
                val = 0.5 + torch.rand(shape, generator=g)
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                val = randn(shape, 1.0 / np.sqrt(shape[2]))
            elif p.ndim == 2:  # Linear weights [out, in]
                val = randn(shape, 1.0 / np.sqrt(shape[1]))
            else:
                raise AssertionError(f"unhandled parameter {name} {shape}")
            p.copy_(val)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                k = cfg.num_experts_per_tok
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(cfg.vocab_size)]
                b.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(randn(tuple(b.shape), 0.3))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf model with random weights, save_pretrained dir, release-layout dir, prompt)."""
    from safetensors.torch import save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.set_num_threads(2)
    cfg_dict = {k: v for k, v in TINY_CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = DeepseekV4Config(**cfg_dict)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, seed=1234)

    hf_dir = tmp_path_factory.mktemp("hf_save")
    model.save_pretrained(hf_dir)

    rel_dir = tmp_path_factory.mktemp("release")
    (rel_dir / "config.json").write_text(json.dumps(TINY_CONFIG, indent=1))
    tensors = hf_state_dict_to_release(model.state_dict())
    save_file(tensors, str(rel_dir / "model.safetensors"), metadata={"format": "pt"})

    prompt = torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    prompt[0] = config.bos_token_id
    return model, hf_dir, rel_dir, prompt.tolist()


def test_release_names_are_spec_names(tiny):
    model, _, rel_dir, _ = tiny
    names = set(read_checkpoint(rel_dir))
    expected = {
        "embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
        "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight", "layers.0.hc_attn_fn", "layers.0.hc_ffn_scale",
        "layers.0.attn.attn_sink", "layers.0.attn.wq_a.weight", "layers.0.attn.q_norm.weight",
        "layers.0.attn.wq_b.weight", "layers.0.attn.wkv.weight", "layers.0.attn.kv_norm.weight",
        "layers.0.attn.wo_a.weight", "layers.0.attn.wo_b.weight", "layers.0.ffn.gate.weight",
        "layers.0.ffn.gate.tid2eid", "layers.0.ffn.experts.7.w1.weight", "layers.0.ffn.experts.7.w2.weight",
        "layers.0.ffn.experts.7.w3.weight", "layers.0.ffn.shared_experts.w1.weight",
        "layers.1.attn.compressor.ape", "layers.1.attn.compressor.wkv.weight",
        "layers.1.attn.compressor.wgate.weight", "layers.1.attn.compressor.norm.weight",
        "layers.1.attn.indexer.wq_b.weight", "layers.1.attn.indexer.weights_proj.weight",
        "layers.1.attn.indexer.compressor.ape", "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.1.attn.indexer.compressor.wgate.weight", "layers.1.attn.indexer.compressor.norm.weight",
        "layers.2.attn.compressor.ape", "layers.2.ffn.gate.bias", "layers.3.ffn.gate.bias",
    }  # fmt: skip
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("model.") for n in names)
    assert "layers.2.ffn.gate.tid2eid" not in names and "layers.1.ffn.gate.bias" not in names
    assert "layers.2.attn.indexer.wq_b.weight" not in names  # HCA: no indexer
    assert "layers.0.attn.compressor.ape" not in names  # sliding: no compressor
    # shapes of the stacked-expert split
    t = read_checkpoint(rel_dir)
    assert tuple(t["layers.3.ffn.experts.5.w1.weight"].shape) == (32, 64)
    assert tuple(t["layers.3.ffn.experts.5.w2.weight"].shape) == (64, 32)
    assert tuple(t["layers.1.attn.compressor.ape"].shape) == (4, 64)
    assert tuple(t["layers.2.attn.compressor.ape"].shape) == (128, 32)
    sd = model.state_dict()
    gu = sd["model.layers.3.mlp.experts.gate_up_proj"]
    assert torch.equal(t["layers.3.ffn.experts.5.w1.weight"], gu[5, :32])
    assert torch.equal(t["layers.3.ffn.experts.5.w3.weight"], gu[5, 32:])
    assert hf_to_release_name("model.layers.3.self_attn.compressor.indexer.kv_norm.weight") == (
        "layers.3.attn.indexer.compressor.norm.weight"
    )
    assert len(hf_to_release_name("model.layers.0.mlp.experts.gate_up_proj", 8)) == 16


def test_save_pretrained_names(tiny):
    """What transformers 5.24 save_pretrained writes: reversed names, but with the `model.` prefix and a few
    names that are not the release names."""
    _, hf_dir, _, _ = tiny
    names = set(read_checkpoint(hf_dir))
    assert "model.layers.0.attn.wq_a.weight" in names and "head.weight" in names
    assert "model.embed_tokens.weight" in names and "model.hc_head.hc_fn" in names
    assert "model.layers.0.attn.norm.weight" in names  # the attention kv_norm, mis-reversed
    assert "model.layers.0.ffn.experts.3.w1.weight" in names
    rel = {normalize_checkpoint_name(n) for n in names}
    model, _, rel_dir, _ = tiny
    assert rel == set(read_checkpoint(rel_dir))


def test_cached_decode_matches_recompute_and_round_trips(tiny):
    model, hf_dir, rel_dir, prompt = tiny
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    ids, logits = hf_greedy(model, prompt, N_STEPS)
    t_greedy = time.perf_counter() - t0
    assert len(ids) == len(logits) == N_STEPS + 1
    assert all(lg.shape == (512,) and lg.dtype == np.float32 for lg in logits)
    assert ids == [int(np.argmax(lg)) for lg in logits]

    full = hf_full_logits(model, prompt + ids[:-1])
    assert full.shape == (PROMPT_LEN + N_STEPS, 512)
    cached = np.stack(logits)
    diff = np.abs(full[PROMPT_LEN - 1 :] - cached).max()
    assert diff <= 1e-4, f"cached decode vs full recompute: max |d logit| = {diff}"
    assert np.ptp(cached, axis=-1).min() > 1.0  # logits are not degenerate

    # the indexer really selects: more CSA entries than index_topk
    assert (PROMPT_LEN + 1) // 4 > model.config.index_topk

    for d in (hf_dir, rel_dir):
        m2 = hf_load(d)
        ids2, logits2 = hf_greedy(m2, prompt, N_STEPS)
        assert ids2 == ids
        d2 = np.abs(np.stack(logits2) - cached).max()
        # the same weights; a fresh load's buffers can send torch's CPU GEMMs down another path (2.2e-6 seen
        # on a 2-core host, 2026-12-02), so not bit-equality
        assert d2 <= 1e-5, f"{d.name}: reloaded model logits differ by {d2}"
        lm = m2.lm_head.weight
        assert not torch.equal(lm, m2.model.embed_tokens.weight)  # not tied
    print(f"greedy {PROMPT_LEN}+{N_STEPS}: {t_greedy:.2f}s, cached-vs-full max diff {diff:.2e}")


def test_release_load_detects_missing_and_wrong_tensors(tiny, tmp_path):
    from safetensors.torch import save_file

    model, _, rel_dir, _ = tiny
    tensors = read_checkpoint(rel_dir)
    cfg = (rel_dir / "config.json").read_text()

    # a missing tensor: transformers itself reports it (missing_keys)
    d1 = tmp_path / "missing"
    d1.mkdir()
    (d1 / "config.json").write_text(cfg)
    save_file({k: v for k, v in tensors.items() if k != "layers.1.attn.compressor.ape"}, str(d1 / "model.safetensors"))
    with pytest.raises(AssertionError, match="position_bias|compressor.ape"):
        hf_load(d1)

    # a missing tid2eid / router bias (buffers) must not silently stay at HF's zero init
    for key in ("layers.1.ffn.gate.tid2eid", "layers.2.ffn.gate.bias"):
        d = tmp_path / f"no_{key}"
        d.mkdir()
        (d / "config.json").write_text(cfg)
        save_file({k: v for k, v in tensors.items() if k != key}, str(d / "model.safetensors"))
        with pytest.raises(AssertionError, match="tid2eid|e_score_correction_bias|gate.bias"):
            hf_load(d)

    # FP8-style `.scale` companions are refused (dequantise first, spec section 6)
    d0 = tmp_path / "quantised"
    d0.mkdir()
    (d0 / "config.json").write_text(cfg)
    save_file({**tensors, "layers.0.attn.wq_a.scale": torch.ones(1, 1)}, str(d0 / "model.safetensors"))
    with pytest.raises((NotImplementedError, AssertionError)):
        hf_load(d0)

    # tid2eid as int32 (REF declares int32) loads as the same values
    d2 = tmp_path / "tid2eid_int32"
    d2.mkdir()
    (d2 / "config.json").write_text(cfg)
    t2 = dict(tensors)
    t2["layers.0.ffn.gate.tid2eid"] = t2["layers.0.ffn.gate.tid2eid"].to(torch.int32)
    t2["layers.1.ffn.gate.tid2eid"] = t2["layers.1.ffn.gate.tid2eid"].to(torch.int32)
    save_file(t2, str(d2 / "model.safetensors"))
    m2 = hf_load(d2)
    assert torch.equal(m2.model.layers[0].mlp.gate.tid2eid, model.model.layers[0].mlp.gate.tid2eid)
    assert m2.model.layers[0].mlp.gate.tid2eid.dtype == torch.int64

    # bf16 release tensors load (upcast to fp32)
    d3 = tmp_path / "bf16"
    d3.mkdir()
    (d3 / "config.json").write_text(cfg)
    t3 = {k: (v.to(torch.bfloat16) if v.dtype == torch.float32 else v) for k, v in tensors.items()}
    t3["mtp.0.attn_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)  # ignored by HF
    save_file(t3, str(d3 / "model.safetensors"))
    m3 = hf_load(d3)
    assert m3.model.embed_tokens.weight.dtype == torch.float32
