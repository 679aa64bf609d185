"""Numerical oracle for the parity tests: transformers' ``DeepseekV4ForCausalLM`` on PyTorch CPU in fp32.

The project writes tiny random checkpoints in the DeepSeek *release* layout (spec section 4: original names,
no ``model.`` prefix, one tensor per routed expert). transformers 5.24 reads that layout directly: its
``conversion_mapping["deepseek_v4"]`` renames the keys and stacks the experts on load. This module

* loads such a checkpoint and proves that every model tensor came from the checkpoint (``hf_load``),
* runs the HF model greedily with its own cache (``hf_greedy``) or without a cache (``hf_full_logits``),
* documents the exact HF -> release name mapping (``hf_to_release_name``, ``hf_state_dict_to_release``),
  validated by ``tests/model/test_oracle_selfcheck.py`` (write release names, load, compare logits).

HF facts (transformers 5.24, checked on the tiny config) an implementation compared with this oracle must know:

* transformers always clamps the shared expert with ``swiglu_limit`` (the reference does not): run the
  implementation with its shared-expert clamp ON when comparing.
* Loading needs ``model.safetensors`` (or ``model.safetensors.index.json``) plus ``config.json``; the release
  ``config.json`` keys (``compress_ratios`` incl. the MTP entry, ``num_hash_layers``, ``qk_rope_head_dim``,
  ``rope_scaling`` with ``type: yarn``) are folded in by ``DeepseekV4Config``. ``mtp.*`` tensors are ignored.
  ``tid2eid`` may be int32 or int64 (loaded as int64); a missing ``tid2eid`` / ``gate.bias`` is reported missing.
* ``save_pretrained`` does NOT write release names: it keeps the ``model.`` prefix and writes
  ``model.embed_tokens.weight``, ``model.hc_head.hc_{fn,base,scale}`` and ``model.layers.L.attn.norm.weight``
  (for the attention's ``kv_norm``); everything else is reversed to release names (``head.weight`` unprefixed).
* Sliding layers use rope theta ``rope_theta`` without YaRN; CSA/HCA layers (q, window kv, compressed kv,
  indexer q/k) use ``compress_rope_theta`` with YaRN and ``attention_factor = 1`` (no mscale). Rope is
  interleaved on the trailing ``qk_rope_head_dim`` dims, and the attention output is de-rotated at ``-p``.
* The sliding cache keeps ``sliding_window - 1`` past rows and appends the current one.
* Cached decode, chunked prefill and a cache-free forward all agree to ~3e-6 (fp32).
* The indexer's top-k is ``torch.topk`` (tie order unspecified); with >= 32 indexer heads ties are rare.
* The API uses ``cache=`` (``past_key_values`` is deprecated) and ``dtype=`` (not ``torch_dtype``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "hf_load",
    "hf_greedy",
    "hf_full_logits",
    "hf_to_release_name",
    "hf_state_dict_to_release",
    "normalize_checkpoint_name",
    "read_checkpoint",
]

# --------------------------------------------------------------------------------------------------------------
# Name mapping: HF module names (DeepseekV4ForCausalLM.state_dict()) -> release names (spec section 4)
# --------------------------------------------------------------------------------------------------------------

#: Top-level (non-layer) tensors.
_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}

#: Per-layer tensors: HF suffix after ``model.layers.L.`` -> release suffix after ``layers.L.``.
#: Note the asymmetries: the *attention* ``kv_norm`` keeps its name, the *compressor* ``kv_norm`` is ``norm``;
#: the indexer's compressor lives under ``attn.indexer.compressor`` in the release but under
#: ``self_attn.compressor.indexer`` in HF (HF folds the indexer compressor into ``DeepseekV4Indexer``).
_LAYER_SUFFIX = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    # attention (all layer types)
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    # main compressor (CSA and HCA)
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    # lightning indexer (CSA only)
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    # MoE
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_to_release_name(name: str, n_experts: int | None = None) -> str | list[str]:
    """Release name(s) of the HF parameter/buffer ``name`` (a key of ``DeepseekV4ForCausalLM.state_dict()``).

    Returns a ``str`` for one-to-one tensors. The two stacked routed-expert tensors return a ``list``:

    * ``model.layers.L.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` -> ``[layers.L.ffn.experts.e.w1.weight for e]
      + [layers.L.ffn.experts.e.w3.weight for e]`` (``gate_up_proj[e, :I] = w1_e``, ``gate_up_proj[e, I:] = w3_e``);
    * ``model.layers.L.mlp.experts.down_proj`` ``[E, H, I]`` -> ``[layers.L.ffn.experts.e.w2.weight for e]``.

    ``n_experts`` is required for those two. Raises ``KeyError`` for names with no release counterpart (the
    non-persistent rotary ``inv_freq`` buffers never appear in a state dict).
    """
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _LAYER_RE.match(name)
    if m is None:
        raise KeyError(f"no release name for HF tensor {name!r}")
    layer, suffix = m.group(1), m.group(2)
    if suffix in _LAYER_SUFFIX:
        return f"layers.{layer}.{_LAYER_SUFFIX[suffix]}"
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        if n_experts is None:
            raise ValueError(f"{name!r} is a stacked expert tensor: pass n_experts")
        ws = ("w1", "w3") if suffix.endswith("gate_up_proj") else ("w2",)
        return [f"layers.{layer}.ffn.experts.{e}.{w}.weight" for w in ws for e in range(n_experts)]
    raise KeyError(f"no release name for HF tensor {name!r}")


def hf_state_dict_to_release(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release-layout tensors (spec section 4, unquantised) of an HF ``DeepseekV4ForCausalLM`` state dict.

    Splits the stacked experts back into ``experts.e.w1/w2/w3``. Tensors are returned as contiguous clones
    (safe to hand to ``safetensors.torch.save_file``).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            n_exp, two_i, _ = t.shape
            names = hf_to_release_name(name, n_exp)
            half = two_i // 2
            for e in range(n_exp):
                out[names[e]] = t[e, :half].clone().contiguous()
                out[names[n_exp + e]] = t[e, half:].clone().contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            n_exp = t.shape[0]
            for e, rel in enumerate(hf_to_release_name(name, n_exp)):
                out[rel] = t[e].clone().contiguous()
        else:
            out[hf_to_release_name(name)] = t.clone().contiguous()
    return out


#: What ``save_pretrained`` writes that differs from the release names (transformers 5.24 reverses its
#: conversion mapping on save but keeps the ``model.`` prefix and gets three names wrong). Used only to
#: compare a save_pretrained directory's tensors with the model in ``hf_load``'s verification.
_SAVE_PRETRAINED_ALIASES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    # HF's reverse of `.norm.` -> `.kv_norm.` also hits the attention's own kv_norm
    (re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
)


def normalize_checkpoint_name(name: str) -> str:
    """Release name for a checkpoint key: identity for release checkpoints; for directories written by
    transformers' ``save_pretrained`` strips ``model.`` and undoes the three names it writes differently."""
    name = name.removeprefix("model.")
    for pat, repl in _SAVE_PRETRAINED_ALIASES:
        name = pat.sub(repl, name)
    return name


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


def _checkpoint_files(ckpt_dir: Path) -> list[Path]:
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [ckpt_dir / f for f in files]
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {ckpt_dir}")
    return files


def read_checkpoint(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by their stored names (torch tensors, stored dtype)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in _checkpoint_files(Path(ckpt_dir)):
        out.update(load_file(str(f)))
    return out


def _verify_loaded(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """Every model tensor equals a checkpoint tensor and every checkpoint tensor (except ``mtp.*``) is used."""
    ckpt = {normalize_checkpoint_name(k): v for k, v in read_checkpoint(ckpt_dir).items()}
    ckpt = {k: v for k, v in ckpt.items() if not k.startswith("mtp.")}
    quantised = sorted(
        k for k in ckpt if k.endswith((".scale", ".weight_scale_inv")) and k.rsplit(".", 1)[0] + ".weight" in ckpt
    )
    if quantised:
        raise NotImplementedError(
            f"{ckpt_dir} holds FP8/FP4 weights (e.g. {quantised[0]}); the oracle needs a dequantised "
            "(bf16/fp32) release checkpoint (spec section 6)"
        )
    model_rel = hf_state_dict_to_release(model.state_dict())
    missing = sorted(set(model_rel) - set(ckpt))
    unused = sorted(set(ckpt) - set(model_rel))
    problems = []
    if missing:
        problems.append(f"{len(missing)} model tensors not in the checkpoint, e.g. {missing[:5]}")
    if unused:
        problems.append(f"{len(unused)} checkpoint tensors not used by the model, e.g. {unused[:5]}")
    for k in sorted(set(model_rel) & set(ckpt)):
        want, got = ckpt[k], model_rel[k]
        if tuple(want.shape) != tuple(got.shape):
            problems.append(f"{k}: checkpoint shape {tuple(want.shape)} vs model {tuple(got.shape)}")
        elif want.dtype.is_floating_point:
            if not torch.equal(want.to(torch.float32), got.to(torch.float32)):
                problems.append(f"{k}: values differ from the checkpoint")
        elif not torch.equal(want.to(torch.int64), got.to(torch.int64)):
            problems.append(f"{k}: integer values differ from the checkpoint (tid2eid not loaded?)")
        if len(problems) > 20:
            break
    if problems:
        raise AssertionError(f"HF did not load {ckpt_dir} faithfully:\n  " + "\n  ".join(problems))


def hf_load(ckpt_dir: str | Path, *, clamp_shared: bool = True, verify: bool = True):
    """``DeepseekV4ForCausalLM`` from ``ckpt_dir`` in fp32, eval mode, on CPU.

    ``ckpt_dir`` holds a ``config.json`` (release/HF keys) and safetensors in the release naming (or a
    ``save_pretrained`` directory). Loading fails loudly if transformers reports missing, unexpected (other
    than ``mtp.*``) or shape-mismatched keys, and, with ``verify`` (default), if any model tensor (``tid2eid``
    and the router bias included) differs from the checkpoint tensor it should have come from.

    ``clamp_shared`` documents the comparison mode only: transformers always applies ``swiglu_limit`` to the
    shared expert too (``DeepseekV4MLP`` has no switch; the reference does not clamp it). Comparing against
    this oracle therefore needs the implementation's shared-expert clamp ON. Passing ``False`` is refused.
    """
    from transformers import DeepseekV4ForCausalLM

    if not clamp_shared:
        raise ValueError("transformers always clamps the shared expert (swiglu_limit); it has no switch")
    ckpt_dir = Path(ckpt_dir)
    model, info = DeepseekV4ForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32, output_loading_info=True)
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not re.search(r"(^|\.)mtp\.", k))
    bad = {
        "missing_keys": sorted(info.get("missing_keys", ())),
        "unexpected_keys": unexpected,
        "mismatched_keys": sorted(info.get("mismatched_keys", ())),
        "error_msgs": list(info.get("error_msgs", ())),
        "conversion_errors": dict(info.get("conversion_errors", {}) or {}),
    }
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        raise AssertionError(f"transformers could not load {ckpt_dir} cleanly: {bad}")
    model = model.to(torch.float32).eval()
    if verify:
        _verify_loaded(model, ckpt_dir)
    return model


# --------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------


def _ids_tensor(ids: Iterable[int]) -> torch.Tensor:
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("empty token list")
    return torch.tensor([ids], dtype=torch.long)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: Iterable[int], n_steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode with HF's own cache: one prefill forward over the prompt, then ``n_steps`` one-token steps.

    Returns ``(ids, logits)`` with ``len(ids) == n_steps + 1`` and ``len(logits) == n_steps + 1``:
    ``logits[0]`` is the fp32 ``[V]`` distribution of the last prompt token and ``ids[0]`` its argmax;
    ``logits[i]`` (i >= 1) comes from the decode step fed ``ids[i-1]``, and ``ids[i] = argmax(logits[i])``.
    So ``logits[i]`` is always the distribution that produced ``ids[i]``; the last id was not fed back.
    Ties in argmax go to the lowest token id (``torch.argmax``).
    """
    from transformers import DynamicCache

    x = _ids_tensor(prompt_ids)
    n_prompt = x.shape[1]
    cache = DynamicCache(config=model.config)
    out = model(input_ids=x, cache=cache, use_cache=True, position_ids=torch.arange(n_prompt)[None])
    step_logits = out.logits[0, -1].float()
    ids: list[int] = []
    logits: list[np.ndarray] = []
    for step in range(n_steps + 1):
        logits.append(step_logits.numpy().copy())
        ids.append(int(torch.argmax(step_logits)))
        if step == n_steps:
            break
        pos = n_prompt + step
        out = model(
            input_ids=torch.tensor([[ids[-1]]]),
            cache=cache,
            use_cache=True,
            position_ids=torch.tensor([[pos]]),
        )
        step_logits = out.logits[0, -1].float()
    return ids, logits


@torch.inference_mode()
def hf_full_logits(model, ids: Iterable[int]) -> np.ndarray:
    """fp32 logits ``[T, V]`` of one cache-free forward over ``ids`` (row t predicts token t+1)."""
    x = _ids_tensor(ids)
    out = model(input_ids=x, use_cache=False, position_ids=torch.arange(x.shape[1])[None])
    return out.logits[0].float().numpy().copy()
