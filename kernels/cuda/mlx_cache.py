"""MLX's kernel cache filled for our `mx.fast.cuda_kernel`s, so a restart loads them instead of building them again.

MLX (0.31-0.32, mlx/backend/cuda/custom_kernel.cpp) builds a custom kernel with NVRTC on its first launch in each
process and never writes it to its disk cache (`get_jit_module(..., use_disk_cache=false)`), but looks there
first (`read_cached_ptx`) under the module name `<kernel name>_<hex std::hash of its source>`: on an H100 a warm
restart spent ~100 s building our kernels again (docs/cuda_graphs.md#start-up). So, once a warm-up has launched
each variant (`Noter`, a factory standing in for `mx.fast.cuda_kernel` as the graphs' recorder does), `populate`
writes an entry for each: the source MLX generates (`mlx_source`: its build_kernel, reproduced), the module name
(`std_hash`: libstdc++'s std::hash, reproduced), a cubin of that source built by kernels/graph/nvrtc.py with our
prelude in place of MLX's device header (as the decode graphs build every step kernel, replayed bit for bit equal
to MLX's) and its lowered name. An entry whose source differs from MLX's by one byte has another name, and MLX
never reads it: no other kernel is ever loaded, at worst nothing is saved.

On by default (`DSV4_KERNEL_CACHE`: `1`; `watch` also notes while serving; `0` off: service/engine/warmup.py). On an
H100 (2026-12-07, c6e72db, `bench/gpu_all.sh PART=verify`, V4-Flash dims, 8 layers) the MLX-step server's warm-up
took 120.6 s cold and 1.3 s restarted over the entries the first start wrote (63 variants, 71.5 s in the
background), and the restarted server's 3,456 greedy tokens equalled the cold one's (MLX's own NVRTC builds).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import CUDA_TYPES, template_lines

log = logging.getLogger("dsv4.kernels")

MASK = (1 << 64) - 1
MUL = (0xC6A4A793 << 32) + 0x5BD1E995
SEED = 0xC70F6907
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
# mlx/backend/common/compiled.cpp get_type_string (the template hash; the signature's types are common.CUDA_TYPES,
# its dtype_to_cuda_type), for the dtypes our kernels take
TYPE_STRING = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.int32: "int32_t",
               mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int64: "int64_t", mx.bool_: "bool"}  # fmt: skip
MAX_NAME = 245  # mlx/backend/cuda/jit_module.cpp get_ptx_path: longer module names become directories


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash<std::string> on 64-bit Linux: _Hash_bytes(data, len, 0xc70f6907)."""
    n, h = len(data), (SEED ^ (len(data) * MUL)) & MASK
    end = n & ~7
    for i in range(0, end, 8):
        k = (int.from_bytes(data[i : i + 8], "little") * MUL) & MASK
        h = ((h ^ (((k ^ (k >> 47)) * MUL) & MASK)) * MUL) & MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[end:], "little")) * MUL) & MASK
    h = ((h ^ (h >> 47)) * MUL) & MASK
    return h ^ (h >> 47)


def kernel_name(name: str, template: Sequence[tuple[str, Any]]) -> str:
    """`custom_kernel_<name><template hash>`, as MLX names the kernel (template_arguments_hash)."""
    parts = []
    for _, v in template:
        if isinstance(v, bool):
            parts.append("_t" if v else "_f")
        elif isinstance(v, int):
            parts.append(f"_{v}")
        else:
            parts.append(f"_{TYPE_STRING[v]}")
    return "custom_kernel_" + name + "".join(parts)


def mlx_source(func: str, header: str, source: str, inputs: Sequence[tuple[str, mx.Dtype, int]],
               outputs: Sequence[tuple[str, mx.Dtype]], template: Sequence[tuple[str, Any]]) -> str:  # fmt: skip
    """The kernel source MLX builds for one launch (custom_kernel.cpp build_kernel): `inputs` (name, dtype, ndim)."""
    out = [DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
           f"__global__ void {func}(\n"]  # fmt: skip
    for n, dtype, ndim in inputs:
        out.append(f"    const {CUDA_TYPES[dtype]}* {n},\n")
        if ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + suffix in source:
                    out.append(f"    const __grid_constant__ {kind} {n}{suffix},\n")
    for i, (n, dtype) in enumerate(outputs):
        out.append(f"    {CUDA_TYPES[dtype]}* {n}" + (",\n" if i < len(outputs) - 1 else ") {\n"))
    out += [line + "\n" for line in template_lines(template)] + (["\n"] if template else [])
    return "".join([*out, source, "\n}\n\n} // namespace mlx::core::cu\n"])


def module_name(func: str, text: str) -> str:
    return f"{func}_{std_hash(text.encode()):x}"


def unit(text: str) -> str:
    """The translation unit our NVRTC builds for MLX's source: our prelude (kernels/graph/codegen.py) and MLX's
    Shape / Strides (device/utils.cuh: libcu++ arrays of MAX_NDIM) in place of its device header."""
    from dsv4_serve.kernels.graph.codegen import PRELUDE

    prelude = [line for line in PRELUDE if not line.startswith("struct Shape")]
    alias = ("namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, MAX_NDIM>; "
             "using Strides = cuda::std::array<int64_t, MAX_NDIM>; }")  # fmt: skip
    return text.replace(DEFAULT_HEADER, "\n".join(["", *prelude, alias, "", ""]), 1)


