"""The time to first token by phase in /metrics (dsv4_ttft_phase_seconds: tokenize, queue, prefill, first_step,
first_byte) on a real server (tiny model): every first token counts once in each phase (first_byte: streams only),
and one request's phases add up to no more than the time to first token its client saw. /metrics is read with
prometheus_client's own parser; bench/serve.py's reading of the same histograms is checked against it."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.server_metrics import pacing, prefill_split, scrape, ttft_split
from tests.e2e.conftest import MODEL

PHASES = ("tokenize", "queue", "prefill", "first_step", "first_byte")
Split = dict[str, tuple[float, float]]


def phases(url: str) -> Split:
    """phase -> (count, sum of seconds)."""
    out: dict[str, list[float]] = {p: [0.0, 0.0] for p in PHASES}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if fam.name != "dsv4_ttft_phase_seconds":
            continue
        for s in fam.samples:
            if s.name.endswith("_count"):
                out[s.labels["phase"]][0] = s.value
            elif s.name.endswith("_sum"):
                out[s.labels["phase"]][1] = s.value
    return {p: (c, t) for p, (c, t) in out.items()}


def diff(after: Split, before: Split) -> Split:
    return {p: (after[p][0] - before[p][0], after[p][1] - before[p][1]) for p in PHASES}


def streamed_ttft(url: str, prompt: list[int], max_tokens: int = 6) -> float:
    """A streamed completion read to its end; the seconds from sending it to its first chunk with a token."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    t0, ttft = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {") and '"choices":[{' in line:
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


@pytest.mark.parametrize("prompt_len", [3, 200])
def test_a_streams_phases_count_once_and_add_up_within_its_ttft(server, prompt_len: int) -> None:
    for i in range(3):
        prompt = [(7 * i + j) % 400 + 3 for j in range(prompt_len)]
        before = phases(server.url)
        ttft = streamed_ttft(server.url, prompt)
        got = diff(phases(server.url), before)
        assert {p: c for p, (c, _) in got.items()} == dict.fromkeys(PHASES, 1.0), got
        assert all(t >= 0 for _, t in got.values()), got
        assert sum(t for _, t in got.values()) <= ttft, (got, ttft)
        assert got["first_step"][1] > 0 and got["tokenize"][1] > 0  # a decode step and a request's parsing
    if prompt_len == 200:  # its prompt goes through the parallel prefill: a forward, not free
        assert got["prefill"][1] > 0


def test_a_bodys_phases_count_without_first_byte_and_chat_streams_count_it(server) -> None:
    before = phases(server.url)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200
    got = diff(phases(server.url), before)
    assert {p: c for p, (c, _) in got.items()} == {**dict.fromkeys(PHASES, 1.0), "first_byte": 0.0}
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x")
    before = phases(server.url)
    n = 2  # two choices: each its own first token, its own first chunk
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, n=n, stream=True, temperature=0))  # fmt: skip
    assert chunks
    got = diff(phases(server.url), before)
    assert {p: c for p, (c, _) in got.items()} == dict.fromkeys(PHASES, float(n)), got


def test_bench_reads_the_phases_as_the_parser_does(server) -> None:
    before, b = scrape(server.url), phases(server.url)
    for i in range(4):
        streamed_ttft(server.url, [i + 3, 9, 11])
    after, a = scrape(server.url), phases(server.url)
    split, want = ttft_split(before, after), diff(a, b)
    assert set(split) == set(PHASES)
    for p in PHASES:
        assert split[p]["count"] == want[p][0] == 4
        assert split[p]["mean_ms"] == pytest.approx(1e3 * want[p][1] / 4)
        assert 0 <= split[p]["median_ms"] <= 60e3


def test_bench_median_interpolates_in_the_median_bucket() -> None:
    """Four first tokens: one <= 1 ms, two in (1, 2.5] ms, one in (2.5, 5] ms, 10 ms in all (hand-made text)."""
    h = "dsv4_ttft_phase_seconds"
    after = [(f"{h}_bucket", {"phase": "queue", "le": le}, c) for le, c in
             (("0.001", 1), ("0.0025", 3), ("0.005", 4), ("+Inf", 4))]  # fmt: skip
    after += [(f"{h}_count", {"phase": "queue"}, 4.0), (f"{h}_sum", {"phase": "queue"}, 0.010)]
    before = [(n, labels, 0.0) for n, labels, _ in after]
    got = ttft_split(before, after)["queue"]
    # the 2nd of 4 lies in (1, 2.5] ms, which holds the 2nd and 3rd: halfway from its lower edge to the 3rd
    assert got == {"count": 4.0, "mean_ms": pytest.approx(2.5), "median_ms": pytest.approx(1.75)}


