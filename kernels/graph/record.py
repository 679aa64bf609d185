"""Recording a decode step's launches into a `plan.StepPlan`.

`Recorder.install()` puts a recording factory in place of `mx.fast.cuda_kernel` (before `kernels.cuda` makes
its kernel objects): every launch of the CUDA path is then kept with its kernel (name, source, header,
argument names: what NVRTC needs to build it again outside MLX), its launch values and the arrays it reads
and writes. `Recorder.plan()` evaluates them and sorts each argument into the buffer kinds of
`kernels/graph/plan.py` by address, so a reshape or a slice of a buffer is that buffer (MLX views share it).

Addresses come from DLPack: on the CPU the plan is made on the CPU twin of the step (`tools/graph_plan.py` stands
a zero-filling launch in for each kernel), whose launch list is the GPU's for the same shapes and dtypes; on CUDA
(`model/graph_step.py`) they are the device addresses the captured graph takes.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.graph.plan import Buffer, Launch, Ref, StepPlan, build

log = logging.getLogger("dsv4.graph")


@dataclass(frozen=True)
class KernelSource:
    """What `mx.fast.cuda_kernel` was given: enough to build the same kernel with NVRTC."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    shared_memory: int


@dataclass
class RawLaunch:
    kernel: KernelSource
    template: tuple[tuple[str, Any], ...]  # as given: ints, bools, mx.Dtype
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    inputs: list[mx.array]
    outputs: list[mx.array]
    init_value: float | None = None  # MLX fills the outputs with it before the launch


@dataclass(frozen=True)
class ArraySpec:
    """What a launch's translation unit and memsets need of an argument: no buffer (an array kept would keep its
    buffer alive, and a pool held so could never be donated by MLX)."""

    shape: tuple[int, ...]
    dtype: mx.Dtype
    nbytes: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


def detached(ln: RawLaunch) -> RawLaunch:
    """The launch with each array replaced by its ArraySpec."""
    def spec(a: mx.array) -> ArraySpec:
        return ArraySpec(tuple(a.shape), a.dtype, a.nbytes)

    return RawLaunch(ln.kernel, ln.template, ln.grid, ln.threadgroup, [spec(a) for a in ln.inputs],  # type: ignore[misc]
                     [spec(a) for a in ln.outputs], ln.init_value)  # type: ignore[misc]  # fmt: skip


def _template(t: Iterable[tuple[str, Any]] | None) -> tuple[tuple[str, str], ...]:
    return tuple((str(n), str(v)) for n, v in (t or ()))


class Recorder:
    """Keeps every launch made while `recording` is true."""

    def __init__(self, base: Callable[..., Any] | None = None) -> None:
        self.base = base
        self.launches: list[RawLaunch] = []
        self.kernels: dict[str, KernelSource] = {}
        self.recording = False

    def install(self) -> None:
        """Replace `mx.fast.cuda_kernel` (the stand-in or MLX's own as `base`) with the recording factory."""
        if self.base is None:
            self.base = mx.fast.cuda_kernel
        mx.fast.cuda_kernel = self.factory

    def factory(self, *, name: str, input_names: list[str], output_names: list[str], source: str,
                header: str = "", ensure_row_contiguous: bool = True, shared_memory: int = 0,
                **kw: Any) -> Callable[..., Any]:  # fmt: skip
        assert self.base is not None
        obj = self.base(name=name, input_names=input_names, output_names=output_names, source=source, header=header,
                        ensure_row_contiguous=ensure_row_contiguous, shared_memory=shared_memory, **kw)  # fmt: skip
        ks = KernelSource(name, tuple(input_names), tuple(output_names), source, header, shared_memory)
        self.kernels[name] = ks

        def launch(*, inputs: list[Any], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                   template: list[tuple[str, Any]] | None = None, **lkw: Any) -> list[mx.array]:  # fmt: skip
            outs = obj(inputs=inputs, grid=grid, threadgroup=threadgroup, template=template, **lkw)
            if self.recording:
                ins = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
                self.launches.append(RawLaunch(ks, tuple(template or ()), tuple(grid), tuple(threadgroup), ins,
                                               list(outs), lkw.get("init_value")))  # fmt: skip
            return outs

        return launch

    def plan(self, rows: int, named: Mapping[str, Mapping[str, mx.array]],
             rewritten: Iterable[str] = ()) -> StepPlan:  # fmt: skip
        """The recorded launches as a plan. `named[kind][label]`: the arrays of each persistent or step kind
        (`weight`, `pool`, `const`, `step`); every other argument is an earlier launch's output (`arena`) or,
        failing that, a `gap`. `rewritten`: the state arrays an MLX op wrote during the step (`moved`)."""
        mx.eval([a for ln in self.launches for a in (*ln.inputs, *ln.outputs)],
                [list(m.values()) for m in named.values()])  # fmt: skip
        spans = Spans()  # persistent, step and arena buffers by address
        buffers: dict[int, Buffer] = {}
        starts: dict[int, int] = {}
        at: dict[int, int | None] = {}  # id(array) -> its address (every array here lives until the plan is built)

        def addr(a: mx.array) -> int | None:
            if id(a) not in at:
                at[id(a)] = address(a)
            return at[id(a)]

        def add(a: mx.array, kind: str, label: str) -> None:
            start = addr(a)
            if start is None or spans.find(start, 1) is not None:
                return  # a view of a buffer already known (or a scalar without a buffer)
            bid = len(buffers)
            buffers[bid] = Buffer(bid, kind, a.nbytes, label)
            spans.add(start, start + a.nbytes, bid)
            starts[bid] = start

        for kind, arrays in named.items():  # first: exported (moved into managed memory once, for good)
            for label, a in arrays.items():
                add(a, kind, label)
        rest = list({id(a): a for ln in self.launches for a in (*ln.inputs, *ln.outputs) if id(a) not in at}.values())
        at.update(zip(map(id, rest), addresses(rest), strict=True))  # the intermediates: read, not moved
        launches = []
        for ln in self.launches:
            ins = tuple(self._ref(a, addr(a), spans, buffers, f"{ln.kernel.name}.{n}")
                        for a, n in zip(ln.inputs, ln.kernel.input_names, strict=True))  # fmt: skip
            for a, n in zip(ln.outputs, ln.kernel.output_names, strict=True):
                add(a, "arena", f"{ln.kernel.name}.{n}")
            outs = tuple(self._ref(a, addr(a), spans, buffers, f"{ln.kernel.name}.{n}")
                         for a, n in zip(ln.outputs, ln.kernel.output_names, strict=True))  # fmt: skip
            launches.append(Launch(ln.kernel.name, ln.grid, ln.threadgroup, _template(ln.template), ins, outs))
        return build(rows, launches, buffers, list(rewritten), starts)

    @staticmethod
    def _ref(a: mx.array, start: int | None, spans: Spans, buffers: dict[int, Buffer], label: str) -> Ref:
        """`a` (at `start`: `address(a)`, None if strided) as a part of a known buffer, or a gap."""
        if start is not None:
            hit = spans.find(start, a.nbytes)
            if hit is not None:
                s, bid = hit
                return Ref(bid, start - s, a.nbytes)
        bid = len(buffers)  # made by an MLX op (or a strided view MLX would copy): a gap
        buffers[bid] = Buffer(bid, "gap", a.nbytes, label)
        return Ref(bid, 0, a.nbytes)


