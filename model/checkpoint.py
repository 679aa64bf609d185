"""Release checkpoint layout (spec section 4): safetensors headers, names, storage dtypes, and the writer.

Safetensors are written by hand (8-byte header length, JSON header, raw bytes): F8_E4M3 / F8_E8M0 have
no NumPy dtype, and writing tensor by tensor keeps memory flat. Reading uses `mx.load`; the headers are
parsed here as well, because mx.load reports F8 tensors as plain uint8 and cannot tell a truncated file.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.quant import encode_fp4, encode_fp8
from dsv4_serve.model.tokenizer import tokenizer_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_DTYPES = {"F32", "BF16", "F16"}
INT_DTYPES = {"I32", "I64"}
_DTYPE_SIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I32": 4,
               "I64": 8, "I16": 2, "U16": 2, "U32": 4, "F64": 8, "BOOL": 1}
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(w[123])$")  # a layer's or the MTP block's
# Release F32 tensors (kept f32 in the model whatever its dtype; spec section 4 / MLX-PR cast_predicate).
_F32 = re.compile(r"(^|\.)(hc_\w+|attn_sink|ape|gate\.bias)$")
# Dense projections the release stores as FP8 e4m3 + UE8M0 per 128x128 block (the MTP block's e_proj / h_proj too).
_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|e_proj|h_proj)"
                  r"\.weight$")


# Weights the model multiplies in f32 (REF upcasts them: the compressors' kv / gate projections, the
# router and the output head). Kept f32 in memory so that a step casts nothing (an upcast inside the step
# is a graph node and a full f32 copy of the weight per step: ~70 MB of traffic per CSA layer, ~3 GB for
# the 129K x 4K head), unless the skinny CUDA kernels run (`kernels.matmul.weights_as_stored`): they read
# the stored bf16 and multiply exactly in f32, half the bytes of the f32 copy.
_F32_COMPUTE = re.compile(r"(^|\.)(compressor\.(wkv|wgate)|ffn\.gate)\.weight$|^head\.weight$")


def is_f32_param(name: str) -> bool:
    return bool(_F32.search(name))


def is_f32_compute(name: str) -> bool:
    """Multiplied in f32 by the model (see _F32_COMPUTE); not f32 in the release."""
    return bool(_F32_COMPUTE.search(name))


def is_f32_resident(name: str, as_stored: bool = False) -> bool:
    """f32 in memory whatever the model dtype: the release's f32 tensors, and the f32-multiplied weights
    unless `as_stored` (kernels.matmul.weights_as_stored())."""
    return is_f32_param(name) or (not as_stored and is_f32_compute(name))


def is_fp8_weight(name: str) -> bool:
    return bool(_FP8.search(name))


def expert_param(name: str) -> tuple[str, str] | None:
    """'layers.1.ffn.experts.w1' -> ('layers.1.ffn.experts', 'w1') for the stacked model parameter (also
    'mtp.0.ffn.experts.w1')."""
    m = _EXPERT.match(name)
    return (m.group(1), m.group(2)) if m else None


def scale_names(weight: str) -> tuple[str, str]:
    stem = weight[: -len(".weight")]
    return f"{stem}.scale", f"{weight}_scale_inv"


# ---- reading headers -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = -1  # of its first byte in the file (-1: unknown)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Names -> (file, dtype, shape); checks that every tensor's bytes lie inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"shard {path.name}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"shard {path.name}: truncated (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"shard {path.name}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        shape, (lo, hi) = tuple(int(d) for d in h["shape"]), h["data_offsets"]
        want = int(np.prod(shape, dtype=np.int64)) * _DTYPE_SIZE.get(h["dtype"], 1)
        if hi - lo != want:
            raise ValueError(f"tensor {name} in {path.name}: {hi - lo} bytes for {h['dtype']} {list(shape)}")
        if 8 + n + hi > size:
            raise ValueError(f"tensor {name} in {path.name}: shard is truncated ({size} bytes, "
                             f"tensor ends at {8 + n + hi})")
        out[name] = TensorInfo(path, h["dtype"], shape, 8 + n + lo)
    return out


ROW_READABLE = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8,
       "U8": np.uint8, "I8": np.int8}


def read_rows(info: TensorInfo, lo: int, hi: int) -> mx.array:
    """Rows lo..hi (along axis 0) of a safetensors tensor: only their bytes are read (a memory map)."""
    if info.dtype not in ROW_READABLE or info.offset < 0:
        raise ValueError(f"read_rows: cannot read {info.dtype} rows of {info.file.name}")
    if not 0 <= lo < hi <= info.shape[0]:
        raise ValueError(f"read_rows: rows {lo}..{hi} outside 0..{info.shape[0]}")
    dt = np.dtype(ROW_READABLE[info.dtype])
    row = int(np.prod(info.shape[1:], dtype=np.int64))
    m = np.memmap(info.file, dtype=dt, mode="r", offset=info.offset + lo * row * dt.itemsize,
                  shape=(hi - lo, *info.shape[1:]))
    out = mx.array(np.array(m))
    return out.view(mx.bfloat16) if info.dtype == "BF16" else out


def read_layout(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint, from the index (sharded) or the single model.safetensors."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{INDEX}: malformed ({e})") from None
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
    elif (model_dir / SINGLE).is_file():
        files, weight_map = {SINGLE: []}, {}
    else:
        raise ValueError(f"no {INDEX} or {SINGLE} in {model_dir}")
    layout: dict[str, TensorInfo] = {}
    for file, names in files.items():
        path = model_dir / file
        if not path.is_file():
            raise ValueError(f"shard file {file} is missing (it holds tensor {names[0]}, ...)")
        header = read_header(path)
        for name in names:
            if name not in header:
                raise ValueError(f"tensor {name}: listed in {INDEX} under {file} but not in that shard")
        for name, info in header.items():
            if weight_map and weight_map.get(name) != file:
                continue  # the index decides which copy counts
            layout[name] = info
    return layout


# ---- writing ---------------------------------------------------------------------------------------
def _np_bytes(a: mx.array) -> tuple[str, np.ndarray]:
    if a.dtype == mx.bfloat16:
        return "BF16", np.array(a.view(mx.uint16))
    table = {mx.float32: "F32", mx.float16: "F16", mx.int32: "I32", mx.int64: "I64", mx.uint8: "U8",
             mx.int8: "I8"}
    return table[a.dtype], np.array(a)


def release_tensors(model, args: ModelArgs, dtype: str):
    """Yield (release name, safetensors dtype, ndarray) for every tensor, experts unstacked."""
    if dtype not in ("float32", "bfloat16", "release"):
        raise ValueError(f"write_checkpoint: dtype must be float32, bfloat16 or release, got {dtype!r}")
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("tid2eid"):
            yield name, *_np_bytes(p.astype(mx.int64 if dtype == "release" else mx.int32))
            continue
        if is_f32_param(name) or dtype == "float32":
            p = p.astype(mx.float32)
        elif dtype == "bfloat16" or not (is_fp8_weight(name) or expert_param(name)):
            p = p.astype(mx.bfloat16)
        ex = expert_param(name)
        if ex:
            for e in range(p.shape[0]):
                w = f"{ex[0]}.{e}.{ex[1]}.weight"
                if dtype == "release":
                    packed, sb = encode_fp4(np.array(p[e].astype(mx.float32)))
                    yield w, "I8", packed
                    yield f"{ex[0]}.{e}.{ex[1]}.scale", "F8_E8M0", sb
                else:
                    yield w, *_np_bytes(p[e])
        elif dtype == "release" and is_fp8_weight(name):
            q, sb = encode_fp8(np.array(p.astype(mx.float32)))
            yield name, "F8_E4M3", q
            yield scale_names(name)[0], "F8_E8M0", sb
        else:
            yield name, *_np_bytes(p)


def write_safetensors(path: Path, tensors: list[tuple[str, str, np.ndarray]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dt, a in tensors:
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, a in tensors:
            f.write(np.ascontiguousarray(a).tobytes())


def write_checkpoint(
    model, args: ModelArgs, out_dir: str | Path, *, dtype: str = "float32", shards: int = 1,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """config.json + safetensors in the release naming (+ index when sharded) + tokenizer files.

    dtype "release": FP8/FP4 + UE8M0 exactly as the official release stores them (spec section 4)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = list(release_tensors(model, args, dtype))
    cfg = args.to_config_json()
    cfg["torch_dtype"] = "float32" if dtype == "float32" else "bfloat16"
    cfg.pop("quantization_config", None)  # float weights: a stale FP8 config would mislead transformers
    if dtype == "release":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        cfg["expert_dtype"] = "fp4"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for stale in [out / SINGLE, out / INDEX, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    shards = max(1, min(shards, len(tensors)))
    if shards == 1:
        write_safetensors(out / SINGLE, tensors)
    else:
        total = sum(a.nbytes for _, _, a in tensors)
        groups: list[list[tuple[str, str, np.ndarray]]] = [[] for _ in range(shards)]
        acc = 0
        for t in tensors:  # contiguous split by bytes; every shard gets at least one tensor
            i = min(shards - 1, acc * shards // max(total, 1))
            groups[i].append(t)
            acc += t[2].nbytes
        groups = [g for g in groups if g]
        weight_map = {}
        for i, g in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            write_safetensors(out / file, g)
            weight_map.update({name: file for name, _, _ in g})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer), indent=2) + "\n")
        gen = {"bos_token_id": args.bos_token_id, "eos_token_id": args.eos_token_id, "do_sample": False}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
