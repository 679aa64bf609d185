"""Prefill paced by an inter-token latency target (`--itl-target-ms`): while rows stream, each iteration is one
decode step plus at most one slice of a prompt's forward, and the slice holds as many of the forward's layers as
keep the two together under the target. Pure Python, no mlx: the engine thread feeds it each iteration's wall
seconds and the prefill it built (rows x layers and layers: `Engine.prefill_rows_layers`, `Engine.prefill_layers`).

Only the slice is paced, never the chunk: every forward takes `--prefill-chunk` prompt tokens (a prompt's pieces
end where they would alone), so pacing changes when a prompt's logits are computed, not their bits (a prompt
chunked otherwise differs in its logits' last bits: `tests/e2e/test_prompt_logprobs.py`).

A slice of L layers costs the streams F + c*L past the step: c a layer's work, F what a slice costs whatever its
layers (with the CUDA-graph step: a synchronize, the moved state pools copied home, a host build the replay cannot
overlap). A cost a layer alone (F folded into c) made one-layer slices look dear and kept them at one layer for
good: a 43-layer forward in 43 steps, 5-7 s to a first token beside 8 streams on an H100. Measured as wall time
(what the streams see: a slice's GPU work is waited for by the step after it):
- the step: an EWMA of iterations that stepped and built no prefill;
- F and c by forward size (rows rounded down to a power of two): a least-squares line through the (L, seconds past
  the step) of slices and the (L, seconds) of forwards built whole, forgetting at ALPHA. A line with c <= 0 or F
  under 0 (past noise) says no fixed cost: F = 0 and c = seconds / L. Where the recent L vary too little to part F
  from c, the last verdict stands (a slope kept, F following the level); before any, F = 0 and c = seconds / L, and
  a slice probes one layer more than the last (L must vary to be fitted) where that one came in under the room or
  was one layer, and more layers would be chosen were F as large as a step (a synchronize and copies are of a
  step's order; a probe that can't pay even then would only cost the streams a gap).
The target is `--itl-target-ms`, or 2x the step (None: auto); the room is the target less the step, and a slice
gets L = floor((room - F) / c), at least one (and once F and c are parted, at most twice the most layers measured:
a line is trusted about as far as it was seen). Where even one layer misses (room - F < c) no slice meets the target;
then L = ceil(F / c): F is at most the layers' cost, so the prompt goes at least half as fast as built whole, and a
stream's gap stays within the step + 2F + c. Before a forward of that size (or a smaller one) was measured, a layer
a slice.

A forward's first slice costs more than its layers: the forward's preamble (its token, position and index arrays,
the first layer of each kind making the index lists every layer of that kind shares). On the H200 those first
slices of a 16K prompt's 2,048-token chunks were the streams' slowest iterations beside it (2026-12-07), and with
a slice every few steps they are a few percent of the gaps: the p99. So a first slice beside a step, once the
line is parted, goes into `lead` (an EWMA of its seconds past the line, by size) and not into the line, and a new
forward's first slice gets the layers that fit the room less the lead (at least one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.25  # EWMA weight of the newest iteration
AUTO_FACTOR = 2.0  # the automatic target: this many steps
MIN_CHUNK = 16  # the smallest forward size a slice's cost is kept for (bucket)
VARY = 0.1  # the least (EWMA) variance of L, in layers^2, that parts F from c
EPS = 1e-9  # slack for floor / ceil of layer counts computed in floating point


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
    """A forward's rows rounded down to a power of two (at least MIN_CHUNK): the key of its slices' cost."""
    return 1 << (max(MIN_CHUNK, rows).bit_length() - 1)


class Fit:
    """One forward size's slice cost F + c*L (seconds past the step): EWMAs of L, L^2, y, L*y and y/L (y: the
    seconds), so a weighted least-squares line; `est` = (F, c), `parted`: F and c told apart (else F = 0)."""

    def __init__(self) -> None:
        self.m: list[float] | None = None
        self.slope: float | None = None  # c as last parted from F (0: no fixed cost found), None: not yet
        self.est = (0.0, 0.0)
        self.last: tuple[int, float] | None = None  # the last slice beside a step: (L, y)
        self.top = 0  # the most layers measured

    @property
    def parted(self) -> bool:
        return self.slope is not None

    def add(self, layers: int, y: float) -> None:
        new = (layers, layers * layers, y, layers * y, y / layers)
        self.top = max(self.top, layers)
        self.m = list(new) if self.m is None else [ewma(a, b) for a, b in zip(self.m, new, strict=True)]
        l1, l2, mean, ly, ratio = self.m
        var = l2 - l1 * l1
        if var >= VARY:  # a fit; a fixed cost a little under 0 (noise about none) reads as 0
            c = (ly - l1 * mean) / var
            self.slope = c if c > 0 and mean - c * l1 >= -c / 4 else 0.0
        c = self.slope
        self.est = (max(0.0, mean - c * l1), c) if c and mean - c * l1 >= -c / 4 else (0.0, ratio)


def layers_for(room: float, fixed: float, per: float) -> int:
    """The layers of a slice with `room` seconds past the step: those that fit it, at least one; where even one
    layer misses, as many as make the fixed cost at most their own (the target cannot be met)."""
    fits = (room - fixed) / per
    if fits >= 1 - EPS:
        return int(fits + EPS)
    return max(1, math.ceil(fixed / per - EPS))


class Pacer:
    """`target_ms`: the inter-token latency target (None: AUTO_FACTOR x the step; 0: off, fixed slices of
    `slice_ms` and `chunk`-token forwards as before)."""

    def __init__(self, target_ms: float | None, slice_ms: float, chunk: int) -> None:
        if target_ms is not None and target_ms < 0:
            raise ValueError(f"itl_target_ms must be >= 0 or None (auto), got {target_ms}")
        self.target_ms, self.chunk = target_ms, chunk
        self.slice_seconds = slice_ms / 1e3 if slice_ms else None
        self.step: float | None = None  # seconds of an iteration with a step and no prefill
        self.fits: dict[int, Fit] = {}  # a slice's cost, by bucket(rows)
        self.recent: Fit | None = None  # the fit observed last (/metrics)
        self.lead: dict[int, float] = {}  # a forward's first slice's seconds past the line, by bucket(rows)
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

    def slice_cost(self, rows: int) -> tuple[float, float] | None:
        """(F, c) of a slice of a `rows`-row forward: its size's fit, else the nearest smaller size's with c scaled
        up by the rows (an over-estimate: fewer layers), else None."""
        key = bucket(rows)
        if key in self.fits:
            return self.fits[key].est
        below = [k for k in self.fits if k < key]
        if not below:
            return None
        k = max(below)
        fixed, per = self.fits[k].est
        return fixed, per * rows / k

    def layer_cost(self, rows: int) -> float | None:
        """Seconds of one more layer of a `rows`-row forward's slice (c of `slice_cost`), else None."""
        cost = self.slice_cost(rows)
        return None if cost is None else cost[1]

    def pace(self, streaming: bool, rows: int | None = None) -> Pace:
        """This iteration's prefill (`streaming`: rows decode beside it, else the forward is built whole; `rows`:
        the forward in flight's, else a new forward's, the chunk: its first slice, less its `lead`)."""
        target = self.target()
        if target is None or self.step is None or not self.slice_seconds:
            return Pace(self.chunk, self.slice_seconds)
        lead = self.lead.get(bucket(self.chunk), 0.0) if rows is None else 0.0
        rows = rows or self.chunk
        room = max(target - self.step, 0.1 * self.step)
        cost = self.slice_cost(rows)
        if not streaming or cost is None:
            return Pace(self.chunk, room, rows if streaming else None)
        fixed, per = cost
        if lead:  # a first slice: what the room less its lead holds, else one layer (no more time to give it)
            fits = (room - lead - fixed) / per
            layers = int(fits + EPS) if fits >= 1 - EPS else 1
            return Pace(self.chunk, max(room, lead + fixed + per * layers), rows * layers)
        layers = layers_for(room, fixed, per)
        fit = self.fits.get(bucket(rows))
        if fit is not None and fit.parted:  # a line is trusted about as far as it was measured
            layers = min(layers, 2 * fit.top)
        elif fit is not None and fit.last is not None and self.pays(room, *fit.last):
            layers = max(layers, fit.last[0] + 1)  # a probe: L must vary to part F from c
        return Pace(self.chunk, max(room, fixed + per * layers), rows * layers)

    def pays(self, room: float, last: int, extra: float) -> bool:
        """Whether one layer more than the `last` (which took `extra` seconds past the step) may pay: under the room
        or from one layer, more layers would be chosen were F as large as a step (its order: a synchronize, copies)."""
        if extra > room and last > 1:
            return False  # over the room: the fit's fewer layers vary L as well
        fixed = min(self.step or 0.0, extra)
        return extra <= fixed or layers_for(room, fixed, (extra - fixed) / last) > last

    def stats(self) -> dict[str, float]:
        """For /metrics (the engine thread writes these, a scrape reads them: one read of the step for both): slices
        built beside a step and their layers (their ratio: layers a slice), the measured step, the target, and the
        slice cost (F, c) of the forward size observed last."""
        step, fit = self.step, self.recent
        fixed, per = fit.est if fit is not None else (0.0, 0.0)
        return {"prefill_slices_total": self.slices, "prefill_slice_layers_total": self.slice_layers,
                "pacer_step_seconds": step or 0.0, "itl_target_seconds": self.target(step) or 0.0,
                "pacer_slice_fixed_seconds": fixed, "pacer_layer_seconds": per}  # fmt: skip

    def observe(self, seconds: float, stepped: bool, rows_layers: int, layers: int = 0, first: bool = False) -> None:
        """One iteration: its wall seconds, whether it ran a decode step, the prefill rows x layers and layers
        it built, and whether they began a forward still in flight after them (`first`: a first slice)."""
        if not self.on:
            return
        if not rows_layers:
            if stepped:
                self.step = ewma(self.step, seconds)
            return
        if stepped and layers:
            self.slices, self.slice_layers = self.slices + 1, self.slice_layers + layers
        extra = seconds - ((self.step or 0.0) if stepped else 0.0)
        if extra > 0 and layers:
            key = bucket(rows_layers // layers)
            fit = self.fits.setdefault(key, Fit())
            if first and stepped and fit.parted:  # its preamble is no fixed cost of every slice: kept apart
                fixed, per = fit.est
                self.lead[key] = ewma(self.lead.get(key), max(0.0, extra - fixed - per * layers))
                return
            fit.add(layers, extra)
            if stepped:
                fit.last = (layers, extra)
            self.recent = fit
