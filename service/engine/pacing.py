"""Prefill paced by an inter-token latency target (`--itl-target-ms`): while rows stream, each iteration is one
decode step plus at most one slice of a prompt's forward, and the slice holds as many of the forward's layers as
keep the two together under the target. Pure Python, no mlx: the engine thread feeds it each iteration's wall
seconds and the prefill it built (rows x layers and layers: `Engine.prefill_rows_layers`, `Engine.prefill_layers`).

Only the slice is paced, never the chunk: every forward takes `--prefill-chunk` prompt tokens (a prompt's pieces
end where they would alone), so pacing changes when a prompt's logits are computed, not their bits (a prompt
chunked otherwise differs in its logits' last bits: `tests/e2e/test_prompt_logprobs.py`).

What it measures, as EWMAs of what the streams see (wall time, the GPU's share included: a slice's GPU work is
waited for by the step after it):
- the step: iterations that stepped and built no prefill;
- a layer of a forward, by its rows rounded down to a power of two: an iteration's seconds past the step, over
  the layers it built (a layer has a large fixed cost, so the cost is kept per size, not per row).
The target is `--itl-target-ms`, or 2x the step (None: auto); a slice gets what the step leaves of it and as
many layers as fit it, at least one (where even one layer misses the target, the prompt still progresses). Before
a layer of that size was measured, a layer a slice.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.25  # EWMA weight of the newest iteration
AUTO_FACTOR = 2.0  # the automatic target: this many steps
MIN_CHUNK = 16  # the smallest forward size a layer's cost is kept for (bucket)


@dataclass(frozen=True)
class Pace:
    """One iteration's prefill: prompt tokens for a new forward, and a slice's host seconds and rows x layers
    (None: the engine's default, DSV4_PREFILL_SLICE_ROWS)."""

    budget: int
    slice_seconds: float | None
    rows_layers: int | None = None


def ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


def bucket(rows: int) -> int:
    """A forward's rows rounded down to a power of two (at least MIN_CHUNK): the key of its layer's cost."""
    return 1 << (max(MIN_CHUNK, rows).bit_length() - 1)


class Pacer:
    """`target_ms`: the inter-token latency target (None: AUTO_FACTOR x the step; 0: off, fixed slices of
    `slice_ms` and `chunk`-token forwards as before)."""

    def __init__(self, target_ms: float | None, slice_ms: float, chunk: int) -> None:
        if target_ms is not None and target_ms < 0:
            raise ValueError(f"itl_target_ms must be >= 0 or None (auto), got {target_ms}")
        self.target_ms, self.chunk = target_ms, chunk
        self.slice_seconds = slice_ms / 1e3 if slice_ms else None
        self.step: float | None = None  # seconds of an iteration with a step and no prefill
        self.layer: dict[int, float] = {}  # seconds of a forward's layer, by bucket(rows)
        self.slices = self.slice_layers = 0  # iterations that built a slice beside a step, and its layers (/metrics)

    @property
    def on(self) -> bool:
        return self.target_ms != 0

    def target(self, step: float | None = None) -> float | None:
        """The inter-token latency target in seconds (auto: from `step`, else the measured step); None while off or
        not measured yet."""
        step = self.step if step is None else step
        if not self.on:
            return None
        if self.target_ms is not None:
            return self.target_ms / 1e3
        return None if step is None else AUTO_FACTOR * step

    def layer_cost(self, rows: int) -> float | None:
        """Seconds of one layer of a `rows`-row forward: its size's EWMA, else the nearest smaller size measured
        scaled up by the rows (an over-estimate: fewer layers, never a missed target), else None."""
        key = bucket(rows)
        if key in self.layer:
            return self.layer[key]
        below = [k for k in self.layer if k < key]
        if not below:
            return None
        k = max(below)
        return self.layer[k] * rows / k

    def pace(self, streaming: bool, rows: int | None = None) -> Pace:
        """This iteration's prefill (`streaming`: rows decode beside it, else the forward is built whole; `rows`:
        the forward in flight's, else a new forward's: the chunk)."""
        target = self.target()
        if target is None or self.step is None or not self.slice_seconds:
            return Pace(self.chunk, self.slice_seconds)
        rows = rows or self.chunk
        cost = self.layer_cost(rows)
        room = max(target - self.step, cost or 0.0, 0.1 * self.step)
        if not streaming:
            return Pace(self.chunk, room)
        layers = max(1, int(room / cost)) if cost else 1
        return Pace(self.chunk, room, rows * layers)

    def stats(self) -> dict[str, float]:
        """For /metrics (the engine thread writes these, a scrape reads them: one read of the step for both): slices
        built beside a step and their layers (their ratio: layers a slice), the measured step, the target."""
        step = self.step
        return {"prefill_slices_total": self.slices, "prefill_slice_layers_total": self.slice_layers,
                "pacer_step_seconds": step or 0.0, "itl_target_seconds": self.target(step) or 0.0}  # fmt: skip

    def observe(self, seconds: float, stepped: bool, rows_layers: int, layers: int = 0) -> None:
        """One iteration: its wall seconds, whether it ran a decode step, the prefill rows x layers and layers
        it built."""
        if not self.on:
            return
        if not rows_layers:
            if stepped:
                self.step = ewma(self.step, seconds)
            return
        if stepped and layers:
            self.slices, self.slice_layers = self.slices + 1, self.slice_layers + layers
        cost = seconds - ((self.step or 0.0) if stepped else 0.0)
        if cost > 0 and layers:
            key = bucket(rows_layers // layers)
            self.layer[key] = ewma(self.layer.get(key), cost / layers)