class Spans:
    """Disjoint address ranges [start, end) with a buffer id each; `find` by bisection (a plan looks up ~2,000
    arguments among ~2,000 buffers: a scan of every span each was most of a 43-layer plan's host time)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.items: list[tuple[int, int, int]] = []  # (start, end, buffer id), sorted by start

    def add(self, start: int, end: int, bid: int) -> None:
        i = bisect.bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.items.insert(i, (start, end, bid))

    def find(self, start: int, nbytes: int) -> tuple[int, int] | None:
        """(span start, buffer id) of the span holding [start, start + nbytes), or None."""
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0:
            return None
        s, e, bid = self.items[i]
        if start + nbytes <= e:
            return s, bid
        for s, e, bid in self.items[:i]:  # a span nested in another (not seen in a step's plan): the old scan's
            if s <= start and start + nbytes <= e:
                return s, bid
        return None


def hold(arrays: Mapping[str, mx.array]) -> dict[str, tuple[mx.array, int | None]]:
    """Each state array's buffer held by a view of its own, with its address: call before the step. An MLX op
    that writes the array (`a[idx] = v` turns the same Python array into a scatter's output) can then not
    write in place (MLX donates only a buffer nothing else holds), so `moved` sees it."""
    views = {k: a.reshape(-1) for k, a in arrays.items()}
    mx.eval(list(views.values()))
    return {k: (v, address(v)) for k, v in views.items()}


def moved(held: Mapping[str, tuple[mx.array, int | None]], after: Mapping[str, mx.array]) -> list[str]:
    """The state arrays an MLX op wrote during the step (now in another buffer than `hold` saw); a launch
    writes in place."""
    mx.eval(list(after.values()))
    return [k for k, a in after.items() if k in held and address(a) != held[k][1]]


def _numpy(a: mx.array) -> np.ndarray:
    """The array's buffer as NumPy sees it through DLPack (bfloat16, which NumPy lacks, as uint16: the same
    bytes). On CUDA this moves a device buffer once into managed memory (docs/cuda_graphs.md): its address is
    then the one MLX keeps, on the host and the GPU alike."""
    return np.from_dlpack(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def addresses(arrays: list[mx.array]) -> list[int | None]:
    """`address` of each array: each exported as `address` does (DLPack: moved into managed memory once);
    `DSV4_GRAPH_ADDRESSES=kernel` on CUDA: read by a kernel, so no buffer moves (kernels/cuda/address.py: a step's
    intermediates are only sorted into buffers by them). Opt-in: on the H100 (2026-12-07, 304f0ca) its reads equal
    DLPack's, but a recording with it took 13.48 s where DLPack's took 3.77 s."""
    if arrays and mx.cuda.is_available() and os.environ.get("DSV4_GRAPH_ADDRESSES", "dlpack") == "kernel":
        from dsv4_serve.kernels.cuda.address import read

        try:
            return read(arrays)
        except Exception:  # noqa: BLE001 - a build failure (another MLX, another NVRTC): DLPack's reads, as before
            log.exception("addresses by kernel failed: reading them through DLPack")
    return [address(a) for a in arrays]


def address(a: mx.array) -> int | None:
    """The first byte of an evaluated, row-contiguous array (None: empty or strided)."""
    if a.nbytes == 0:
        return None
    n = _numpy(a)
    if not n.flags.c_contiguous:
        return None
    return int(n.ctypes.data)

