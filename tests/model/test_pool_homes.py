"""model/graph_record.set_pool and StatePools.set_array on the CPU: every state array a graph reads (the pools in
`StatePools.arrays()` order, the kernels' workspaces) can be put back where it came from by its label; the decode
graphs hand each moved pool's home array back this way (docs/cuda_graphs.md)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.model.graph_record import pool_arrays, set_pool
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model


def test_every_label_is_put_back_in_its_place() -> None:
    model, args, _ = tiny_model()
    pools = StatePools(args, max_slots=2, max_positions=256, page_size=16, dtype=mx.float32)
    before = pool_arrays(pools)
    assert len(before) == len(pools.arrays()) + len(pools.comp_ws) + len(pools.idx_ws) + ("hc_ws" in before)
    marks = {label: mx.full(a.shape, i + 1, a.dtype) for i, (label, a) in enumerate(before.items()) if label != "hc_ws"}
    for label, a in marks.items():
        set_pool(pools, label, a)
    after = pool_arrays(pools)
    for label, a in marks.items():
        assert after[label] is a, label
    assert all(x is marks[f"pool{i}"] for i, x in enumerate(pools.arrays()))  # arrays() keeps its order


def test_a_label_that_is_no_state_array_is_refused() -> None:
    _, args, _ = tiny_model()
    pools = StatePools(args, max_slots=1, max_positions=64, page_size=16, dtype=mx.float32)
    with pytest.raises(IndexError):
        set_pool(pools, f"pool{len(pools.arrays())}", mx.zeros(1))
    with pytest.raises(KeyError):
        set_pool(pools, "window0", mx.zeros(1))
