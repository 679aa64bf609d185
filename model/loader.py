"""Load a release-layout checkpoint into DeepseekV4 (the embedded tiny model: model/tiny.py).

One tensor at a time: shards are opened lazily with mx.load, each model parameter is converted
(FP8/FP4 decoded, or repacked for MLX mxfp8/mxfp4) and evaluated before the next, so peak memory stays
near the final model size. Everything is validated against config.json: a missing, mis-shaped,
wrong-dtype or surplus tensor is an error naming it; nothing is zero-filled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dsv4_serve.kernels.matmul import weights_as_stored
from dsv4_serve.model.checkpoint import (
    FLOAT_DTYPES,
    INT_DTYPES,
    ROW_READABLE,
    TensorInfo,
    expert_param,
    is_f32_resident,
    read_layout,
    read_rows,
    scale_names,
)
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.deepseek_v4 import DeepseekV4
from dsv4_serve.model.load_progress import LoadProgress
from dsv4_serve.model.quant import (
    FP8_BLOCK,
    FP8_LINEAR,
    QuantizedExperts,
    dequant_fp4,
    dequant_fp8,
    fp4_grid,
    fp4_to_mxfp4,
    fp8_grid,
    fp8_to_mxfp8,
    mxfp8_linear,
)

log = logging.getLogger("dsv4.loader")
Slice = tuple[int, int, int]  # (axis, lo, hi) of a parameter's full shape: one rank's share (model/distributed.py)


class _Reader:
    """Lazy per-shard tensors plus the header facts mx.load loses (F8 dtypes)."""

    def __init__(self, model_dir: Path, args: ModelArgs):
        self.layout = read_layout(model_dir)
        self.args, self.used = args, set()
        self.progress = LoadProgress(self.layout)
        self._shards: dict[Path, dict[str, mx.array]] = {}

    def info(self, name: str) -> TensorInfo:
        if name not in self.layout:
            raise ValueError(f"tensor {name} is missing from the checkpoint")
        return self.layout[name]

    def get(self, name: str) -> mx.array:
        info = self.info(name)
        if info.file not in self._shards:
            try:
                self._shards[info.file] = mx.load(str(info.file))
            except Exception as e:  # mx.load errors do not name the tensor
                raise ValueError(f"tensor {name}: cannot read shard {info.file.name}: {e}") from None
        self.used.add(name)
        self.progress.read(name)
        # Hand the only reference over: once converted and evaluated, the source buffer is freed.
        return self._shards[info.file].pop(name)

    def skip(self, name: str) -> None:
        """A tensor of the checkpoint this load never reads (another rank's)."""
        self.used.add(name)
        self.progress.skip(name)

    def rows(self, name: str, lo: int, hi: int) -> mx.array:
        """Rows lo..hi of a tensor, reading only their bytes (a rank's heads of a sharded load)."""
        info = self.info(name)
        self.used.add(name)
        self.progress.read(name)  # counted whole: done, though only these rows were read
        return read_rows(info, lo, hi)

    def shape_error(self, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> ValueError:
        # Point at the config keys that produced the expected sizes (config contradicting the weights).
        ints = {f.name: getattr(self.args, f.name) for f in fields(self.args)
                if isinstance(getattr(self.args, f.name), int) and not isinstance(getattr(self.args, f.name), bool)}
        keys = sorted({k for w, g in zip(want, got, strict=False) if w != g for k, v in ints.items() if v == w})
        hint = f" (config.json: {', '.join(f'{k}={ints[k]}' for k in keys)})" if keys else ""
        return ValueError(f"tensor {name}: shape {list(got)} in the checkpoint, expected {list(want)}{hint}")

    def scale_of(self, weight: str, want: tuple[int, int]) -> tuple[str, mx.array]:
        for cand in scale_names(weight):
            if cand in self.layout:
                info = self.layout[cand]
                if info.dtype not in ("F8_E8M0", "U8", "F32"):
                    raise ValueError(f"tensor {cand}: dtype {info.dtype}, expected F8_E8M0 (UE8M0 scales)")
                if info.shape != want:
                    raise ValueError(f"tensor {cand}: scale grid {list(info.shape)} does not match weight "
                                     f"{weight} (expected {list(want)})")
                s = self.get(cand)
                if s.dtype == mx.uint8 and bool(mx.any(s == 255)):
                    raise ValueError(f"tensor {cand}: UE8M0 byte 0xFF (NaN scale)")
                return cand, s
        raise ValueError(f"tensor {scale_names(weight)[0]} (scale of {weight}) is missing from the checkpoint")

    def matrix(self, name: str, want: tuple[int, ...], dtype: mx.Dtype, quant: bool,
               rows: tuple[int, int] | None = None):  # fmt: skip
        """A float/FP8/FP4 2-D weight -> array in `dtype`, or ('mxfp8'|'mxfp4', weight, scales) if quant.
        rows: only rows lo..hi (read alone; FP8 on whole 128-row scale blocks), else None."""
        info = self.info(name)
        if rows is not None:
            return self._matrix_rows(name, info, want, dtype, quant, *rows)
        if info.dtype in FLOAT_DTYPES:
            if info.shape != want:
                raise self.shape_error(name, info.shape, want)
            return self.get(name).astype(dtype)
        if info.dtype in ("F8_E4M3", "U8"):
            if info.shape != want:
                raise self.shape_error(name, info.shape, want)
            sname, s = self.scale_of(name, fp8_grid(want))
            if quant and s.dtype == mx.uint8 and want[1] % 32 == 0:
                return ("mxfp8", *fp8_to_mxfp8(self.get(name), s))
            return dequant_fp8(self.get(name), s, dtype)
        if info.dtype == "I8" and len(want) == 2:  # FP4 e2m1, two per byte
            if want[1] % 32 or info.shape != (want[0], want[1] // 2):
                raise self.shape_error(name, info.shape, (want[0], want[1] // 2))
            sname, s = self.scale_of(name, fp4_grid(want))
            if s.dtype != mx.uint8:
                raise ValueError(f"tensor {sname}: FP4 scales must be F8_E8M0, got {self.layout[sname].dtype}")
            if quant:
                return ("mxfp4", *fp4_to_mxfp4(self.get(name), s))
            return dequant_fp4(self.get(name), s, dtype)
        raise ValueError(f"tensor {name}: dtype {info.dtype} is not a weight dtype (F32/BF16/F16/FP8/FP4)")

    def _matrix_rows(self, name: str, info: TensorInfo, want: tuple[int, ...], dtype: mx.Dtype, quant: bool,
                     lo: int, hi: int):  # fmt: skip
        if info.shape != want:
            raise self.shape_error(name, info.shape, want)
        if info.dtype in FLOAT_DTYPES:
            return self.rows(name, lo, hi).astype(dtype)
        sname, _ = next(((c, 0) for c in scale_names(name) if c in self.layout), (None, 0))
        if info.dtype not in ("F8_E4M3", "U8") or sname is None:
            raise ValueError(f"tensor {name}: dtype {info.dtype} cannot be read by rows")
        grid = fp8_grid(want)
        if self.layout[sname].shape != grid:
            raise ValueError(f"tensor {sname}: scale grid {list(self.layout[sname].shape)} does not match weight "
                             f"{name} (expected {list(grid)})")
        s = self.rows(sname, lo // FP8_BLOCK, -(-hi // FP8_BLOCK))
        if s.dtype == mx.uint8 and bool(mx.any(s == 255)):
            raise ValueError(f"tensor {sname}: UE8M0 byte 0xFF (NaN scale)")
        q = self.rows(name, lo, hi)
        if quant and s.dtype == mx.uint8 and want[1] % 32 == 0:
            return ("mxfp8", *fp8_to_mxfp8(q, s))
        return dequant_fp8(q, s, dtype)


def _tid2eid(r: _Reader, name: str, want: tuple[int, ...]) -> mx.array:
    info = r.info(name)
    if info.dtype not in INT_DTYPES:
        raise ValueError(f"tensor {name}: dtype {info.dtype}, expected an integer type (I32/I64)")
    if info.shape != want:
        raise r.shape_error(name, info.shape, want)
    t = r.get(name).astype(mx.int32)
    lo, hi = int(mx.min(t)), int(mx.max(t))
    if lo < 0 or hi >= r.args.n_routed_experts:
        raise ValueError(f"tensor {name}: expert ids in [{lo}, {hi}], need 0..{r.args.n_routed_experts - 1}")
    return t


def _module(model: DeepseekV4, path: str):
    """The module at a dotted parameter path ('layers.1.ffn', 'mtp.0.ffn')."""
    obj = model
    for p in path.split("."):
        obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
    return obj


def _set_module(model: DeepseekV4, path: str, module) -> None:
    parent, _, last = path.rpartition(".")
    setattr(_module(model, parent) if parent else model, last, module)


def load_model(
    model_dir: str | Path, *, dtype: mx.Dtype | None = None, clamp_shared_expert: bool = False,
    quantize: bool = False, shard: Callable[[str], tuple[int, int, int] | None] | None = None, mtp: bool = True,
) -> tuple[DeepseekV4, ModelArgs]:
    """config.json + release-named safetensors -> (model, args).

    dtype: model dtype (default: f32 for an F32 checkpoint or on the CPU, else bf16); hc_*, sinks, APE, router
    bias stay f32 as released. quantize: keep FP8 projections as mxfp8 and FP4 experts as mxfp4 MLX
    quantized weights instead of decoding them.
    shard: parameter name -> (axis, lo, hi) of its full shape to keep (model/distributed.py); routed experts
    outside [lo, hi) are never read, other slices are cut before evaluation. The caller marks the modules.
    mtp: load the MTP block (`mtp.0.*`, model/mtp.py) where config.json and the checkpoint have it; without it
    (or with mtp=False) the model has none and args.num_nextn_predict_layers is 0."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_file(model_dir / "config.json")
    args.clamp_shared_expert = clamp_shared_expert
    r = _Reader(model_dir, args)
    if args.num_nextn_predict_layers and not (mtp and any(n.startswith("mtp.") for n in r.layout)):
        log.info("no MTP block: %s", "not asked for" if not mtp else "no mtp.* tensors in the checkpoint")
        args.num_nextn_predict_layers = 0
    if dtype is None:
        # MLX's CPU gather_mm (the routed experts) is float32-only, so a CPU model is f32 whatever the storage.
        embed = r.layout.get("embed.weight")
        f32 = (embed is not None and embed.dtype == "F32") or mx.default_device() == mx.cpu
        dtype = mx.float32 if f32 else mx.bfloat16
    model = DeepseekV4(args)  # lazy zeros: replaced before anything is evaluated
    cache_limit = mx.set_cache_limit(0)  # freed source buffers go back to the OS, not MLX's cache
    try:
        _fill(model, args, r, dtype, quantize, shard)
    finally:
        mx.set_cache_limit(cache_limit)
    return model, args


def take(arr: mx.array, sl: Slice, full: int) -> mx.array:
    """Slice `arr` along sl's axis; `full` is that axis' logical size (packed/scale arrays are scaled)."""
    axis, lo, hi = sl
    k = arr.shape[axis]
    if (lo * k) % full or (hi * k) % full:
        raise ValueError(f"distributed: slice {lo}:{hi} of {full} does not fall on a packed boundary ({k})")
    ix = [slice(None)] * arr.ndim
    ix[axis] = slice(lo * k // full, hi * k // full)
    # A copy, not a view: the full source buffer must be freeable once this is evaluated.
    return arr[tuple(ix)] * 1


def _cut(x, sl: tuple[int, int, int] | None, full: int):
    """This rank's slice of an array or of a quantized (mode, weight, scales) triple; a copy, not a view."""
    if sl is None:
        return x
    if isinstance(x, tuple):
        return (x[0], take(x[1], sl, full), take(x[2], sl, full))
    return take(x, sl, full)


def _by_rows(r: _Reader, name: str, sl: tuple[int, int, int]) -> bool:
    """Can rows sl[1]..sl[2] of a 2-D weight be read alone? Floats always; FP8 on whole scale blocks."""
    info = r.info(name)
    if info.dtype in FLOAT_DTYPES:
        return True
    return info.dtype in ("F8_E4M3", "U8") and sl[1] % FP8_BLOCK == 0 and sl[2] % FP8_BLOCK == 0


def _fill(model: DeepseekV4, args: ModelArgs, r: _Reader, dtype: mx.Dtype, quantize: bool, shard=None) -> None:
    weights: list[tuple[str, mx.array]] = []
    as_stored = weights_as_stored()
    for name, p in tree_flatten(model.parameters()):
        want, pdt = tuple(p.shape), (mx.float32 if is_f32_resident(name, as_stored) else dtype)
        ex = expert_param(name)
        sl = shard(name) if shard else None
        if name.endswith("tid2eid"):
            arr = _tid2eid(r, name, want)
        elif ex:
            stem, w = ex
            lo, hi = (sl[1], sl[2]) if sl else (0, want[0])
            for e in (*range(lo), *range(hi, want[0])):  # other ranks' experts: never read
                r.skip(f"{stem}.{e}.{w}.weight")
                for n in scale_names(f"{stem}.{e}.{w}.weight"):
                    if n in r.layout:
                        r.skip(n)
            parts = [r.matrix(f"{stem}.{e}.{w}.weight", want[1:], pdt, quantize) for e in range(lo, hi)]
            if all(isinstance(x, tuple) and x[0] == "mxfp4" for x in parts):
                mods = _module(model, stem.removesuffix(".experts"))
                if not isinstance(mods.experts, QuantizedExperts):
                    mods.experts = QuantizedExperts({}, args.swiglu_limit)
                setattr(mods.experts, w, mx.stack([x[1] for x in parts]))
                setattr(mods.experts, f"{w}_scales", mx.stack([x[2] for x in parts]))
                mx.eval(getattr(mods.experts, w), getattr(mods.experts, f"{w}_scales"))
                continue
            parts = [x if not isinstance(x, tuple) else r.matrix(f"{stem}.{e}.{w}.weight", want[1:], pdt, False)
                     for e, x in zip(range(lo, hi), parts, strict=True)]
            arr = mx.stack(parts)
        elif p.ndim == 2 and name.endswith(".weight"):
            quant = quantize and name[: -len(".weight")].split(".", 2)[-1] in FP8_LINEAR
            if sl is not None and sl[0] == 0 and _by_rows(r, name, sl):  # a rank's heads: only their rows read
                arr = r.matrix(name, want, pdt, quant, rows=(sl[1], sl[2]))
            else:
                arr = r.matrix(name, want, pdt, quant)
                arr = _cut(arr, sl, want[sl[0]]) if sl else arr
            if isinstance(arr, tuple):
                lin = mxfp8_linear(arr[1], arr[2])
                mx.eval(lin.parameters())
                _set_module(model, name[: -len(".weight")], lin)
                continue
        else:
            info = r.info(name)
            if info.dtype not in FLOAT_DTYPES:
                raise ValueError(f"tensor {name}: dtype {info.dtype}, expected a float type (F32/BF16/F16)")
            if info.shape != want:
                raise r.shape_error(name, info.shape, want)
            if sl is not None and sl[0] == 0 and info.dtype in ROW_READABLE:  # attn_sink: a rank's heads
                arr = r.rows(name, sl[1], sl[2]).astype(pdt)
            else:
                arr = _cut(r.get(name).astype(pdt), sl, want[sl[0]] if sl else 0)
        mx.eval(arr)
        weights.append((name, arr))
    r.progress.finish()
    mtp = [n for n in r.layout if n.startswith("mtp.")] if not model.mtp else []
    if mtp:
        log.info("skipping %d mtp.* tensors (the MTP block is not loaded)", len(mtp))
    extra = sorted(set(r.layout) - r.used - set(mtp))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ValueError(f"unexpected tensors in the checkpoint (not in the model for config.json with "
                         f"num_hidden_layers={args.num_hidden_layers}): {', '.join(extra[:5])}{more}")
    model.load_weights(weights, strict=False)
    for mods in (m.ffn for m in model.blocks()):
        if isinstance(mods.experts, QuantizedExperts) and len(mods.experts.parameters()) != 6:
            raise ValueError("experts: some projections are FP4 and others not; cannot mix in one layer")
    mx.eval(model.parameters())
