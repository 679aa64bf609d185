"""The decode graphs' counters and the kernel noter's late builds as /metrics renders them (service/api/metrics.py)
from the engine's stats: the stats here are written by hand, as `DecodeGraphs.stats()` and the worker give them on a
GPU (the graphs and the noter need CUDA)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsv4_serve.service.api.metrics import _EngineCollector


def rendered(stats: dict) -> dict[str, float]:
    reg = CollectorRegistry()
    reg.register(_EngineCollector(lambda: stats, max_rows=8))
    text = generate_latest(reg).decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_refreshes_and_their_seconds_are_counters() -> None:
    got = rendered({"graph_replays": 40, "graph_pool_moves": 12, "graph_refreshes": 3, "graph_refresh_ms": 7.5,
                    "graph_fallbacks": {"no graph for this row count": 2}})  # fmt: skip
    assert got["dsv4_graph_refreshes_total"] == 3.0
    assert got["dsv4_graph_refresh_seconds_total"] == 0.0075  # ms in the stats, seconds in /metrics
    assert got["dsv4_graph_pool_moves_total"] == 12.0 and got["dsv4_graph_replays_total"] == 40.0


def test_late_kernel_builds_are_a_counter() -> None:
    assert rendered({"kernels_late_total": 3})["dsv4_kernels_late_total"] == 3.0  # the noter's, when it runs


def test_no_graphs_no_refresh_seconds() -> None:
    assert "dsv4_graph_refresh_seconds_total" not in rendered({"graph_fallbacks": {}})
