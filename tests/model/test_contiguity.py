"""The decode step hands its fast ops row-contiguous arrays (tools/contiguity.py): on CUDA each strided
argument of an `mx.fast.cuda_kernel` is one more copy kernel, a step's host time at <= 8 rows."""

from __future__ import annotations

from dsv4_serve.model.config import ModelArgs
from tools.contiguity import scan


def test_the_decode_step_passes_its_fast_ops_contiguous_arrays() -> None:
    a = ModelArgs.tiny()
    a.num_hidden_layers, a.compress_ratios, a.num_hash_layers = 3, [0, 4, 128], 0
    found = scan(a, [1, 3, 8])
    # the one exception: the reference router's ids are an argpartition's slice; the CUDA router writes its own
    expected = {op for op in ("experts_gate_up_rows", "experts_down_rows")}
    rest = {k: n for k, n in found.items() if not (k[1] in expected and k[2] == "arg[1]")}
    assert not rest, f"strided fast-op arguments (rows, op, argument, shape): calls a step: {rest}"
