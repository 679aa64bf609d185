"""kernels/graph/runtime.py on a CUDA GPU (skipped elsewhere): a chain of the project's own launches recorded,
built again with NVRTC (kernels/graph/codegen.py), captured as one CUDA graph over MLX arrays and replayed
gives what MLX's own launches give, bit for bit, and MLX reads the graph's writes. Off a GPU the codegen is
checked by nvcc instead: every kernel of the V4-Flash step (tools/graph_plan.py --emit) compiles."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

from dsv4_serve.kernels.graph.runtime import unavailable

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
        mx.eval(x, w)
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
    finally:
        mx.fast.cuda_kernel = base
        common._kernels.clear()
        common._kernels.update(saved[0])
        common._plans.clear()
        common._plans.update(saved[1])


GLUE_KERNELS = ("rope_tables0", "rope_tables4", "rope_tables128", "rms_rope_ring", "router_hash", "index_weights",
                "embed_streams", "hc_head")  # fmt: skip


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("glue", [False, True], ids=["plain", "glue"])
def test_every_step_kernel_compiles_as_generated(tmp_path: Path, glue: bool) -> None:
    """The translation units the runtime hands NVRTC, for every distinct kernel of a V4-Flash step (4 layers:
    sliding, CSA, HCA; 8 rows), compile for sm_90 with nvcc; with the glue kernels (DSV4_GRAPH_GLUE) too."""
    r = subprocess.run([sys.executable, "tools/graph_plan.py", "--layers", "4", "--experts", "8", "--rows", "8",
                        "--emit", str(tmp_path), *(["--glue"] if glue else [])], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    units = {}
    for f in sorted(tmp_path.glob("*.cu")):
        units.setdefault(f.name.rsplit("_", 1)[0], f)  # one unit a kernel source (its variants differ in values)
    assert len(units) >= 10
    names = {n.removeprefix("dsv4_").rsplit("_", 1)[0] for n in units}
    assert all((k in names) == glue for k in GLUE_KERNELS), names

    def nvcc(f: Path) -> tuple[str, int, str]:
        p = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "--ptx", "-o", str(f.with_suffix(".ptx")), str(f)],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        return f.name, p.returncode, p.stderr[-2000:]

    with ThreadPoolExecutor(2) as pool:
        failed = [(n, e) for n, rc, e in pool.map(nvcc, units.values()) if rc]
    assert not failed, failed
