"""The CUDA path of the decode step on any machine: each kernel stood in for, the weights zeros.

`stand_in` replaces MLX's `cuda_kernel` factory: a launch returns zero buffers of its output shapes that depend on
its inputs, so the launch list, grids and argument sizes are the GPU's for the same shapes and dtypes (the CUDA
graph plan on the CPU: bench/roofline.py, tools/graph_plan.py, tools/build_profile.py,
tests/model/test_graph_record.py, tests/kernels/test_graph_deps.py). `stand_in_recorder` installs it under the
graph recorder, `flash_rows` builds a model and rows to record. Here in bench/ since bench/roofline.py records with
it (tools import bench, never the reverse); tools/build_profile.py keeps its old names for them.
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


def stand_in_recorder(base=None):  # noqa: ANN001, ANN201 - kernels.graph.record.Recorder (imported after the stand-in)
    """The recorder over stand-in kernels (or over `base`, a factory over them: tools/prebuild_caches.py's kernel
    noter), installed before kernels.cuda makes its kernel objects; the backend picks the fast ops and the glue
    kernels (the graph step's launches, as service/engine/graphs.prepare sets them); the weights zeros. Call before
    building a model."""
    from dsv4_serve.kernels.graph.record import Recorder

    rec = Recorder(base or stand_in)
    rec.install()
    import dsv4_serve.kernels.cuda  # noqa: F401  (registers the fast ops, their kernels through the recorder)
    from dsv4_serve.kernels import backend
    from dsv4_serve.kernels.cuda import set_graph_glue

    backend._use_fast = lambda: True
    set_graph_glue(True)
    zero_weights()
    return rec


def flash_rows(layers: int = 4, experts: int = 16, slots: int = 3, positions: int = 512):  # noqa: ANN201
    """A V4-Flash of `layers` layers (zero weights: call `stand_in_recorder` first), its state pools and `slots`
    admitted rows: (model, pools, handles, table widths), what `model.graph_record.record_step` takes."""
    from bench.step import flash_args, random_model
    from dsv4_serve.model.state import StatePools

    model = random_model(flash_args(layers, experts))
    pools = StatePools(model.args, max_slots=slots, max_positions=positions, page_size=64, dtype=model.dtype)
    handles = [pools.alloc(positions) for _ in range(slots)]
    return model, pools, handles, {r: pools.table_width(r) for r in pools.ratios}
