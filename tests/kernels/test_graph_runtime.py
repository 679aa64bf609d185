"""kernels/graph/runtime.py on a CUDA GPU (skipped elsewhere): a chain of the project's own launches recorded,
built again with NVRTC (kernels/graph/codegen.py), captured as one CUDA graph over MLX arrays and replayed
gives what MLX's own launches give, bit for bit, and MLX reads the graph's writes. Off a GPU the build itself runs:
every kernel of the V4-Flash step (tools/graph_plan.py --emit) goes through NVRTC as the runtime builds it
(kernels/graph/nvrtc.py: MLX's options, sm_90a), which needs no GPU."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

from dsv4_serve.kernels.graph.runtime import unavailable
from tests.kernels.nvrtc_here import NEEDS_NVRTC

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_replayed_chain_equals_mlx() -> None:
    from dsv4_serve import kernels
    from dsv4_serve.kernels.cuda import common
    from dsv4_serve.kernels.graph.record import Recorder
    from dsv4_serve.kernels.graph.runtime import Runtime, mlx_address

    base = mx.fast.cuda_kernel
    rec = Recorder(base)
    saved = dict(common._kernels), dict(common._plans)
    common._kernels.clear()
    common._plans.clear()
    rec.install()
    try:
        x = mx.random.normal((8, 4096)).astype(mx.bfloat16)
        w = mx.random.normal((4096,)).astype(mx.bfloat16)
        # once before recording: its small parameters are uploaded then (kernels/upload.py, a kernel of its own
        # that the content cache skips afterwards), so the recording holds the three norms alone
        mx.eval(x, w, kernels.rms_norm_rows(x, w, eps=1e-6))
        rec.recording = True
        y = x
        for _ in range(3):
            y = kernels.rms_norm_rows(y, w, eps=1e-6)
        rec.recording = False
        mx.eval(y)
        assert len(rec.launches) == 3
        rt = Runtime()
        outs = [mx.zeros(ln.outputs[0].shape, ln.outputs[0].dtype) for ln in rec.launches]
        mx.eval(outs)
        address = {id(a): mlx_address(a) for ln in rec.launches for a in ln.inputs if a is not None}
        for ln, o in zip(rec.launches, outs, strict=True):  # each output at its MLX stand-in's address
            address[id(ln.outputs[0])] = mlx_address(o)
        for ln, prev in zip(rec.launches[1:], outs, strict=False):
            address[id(ln.inputs[0])] = mlx_address(prev)  # the chain reads the graph's own outputs
        rt.prefetch([x, w, *outs])
        graph = rt.capture(rec.launches, address)
        rt.replay(graph)
        rt.wait()
        assert mx.array_equal(outs[-1] + 0, y).item()  # `+ 0`: MLX reads the buffer the graph wrote
        # the same launches built node by node with their dependencies (kernels/graph/deps.py's form)
        for o in outs:
            rt.zero(mlx_address(o), o.nbytes)
        args = [[address[id(a)] for a in (*ln.inputs, *ln.outputs)] for ln in rec.launches]
        dag = rt.capture_dag(rec.launches, args, [(), (0,), (1,)])
        rt.replay(dag)
        rt.wait()
        assert mx.array_equal(outs[-1] + 0, y).item()
    finally:
        mx.fast.cuda_kernel = base
        common._kernels.clear()
        common._kernels.update(saved[0])
        common._plans.clear()
        common._plans.update(saved[1])


@pytest.mark.gpu
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_kernel_past_48k_of_shared_memory_captures_and_replays() -> None:
    """The attention and indexer kernels ask for 61-162 KB of dynamic shared memory: the runtime raises the
    kernel's cap before its first launch (CUDA refuses the launch, and a capture with it, otherwise)."""
    from dsv4_serve.kernels.cuda import common
    from dsv4_serve.kernels.graph.record import Recorder
    from dsv4_serve.kernels.graph.runtime import Runtime, mlx_address

    smem = 160 * 1024
    src = """
  extern __shared__ __align__(128) unsigned char smem_raw[];
  float* s = reinterpret_cast<float*>(smem_raw);
  const int n = 160 * 1024 / 4;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = x[i % x_shape[0]] + float(i / x_shape[0]);
  __syncthreads();
  float acc = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += s[n - 1 - i];
  y[threadIdx.x] = acc;
"""
    base = mx.fast.cuda_kernel
    rec = Recorder(base)
    rec.install()
    try:
        k = common.kernel("smem_probe", ["x"], ["y"], src, shared_memory=smem)
        x = mx.arange(1024, dtype=mx.float32)
        run = lambda: k(inputs=[x], output_shapes=[(256,)], output_dtypes=[mx.float32],  # noqa: E731
                        grid=(256, 1, 1), threadgroup=(256, 1, 1))[0]  # fmt: skip
        rec.recording = True
        want = run()
        rec.recording = False
        mx.eval(want)
        out = mx.zeros((256,), mx.float32)
        mx.eval(out)
        rt = Runtime()
        graph = rt.capture_at(rec.launches, [[mlx_address(x), mlx_address(out)]])
        rt.replay(graph)
        rt.wait()
        assert mx.array_equal(out + 0, want).item()
    finally:
        mx.fast.cuda_kernel = base


