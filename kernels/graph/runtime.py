"""The CUDA graph runtime over MLX-owned buffers, on NVIDIA's cuda.core (the `cuda` extra).

- Kernels: each recorded launch's translation unit (`codegen.py`) built once with NVRTC (`nvrtc.py`), cached by
  its text.
- Buffers: the weights and state pools stay MLX arrays; their addresses come from MLX's DLPack export, which
  moves an array once into CUDA managed memory (so addresses are taken at load, never per step), prefetched
  to the GPU. The plan's arena and the staging buffer are cuda.core allocations that live with the graphs.
- Graphs: a plan's launches captured once into a graph (a row count a graph), replayed with one launch.
- Ordering with MLX: a replay waits for MLX's queued work (`mx.synchronize`) and MLX reads what a replay wrote
  only after `Runtime.wait` (the runtime's stream synchronized), so neither reads the other's half-written state.

On the H200 (2026-12-05): tests/kernels/test_graph_runtime.py (gpu) captures a chain of the project's kernels
over MLX arrays, and its replay equals MLX's own launches bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.graph import nvrtc
from dsv4_serve.kernels.graph.codegen import entry, translation_unit
from dsv4_serve.kernels.graph.record import RawLaunch

WORDS = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32}  # init_value fills as 4-byte memsets


def unavailable() -> str | None:
    """Why the runtime cannot run here (None: it can)."""
    if not mx.cuda.is_available():
        return "MLX's default device is not a CUDA GPU"
    try:
        import cuda.core  # noqa: F401
    except ImportError as err:
        return f"cuda.core is not installed (pip install 'dsv4-serve[cuda]'): {err}"
    return None


def mlx_address(a: mx.array) -> int:
    """The device address of an evaluated MLX array, valid while it lives (moved into managed memory once)."""
    mx.eval(a)
    view = a if a.dtype not in (mx.bfloat16,) else a.view(mx.uint16)  # NumPy has no bfloat16
    return int(np.from_dlpack(view).ctypes.data)


class Runtime:
    def __init__(self) -> None:
        from cuda.core import Device

        self.device = Device()
        self.device.set_current()
        self.stream = self.device.create_stream()
        major, minor = self.device.compute_capability
        self.arch = nvrtc.arch(major, minor)
        self._kernels: dict[str, Any] = {}
        self._buffers: list[Any] = []  # cuda.core allocations the graphs use: they live as long as the runtime

    def kernel(self, launch: RawLaunch) -> Any:
        """The launch's kernel, built with NVRTC (`nvrtc.py`: the same build the CPU suite checks) the first time its
        translation unit is seen."""
        from cuda.core import ObjectCode

        src = translation_unit(launch.kernel, launch.template, launch.inputs, [o.dtype for o in launch.outputs])
        k = self._kernels.get(src)
        if k is None:
            cubin, lowered = nvrtc.compile_cubin(src, entry(launch.kernel), self.arch)
            k = self._kernels[src] = ObjectCode.from_cubin(cubin, name=launch.kernel.name).get_kernel(lowered)
        return k

    def allocate(self, nbytes: int) -> int:
        """Device memory that lives as long as the runtime (the arena, the staging buffer); its address."""
        buf = self.device.allocate(max(nbytes, 1), stream=self.stream)
        self._buffers.append(buf)
        return int(buf.handle)

    def prefetch(self, arrays: Sequence[mx.array]) -> None:
        """Managed pages of MLX arrays onto the GPU, so graphs read them at device bandwidth."""
        from cuda.bindings import driver

        loc = driver.CUmemLocation()
        loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = self.device.device_id
        for a in arrays:
            (err,) = driver.cuMemPrefetchAsync(mlx_address(a), a.nbytes, loc, 0, self.stream.handle)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemPrefetchAsync: {err}")
        self.stream.sync()

    def capture(self, launches: Sequence[RawLaunch], address: Mapping[int, int]) -> Any:
        """One graph of `launches`; `address[id(array)]`: the device address of every argument."""
        from cuda.bindings import driver
        from cuda.core import LaunchConfig, launch

        kernels = [self.kernel(ln) for ln in launches]  # built before the capture: NVRTC is not capturable
        gb = self.stream.create_graph_builder().begin_building()
        for ln, k in zip(launches, kernels, strict=True):
            if ln.init_value is not None:  # MLX's fill of the outputs, as a memset node
                for o in ln.outputs:
                    if o.dtype not in WORDS:
                        raise ValueError(f"{ln.kernel.name}: init_value on a {o.dtype} output (4-byte words only)")
                    bits = int(np.array(ln.init_value, dtype=WORDS[o.dtype]).view(np.uint32))
                    (err,) = driver.cuMemsetD32Async(address[id(o)], bits, o.nbytes // 4, gb.stream.handle)
                    if err != driver.CUresult.CUDA_SUCCESS:
                        raise RuntimeError(f"cuMemsetD32Async: {err}")
            blocks = tuple(-(-g // t) for g, t in zip(ln.grid, ln.threadgroup, strict=True))  # MLX's grid is threads
            cfg = LaunchConfig(grid=blocks, block=ln.threadgroup, shmem_size=ln.kernel.shared_memory)
            args = [address[id(a)] for a in (*ln.inputs, *ln.outputs)]
            launch(gb, cfg, k, *args)
        return gb.end_building().complete()

    def replay(self, graph: Any) -> None:
        """One graph launch after MLX's queued work."""
        mx.synchronize()
        graph.launch(self.stream)

    def wait(self) -> None:
        """Until the replays are done (before MLX reads what they wrote)."""
        self.stream.sync()
