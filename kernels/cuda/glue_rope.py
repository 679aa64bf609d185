"""The step's RoPE glue on CUDA (DSV4_GRAPH_GLUE=1): rope_step_tables and rms_rope_ring_rows, one launch each.

rope_step_tables: one block a row; each thread a table column: the angle (float)p * freqs[k] (one product: no
sum to contract), cosf / sinf (NVRTC without fast math, as MLX's compiled cos / sin: the same values), the
sine's sign per pair (-sin, +sin), 1 / 0 on the dims before the rope dims, and -S with its -0 there: the
reference's tables bit for bit. A layer kind's outputs: (C, S[, ccos, csin][, Ci, Si], -S).
rms_rope_ring_rows: kernels/cuda/rope.py's block-a-vector source (the same f32 ops in the same order), each
rotated kv element rounded to x's dtype and written to the ring row window[slot, p % ring] (in the window's
dtype, as the reference's cast) in place; its output is a 4-int token (kernels/cuda/compressor_inplace.py's
form: MLX keeps outputs of <= 8 bytes in managed memory) that the ring's readers take (`after=`).
Fast path: f32 freqs, int32 positions; x / weight / window of a float dtype, f32 tables; else the reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import f32_params, kernel, plan_cached
from dsv4_serve.kernels.cuda.norms import INV_RMS
from dsv4_serve.kernels.cuda.rope import NORMED_PAIR
from dsv4_serve.kernels.glue import (
    check_rms_rope_ring_rows,
    check_rope_step_tables,
    rms_rope_ring_rows_reference,
    rope_step_tables_reference,
)

THREADS = 128
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

def _rotation(dim: str, c: str, s: str, extra: str = "") -> str:
    """The loop body writing one rotation table pair (cos c, sin s with the pairs' sign folded in) of `dim`."""
    return f"""    if (j < {dim}) {{
      float cv = 1.f, sv = 0.f;
      const int i = j - ({dim} - 2 * HALF);
      if (i >= 0) {{
        const float a = pf * freqs[i >> 1];
        cv = cosf(a);
        sv = sinf(a);
        if (!(i & 1)) sv = -sv;
      }}
      {c}[(size_t)b * {dim} + j] = cv;
      {s}[(size_t)b * {dim} + j] = sv;
{extra}    }}
"""


TABLES = r"""
  const int b = blockIdx.x;
  const int p = positions[b];
  const float pf = (float)p;
  for (int j = threadIdx.x; j < JMAX; j += blockDim.x) {
""" + _rotation("D", "c", "s", "      sb[(size_t)b * D + j] = -sv;\n") + r"""@MORE@
  }
"""
COMPRESSED = r"""
    if (j < HALF) {
      const float a = (float)max(p + 1 - RATIO, 0) * freqs[j];
      ccos[(size_t)b * HALF + j] = cosf(a);
      csin[(size_t)b * HALF + j] = sinf(a);
    }
"""
INDEXER = "\n" + _rotation("DI", "ci", "si")


def tables_source(ratio: int) -> tuple[str, tuple[str, ...]]:
    """The kernel source of a layer kind and its output names, in the op's order but -S last."""
    more = (COMPRESSED if ratio else "") + (INDEXER if ratio == 4 else "")
    outs = ("c", "s") + (("ccos", "csin") if ratio else ()) + (("ci", "si") if ratio == 4 else ()) + ("sb",)
    return TABLES.replace("@MORE@", more.strip("\n")), outs


class TablesPlan:
    __slots__ = ("dtypes", "grid", "kernel", "shapes", "tmpl")

    def __init__(self, rows: int, half: int, ratio: int, head_dim: int, index_dim: int) -> None:
        src, outs = tables_source(ratio)
        self.kernel = kernel(f"rope_tables{ratio}", ("freqs", "positions"), outs, src)
        jmax = max(head_dim, index_dim if ratio == 4 else 0)
        self.tmpl = [("D", head_dim), ("DI", index_dim), ("HALF", half), ("RATIO", ratio), ("JMAX", jmax)]
        widths = {"c": head_dim, "s": head_dim, "sb": head_dim, "ccos": half, "csin": half, "ci": index_dim,
                  "si": index_dim}  # fmt: skip
        self.shapes = [(rows, widths[n]) for n in outs]
        self.dtypes = [mx.float32] * len(outs)
        self.grid = (rows * THREADS, 1, 1)


def rope_step_tables_cuda(freqs: mx.array, positions: mx.array, *, ratio: int, head_dim: int,
                          index_dim: int) -> tuple[mx.array, ...]:  # fmt: skip
    try:
        key: tuple[Any, ...] = ("rope_step_tables", freqs.shape, freqs.dtype, positions.shape, positions.dtype,
                                type(ratio), ratio, type(head_dim), head_dim, type(index_dim), index_dim)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_rope_step_tables(freqs, positions, ratio, head_dim, index_dim)
        raise

    def make() -> TablesPlan | None:
        check_rope_step_tables(freqs, positions, ratio, head_dim, index_dim)
        if positions.size == 0:
            return None
        return TablesPlan(positions.shape[0], freqs.shape[0], ratio, head_dim, index_dim)

    plan: TablesPlan | None = plan_cached(key, make)
    if plan is None:
        return rope_step_tables_reference(freqs, positions, ratio=ratio, head_dim=head_dim, index_dim=index_dim)
    return tuple(plan.kernel(inputs=[freqs, positions], template=plan.tmpl, grid=plan.grid,
                             threadgroup=(THREADS, 1, 1), output_shapes=plan.shapes, output_dtypes=plan.dtypes))


RING = r"""
  __shared__ float red[32];
  const int vec = blockIdx.x, tid = threadIdx.x;
  const int D = x_shape[1];
  const T* xr = x + (size_t)vec * D;
  const float* cr = c + (size_t)vec * D;
  const float* sr = s + (size_t)vec * D;
  float inv = 1.f;
  if (NORM) {
@INV_RMS@
  }
  P* ring = const_cast<P*>(window) + ((size_t)slots[vec] * RING_LEN + positions[vec] % RING_LEN) * D;
  for (int p = tid; p < D / 2; p += blockDim.x) {
    const int i = 2 * p;
@NORMED_PAIR@
    const T o0 = dsv4_t<T>(y0 * cr[i] + y1 * sr[i]);  // rms_rope_rows' output, then the ring's dtype
    const T o1 = dsv4_t<T>(y1 * cr[i + 1] + y0 * sr[i + 1]);
    ring[i] = dsv4_t<P>(dsv4_f(o0));
    ring[i + 1] = dsv4_t<P>(dsv4_f(o1));
  }
  if (vec == 0 && tid == 0) token[0] = 0;
""".replace("@INV_RMS@", INV_RMS.strip("\n")).replace("@NORMED_PAIR@", NORMED_PAIR.strip("\n"))
RING_INPUTS = ("x", "c", "s", "w", "fparams", "window", "slots", "positions")


class RingPlan:
    __slots__ = ("fparams", "kernel", "tmpl")

    def __init__(self, x: mx.array, window: mx.array, weight: mx.array | None, eps: float | None) -> None:
        self.kernel = kernel("rms_rope_ring", RING_INPUTS, ("token",), RING)
        wdt = weight.dtype if weight is not None else mx.float32
        self.tmpl = [("T", x.dtype), ("W", wdt), ("P", window.dtype), ("NORM", eps is not None),
                     ("HAS_W", weight is not None), ("RING_LEN", window.shape[1])]  # fmt: skip
        self.fparams = f32_params(eps or 0.0)


def rms_rope_ring_rows_cuda(x: mx.array, c: mx.array, s: mx.array, window: mx.array, slots: mx.array,
                            positions: mx.array, ring: mx.array | None = None, *, weight: mx.array | None = None,
                            eps: float | None = None, kv: mx.array | None = None
                            ) -> tuple[mx.array, mx.array | None]:  # fmt: skip
    """`kv` (the caller's rms_rope_rows of x) is the reference's; the kernel makes its own from x."""
    args = (x, c, s, window, slots, positions)
    try:
        key: tuple[Any, ...] = ("rms_rope_ring", *((a.shape, a.dtype) for a in args),
                                None if weight is None else (weight.shape, weight.dtype), type(eps), eps)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check_rms_rope_ring_rows(*args, weight, eps)
        raise

    def make() -> RingPlan | None:
        check_rms_rope_ring_rows(*args, weight, eps)
        if (x.size == 0 or x.dtype not in _FLOATS or window.dtype not in _FLOATS or c.dtype != mx.float32
                or s.dtype != mx.float32 or slots.dtype != mx.int32 or positions.dtype != mx.int32
                or (weight is not None and weight.dtype not in _FLOATS)):  # fmt: skip
            return None
        return RingPlan(x, window, weight, eps)

    plan: RingPlan | None = plan_cached(key, make)
    if plan is None:
        return rms_rope_ring_rows_reference(x, c, s, window, slots, positions, ring, weight=weight, eps=eps, kv=kv)
    (token,) = plan.kernel(
        inputs=[x, c, s, weight if weight is not None else plan.fparams, plan.fparams, window, slots, positions],
        template=plan.tmpl, grid=(x.shape[0] * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(4,)], output_dtypes=[mx.int32],
    )  # fmt: skip
    return window, token
