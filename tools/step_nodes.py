"""MLX graph nodes of one decode layer, by part (runs anywhere, no GPU): at <= 8 rows a step is host-bound,
and every node costs host time (MLX builds and launches each one; a CUDA kernel node ~3-6 us on the
H200's host; docs/performance.md), so the node count is the step's first-order cost.

The model is the tiny one with the release's structure where it sets the graph: 4 mHC streams, 20
Sinkhorn iterations, 8 output groups, 6 routed experts per token. Each part is traced under
mx.compile (as the model runs it) and its graph exported (`mx.export_to_dot`) and counted. The
kernel dispatches (compressor / indexer / attention) are not counted here: on CUDA they are 1-3
nodes each (bench/kernels.py, removed after 3aa6037). Prints a table, writes JSON.

    python tools/step_nodes.py [--out step-nodes.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from dsv4_serve.model.config import ModelArgs  # noqa: E402
from dsv4_serve.model.deepseek_v4 import DeepseekV4  # noqa: E402
from dsv4_serve.model.layers import _hc_pre, hc_post, rms, rope_angles  # noqa: E402


def nodes(outs: list[mx.array]) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        text = Path(f.name).read_text()
    return collections.Counter(re.findall(r'\[label ="?([^"\]]*)"?, shape=rectangle', text))


def traced(fn: Any, *args: Any) -> collections.Counter:
    cf = mx.compile(fn)
    mx.eval(cf(*args))
    out = cf(*args)
    return nodes(list(out) if isinstance(out, (tuple, list)) else [out])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", default="step-nodes.json")
    opt = ap.parse_args()
    a = ModelArgs.tiny()
    a.hc_mult, a.hc_sinkhorn_iters = 4, 20
    a.num_attention_heads, a.o_groups, a.n_routed_experts, a.num_experts_per_tok = 8, 8, 16, 6
    model = DeepseekV4(a)
    mx.eval(model.parameters())
    b, nc, hid = opt.rows, a.hc_mult, a.hidden_size
    h = mx.random.normal((b, nc, hid))
    x = mx.random.normal((b, hid))
    pos = mx.arange(b) + 100
    tok = mx.arange(b).astype(mx.int32)
    o = mx.random.normal((b, a.num_attention_heads, a.head_dim))
    post, comb = mx.random.normal((b, nc)), mx.random.normal((b, nc, nc))
    mx.eval(h, x, pos, o, post, comb)
    rows = []
    for i, kind in ((0, "sliding"), (1, "CSA"), (2, "HCA")):
        blk = model.layers[i]
        fr = model._freqs[a.layer_ratio(i) != 0]
        angles = rope_angles(fr, pos, a.layer_ratio(i), a)  # once per step in the model (RowBatch.once)
        mx.eval(angles)
        proj = blk.attn.project(blk.attn_norm(x), *angles)
        mx.eval(proj)
        parts = {
            "hc_pre (x2)": traced(functools.partial(_hc_pre, args=a), h, blk.hc_attn_fn, blk.hc_attn_base,
                                  blk.hc_attn_scale),  # fmt: skip
            "norm + project": traced(lambda x, *an: blk.attn.project(blk.attn_norm(x), *an), x, *angles),  # noqa: B023
            "attn output": traced(lambda o: blk.attn.output(o, proj[2], proj[3], mx.float32), o),  # noqa: B023
            "norm + MoE": traced(lambda x: blk.ffn(blk.ffn_norm(x), tok), x),  # noqa: B023
            "hc_post (x2)": traced(lambda y: hc_post(y, h, post, comb), x),
        }
        # with the CUDA mixing kernel (cannot run here): the rms + matmul before it, + 1 kernel node
        lead = traced(lambda h, fn: rms(h.reshape(b, -1).astype(mx.float32), a.rms_norm_eps)  # noqa: B023
                      @ fn.astype(mx.float32).T, h, blk.hc_attn_fn)  # fmt: skip
        lead["hc_pre_mix kernel"] += 1
        parts["hc_pre (x2), CUDA mix kernel"] = lead
        twice = {"hc_pre (x2)", "hc_post (x2)", "hc_pre (x2), CUDA mix kernel"}
        count = {k: sum(c.values()) * (2 if k in twice else 1) for k, c in parts.items()}
        total = sum(v for k, v in count.items() if k != "hc_pre (x2), CUDA mix kernel")
        kern = total - count["hc_pre (x2)"] + count["hc_pre (x2), CUDA mix kernel"]
        for k, c in parts.items():
            rows.append({"layer": kind, "part": k, "nodes": count[k], "top": c.most_common(4)})
        rows.append({"layer": kind, "part": "total (no kernel dispatches)", "nodes": total, "top": []})
        rows.append({"layer": kind, "part": "total, CUDA mix kernel", "nodes": kern, "top": []})
    print(f"{'layer':8} {'part':30} {'nodes':>6}  most common")
    for r in rows:
        print(f"{r['layer']:8} {r['part']:30} {r['nodes']:6d}  {', '.join(f'{n} {k}' for n, k in r['top'])}")
    meta = {"rows": b, "hc_mult": nc, "hc_sinkhorn_iters": a.hc_sinkhorn_iters, "mlx": mx.__version__,
            "device": str(mx.default_device()), "backend": __import__("kernels").backend.name()}  # fmt: skip
    Path(opt.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
