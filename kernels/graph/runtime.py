"""The CUDA graph runtime over MLX-owned buffers, on NVIDIA's cuda.core (the `cuda` extra).

- Kernels: each recorded launch's translation unit (`codegen.py`) built once with NVRTC (`nvrtc.py`), cached by
  its text.
- Buffers: the weights and state pools stay MLX arrays; their addresses come from MLX's DLPack export, which
  moves an array once into CUDA managed memory (so addresses are taken at load, never per step), prefetched
  to the GPU. The plan's arena and the staging buffer are cuda.core allocations that live with the graphs.
- Graphs: a plan's launches captured once into a graph (a row count a graph), replayed with one launch.
- The device's memory pool: MLX allocates with `cudaMallocAsync` from the device's default pool and frees into it,
  counting on its release threshold of 0 (freed bytes go back to the driver at the next synchronization). Two
  things keep freed bytes there: cuda.core's device memory resource raises that threshold to the maximum when it
  first allocates (its DeviceMemoryResource: "to improve performance"), which `release_pool` undoes after each
  `allocate`; and a chunk the pool reserved stays reserved while any allocation lives in it, so the device copies
  the DLPack exports free after the warm-up stay pinned by the warm-up's buffers around them (H100, 2026-12-07,
  557134d: 44.12 GB reserved, 1.07 GB in use, 0.00 GB free, a trim gave nothing back): `to_managed` moves the
  weights and pools before anything else is allocated, when a trim gives their chunks back whole.
- Ordering with MLX: a replay waits for MLX's queued work (`mx.synchronize`) and MLX reads what a replay wrote
  only after `Runtime.wait` (the runtime's stream synchronized), so neither reads the other's half-written state.

On the H200 (2026-12-05): tests/kernels/test_graph_runtime.py (gpu) captures a chain of the project's kernels
over MLX arrays, and its replay equals MLX's own launches bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.graph import nvrtc
from dsv4_serve.kernels.graph.codegen import entry, launch_unit
from dsv4_serve.kernels.graph.cubin_cache import CubinCache
from dsv4_serve.kernels.graph.record import RawLaunch

WORDS = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32}  # init_value fills as 4-byte memsets
# CUDA's default cap on a launch's dynamic shared memory; a kernel that asks for more must raise its own
# CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first (MLX does for its launches; three of the step's kernels
# ask for 61-162 KB, and without it the capture fails with CUDA_ERROR_INVALID_VALUE)
DEFAULT_SHARED = 48 * 1024


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


def _ok(result: object, what: str) -> None:
    from cuda.bindings import driver

    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err}")


def _config(ln: RawLaunch) -> Any:
    """The launch's cuda.core LaunchConfig (MLX's grid counts threads, CUDA's blocks)."""
    from cuda.core import LaunchConfig

    blocks = tuple(-(-g // t) for g, t in zip(ln.grid, ln.threadgroup, strict=True))
    return LaunchConfig(grid=blocks, block=ln.threadgroup, shmem_size=ln.kernel.shared_memory)


def _fills(ln: RawLaunch, at: Sequence[int]) -> list[tuple[int, bytes, int]]:
    """MLX's `init_value` fill of the launch's outputs as (address, 4-byte word, words); checks the addresses."""
    if len(at) != len(ln.inputs) + len(ln.outputs):
        raise ValueError(f"{ln.kernel.name}: {len(at)} addresses for {len(ln.inputs) + len(ln.outputs)} arguments")
    if ln.init_value is None:
        return []
    out = []
    for o, a in zip(ln.outputs, at[len(ln.inputs) :], strict=True):
        if o.dtype not in WORDS:
            raise ValueError(f"{ln.kernel.name}: init_value on a {o.dtype} output (4-byte words only)")
        out.append((a, np.array(ln.init_value, dtype=WORDS[o.dtype]).tobytes(), o.nbytes // 4))
    return out


def release_pool(device_id: int) -> int:
    """`Runtime.release_pool` for a device id; the pool's reserved bytes after the trim."""
    from cuda.bindings import driver

    attr = driver.CUmemPool_attribute
    err, pool = driver.cuDeviceGetMemPool(driver.CUdevice(device_id))
    _ok((err,), "cuDeviceGetMemPool")
    _ok(driver.cuMemPoolSetAttribute(pool, attr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, driver.cuuint64_t(0)),
        "cuMemPoolSetAttribute(RELEASE_THRESHOLD, 0)")  # fmt: skip
    # MLX frees on a stream of its own (allocator.cpp free_streams_): a trim before those frees ran finds the
    # bytes still in use (the gpu test failed so on one H100 of two), hence the whole device synchronized first
    _ok(driver.cuCtxSynchronize(), "cuCtxSynchronize")
    _ok(driver.cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo")
    if os.environ.get("DSV4_POOL_KEEP", "0").strip() == "1":
        # Trimmed now, then kept: with a threshold of 0 every synchronization gives the pool's free bytes back and
        # MLX's next allocation past its own cache maps memory again (a suspect of the graph server's 2x slower
        # prefill and MLX step against the same work without a runtime: opt-in until a GPU run has measured it)
        _ok(driver.cuMemPoolSetAttribute(pool, attr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, driver.cuuint64_t(2**64 - 1)),
            "cuMemPoolSetAttribute(RELEASE_THRESHOLD, max)")  # fmt: skip
    return pool_bytes(device_id)["reserved"]


def missing_units(launches: Sequence[RawLaunch], have: set[str], cubins: CubinCache, arch: str) -> dict[str, str]:
    """The translation units of `launches` (unit -> kernel entry name) neither in `have` nor in the cubin cache.
    Each unit's cache entry is read and checked once: a step repeats a unit ~40 times, and reading it for every
    launch took ~2.3 s of a warm start (the H100's "0 kernels built in 2.28-2.96 s", 2026-12-07; 0.14 s after)."""
    todo: dict[str, str] = {}
    seen: set[str] = set()
    for ln in launches:
        src = launch_unit(ln)
        if src in seen or src in have:
            continue
        seen.add(src)
        name = entry(ln.kernel)
        if not cubins.has(src, name, arch):
            todo[src] = name
    return todo


def to_managed(arrays: Sequence[mx.array]) -> int:
    """`arrays` moved into managed memory now (their DLPack export: MLX copies each out of the device pool once,
    and its address never changes again), their device copies given back to the driver and the managed pages
    prefetched to the GPU; the pool's reserved bytes after. For the weights and state pools right after they are
    made: the device pool's chunks then hold nothing else, so the trim frees them whole. Exported later, with
    the warm-up's buffers interleaved, the chunks stay reserved around the few live ones: on an H100 (2026-12-07,
    557134d, V4-Flash, 2 row counts) 43 GB the pool no longer used stayed reserved beside the 38 GB moved out of
    it, the device reported 0.00 GB free, and the first request's prefill took 21.6 s (~90 ms after), the
    managed pages evicted to the host and faulted back."""
    from cuda.core import Device

    for a in arrays:
        mlx_address(a)
    mx.synchronize()
    mx.clear_cache()
    dev = Device()
    dev.set_current()
    reserved = release_pool(dev.device_id)
    prefetch(arrays, dev.device_id, dev.create_stream())
    return reserved


def prefetch(arrays: Sequence[mx.array], device_id: int, stream: Any) -> None:
    """Managed pages of MLX arrays onto the GPU (on a cuda.core `stream`, waited for), so graphs read them at
    device bandwidth."""
    from cuda.bindings import driver

    loc = driver.CUmemLocation()
    loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device_id
    for a in arrays:
        _ok(driver.cuMemPrefetchAsync(mlx_address(a), a.nbytes, loc, 0, stream.handle), "cuMemPrefetchAsync")
    stream.sync()


def pool_bytes(device_id: int = 0) -> dict[str, int]:
    """The device's current memory pool: bytes reserved from the driver, bytes in use, and its release threshold."""
    from cuda.bindings import driver

    attr = driver.CUmemPool_attribute
    err, pool = driver.cuDeviceGetMemPool(driver.CUdevice(device_id))
    _ok((err,), "cuDeviceGetMemPool")
    out = {}
    for key, a in (("reserved", attr.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
                   ("used", attr.CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
                   ("threshold", attr.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)):  # fmt: skip
        err, v = driver.cuMemPoolGetAttribute(pool, a)
        _ok((err,), f"cuMemPoolGetAttribute({key})")
        out[key] = int(v)
    return out


class Runtime:
    def __init__(self, cache_dir: Path | None = None) -> None:
        from cuda.core import Device

        self.device = Device()
        self.device.set_current()
        self.stream = self.device.create_stream()
        major, minor = self.device.compute_capability
        self.arch = nvrtc.arch(major, minor)
        self._kernels: dict[str, Any] = {}
        self._built: dict[str, tuple[bytes, str]] = {}  # prebuild's (cubin, lowered name) by translation unit
        self.cubins = CubinCache(cache_dir)  # None: every start builds with NVRTC
        self._buffers: list[Any] = []  # cuda.core allocations the graphs use: they live as long as the runtime

    def prebuild(self, launches: Sequence[RawLaunch], workers: int | None = None) -> int:
        """Build every kernel of `launches` that is neither loaded nor in the cubin cache at once
        (`nvrtc.compile_many`); `kernel` then takes them. How many were built."""
        have = set(self._kernels) | set(self._built)
        todo = missing_units(launches, have, self.cubins, self.arch)
        self._built.update(nvrtc.compile_many(todo, self.arch, workers))
        return len(todo)

    def kernel(self, launch: RawLaunch) -> Any:
        """The launch's kernel, built with NVRTC (`nvrtc.py`: the same build the CPU suite checks) the first time its
        translation unit is seen (or loaded from the cubin cache), its dynamic shared memory cap raised to what
        the launch asks."""
        from cuda.bindings import driver
        from cuda.core import ObjectCode

        src = launch_unit(launch)
        k = self._kernels.get(src)
        if k is None:
            name = entry(launch.kernel)
            built = self._built.pop(src, None)  # prebuild's, stored in the cache by `get`
            cubin, lowered = self.cubins.get(src, name, self.arch,
                                             lambda: built or nvrtc.compile_cubin(src, name, self.arch))  # fmt: skip
            k = ObjectCode.from_cubin(cubin, name=launch.kernel.name).get_kernel(lowered)
            if launch.kernel.shared_memory > DEFAULT_SHARED:
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _ok(driver.cuKernelSetAttribute(attr, launch.kernel.shared_memory, k.handle,
                                                driver.CUdevice(self.device.device_id)),
                    f"cuKernelSetAttribute({launch.kernel.name}, {launch.kernel.shared_memory} B of shared memory)")
            self._kernels[src] = k
        return k

    def allocate(self, nbytes: int) -> int:
        """Device memory that lives as long as the runtime (the arena, the staging buffer); its address."""
        buf = self.device.allocate(max(nbytes, 1), stream=self.stream)
        self._buffers.append(buf)
        self.release_pool()  # cuda.core's first allocation raised the shared pool's release threshold
        return int(buf.handle)

    def release_pool(self) -> int:
        """The device's current memory pool (MLX's and cuda.core's) back to a release threshold of 0, and what it
        holds unused given back to the driver (`cuMemPoolTrimTo`): the bytes it then reserves."""
        return release_pool(self.device.device_id)

    def prefetch(self, arrays: Sequence[mx.array]) -> None:
        """Managed pages of MLX arrays onto the GPU, so graphs read them at device bandwidth."""
        prefetch(arrays, self.device.device_id, self.stream)

    def capture(self, launches: Sequence[RawLaunch], address: Mapping[int, int]) -> Any:
        """One graph of `launches`; `address[id(array)]`: the device address of every argument."""
        return self.capture_at(launches, [[address[id(a)] for a in (*ln.inputs, *ln.outputs)] for ln in launches])

    def capture_at(self, launches: Sequence[RawLaunch], args: Sequence[Sequence[int]]) -> Any:
        """One graph of `launches`, launch i's inputs then outputs at the device addresses `args[i]` (the engine's
        graphs: persistent arrays where MLX keeps them, intermediates in the arena, step inputs in staging)."""
        from cuda.bindings import driver
        from cuda.core import launch

        kernels = [self.kernel(ln) for ln in launches]  # built before the capture: NVRTC is not capturable
        gb = self.stream.create_graph_builder().begin_building()
        for ln, k, at in zip(launches, kernels, args, strict=True):
            for a, word, n in _fills(ln, at):  # MLX's fill of the outputs, as a memset node
                bits = int(np.frombuffer(word, np.uint32)[0])
                _ok(driver.cuMemsetD32Async(a, bits, n, gb.stream.handle), "cuMemsetD32Async")
            launch(gb, _config(ln), k, *at)
        return gb.end_building().complete()

    def capture_dag(self, launches: Sequence[RawLaunch], args: Sequence[Sequence[int]],
                    deps: Sequence[Sequence[int]]) -> Any:  # fmt: skip
        """`capture_at`'s graph with launch i waiting only for the launches `deps[i]` (`deps.dependencies`)
        instead of for the one before it: built node by node (cuda.core's GraphDefinition), not captured."""
        from cuda.core import graph as cgraph

        kernels = [self.kernel(ln) for ln in launches]
        gd = cgraph.GraphDefinition()
        nodes: list[Any] = []
        for ln, k, at, d in zip(launches, kernels, args, deps, strict=True):
            pred = [nodes[j] for j in d]
            fills = []
            for a, word, n in _fills(ln, at):  # MLX's fill of the outputs, as memset nodes the launch waits for
                m = gd.memset(a, word, n)
                if pred:
                    m.pred = pred
                fills.append(m)
            node = gd.launch(_config(ln), k, *at)
            if pred or fills:
                node.pred = pred + fills
            nodes.append(node)
        return gd.instantiate()

    def upload(self, address: int, host: np.ndarray) -> None:
        """Host bytes to device memory on the runtime's stream (a pageable source: the call returns once the
        bytes are staged, so the host buffer may be reused at once)."""
        from cuda.bindings import driver

        _ok(driver.cuMemcpyHtoDAsync(address, host.ctypes.data, host.nbytes, self.stream.handle), "cuMemcpyHtoDAsync")

    def zero(self, address: int, nbytes: int) -> None:
        from cuda.bindings import driver

        _ok(driver.cuMemsetD8Async(address, 0, nbytes, self.stream.handle), "cuMemsetD8Async")

    def replay(self, graph: Any) -> None:
        """One graph launch after MLX's queued work."""
        mx.synchronize()
        graph.launch(self.stream)

    def wait(self) -> None:
        """Until the replays are done (before MLX reads what they wrote); the driver call releases the GIL, so
        the event loop's thread runs meanwhile."""
        from cuda.bindings import driver

        _ok(driver.cuStreamSynchronize(self.stream.handle), "cuStreamSynchronize")
