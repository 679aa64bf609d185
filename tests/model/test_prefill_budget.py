"""The CUDA kernels a prefill forward launches per layer kind, as a budget held on any machine
(tools/prefill_count.py: each CUDA launch one node, the Python around the launches as it runs). Below a few
hundred tokens the forward is host-bound on the H200, so a change that adds kernels fails here first."""

from __future__ import annotations

import pytest

from tools.prefill_count import layer_counts

# Counted 2026-12-02 at 256 tokens from position 0 (what one more layer of a kind adds): the compressors'
# windows, the attention's reversed keys and rows and the indexer's keys through host-made indices, the
# experts' tile table in one scatter, the RoPE tables once a kind, the window ring as a view (a sliding / CSA /
# HCA layer was 95 / 261 / 152 at 76d6509), then with DSV4_PREFILL_COMPILE=1; since 2026-12-03 the MoE's
# combine, shared expert and post-mix in one launch (65 / 182 / 107 before); one more since wo_a is kept mxfp8 as
# released (its dequantized copy a forward, as every dense mxfp8 projection of prefill has: ~1.3 GiB less resident).
BUDGET = {"0": {"sliding": 60, "CSA": 177, "HCA": 102}, "1": {"sliding": 52, "CSA": 120, "HCA": 78}}


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_each_layer_kind_stays_within_its_prefill_budget(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_PREFILL_COMPILE", compiled)
    counts = {kind: sum(c.values()) for kind, c in layer_counts(256).items()}
    over = {k: (n, BUDGET[compiled][k]) for k, n in counts.items() if n > BUDGET[compiled][k]}
    assert not over, f"kernels a layer over budget (count, budget): {over}"
    assert counts["CSA"] > counts["HCA"] > counts["sliding"]  # two compressors + the indexer; one; none


def test_a_compressor_call_reads_its_windows_in_few_kernels() -> None:
    """A CSA layer against a sliding one at 256 tokens: two compressors and the indexer's selection add at most
    125 kernels (52 a compressor call before the host-made indices, 40 now)."""
    counts = {kind: sum(c.values()) for kind, c in layer_counts(256).items()}
    assert counts["CSA"] - counts["sliding"] <= 125


def test_more_prompts_in_a_forward_add_few_kernels_a_layer() -> None:
    """A forward of 8 prompts of 32 tokens against one prompt of 256 (the same rows, so the same products): the
    rings' writes, the compressors and the indexer's picks run once for all (model/prefill_compress.py,
    prefill_indexer.py), and what is left per request is its attention. Counted 2026-12-07: sliding / CSA / HCA
    88 / 217 / 101 against 60 / 177 / 102, where a call a request made the CSA layer 994 (~117 a request more).
    At most 8 kernels a layer more per request."""
    one, eight = layer_counts(256), layer_counts(32, prompts=8)
    for kind in ("sliding", "CSA", "HCA"):
        grown = sum(eight[kind].values()) - sum(one[kind].values())
        assert grown <= 8 * 7, (kind, grown)