def test_bench_pacing_is_the_cells_slices_and_the_last_step() -> None:
    """Hand-made scrapes: 5 slices of 12 layers over the cell, the pacer's step and target as the cell ended."""
    before = [("dsv4_prefill_slices_total", {}, 10.0), ("dsv4_prefill_slice_layers_total", {}, 40.0),
              ("dsv4_pacer_step_seconds", {}, 0.020)]  # fmt: skip
    after = [("dsv4_prefill_slices_total", {}, 15.0), ("dsv4_prefill_slice_layers_total", {}, 52.0),
             ("dsv4_pacer_step_seconds", {}, 0.014), ("dsv4_itl_target_seconds", {}, 0.028),
             ("dsv4_graph_refreshes_total", {}, 4.0), ("dsv4_graph_refresh_seconds_total", {}, 0.010),
             ("dsv4_graph_pool_moves_total", {}, 24.0)]  # fmt: skip
    got = pacing(before, after)
    assert got == {"slices": 5.0, "layers_a_slice": pytest.approx(2.4), "step_ms": pytest.approx(14.0),
                   "target_ms": pytest.approx(28.0), "graph_refreshes": 4.0, "graph_refresh_ms": pytest.approx(2.5),
                   "graph_pool_moves": 24.0, "fixed_ms": 0.0, "layer_ms": 0.0, "kernels_late": 0.0}  # fmt: skip
    assert pacing(after, after)["layers_a_slice"] == 0.0  # no slice in the cell


def test_pacing_is_on_by_default_at_twice_the_measured_step(server) -> None:
    """A server started with no flag paces prefill slices (`--itl-target-ms auto`): once it has stepped, its target
    in /metrics is set (twice the EWMA of its iterations with a step and no prefill), not 0 (off)."""
    streamed_ttft(server.url, [5, 6, 7], max_tokens=24)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    names = ("dsv4_itl_target_seconds", "dsv4_pacer_step_seconds", "dsv4_prefill_slices_total",
             "dsv4_prefill_slice_layers_total", "dsv4_pacer_slice_fixed_seconds",
             "dsv4_pacer_layer_seconds")  # fmt: skip
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in names}
    assert 0 < got["dsv4_itl_target_seconds"] < 5.0, got
    # the step pacing measured, published beside it (one scrape: the target is twice it); slices are counted
    assert got["dsv4_itl_target_seconds"] == pytest.approx(2 * got["dsv4_pacer_step_seconds"]), got
    assert 0 <= got["dsv4_prefill_slices_total"] <= got["dsv4_prefill_slice_layers_total"], got
    # the slice cost pacing fitted (F + c x layers; 0 before a prefill was measured) is published too
    assert got["dsv4_pacer_slice_fixed_seconds"] >= 0 and got["dsv4_pacer_layer_seconds"] >= 0, got


def test_a_prompt_s_host_time_by_part_is_in_metrics_and_bounded_by_its_prefill(server) -> None:
    """Three streamed prompts of 40 tokens: dsv4_prefill_host_seconds counts build, eval, snapshot and admit; their
    growth is positive for build and admit, and no part's exceeds the prefill phases' plus the queue's time (the
    admission's reset ends the queue phase, the forward's build and eval are in the prefill phase); bench/serve.py's
    reading gives the same per prompt."""
    def parts() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return {s.labels["part"]: s.value for fam in text_string_to_metric_families(text)
                if fam.name == "dsv4_prefill_host_seconds" for s in fam.samples}  # fmt: skip

    before, phases0, scraped0 = parts(), phases(server.url), scrape(server.url)
    for i in range(3):
        streamed_ttft(server.url, [(11 * i + j) % 400 + 3 for j in range(40)])
    after, took, scraped1 = parts(), diff(phases(server.url), phases0), scrape(server.url)
    assert set(after) == {"build", "eval", "snapshot", "admit"}, after
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew["build"] > 0 and grew["admit"] > 0 and min(grew.values()) >= 0, grew
    bound = took["prefill"][1] + took["queue"][1] + took["first_step"][1]
    assert max(grew.values()) <= bound, (grew, took)
    per = prefill_split(scraped0, scraped1)
    assert per == {k: pytest.approx(1e3 * v / took["prefill"][0], rel=1e-6, abs=1e-6) for k, v in grew.items()}


def test_bench_prefill_split_is_ms_a_first_token() -> None:
    """Hand-made scrapes: 2 first tokens over the cell, 30 ms of build and 4 ms of admit: 15 and 2 ms a prompt."""
    before = [("dsv4_prefill_host_seconds_total", {"part": "build"}, 1.0),
              ("dsv4_prefill_host_seconds_total", {"part": "admit"}, 0.5),
              ("dsv4_ttft_phase_seconds_count", {"phase": "prefill"}, 7.0),
              ("dsv4_ttft_phase_seconds_count", {"phase": "queue"}, 7.0)]  # fmt: skip
    after = [("dsv4_prefill_host_seconds_total", {"part": "build"}, 1.030),
             ("dsv4_prefill_host_seconds_total", {"part": "admit"}, 0.504),
             ("dsv4_ttft_phase_seconds_count", {"phase": "prefill"}, 9.0),
             ("dsv4_ttft_phase_seconds_count", {"phase": "queue"}, 9.0)]  # fmt: skip
    assert prefill_split(before, after) == {"build": pytest.approx(15.0), "admit": pytest.approx(2.0)}
    assert prefill_split(after, after) == {}  # no first token in the cell
