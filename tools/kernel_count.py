"""Kernels a decode layer launches on CUDA, counted on any machine from its compiled graphs (no GPU).

Each op that `kernels/cuda` serves with one launch (the skinny matmuls, the mHC pre-mix and, unless
`--no-glue`, the glue kernels) is stood in for by one `mx.depends` node on all its inputs, so the graph
keeps its shape. Then each layer kind's two
compiled segments (`Block.before` / `Block.after`) are exported (`mx.export_to_dot`) and their
primitives counted, views (reshape, slice, broadcast, transpose, ...) apart: on CUDA each other
primitive is about one kernel. The kernel part of a layer (window write, compressor, indexer,
attention: 4-8 launches) is not in the segments and not counted. Against CUPTI on the H200: without
the glue kernels 58-66 here + that part, for 67 measured a layer (72863cd); with them 24-32 + that
part, for 40 measured (1,720 a step at 1 row, 383f696).

    python tools/kernel_count.py [--no-glue] [--rows 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from dsv4_serve.kernels import backend, rope_apply  # noqa: E402
from dsv4_serve.kernels.matmul import MANY_ROWS  # noqa: E402
from dsv4_serve.kernels.norms import rms_norm_rows_reference  # noqa: E402
from dsv4_serve.model.checkpoint import is_f32_param  # noqa: E402
from dsv4_serve.model.config import ModelArgs  # noqa: E402
from dsv4_serve.model.deepseek_v4 import DeepseekV4  # noqa: E402
from dsv4_serve.model.layers import reset_compiled as forget_hc_pre  # noqa: E402
from dsv4_serve.model.layers import rope_angles  # noqa: E402
from dsv4_serve.model.quant import quantize_block  # noqa: E402

VIEWS = {"Full", "Reshape", "Slice", "Broadcast", "BroadcastAxes", "Squeeze", "ExpandDims", "Transpose",
         "AsStrided", "Copy"}  # fmt: skip


def one(shapes: list[tuple[tuple[int, ...], mx.Dtype]], *deps: Any) -> list[mx.array]:
    """One graph node for a kernel launch: zeros of the outputs' shapes depending on every array input."""
    return mx.depends([mx.zeros(s, d) for s, d in shapes], [a for a in deps if isinstance(a, mx.array)])


def pre_mix(h: mx.array, *deps: Any) -> tuple[mx.array, ...]:
    """The mHC pre-mix's outputs (x [B, H], post [B, nc], comb [B, nc, nc]) as one node."""
    b, nc, hid = h.shape
    return tuple(one([((b, hid), h.dtype), ((b, nc), mx.float32), ((b, nc, nc), mx.float32)], h, *deps))


STANDINS = {
    "qlinear_rows": lambda x, w, s: one([((*x.shape[:-1], w.shape[0]), x.dtype)], x, w, s)[0],
    "qlinear_cat_rows": lambda x, w1, s1, w2, s2: tuple(one([((*x.shape[:-1], w1.shape[0]), x.dtype),
                                                              ((*x.shape[:-1], w2.shape[0]), x.dtype)],
                                                             x, w1, s1, w2, s2)),  # fmt: skip
    "f32_linear_rows": lambda x, w: one([((*x.shape[:-1], w.shape[0]), mx.float32)], x, w)[0],
    "f32_linear_pair_rows": lambda x, w1, w2: tuple(one([((*x.shape[:-1], w1.shape[0]), mx.float32)] * 2, x, w1, w2)),
    "swiglu_rows": lambda x, w1, s1, w3, s3, *, limit: one([((*x.shape[:-1], w1.shape[0]), x.dtype)],
                                                           x, w1, s1, w3, s3)[0],  # fmt: skip
    "experts_gate_up_rows": lambda x, i, w1, s1, w3, s3, *, limit: one([((*i.shape, w1.shape[1]), x.dtype)],
                                                                       x, i, w1, s1, w3, s3)[0],  # fmt: skip
    "experts_down_rows": lambda h, i, w2, s2: one([((*i.shape, w2.shape[1]), h.dtype)], h, i, w2, s2)[0],
    "grouped_qlinear_rows": lambda x, w, s: one([((*x.shape[:2], w.shape[1]), x.dtype)], x, w, s)[0],
    "hc_pre_mix": lambda m, sc, ba, h, *, iters, eps: pre_mix(h, m, sc, ba),
    "write_rows": lambda pool, rows, values, carry=None: (pool, one([((1,) if carry is None else carry.shape,
                                                                      mx.int32)], pool, rows, values)[0]),  # fmt: skip
}
# the CUDA skinny kernels take a short prompt's 9..64 rows as 8-row groups of one launch (kernels/cuda/matmul.py)
for _op in ("qlinear_rows", "qlinear_cat_rows", "f32_linear_rows", "f32_linear_pair_rows", "swiglu_rows",
            "experts_gate_up_rows", "experts_down_rows"):  # fmt: skip
    STANDINS[_op].rows_per_launch = MANY_ROWS  # type: ignore[attr-defined]
