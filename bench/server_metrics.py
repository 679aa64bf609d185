"""The server's /metrics as bench/serve.py reads it around a cell: the engine thread's host time a step
(dsv4_engine_host_seconds), the time to first token by phase (dsv4_ttft_phase_seconds) and the prompts' host time
by part (dsv4_prefill_host_seconds), each as the difference between two scrapes."""

from __future__ import annotations

import httpx


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The server's /metrics as (name, labels, value) samples."""
    out = []
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        pairs = (kv.split("=", 1) for kv in labels.rstrip("}").split(",") if kv)
        out.append((name, {k: v.strip('"') for k, v in pairs}, float(value)))
    return out


def engine_host(source: str | list[tuple[str, dict[str, str], float]]) -> tuple[float, dict[str, float]]:
    """(engine steps so far, host seconds by phase) from the server's /metrics (its url, or `scrape`'s samples)."""
    steps, host = 0.0, {}
    for name, labels, value in scrape(source) if isinstance(source, str) else source:
        if name == "dsv4_engine_step_seconds_count":
            steps = value
        elif name == "dsv4_prefill_seconds_total":
            host["prefill"] = value
        elif name == "dsv4_engine_host_seconds_total":
            host[labels["phase"]] = value
    return steps, host


def ttft_split(before: list[tuple[str, dict[str, str], float]], after: list[tuple[str, dict[str, str], float]],
               ) -> dict[str, dict[str, float]]:  # fmt: skip
    """The time to first token by phase over a cell (dsv4_ttft_phase_seconds, after less before): per phase the
    first tokens counted, the mean and the median in ms (interpolated in its bucket, as histogram_quantile)."""
    delta: dict[tuple[str, str, str], float] = {}
    for sign, samples in ((-1, before), (1, after)):
        for name, labels, value in samples:
            if name.startswith("dsv4_ttft_phase_seconds_"):
                key = (name.rsplit("_", 1)[1], labels["phase"], labels.get("le", ""))
                delta[key] = delta.get(key, 0.0) + sign * value
    out = {}
    for (kind, phase, _), n in delta.items():
        if kind != "count" or n <= 0:
            continue
        buckets = sorted((float(le), c) for (k, p, le), c in delta.items() if k == "bucket" and p == phase)
        median, lo, below = 0.0, 0.0, 0.0
        for le, c in buckets:
            if c >= n / 2:
                median = lo if le == float("inf") else lo + (le - lo) * (n / 2 - below) / max(c - below, 1e-12)
                break
            lo, below = le, c
        out[phase] = {"count": n, "mean_ms": 1e3 * delta[("sum", phase, "")] / n, "median_ms": 1e3 * median}
    return out


def host_ms_per_step(before: tuple[float, dict[str, float]], after: tuple[float, dict[str, float]]) -> dict:
    steps = after[0] - before[0]
    ms = {k: 1e3 * (v - before[1].get(k, 0.0)) / steps for k, v in after[1].items()} if steps else {}
    if ms:
        parts = ("build", "encode", "sample", "wait", "prefill")
        ms["other"] = ms.get("loop", 0.0) - sum(ms.get(k, 0.0) for k in parts)
    return ms


def pacing(before: list[tuple[str, dict[str, str], float]], after: list[tuple[str, dict[str, str], float]],
           ) -> dict[str, float]:  # fmt: skip
    """Prefill pacing over a cell: slices built beside a step and their mean layers, the pacer's measured step and
    its target at the cell's end (ms); with decode graphs, their refreshes, the mean ms of one and the pools moved."""
    b, a = ({n: v for n, _, v in s} for s in (before, after))
    slices = a.get("dsv4_prefill_slices_total", 0.0) - b.get("dsv4_prefill_slices_total", 0.0)
    layers = a.get("dsv4_prefill_slice_layers_total", 0.0) - b.get("dsv4_prefill_slice_layers_total", 0.0)
    refreshes = a.get("dsv4_graph_refreshes_total", 0.0) - b.get("dsv4_graph_refreshes_total", 0.0)
    refresh_s = a.get("dsv4_graph_refresh_seconds_total", 0.0) - b.get("dsv4_graph_refresh_seconds_total", 0.0)
    moves = a.get("dsv4_graph_pool_moves_total", 0.0) - b.get("dsv4_graph_pool_moves_total", 0.0)
    return {"slices": slices, "layers_a_slice": layers / slices if slices else 0.0,
            "step_ms": 1e3 * a.get("dsv4_pacer_step_seconds", 0.0),
            "target_ms": 1e3 * a.get("dsv4_itl_target_seconds", 0.0),
            "fixed_ms": 1e3 * a.get("dsv4_pacer_slice_fixed_seconds", 0.0),  # the fitted slice: fixed + per layer
            "layer_ms": 1e3 * a.get("dsv4_pacer_layer_seconds", 0.0),
            # the graph engine's refreshes (moved pools brought home before a replay) and their mean ms
            "graph_refreshes": refreshes, "graph_refresh_ms": 1e3 * refresh_s / refreshes if refreshes else 0.0,
            "graph_pool_moves": moves,
            # variants first built while serving (the noter's, DSV4_KERNEL_CACHE=watch): NVRTC in a request's path
            "kernels_late": a.get("dsv4_kernels_late_total", 0.0) - b.get("dsv4_kernels_late_total", 0.0)}  # fmt: skip


def prefill_split(before: list[tuple[str, dict[str, str], float]], after: list[tuple[str, dict[str, str], float]],
                  ) -> dict[str, float]:  # fmt: skip
    """The engine's prompt host time over a cell by part (dsv4_prefill_host_seconds: build, eval, snapshot, admit),
    in ms a first token (the cell's dsv4_ttft_phase_seconds prefill count); {} without either."""
    delta: dict[str, float] = {}
    n = 0.0
    for sign, samples in ((-1, before), (1, after)):
        for name, labels, value in samples:
            if name == "dsv4_prefill_host_seconds_total":
                delta[labels["part"]] = delta.get(labels["part"], 0.0) + sign * value
            elif name == "dsv4_ttft_phase_seconds_count" and labels.get("phase") == "prefill":
                n += sign * value
    return {part: 1e3 * v / n for part, v in delta.items()} if n > 0 else {}