def ptx_path(cache: Path, module: str) -> Path:
    """Where MLX reads a module's cubin (get_ptx_path)."""
    if len(module) <= MAX_NAME:
        return cache / f"{module}.ptx"
    *dirs, last = [module[i : i + MAX_NAME] for i in range(0, len(module), MAX_NAME)]
    return cache.joinpath(*dirs) / f"{last}.ptx"


def cache_dir() -> Path:
    """MLX's kernel cache (jit_module.cpp ptx_cache_dir): MLX_PTX_CACHE_DIR, else <tmp>/mlx/<version>/ptx."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def write_entry(cache: Path, module: str, func: str, cubin: bytes, lowered: str) -> None:
    """The .txt (kernel name, tab, lowered name) first, then the cubin renamed into place: MLX reads an entry
    only once its .ptx exists."""
    path = ptx_path(cache, module)
    path.parent.mkdir(parents=True, exist_ok=True)
    for data, suffix in ((f"mlx::core::cu::{func}\t{lowered}\n".encode(), ".txt"), (cubin, ".ptx")):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".dsv4-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path.with_suffix(suffix))


class Noter:
    """Stands in for `mx.fast.cuda_kernel` (over MLX's or the graphs' recorder's): each kernel object it makes
    notes the variants it launches while `noting`, for `populate`. Once `warmed` (the warm-up over), a variant
    noted for the first time is logged and counted (`late`): MLX builds it with NVRTC in a request's path (~1-2.5 s
    on an H100), which is what a warm-up that missed a serving shape costs a user."""

    def __init__(self) -> None:
        self.base: Callable[..., Any] | None = None
        self.noting = True
        self.warmed = False
        self.late = 0  # variants first launched after the warm-up
        self.variants: dict[str, tuple[str, str]] = {}  # module name -> (kernel name, MLX's source)
        self.lock = threading.Lock()

    def install(self, base: Callable[..., Any] | None = None) -> None:
        """In place of `mx.fast.cuda_kernel`, over `base` (default: the factory there now); the kernel objects made
        so far are dropped, so that every later launch goes through it."""
        from dsv4_serve.kernels import upload
        from dsv4_serve.kernels.cuda.common import forget_kernels

        self.base = base or mx.fast.cuda_kernel
        mx.fast.cuda_kernel = self.factory
        forget_kernels()
        upload._kernels.clear()

    def factory(self, *, name: str, input_names: list[str], output_names: list[str], source: str,
                header: str = "", **kw: Any) -> Callable[..., Any]:  # fmt: skip
        assert self.base is not None
        obj = self.base(name=name, input_names=input_names, output_names=output_names, source=source, header=header,
                        **kw)  # fmt: skip
        seen: set[tuple[Any, ...]] = set()

        def note(call: dict[str, Any]) -> None:
            template = list(call.get("template") or ())
            ins = [(n, a.dtype, a.ndim) for n, a in zip(input_names, call["inputs"], strict=True)]
            key = (tuple(template), tuple(ins), tuple(call["output_dtypes"]))
            if key in seen:
                return
            seen.add(key)
            func = kernel_name(name, template)
            outs = list(zip(output_names, call["output_dtypes"], strict=True))
            text = mlx_source(func, header, source, ins, outs, template)
            late = self.warmed
            with self.lock:
                self.variants[module_name(func, text)] = (func, text)
                self.late += late
            if late:
                log.warning("kernel variant first launched after the warm-up (built in a request's path): %s %s",
                            func, ins)  # fmt: skip

        def launch(*args: Any, **call: Any) -> Any:
            if self.noting:
                try:
                    note(call)
                except Exception:  # noqa: BLE001 - a variant not noted is built by MLX as before
                    log.debug("kernel cache: %s not noted", name, exc_info=True)
            return obj(*args, **call)

        return launch

    def populate(self, cache: Path, arch: str, workers: int | None = None) -> tuple[int, int]:
        """Build and write every noted variant MLX's cache lacks, in `workers` threads (default: half the cores,
        the rest serve; NVRTC releases the GIL); (written, failed)."""
        from dsv4_serve.kernels.graph import nvrtc

        with self.lock:
            todo = [(m, *v) for m, v in self.variants.items() if not ptx_path(cache, m).exists()]

        def one(item: tuple[str, str, str]) -> bool:
            module, func, text = item
            try:
                cubin, lowered = nvrtc.compile_cubin(unit(text), f"mlx::core::cu::{func}", arch)
                write_entry(cache, module, func, cubin, lowered)
                return True
            except Exception as e:  # noqa: BLE001 - that kernel is built by MLX as before
                log.warning("kernel cache: %s not written: %s", func, (str(e).splitlines() or [""])[0][:200])
                return False

        # daemon threads (nvrtc.daemon_map): an executor's workers kept a graph server from exiting 30 s after
        # SIGTERM while it built 37 entries (H100, 2026-12-07); an entry is written whole or not at all
        done = nvrtc.daemon_map(one, todo, workers or max(1, (os.cpu_count() or 2) // 2))
        return sum(done), len(done) - sum(done)