GLUE_KERNELS = ("rope_tables0", "rope_tables4", "rope_tables128", "rms_rope_ring", "router_hash", "index_weights",
                "embed_streams", "hc_head")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_bytes_mlx_frees_go_back_to_the_driver_after_a_runtime_allocates() -> None:
    """cuda.core's first allocation raises the release threshold of the pool MLX allocates from; after the
    runtime's allocation it is 0 again, and 1 GB that MLX frees leaves the pool at its next trim."""
    from dsv4_serve.kernels.graph.runtime import Runtime, pool_bytes

    rt = Runtime()
    rt.allocate(1 << 20)
    assert pool_bytes()["threshold"] == 0
    big = mx.zeros((1 << 28,), mx.float32) + 1  # 1 GiB from MLX's cudaMallocAsync
    mx.eval(big)
    held = pool_bytes()["reserved"]
    assert held >= 1 << 30
    del big
    mx.clear_cache()  # MLX's buffer cache frees into the pool
    mx.synchronize()
    left = rt.release_pool()
    assert left <= held - (1 << 30), (held, left)



@pytest.mark.gpu
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_arrays_moved_to_managed_memory_give_their_device_bytes_back() -> None:
    """`to_managed`: each array's buffer is managed memory after it, its values unchanged, and the device pool
    no longer reserves the bytes it held for them (which a trim must give back: the pool keeps freed bytes)."""
    from cuda.bindings import driver

    from dsv4_serve.kernels.graph.runtime import mlx_address, pool_bytes, to_managed

    arrays = [mx.random.normal((1 << 26,)) for _ in range(4)]  # 4 x 256 MiB in the device pool
    mx.eval(arrays)
    want = [float(mx.sum(a)) for a in arrays]
    before = pool_bytes()["reserved"]
    assert before >= 4 << 28
    after = to_managed(arrays)
    assert after <= before - (4 << 28), (before, after)
    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED
    for a, w in zip(arrays, want, strict=True):
        err, managed = driver.cuPointerGetAttribute(attr, mlx_address(a))
        assert err == driver.CUresult.CUDA_SUCCESS and managed
        assert float(mx.sum(a)) == w



@NEEDS_NVRTC
@pytest.mark.parametrize("glue", [False, True], ids=["plain", "glue"])
def test_every_step_kernel_builds_with_nvrtc(tmp_path: Path, glue: bool) -> None:
    """Every translation unit the runtime would build for a V4-Flash step (4 layers: sliding, CSA, HCA; 8 rows),
    with the glue kernels (DSV4_GRAPH_GLUE) too, builds with NVRTC for the H200 as the runtime builds it, and
    yields its kernel's lowered name."""
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin

    r = subprocess.run([sys.executable, "tools/graph_plan.py", "--layers", "4", "--experts", "8", "--rows", "8",
                        "--emit", str(tmp_path), *(["--glue"] if glue else [])], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    units = sorted(tmp_path.glob("*.cu"))
    assert len(units) >= 10
    names = {f.name.removeprefix("dsv4_").rsplit("_", 2)[0] for f in units}
    assert all((k in names) == glue for k in GLUE_KERNELS), names

    def build(f: Path) -> tuple[str, str]:
        src = f.read_text()
        kernel = src.split("__global__ void ", 1)[1].split("(", 1)[0]
        try:
            cubin, lowered = compile_cubin(src, f"mlx::core::cu::{kernel}", "sm_90a")
        except RuntimeError as e:
            return f.name, str(e)[-1500:]
        return f.name, "" if cubin and kernel in lowered else f"no cubin or name ({lowered})"

    with ThreadPoolExecutor(2) as pool:
        failed = [(n, e) for n, e in pool.map(build, units) if e]
    assert not failed, failed


@NEEDS_NVRTC
def test_a_clean_build_leaves_python_s_shared_bytes_alone() -> None:
    """A kernel that builds without a warning has a one-byte log ("\\0"). NVRTC writes it into the buffer it is
    given; were that `b" " * 1`, CPython's shared b" " would become b"\\0" for the whole process (every later
    b" " in a safetensors header's padding or an Authorization split breaks)."""
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin

    src = 'namespace mlx::core::cu { __global__ void k(float* x) { x[0] = 1.0f; } }'
    cubin, lowered = compile_cubin(src, "mlx::core::cu::k", "sm_90a")
    assert cubin and "k" in lowered
    assert ord(b" ") == 32 and b"a b".split(b" ") == [b"a", b"b"]


def test_the_runtime_headers_come_from_where_crt_is(tmp_path: Path) -> None:
    """A pip install without nvidia-cuda-crt (torch's on the H200 machine) has cuda_runtime.h but not the crt/
    headers it includes: the toolkit's directory is taken then, and with neither the error names the wheel."""
    from dsv4_serve.kernels.graph.nvrtc import BuildError, runtime_dir

    def headers(name: str, crt: bool) -> str:
        d = tmp_path / name
        (d / "crt" if crt else d).mkdir(parents=True)
        (d / "cuda_runtime.h").write_text("")
        return str(d)

    full, partial, toolkit = headers("full", True), headers("partial", False), headers("toolkit", True)
    assert runtime_dir(full, toolkit) == full
    assert runtime_dir(partial, toolkit) == toolkit
    with pytest.raises(BuildError, match="nvidia-cuda-crt"):
        runtime_dir(partial, None)
    with pytest.raises(BuildError, match="nvidia-cuda-crt"):
        runtime_dir(partial, headers("bare", False))
