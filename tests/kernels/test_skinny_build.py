"""The skinny matmuls' kernel (kernels/cuda/matmul_src.py) builds with NVRTC for sm_90a in every form a model
launches: each weight format, the pairs (SwiGLU, both products, CAT), the routed experts (x or the pairs' own
hidden) and the grouped product, for the decode step's 1..8 rows and a short prompt's 8-row groups (`GR` 1: a
group a block; 2: each block runs them in turn), K split among warps (the shared-memory sum between groups) and
not. No GPU: the bits are the gpu tests' (tests/kernels/test_cuda_matmul.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.kernels.nvrtc_here import NEEDS_NVRTC

# (wf, pair, exp, n, k, n2): dense mxfp8, its CAT, the bf16 compressor pair, SwiGLU on mxfp8, experts mxfp4 x / hidden
FORMS = [(1, 0, 0, 1024, 4096, 0), (1, 3, 0, 1024, 4096, 512), (0, 2, 0, 512, 4096, 0), (1, 1, 0, 2048, 4096, 0),
         (2, 1, 1, 2048, 4096, 0), (2, 0, 2, 4096, 2048, 0), (0, 0, 0, 48, 64, 0)]


@NEEDS_NVRTC
@pytest.mark.parametrize("grouped", [0, 1, 2], ids=["rows", "groups", "group_loop"])
@pytest.mark.parametrize("form", FORMS, ids=[f"wf{f[0]}-pair{f[1]}-exp{f[2]}" for f in FORMS])
def test_the_skinny_kernel_builds(form: tuple[int, ...], grouped: int) -> None:
    from dsv4_serve.kernels.cuda.common import E2M1, HEADER, minify
    from dsv4_serve.kernels.cuda.matmul import INPUTS, geometry
    from dsv4_serve.kernels.cuda.matmul_src import SOURCE
    from dsv4_serve.kernels.graph.codegen import translation_unit
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin
    from dsv4_serve.kernels.graph.record import KernelSource

    wf, pair, exp, n, k, n2 = form
    mt, wk, wr, u = geometry(n + n2, k, wf, pair, exp)
    tmpl = [("T", mx.bfloat16), ("O", mx.float32 if wf == 0 else mx.bfloat16), ("WF", wf), ("K", k), ("N", n),
            ("MT", mt), ("PAIR", pair), ("WK", wk), ("WR", wr), ("U", u), ("EXP", exp), ("TOPK", 6 if exp else 1),
            ("N2", n2), ("GR", grouped)]  # fmt: skip
    name = f"dsv4_skinny_mm_test_{wf}{pair}{exp}{grouped}"
    ks = KernelSource(name, INPUTS, ("out",), minify(SOURCE), minify(HEADER + E2M1) + "\n", 0)
    arrays = [mx.zeros((1,), t) for t in (mx.bfloat16, mx.uint32, mx.uint8, mx.uint32, mx.uint8, mx.uint32,
                                          mx.float32)]  # fmt: skip
    unit = translation_unit(ks, tmpl, arrays, [tmpl[1][1]])
    cubin, lowered = compile_cubin(unit, f"mlx::core::cu::{name}", "sm_90a")
    assert cubin and name in lowered
    assert wk > 1 or form[3] == 48  # the forms above split K (the sum between groups) but the small one
