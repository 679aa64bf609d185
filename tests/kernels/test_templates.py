"""Prefill's CUDA kernels take no context-dependent template value: MLX compiles a custom kernel once per
template (NVRTC, ~2 s for a tile GEMM on the H200), so a value that follows the prompt's length (the indexer's
entry count as the tile GEMM's N did until d3b8705) recompiles every few hundred tokens of a long prompt.
Runs on any machine: the launches are captured, not run."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

NH, D, W, PAGE = 64, 512, 128, 256


class Capture:
    """A stand-in for kernels.cuda.common.kernel: records each launch's name and template, returns zeros."""

    def __init__(self) -> None:
        self.templates: set[tuple[str, tuple[Any, ...]]] = set()

    def __call__(self, name: str, *_: Any, **__: Any) -> Any:
        def launch(*, template: list, output_shapes: list, output_dtypes: list, **___: Any) -> list[mx.array]:
            self.templates.add((name, tuple((k, str(v)) for k, v in template)))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return launch


def attention_launch(kind: str, start: int, t: int, cap: Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    import dsv4_serve.kernels.cuda.prefill_attention as kpa

    monkeypatch.setattr(kpa, "kernel", cap)
    ratio = {"sliding": None, "csa": 4, "hca": 128}[kind]
    q = mx.zeros((t, NH, D), mx.bfloat16)
    ring, kv, sinks = mx.zeros((W, D), mx.bfloat16), mx.zeros((t, D), mx.bfloat16), mx.zeros((NH,))
    pool = table = ind = None
    if ratio:
        n = (start + t) // ratio
        pages = max(1, -(-n // PAGE))
        pool, table = mx.zeros((pages + 1, PAGE, D), mx.bfloat16), mx.arange(1, pages + 1, dtype=mx.int32)
        if ratio == 4:
            ind = mx.array(np.tile(np.arange(512, dtype=np.int32) % max(n, 1), (t, 1)))
    kpa.prefill_attention_cuda(q, ring, kv, start, pool, table, ind, sinks, scale=D**-0.5, ratio=ratio)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_heads_attention_template_is_the_same_at_every_context(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first, later = Capture(), Capture()
    attention_launch(kind, 0, 2048, first, monkeypatch)
    attention_launch(kind, 63_488, 2048, later, monkeypatch)
    assert first.templates and first.templates == later.templates


def test_tile_gemm_template_holds_neither_rows_nor_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiles_mm's Plan for the indexer's scores (N = the entries, growing with the context) and the f32
    products (P = the chunk's rows)."""
    import dsv4_serve.kernels.cuda.tiles_mm as tm

    monkeypatch.setattr(tm, "kernel", lambda *a, **k: None)
    monkeypatch.setattr(tm, "f32_params", lambda *a: None)
    plans = [tm.Plan(p, 128, n, -(-p // tm.TR), wf=0, pair=3, xdiv=1, out=mx.float32)
             for p, n in ((64 * 2048, 512), (64 * 2048, 16_384), (64 * 300, 4096))]  # fmt: skip
    assert all(p.tmpl == plans[0].tmpl for p in plans)
