"""The CUDA kernels a decode layer launches, as a budget held on any machine (tools/kernel_count.py: the
compiled segments' graphs with each fast op as one node). At <= 8 rows the step is host-bound and each
kernel is host time, so a change that adds kernels to a layer fails here, not on the next GPU run."""

from __future__ import annotations

import pytest

from tools.kernel_count import layer_counts

# Counted 2026-12-02 (tools/kernel_count.py), with a compressor's kv and gate one launch, wq_a and wkv one (and
# the two wq_b of a CSA layer), each RoPE one with the norm before it, the MoE's combine one with the post-mix
# and the mHC pre-mix one with the unit's RMSNorm. These + the row-batched ops'
# 4-8 launches (not in the segments) against CUPTI on the H200: 67 a layer measured without the glue kernels,
# 40 with them before those three (the pair swap's copies, invisible here, were ~3.5 of the 40).
BUDGET = {False: {"sliding": 57, "CSA": 62, "HCA": 58}, True: {"sliding": 18, "CSA": 23, "HCA": 19}}


@pytest.mark.parametrize("glue", [False, True])
def test_each_layer_kind_stays_within_its_kernel_budget(glue: bool) -> None:
    counts = {kind: sum((c1 + c2).values()) for kind, (c1, c2) in layer_counts(glue).items()}
    assert counts.keys() == BUDGET[glue].keys()
    over = {k: (n, BUDGET[glue][k]) for k, n in counts.items() if n > BUDGET[glue][k]}
    assert not over, f"kernels a layer over budget (count, budget): {over}"


def test_the_glue_kernels_take_the_counted_glue() -> None:
    """The glue kernels remove what they are for: no f32 casts, reductions or sorts left between the ops."""
    for kind, (c1, c2) in layer_counts(True).items():
        c = c1 + c2
        assert c["ArgPartition"] == c["Square"] == 0, (kind, c)
        assert c["AsType"] == 0, (kind, c)
