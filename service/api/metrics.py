"""Prometheus metrics on the service's own CollectorRegistry.

Latencies and token counts are observed by the streaming code on the event loop. Engine-side
numbers (waiting / running requests, rows per step, state bytes) are read from `worker.stats()`
at scrape time by a custom collector, so the engine thread never calls into prometheus:
  waiting, running: int             requests queued / holding a row now
  rows_per_step: list[int]          rows_per_step[r] = engine steps with r rows so far (cumulative)
  bytes_in_use, bytes_budget: int   decode state bytes (slots + pages) reserved / total
  prefill_tokens_total, prefill_seconds_total   the parallel prefill's prompt tokens / engine time
  steps_ahead_total: int            decode steps queued before the previous one was read back (pipelined)
  host_seconds_total, engine_loop_seconds_total   the engine thread's host time by phase (Engine.host_seconds)
  prefix_*                          the prefix cache's lookups, hits, cached tokens, evictions, bytes, entries
  spec_*                            speculative decoding: drafted / accepted tokens, verify steps (mean accept length)
  canary_*                          the correctness canary: checks, failures, the last check's max logprob diff
  stream_events_queued: int         token events waiting for their readers (each stream capped)
Step durations come through the worker's on_step_metrics hook (observe_step), each iteration's host seconds by
phase through on_phase_metrics (observe_phases: dsv4_engine_phase_seconds, a histogram per phase).
Missing keys are simply not exported."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
PREFIX = "dsv4"
OUTCOMES = (
    "stop",
    "length",
    "tool_calls",
    "abort",
    "client_disconnect",
    "rejected_4xx",
    "queue_full",
    "unavailable",
    "error",
)
_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# An engine phase's share of one iteration: 0.1 ms (the sampler's host work) .. 100 ms (a slow step's encode).
_PHASE = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
# A phase of the time to first token: 0.5 ms (a queue that was empty) .. 60 s (a long prompt's prefill).
_TTFT_PHASE = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_PHASES = ("tokenize", "queue", "prefill", "first_step", "first_byte")
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any] | None], max_rows: int) -> None:
        self.stats, self.max_rows = stats, max_rows

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.stats() or {}
        except Exception:  # a scrape must never fail because the engine is busy or gone
            log.exception("worker.stats() failed")
            s = {}
        for key, name, doc in (
            ("waiting", "requests_waiting", "Requests waiting for a decode row"),
            ("running", "requests_running", "Requests holding a decode row"),
            ("bytes_in_use", "state_bytes_in_use", "Decode state bytes reserved by running requests"),
            ("bytes_budget", "state_bytes_budget", "Decode state bytes available in the pools"),
            ("prefix_cache_bytes", "prefix_cache_bytes", "Prefix cache bytes: slot copies + distinct pages held"),
            ("prefix_cache_page_bytes", "prefix_cache_page_bytes", "Prefix cache bytes of pages (each counted once)"),
            ("prefix_cache_entries", "prefix_cache_entries", "Cached prefixes (slot snapshots)"),
            ("stream_events_queued", "stream_events_queued", "Token events waiting for their (slow) readers"),
            ("canary_max_logprob_diff", "canary_max_logprob_diff",
             "The last canary check's largest logprob difference from the start-up decode (nats)"),
            ("itl_target_seconds", "itl_target_seconds", "The inter-token latency prefill is paced by (0: off)"),
            ("pacer_step_seconds", "pacer_step_seconds", "A decode iteration without prefill, as pacing measures it"),
            ("pacer_slice_fixed_seconds", "pacer_slice_fixed_seconds",
             "A prefill slice's fixed cost past the step, whatever its layers (pacing's fit, the last forward size)"),
            ("pacer_layer_seconds", "pacer_layer_seconds",
             "A prefill slice's cost a layer past its fixed cost (pacing's fit, the last forward size)"),
        ):
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            g.add_metric([], float(s.get(key) or 0))
            yield g
        for key, name, doc in (
            ("prefill_tokens_total", "prefill_tokens", "Prompt tokens fed by the parallel prefill"),
            ("prefill_seconds_total", "prefill_seconds", "Engine time spent in the parallel prefill"),
            ("steps_ahead_total", "decode_steps_ahead", "Decode steps queued before the previous one was read back"),
            ("prompt_tokens_computed_total", "prompt_tokens_computed",
             "Prompt tokens run through the model (parallel prefill or decode step), not taken from a cache"),
            ("prefix_lookups_total", "prefix_lookups", "Prefix cache lookups"),
            ("prefix_hits_total", "prefix_hits", "Prefix cache hits (a cached prefix adopted)"),
            ("prefix_cached_tokens_total", "prefix_cached_tokens", "Prompt tokens taken from the prefix cache"),
            ("prefix_evictions_total", "prefix_evictions", "Prefix cache entries evicted (LRU)"),
            ("spec_drafted_tokens_total", "spec_drafted_tokens", "Draft tokens (MTP) verified by the target model"),
            ("spec_accepted_tokens_total", "spec_accepted_tokens", "Draft tokens accepted"),
            ("spec_verify_steps_total", "spec_verify_steps", "Request-steps that verified drafts"),
            ("prefill_slices_total", "prefill_slices", "Iterations that built a slice of a forward beside a step"),
            ("prefill_slice_layers_total", "prefill_slice_layers", "Layers those slices built (a forward's per row)"),
            ("graph_replays", "graph_replays", "Decode steps run as one replayed CUDA graph"),
            ("graph_recaptures", "graph_recaptures", "Decode graphs captured again (their arena grew)"),
            ("graph_pool_moves", "graph_pool_moves", "State pools MLX moved, copied back home before a replay"),
            ("graph_refreshes", "graph_refreshes", "Replays that first brought moved pools home"),
            ("kernels_late_total", "kernels_late",
             "Kernel variants first launched after the warm-up (DSV4_KERNEL_CACHE=watch): built in a request's path"),
            ("canary_checks_total", "canary_checks", "Correctness canary checks compared with the start-up decode"),
            ("canary_failures_total", "canary_failures", "Correctness canary checks whose tokens or logprobs differed"),
        ):
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            c.add_metric([], float(s.get(key) or 0))
            yield c
        if "spec_verify_steps_total" in s:  # tokens a verifying request-step emits: 1 + its accepted drafts
            g = GaugeMetricFamily(f"{PREFIX}_spec_mean_accept_length", "Mean tokens emitted by a request-step "
                                  "that verified drafts (1 + accepted / verify steps; 0 before any)")  # fmt: skip
            n = float(s["spec_verify_steps_total"])
            g.add_metric([], 1 + float(s["spec_accepted_tokens_total"]) / n if n else 0.0)
            yield g
        if "graph_refresh_ms" in s:  # the host's wait for MLX's queued state writes and the copies home
            c = CounterMetricFamily(f"{PREFIX}_graph_refresh_seconds", "Seconds the replays spent bringing moved pools "
                                    "home (MLX's queued writes waited for, then the copies)")  # fmt: skip
            c.add_metric([], float(s["graph_refresh_ms"]) / 1e3)
            yield c
        if "graph_fallbacks" in s:
            c = CounterMetricFamily(f"{PREFIX}_graph_fallback", "Decode steps run through MLX instead of a replayed "
                                    "graph, by reason", labels=["reason"])  # fmt: skip
            for reason, n in sorted(s["graph_fallbacks"].items()):
                c.add_metric([reason], float(n))
            yield c
        host = dict(s.get("host_seconds_total") or {})
        if "engine_loop_seconds_total" in s:
            host["loop"] = s["engine_loop_seconds_total"]
        if host:
            c = CounterMetricFamily(f"{PREFIX}_engine_host_seconds", "Engine thread host seconds by phase: build "
                                    "(the step's graph in Python), encode (MLX's async_eval), sample, wait (for the "
                                    "sampled tokens), loop (whole iterations)", labels=["phase"])  # fmt: skip
            for phase, v in host.items():
                c.add_metric([phase], float(v))
            yield c
        split = s.get("prefill_host_ms") or {}
        if split:  # Engine.prefill_ms: prefill_<part>_ms
            c = CounterMetricFamily(f"{PREFIX}_prefill_host_seconds", "Engine thread host seconds of prompts by "
                                    "part: build (a forward's layers built and queued), eval (its end waited for: the "
                                    "GPU behind the build), snapshot (the prefix cache's at a prompt's end), admit (a "
                                    "slot's reset at admission)", labels=["part"])  # fmt: skip
            for key, ms in split.items():
                c.add_metric([key.removeprefix("prefill_").removesuffix("_ms")], float(ms) / 1e3)
            yield c
        by_rows = dict(enumerate(int(n) for n in s.get("rows_per_step") or ()))
        buckets, acc = [], 0
        for rows in range(1, self.max_rows + 1):
            acc += by_rows.get(rows, 0)
            buckets.append((str(float(rows)), acc))
        total = sum(by_rows.values())
        buckets.append(("+Inf", total))
        h = HistogramMetricFamily(
            f"{PREFIX}_decode_rows_per_step", "Rows decoded together in one engine step"
        )
        h.add_metric([], buckets, sum_value=float(sum(r * n for r, n in by_rows.items())))
        yield h


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, Any] | None], max_rows: int = 8) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token", buckets=_LAT, registry=r
        )
        self.ttft_phase = Histogram(
            f"{PREFIX}_ttft_phase_seconds", "Time to first token by phase: tokenize (arrival to queued: body, "
            "validation, prompt, tokens), queue (to admission), prefill (to its prompt fed but the last token), "
            "first_step (to the first token read back), first_byte (to its chunk written; streams only)",
            ["phase"], buckets=_TTFT_PHASE, registry=r)  # fmt: skip
        for p in TTFT_PHASES:
            self.ttft_phase.labels(p)
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between tokens", buckets=_LAT, registry=r
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Request latency", buckets=_E2E, registry=r
        )
        self.step_seconds = Histogram(
            f"{PREFIX}_engine_step_seconds", "Duration of one engine step", buckets=_LAT, registry=r
        )
        self.phase_seconds = Histogram(
            f"{PREFIX}_engine_phase_seconds", "Engine thread host seconds of one iteration by phase: build, encode, "
            "sample, wait (as dsv4_engine_host_seconds), prefill, schedule (the rest: inbox, admission, events), "
            "loop (the whole iteration)", ["phase"], buckets=_PHASE, registry=r)  # fmt: skip
        r.register(_EngineCollector(stats, max_rows))

    def observe_step(self, rows: int, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def observe_phases(self, phases: dict[str, float]) -> None:
        """On the engine thread (prometheus objects are thread-safe): one iteration's phases
        (service/engine/phases.py)."""
        for phase, seconds in phases.items():
            self.phase_seconds.labels(phase).observe(seconds)

    def outcome(self, name: str) -> None:
        self.requests.labels(name).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