GLUE = {
    "rms_norm_rows": lambda x, w, *, eps, out_dtype=None: one([(x.shape, out_dtype or x.dtype)], x, w)[0],
    "hc_post_rows": lambda y, h, post, comb: one([(h.shape, h.dtype)], y, h, post, comb)[0],
    "router_topk": lambda lg, b, *, k, route_scale: tuple(one([((lg.shape[0], k), mx.uint32),
                                                                ((lg.shape[0], k), mx.float32)], lg, b)),  # fmt: skip
    "moe_combine_rows": lambda p, w, s, *, out_dtype: one([((p.shape[0], p.shape[2]), out_dtype)], p, w, s)[0],
    "rms_rope_rows": lambda x, c, s, *, weight=None, eps=None: one([(x.shape, x.dtype)], x, c, s, weight)[0],
    "moe_combine_post_rows": lambda p, w, s, h, post, comb: one([(h.shape, h.dtype)], p, w, s, h, post, comb)[0],
    "hc_pre_rows": lambda h, fn, sc, ba, *, iters, eps, norm_eps: pre_mix(h, fn, sc, ba),
    "hc_pre_norm_rows": lambda h, fn, sc, ba, w, *, iters, eps, norm_eps, x_eps: pre_mix(h, fn, sc, ba, w),
}


def counted(outs: list[mx.array]) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        names = re.findall(r'\[label ="?([^"\]]*)"?, shape=rectangle', Path(f.name).read_text())
    return collections.Counter(n for n in names if n not in VIEWS)


def _rms_rope_unfused(x: mx.array, c: mx.array, s: mx.array, *, weight: mx.array | None = None,
                      eps: float | None = None) -> mx.array:  # fmt: skip
    if eps is not None:
        x = one([(x.shape, x.dtype)], x)[0] if weight is None else rms_norm_rows_reference(x, weight, eps=eps)
    return rope_apply(x, c, s)


@contextlib.contextmanager
def standins(glue: bool) -> Iterator[None]:
    """The fast ops' dispatch with one-node stand-ins, undone after."""
    use_fast, fast = backend._use_fast, dict(backend._fast)
    backend._use_fast = lambda: True
    for op, fn in (STANDINS | (GLUE if glue else {})).items():
        backend.register(op, fn)
    for op in () if glue else GLUE:
        backend.unregister(op)
    if not glue:  # the norm before RoPE as CUDA runs it: MLX's fused norm (one kernel) or the weighted reference
        backend.register("rms_rope_rows", _rms_rope_unfused)
    try:
        yield
    finally:
        backend._use_fast = use_fast
        backend._fast.clear()
        backend._fast.update(fast)
        forget_hc_pre()  # its compiled functions traced the stand-ins


def release_structure(ratios: list[int], **dims: int) -> tuple[DeepseekV4, ModelArgs]:
    """A model with the release's structure where it sets the graph (4 mHC streams, 20 Sinkhorn iterations,
    8 output groups, 6 of 16 routed experts, the layers' compress `ratios`) at small dims (`dims` overrides
    ModelArgs fields), quantized as released, bf16 but the release's f32 tensors (checkpoint.is_f32_param)."""
    a = ModelArgs.tiny()
    a.num_hidden_layers, a.compress_ratios, a.num_hash_layers = len(ratios), list(ratios), 0
    a.hc_mult, a.hc_sinkhorn_iters = 4, 20
    a.num_attention_heads, a.o_groups, a.n_routed_experts, a.num_experts_per_tok = 8, 8, 16, 6
    for k, v in dims.items():
        setattr(a, k, v)
    model = DeepseekV4(a)
    for blk in model.layers:
        quantize_block(blk)
    model.update(tree_unflatten([(n, p.astype(mx.bfloat16) if p.dtype == mx.float32 and not is_f32_param(n) else p)
                                 for n, p in tree_flatten(model.parameters())]))  # fmt: skip
    mx.eval(model.parameters())
    return model, a


def layer_counts(glue: bool, rows: int = 1) -> dict[str, tuple[collections.Counter, collections.Counter]]:
    """Per layer kind (sliding, CSA, HCA): the kernel-like primitives of its `before` and `after` segments."""
    model, a = release_structure([0, 4, 128])
    h = mx.random.normal((rows, a.hc_mult, a.hidden_size)).astype(mx.bfloat16)
    pos, tok = mx.arange(rows) + 100, mx.arange(rows).astype(mx.int32)
    o = mx.random.normal((rows, a.num_attention_heads, a.head_dim)).astype(mx.bfloat16)
    mx.eval(h, pos, tok, o)  # inputs, not graph
    out: dict[str, tuple[collections.Counter, collections.Counter]] = {}
    with standins(glue):
        for i, kind in enumerate(("sliding", "CSA", "HCA")):
            blk = model.layers[i]
            angles = rope_angles(model._freqs[a.layer_ratio(i) != 0], pos, a.layer_ratio(i), a)
            back = -angles[1]
            mx.eval(angles, back)  # once a step, outside the segments
            seg = mx.compile(blk.before)(h, *angles)
            c1 = counted(list(seg))
            mx.eval(seg)  # the after segment's own graph only
            post, comb, proj = seg[0], seg[1], seg[2:]
            out[kind] = (c1, counted([mx.compile(blk.after)(o, h, post, comb, proj[2], back, tok)]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-glue", dest="glue", action="store_false",
                    help="the glue ops' references (DSV4_GLUE_KERNELS=0)")
    ap.add_argument("--rows", type=int, default=1)
    opt = ap.parse_args()
    print(f"{'layer':8} {'before':>6} {'after':>6} {'total':>6}  most common")
    for kind, (c1, c2) in layer_counts(opt.glue, opt.rows).items():
        top = (c1 + c2).most_common(5)
        print(f"{kind:8} {sum(c1.values()):6d} {sum(c2.values()):6d} {sum((c1 + c2).values()):6d}  "
              + ", ".join(f"{n} {k}" for n, k in top))


if __name__ == "__main__":
    main()
