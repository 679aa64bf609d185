"""The CUDA kernels a prefill forward launches per layer kind, as a budget held on any machine
(tools/prefill_count.py: each CUDA launch one node, the Python around the launches as it runs). Below a few
hundred tokens the forward is host-bound on the H200, so a change that adds kernels fails here first."""

from __future__ import annotations

import pytest

from tools.prefill_count import forward_count

# Counted 2026-12-02 at 256 tokens from position 0: the compressors' windows, the attention's reversed keys and
# rows and the indexer's keys through host-made indices, the experts' tile table in one scatter (a sliding /
# CSA / HCA layer was 95 / 261 / 152 before), then with DSV4_PREFILL_COMPILE=1.
BUDGET = {"0": {"sliding": 74, "CSA": 204, "HCA": 123}, "1": {"sliding": 63, "CSA": 143, "HCA": 96}}


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_each_layer_kind_stays_within_its_prefill_budget(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_PREFILL_COMPILE", compiled)
    base = sum(forward_count([0], 256, 0).values())
    counts = {kind: sum(forward_count([0, r], 256, 0).values()) - base
              for kind, r in (("sliding", 0), ("CSA", 4), ("HCA", 128))}  # fmt: skip
    over = {k: (n, BUDGET[compiled][k]) for k, n in counts.items() if n > BUDGET[compiled][k]}
    assert not over, f"kernels a layer over budget (count, budget): {over}"
    assert counts["CSA"] > counts["HCA"] > counts["sliding"]  # two compressors + the indexer; one; none


def test_a_compressor_call_reads_its_windows_in_few_kernels() -> None:
    """The CSA layer's count at 256 tokens against the sliding layer's: two compressors and the indexer's
    selection add at most 130 kernels (52 a compressor call before the host-made indices, 40 now)."""
    base = forward_count([0, 0], 256, 0)
    csa = forward_count([0, 4], 256, 0)
    assert sum(csa.values()) - sum(base.values()) <= 130
