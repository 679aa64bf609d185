"""Random weights at release precision for a config, with no checkpoint: `serve --load-format dummy`
(vLLM's name) and the benchmarks (bench/step.py, bench/distributed_step.py) build their models here.

The model is what `load_model(quantize=True)` makes of a release checkpoint: the FP8 projections of the
`model.quant.FP8_LINEAR` as mxfp8 QuantizedLinear, the routed experts as mxfp4 QuantizedExperts (as
model/quant.py's quantize_model does), the rest in the model dtype, the release's F32 tensors
and the f32-multiplied weights as the loader keeps them (checkpoint.is_f32_resident with
kernels.matmul.weights_as_stored(): f32 copies unless the skinny kernels read them as stored), tid2eid int32.
Built one tensor at a time on the default device: each is drawn, cut to the rank's shard, quantized
and evaluated before the next, and each expert projection of a layer is drawn expert by expert; the
peak is the final model plus one layer's float draw of one expert projection (no float copy of the
model ever exists).

The MTP block (`mtp.0.*`, model/mtp.py) is drawn too, quantized as the layers are, where the config has one.

Every tensor (every expert of a stacked tensor) has a key of its own from (seed, name[, expert]), so a
rank's shard (`group`) holds exactly the slices of the full model that `shard_model` would cut: ranks
build only their own experts and heads, and agree on everything replicated.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from dsv4_serve.kernels.matmul import weights_as_stored
from dsv4_serve.model.checkpoint import expert_param, is_f32_resident
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.deepseek_v4 import DeepseekV4
from dsv4_serve.model.quant import FP4_GROUP, FP8_LINEAR, QuantizedExperts, mxfp8_linear

log = logging.getLogger("dsv4.loader")

PRESETS = ("flash", "pro", "tiny")


def preset_args(name: str) -> ModelArgs:
    """'flash' / 'pro': the released V4 configs (model/skeleton.py); 'tiny': ModelArgs.tiny()."""
    from dsv4_serve.model.skeleton import flash_args, pro_args

    makers = {"flash": flash_args, "pro": pro_args, "tiny": ModelArgs.tiny}
    if name not in makers:
        raise ValueError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)} or a config.json path")
    return makers[name]()


def cut(args: ModelArgs, *, experts: int | None = None, layers: int | None = None) -> ModelArgs:
    """A copy with the routed experts cut to `experts` (the released top-k kept) and the first `layers`
    layers (the config's own layer schedule, hash layers capped)."""
    a = dataclasses.replace(args, compress_ratios=list(args.compress_ratios))
    if experts is not None:
        if not isinstance(experts, int) or not a.num_experts_per_tok <= experts <= args.n_routed_experts:
            raise ValueError(f"experts must be in {a.num_experts_per_tok}..{args.n_routed_experts} "
                             f"(num_experts_per_tok..n_routed_experts of the config), got {experts!r}")
        a.n_routed_experts = experts
    if layers is not None:
        if not isinstance(layers, int) or not 1 <= layers <= args.num_hidden_layers:
            raise ValueError(f"layers must be in 1..{args.num_hidden_layers} (num_hidden_layers of the config), "
                             f"got {layers!r}")
        a.num_hidden_layers = layers
        a.compress_ratios = a.compress_ratios[:layers]
        a.num_hash_layers = min(a.num_hash_layers, layers)
    a.validate()
    return a


def resolve_args(spec: str, *, experts: int | None = None, layers: int | None = None) -> ModelArgs:
    """`--model` of `--load-format dummy`: a preset name, or a config.json (the file or its directory)."""
    if spec in PRESETS:
        args = preset_args(spec)
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                             f"(file or directory): {path} does not exist")
        args = ModelArgs.from_file(path)
    return cut(args, experts=experts, layers=layers)


def _key(seed: int, name: str) -> mx.array:
    return mx.random.key(zlib.crc32(f"{seed}:{name}".encode()))


def _draw(name: str, shape: tuple[int, ...], dtype: mx.Dtype, key: mx.array) -> mx.array:
    """One tensor, scaled so that activations stay O(1) (the rules of model.tiny.randomize)."""
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * mx.random.normal(shape, key=key)).astype(dtype)
    if name.endswith(("_scale", "hc_head_scale")):
        return mx.random.uniform(0.5, 1.5, shape, key=key).astype(dtype)
    if name.endswith(("_base", "attn_sink", "ape")):
        return (0.5 * mx.random.normal(shape, key=key)).astype(dtype)
    if name.endswith("gate.bias"):
        return (0.1 * mx.random.normal(shape, key=key)).astype(dtype)
    std = 1.0 if name == "embed.weight" else shape[-1] ** -0.5  # projections: 1/sqrt(fan_in)
    return mx.random.normal(shape, dtype=dtype, key=key) * mx.array(std, dtype)


def _tid2eid(shape: tuple[int, ...], n_experts: int, key: mx.array) -> mx.array:
    """Hash-layer routing table: distinct experts per token. Drawn on the CPU: MLX's CUDA sort launches a block
    row per sorted row, and 129,280 rows are past the grid's 65,535 (cudaGraphAddKernelNode: invalid argument)."""
    u = mx.random.uniform(shape=(shape[0], n_experts), key=key, stream=mx.cpu)
    return mx.argsort(u, axis=-1, stream=mx.cpu)[:, : shape[1]].astype(mx.int32, stream=mx.cpu)


def _experts(name: str, shape: tuple[int, ...], lo: int, hi: int, dtype: mx.Dtype, seed: int,
             quantize: bool) -> tuple[mx.array, ...]:  # fmt: skip
    """Experts lo..hi of a stacked [E, out, in] projection: (mxfp4 weight, scales) or (float weight,)."""
    w = mx.stack([_draw(name, shape[1:], dtype, _key(seed, f"{name}.{e}")) for e in range(lo, hi)])
    out = mx.quantize(w, group_size=FP4_GROUP, bits=4, mode="mxfp4") if quantize else (w,)
    mx.eval(*out)
    return tuple(out)


