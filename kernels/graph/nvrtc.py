"""NVRTC builds of the graph runtime's kernels (NVIDIA's cuda-bindings, the `cuda` extra): a translation unit
(`codegen.py`) -> a cubin for one architecture and the kernel's lowered name. It needs no GPU, so the CPU suite
builds every kernel of the step the way the runtime will (tests/kernels/test_graph_runtime.py).

NVRTC searches no directory by itself: the CUDA headers the units include (cuda_bf16.h, cooperative_groups.h,
and CCCL's cuda/std/...) are found by NVIDIA's cuda-pathfinder (a toolkit's include dirs or the pip wheels').
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class BuildError(RuntimeError):
    """NVRTC refused a unit; the message holds its log."""


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """The CUDA runtime's and CCCL's header directories (cuda-pathfinder; an error naming what is missing)."""
    from cuda.pathfinder import find_nvidia_header_directory

    found = {lib: find_nvidia_header_directory(lib) for lib in ("cudart", "cccl", "nvcc")}
    for lib in ("cudart", "cccl"):
        if found[lib] is None:
            raise BuildError(f"NVRTC: no {lib} headers found (a CUDA toolkit, or pip's nvidia-cuda-runtime / "
                             "nvidia-cuda-cccl)")  # fmt: skip
    return runtime_dir(str(found["cudart"]), found["nvcc"]), str(found["cccl"])


def runtime_dir(cudart: str, toolkit: str | None) -> str:
    """The runtime headers' directory: `cudart`'s when it has the crt/ headers they include (mma.h includes
    crt/mma.h), else the toolkit's. A pip install without nvidia-cuda-crt (torch's, on the H200 machine) has
    cuda_runtime.h but no crt/."""
    for d in (cudart, toolkit):
        if d and (Path(d) / "crt").is_dir() and (Path(d) / "cuda_runtime.h").is_file():
            return d
    raise BuildError(f"NVRTC: the CUDA runtime headers in {cudart} lack crt/ and no toolkit has them "
                     "(pip's nvidia-cuda-crt, or a CUDA toolkit)")


def options(arch: str) -> list[bytes]:
    """MLX's JIT options (mlx/backend/cuda/jit_module.cpp): device code by default, the architecture (`sm_90a` on
    Hopper, as MLX), C++17, the header directories."""
    return [b"--device-as-default-execution-space", f"-arch={arch}".encode(), b"--std=c++17",
            *(f"-I{d}".encode() for d in include_dirs())]  # fmt: skip


def arch(major: int, minor: int) -> str:
    """MLX's target for a device of compute capability major.minor: `a` (arch-specific features) from 9.0 on."""
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _check(result: object, what: str, log: str = "") -> None:
    from cuda.bindings import nvrtc

    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise BuildError(f"NVRTC {what}: {err}\n{log}")


def compile_cubin(source: str, name: str, arch: str) -> tuple[bytes, str]:
    """(cubin, lowered name) of the `__global__` function `name` (its C++ name, e.g. `mlx::core::cu::k`)."""
    from cuda.bindings import nvrtc

    made = nvrtc.nvrtcCreateProgram(source.encode(), f"{name.rsplit(':', 1)[-1]}.cu".encode(), 0, [], [])
    _check(made, "create")
    prog = made[1]
    try:
        _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "name expression")
        opts = options(arch)
        built = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # NVRTC writes into these buffers: fresh bytearrays, never `b" " * size`, which for size 1 is CPython's
        # shared one-byte b" " and NVRTC's empty log would turn every b" " in the process into b"\\0"
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        _check(built, f"compile of {name}", log.decode(errors="replace").rstrip("\x00"))
        lowered = nvrtc.nvrtcGetLoweredName(prog, name.encode())
        _check(lowered, "lowered name")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        return bytes(cubin), lowered[1].decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_many(units: Mapping[str, str], arch: str, workers: int | None = None) -> dict[str, tuple[bytes, str]]:
    """`compile_cubin` of each (source -> name) in `workers` threads (default: a thread a core); NVRTC releases
    the GIL (4 units: 14.3 s one by one, 7.7 s in 4 threads on 2 cores, 2026-12-06)."""
    if not units:
        return {}
    built = daemon_map(lambda kv: compile_cubin(kv[0], kv[1], arch), list(units.items()), workers)
    return dict(zip(units, built, strict=True))


def daemon_map(fn: Callable[[T], R], items: Sequence[T], workers: int | None = None) -> list[R]:
    """`[fn(x) for x in items]` in `workers` daemon threads (default: a thread a core), in order; the first
    exception raised again once all are done. Not a ThreadPoolExecutor: the interpreter's exit joins an
    executor's workers after they have run every queued item, so a server stopped while NVRTC builds its
    kernels (a cold start builds 193 for the decode graphs, minutes) would live on until the last one."""
    out: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    todo = list(range(len(items)))[::-1]
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                i = todo.pop()
            try:
                out[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                with lock:
                    errors.append(e)

    n = max(1, min(len(items), workers or os.cpu_count() or 1))
    threads = [threading.Thread(target=work, name=f"dsv4-build-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
