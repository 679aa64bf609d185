"""The CUDA path of the decode step on any machine: each kernel stood in for, the weights zeros.

`stand_in` replaces MLX's `cuda_kernel` factory: a launch returns zero buffers of its output shapes that depend on
its inputs, so the launch list, grids and argument sizes are the GPU's for the same shapes and dtypes (the CUDA
graph plan on the CPU: bench/roofline.py, tools/graph_plan.py, tools/build_profile.py,
tests/model/test_graph_record.py). Here in bench/ since bench/roofline.py records with it (tools import bench,
never the reverse); tools/build_profile.py keeps its old names for them.
"""

from __future__ import annotations

import mlx.core as mx


def stand_in(*_: object, **__: object):
    """kernels.cuda.common.kernel's stand-in: a launch is zero buffers of its output shapes, after its inputs."""

    def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_kw):
        outs = [mx.zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return mx.depends(outs, [i for i in inputs if isinstance(i, mx.array)])

    return launch


def zero_weights() -> None:
    """model.dummy draws zeros, the routed experts zero mxfp4 words and scales (the layout as before, no draws
    and no quantizing of the experts: that alone is ~20 s a layer on the CPU)."""
    import dsv4_serve.model.dummy as dummy

    def experts(_name, shape, lo, hi, dtype, _seed, quantize):
        e, o, i = hi - lo, *shape[1:]
        if not quantize:
            return (mx.zeros((e, o, i), dtype),)
        return mx.zeros((e, o, i // 8), mx.uint32), mx.zeros((e, o, i // 32), mx.uint8)

    dummy._draw = lambda _name, shape, dtype, _key: mx.zeros(shape, dtype)
    dummy._experts = experts