def dummy_model(
    args: ModelArgs, *, experts: int | None = None, layers: int | None = None, seed: int = 0,
    dtype: mx.Dtype | None = None, quantize: bool = True, group: Any = None,
) -> DeepseekV4:
    """Random weights for `args` (cut to `experts` / `layers`), laid out as the loader lays out a release
    checkpoint. dtype: the model dtype (default as load_model: f32 on the CPU, else bf16). quantize=False:
    what `load_model(quantize=False)` keeps (`serve --dequantize`). group: an mx.distributed group (or any
    object with rank() / size()) of > 1 ranks: build only this rank's shard (model/distributed.py)."""
    from dsv4_serve.model.distributed import mark_sharded, shard_slices
    from dsv4_serve.model.loader import _module, _set_module, take

    args = cut(args, experts=experts, layers=layers)
    if dtype is None:
        dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    sharded = group is not None and group.size() > 1
    rule = shard_slices(args, group.rank(), group.size()) if sharded else (lambda _name: None)
    model = DeepseekV4(args)  # lazy zeros: every parameter is replaced before anything is evaluated
    weights: list[tuple[str, mx.array]] = []
    as_stored = weights_as_stored()
    what, t0, done = "dummy weights" + (" of this rank's shard" if sharded else ""), time.perf_counter(), 0
    cache_limit = mx.set_cache_limit(0)  # freed draws go back to the allocator's owner, not MLX's cache
    try:
        for name, p in tree_flatten(model.parameters()):
            shape, sl = tuple(p.shape), rule(name)
            pdt = mx.float32 if is_f32_resident(name, as_stored) else dtype
            layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
            if layer > done:  # a layer is done: its progress in the log
                _progress(what, layer, args.num_hidden_layers, t0)
                done = layer
            ex = expert_param(name)
            if name.endswith("tid2eid"):
                arr = _tid2eid(shape, args.n_routed_experts, _key(seed, name))
            elif ex:
                lo, hi = (sl[1], sl[2]) if sl else (0, shape[0])
                parts = _experts(name, shape, lo, hi, pdt, seed, quantize)
                ffn = _module(model, name.rsplit(".", 2)[0])  # a layer's or the MTP block's (mtp.0.ffn)
                if quantize:
                    if not isinstance(ffn.experts, QuantizedExperts):
                        ffn.experts = QuantizedExperts({}, args.swiglu_limit)
                    setattr(ffn.experts, ex[1], parts[0])
                    setattr(ffn.experts, f"{ex[1]}_scales", parts[1])
                else:
                    weights.append((name, parts[0]))
                continue
            else:
                arr = _draw(name, shape, pdt, _key(seed, name))
                if sl is not None:
                    arr = take(arr, sl, shape[sl[0]])
                stem = name.removesuffix(".weight")
                if (quantize and p.ndim == 2 and stem.split(".", 2)[-1] in FP8_LINEAR and stem != name
                        and arr.shape[1] % 32 == 0):  # fmt: skip
                    lin = mxfp8_linear(*mx.quantize(arr, group_size=32, bits=8, mode="mxfp8"))
                    mx.eval(lin.parameters())
                    _set_module(model, stem, lin)
                    continue
            mx.eval(arr)
            weights.append((name, arr))
        model.load_weights(weights, strict=False)
        mx.eval(model.parameters())
    finally:
        mx.set_cache_limit(cache_limit)
    if sharded:
        mark_sharded(model, group)
    model.reset_compiled()
    _progress(what, args.num_hidden_layers, args.num_hidden_layers, t0)
    return model


def _progress(what: str, done: int, n: int, t0: float) -> None:
    log.info("%s: %d/%d layers, %.2f GiB, %.1f s", what, done, n, mx.get_active_memory() / 2**30,
             time.perf_counter() - t0)


# ---- memory arithmetic ----------------------------------------------------------------------------
def resident_bytes(args: ModelArgs, *, dtype_bytes: int = 2, ranks: int = 1, as_stored: bool | None = None) -> int:
    """Bytes of dummy_model(args) (quantized) on one of `ranks` ranks, from the shapes alone: mxfp4 is
    K/2 + K/32 bytes a row, mxfp8 K + K/32, f32-resident tensors 4 bytes an element, the rest dtype_bytes.
    as_stored: the f32-multiplied weights in the model dtype (default: weights_as_stored(), as built)."""
    as_stored = weights_as_stored() if as_stored is None else as_stored
    from dsv4_serve.model.distributed import shard_slices

    rule = shard_slices(args, 0, ranks) if ranks > 1 else (lambda _name: None)
    total = 0
    for name, p in tree_flatten(DeepseekV4(args).parameters()):  # lazy: nothing allocated
        shape = list(p.shape)
        sl = rule(name)
        if sl is not None:  # the float model's shapes are the logical ones the slices are given in
            shape[sl[0]] = sl[2] - sl[1]
        n = 1
        for d in shape:
            n *= d
        rows, k = n // shape[-1], shape[-1]
        stem = name.removesuffix(".weight")
        if name.endswith("tid2eid") or is_f32_resident(name, as_stored):
            total += 4 * n
        elif expert_param(name):
            total += rows * (k // 2 + k // 32)
        elif len(shape) == 2 and stem != name and stem.split(".", 2)[-1] in FP8_LINEAR and k % 32 == 0:
            total += rows * (k + k // 32)
        else:
            total += dtype_bytes * n
    return total

