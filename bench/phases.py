"""Where a kernel's time goes, on the GPU: each block's start / end (%globaltimer, ns) and, for the
indexer's segment kernel, its phases (clock64 cycles). A probe, not a benchmark: the instrumented
copies are built here (the kernels' own source with timer reads spliced in at named anchors) and run
with the real launch plans (kernels/cuda/indexer.py, attention.py) on bench/cases inputs.

    python bench/phases.py [--cases indexer:8:131072,attention:8:131072,...] [--reps 5]

Per case and kernel: the kernel's span (first block start to last block end), the median block's
duration, the gap from the previous kernel's last block end to this one's first start (the CUDA
graph's launch gap), and the segment kernel's phases (q fragments, scoring loop, select, take).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import kernels.cuda.attention as ka  # noqa: E402
import kernels.cuda.indexer as ki  # noqa: E402
from bench.cases import DI, NH, NI, PAGE, TOPK, D, attention_inputs, indexer_inputs  # noqa: E402
from bench.idx_variants import SEG_VARIANTS, merge_variant, seg_variant  # noqa: E402
from kernels.cuda.common import f32_params, i32_dummy  # noqa: E402

TIMER = r"""
__device__ __forceinline__ unsigned long long dsv4_gt() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
"""
NSLOT = 8  # uint32 words per block: start lo/hi, end lo/hi, 4 phase durations (cycles)


def wrap(src: str, marks: dict[str, str] | None = None) -> str:
    """`src` (a kernel body whose `return;`s all sit outside loops) inside `do { } while (0)`, its
    block's start / end time and (thread 0's clock) the phases ending at each `marks` anchor and at
    the end written to `ts`."""
    body = src.replace("return;", "break;")
    anchors = list((marks or {}).values())
    assert len(anchors) <= 3
    for i, anchor in enumerate(anchors):
        assert body.count(anchor) == 1, anchor
        body = body.replace(anchor, f"dsv4_ph[{i + 1}] = clock64();\n" + anchor)
    nm = len(anchors)
    return (
        "unsigned long long dsv4_t0 = dsv4_gt();\nlong long dsv4_ph[5] = {clock64(), 0, 0, 0, 0};\n"
        "do {\n" + body + "\n} while (0);\n__syncthreads();\n"
        "if (threadIdx.x == 0) {\n"
        f"  dsv4_ph[{nm + 1}] = clock64();\n"
        "  unsigned long long t1 = dsv4_gt();\n"
        "  const size_t bi = ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;\n"
        "  unsigned int* w = ts + bi * 8;\n"
        "  w[0] = (unsigned int)dsv4_t0; w[1] = (unsigned int)(dsv4_t0 >> 32);\n"
        "  w[2] = (unsigned int)t1; w[3] = (unsigned int)(t1 >> 32);\n"
        f"  for (int i = 1; i <= {nm + 1}; ++i) w[3 + i] = (unsigned int)(dsv4_ph[i] - dsv4_ph[i - 1]);\n"
        "}\n"
    )


def wrap_loop(src: str, top: str, marks: list[str], end: str) -> str:
    """`wrap` for a loop's phases: cycles summed over the iterations from the loop's `top` anchor to each
    of `marks` (<= 3) and from the last mark to the next iteration's top / the `end` anchor."""
    n = len(marks)
    assert n <= 3 and src.count(top) == 1 and src.count(end) == 1
    body = src.replace(top, f"{top}\n    if (c) dsv4_acc[{n}] += clock64() - dsv4_last; dsv4_last = clock64();\n")
    for i, m in enumerate(marks):
        assert body.count(m) == 1, m
        body = body.replace(m, f"    dsv4_acc[{i}] += clock64() - dsv4_last; dsv4_last = clock64();\n" + m)
    body = body.replace(end, f"  dsv4_acc[{n}] += clock64() - dsv4_last;\n" + end)
    w = wrap(body)
    w = "long long dsv4_acc[4] = {0, 0, 0, 0}, dsv4_last = 0;\n" + w
    return w.replace("for (int i = 1; i <= 1; ++i) w[3 + i] = (unsigned int)(dsv4_ph[i] - dsv4_ph[i - 1]);",
                     "for (int i = 0; i < 4; ++i) w[4 + i] = (unsigned int)dsv4_acc[i];")


DSPLIT_LOOP = ("  for (int c = 0; c < nchunk; ++c) {", ["    {  // S = Q K^T",
               "    dsv4_online_softmax<T, HG, CK, LDP, NWARP>(Ss, ko,", "    {  // O[:, slice]"],
               "  // the sink joins the denominator here")  # fmt: skip
# dsplit outside its loop: row lookup + Q load + O init | chunk 0's offsets | the loop | the epilogue
DSPLIT_OUTER = {"pre": "  offsets(0);\n  __syncthreads();", "offsets": "  fetch(0);\n  for (int c = 0;",
                "loop": "  // the sink joins the denominator here"}  # fmt: skip
WIDE_MARKS = {"load": "  {  // S = Q K^T", "qk": "  {  // this chunk's softmax numerators",
              "softmax": "  {  // O = P V"}  # fmt: skip


def probe(name: str, inputs: list[str], outputs: list[str], src: str, smem: int, header: str,
          marks: dict[str, str] | None = None, loop: tuple[Any, ...] | None = None) -> Any:  # fmt: skip
    body = wrap_loop(src, *loop) if loop else wrap(src, marks)
    return mx.fast.cuda_kernel(name=f"probe_{name}_{abs(hash(body)) % 10**8}", input_names=inputs,
                               output_names=outputs + ["ts"], source=body,
                               header=ka.common.HEADER + header + TIMER, ensure_row_contiguous=True,
                               shared_memory=smem)  # fmt: skip


def blocks(ts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = ts.reshape(-1, NSLOT).astype(np.uint64)
    ok = (w[:, 0] | w[:, 1]) != 0
    w = w[ok]
    start = w[:, 0] | (w[:, 1] << np.uint64(32))
    end = w[:, 2] | (w[:, 3] << np.uint64(32))
    return start.astype(np.int64), end.astype(np.int64), w[:, 4:8].astype(np.int64)


def summarize(runs: list[list[np.ndarray]], names: list[str], phases: dict[str, list[str]]) -> dict[str, Any]:
    """Median over runs of each kernel's span, median block, launch gap (ns) and phases (cycles)."""
    out: dict[str, Any] = {}
    for k, name in enumerate(names):
        spans, meds, gaps, ph = [], [], [], []
        for r in runs:
            s, e, p = blocks(r[k])
            spans.append(float(e.max() - s.min()))
            meds.append(float(np.median(e - s)))
            if k:
                ps, pe, _ = blocks(r[k - 1])
                gaps.append(float(s.min() - pe.max()))
            ph.append(np.median(p, axis=0))
        o = {"span_us": statistics.median(spans) / 1e3, "block_med_us": statistics.median(meds) / 1e3}
        if gaps:
            o["gap_us"] = statistics.median(gaps) / 1e3
        if name in phases:
            m = np.median(np.stack(ph), axis=0)
            o["phase_cycles"] = {n: float(m[i]) for i, n in enumerate(phases[name])}
        out[name] = o
    return out


SEG_MARKS = {"q": "  const int nch = (nv + CH - 1) / CH;", "score": "  const int K = min(TOPK, nv);",
             "select": "  if (tid == 0) cbound[(size_t)b * NSEG + seg] = bm;"}  # fmt: skip


MERGE_MARKS = {"bound": "  unsigned int kmax = 0u;",
               "filter": "    // over the offsets from the bound",
               "select": "    dsv4_take<NT>(ck, n2, thr, need_eq"}  # fmt: skip


def indexer_case(rows: int, ctx: int, reps: int, variants: list[str], merge_urs: list[int]) -> dict[str, Any]:
    """The segment kernel's variants (each followed by the merge), then the merge at each UR."""
    batch, _, q, w, keys = indexer_inputs(np.random.default_rng(0), rows, ctx)
    plan = ki.Plan(batch, q, keys, TOPK)
    assert not plan.one, "the probe covers segment + merge (rows of more than ONE_MAX entries)"
    nseg_blocks = plan.seg_grid[0] // plan.nt * plan.seg_grid[1]
    args = [batch.positions, batch.q_rows, batch.tables[4], q, w, keys, i32_dummy((1,))]
    want = ki.indexer_rows_cuda(batch, q, w, keys, topk=TOPK)
    mx.eval(want)
    want_np = np.array(want)
    seg_words = dict(plan.seg_tmpl)["SEG"] + 2048
    merges = {}
    for v in {"base", *variants}:
        msrc, mheader = merge_variant(v)
        merges[v] = probe("merge", list(ki.MERGE_IN), ["out"], msrc, 8 * ki.MERGE_CAP, mheader, MERGE_MARKS)
    out: dict[str, Any] = {}
    for vi, (v, ur) in enumerate([(v, merge_urs[0]) for v in variants] + [("base", u) for u in merge_urs[1:]]):
        src, header, st, checked = seg_variant(v, seg_words - 2048)
        tmpl = [(k, st if (k == "ST" and st) else x) for k, x in plan.seg_tmpl]
        seg = probe(f"seg_{v}", list(ki.SEG_IN), ["cand"], src, ki.smem_bytes(NI, DI, seg_words, st or ki.STAGES),
                    header, SEG_MARKS)  # fmt: skip
        mtmpl = [(k, (ur or x) if k == "UR" else x) for k, x in plan.merge_tmpl]  # 0: the plan's
        merge = merges[v]  # matchany: the merge's select too; rawsel: the merge's select only

        def run(seg: Any = seg, tmpl: Any = tmpl, mtmpl: Any = mtmpl, merge: Any = merge) -> list[mx.array]:
            cand, ts1 = seg(inputs=args, template=tmpl, grid=plan.seg_grid, threadgroup=(plan.nt, 1, 1),
                            output_shapes=[plan.seg_shapes[0], (nseg_blocks * NSLOT,)],
                            output_dtypes=[mx.uint32, mx.uint32], init_value=0)  # fmt: skip
            ids, ts2 = merge(inputs=[batch.positions, batch.q_rows, cand], template=mtmpl,
                             grid=plan.merge_grid, threadgroup=(1024, 1, 1),
                             output_shapes=[plan.out_shape, (rows * NSLOT,)], output_dtypes=[mx.int32, mx.uint32],
                             init_value=0)  # fmt: skip
            return [ids, ts1, ts2]

        got = run()
        mx.eval(got)
        if checked:
            assert np.array_equal(want_np, np.array(got[0])), f"instrumented indexer ({v}, UR {ur}) differs"
        runs = []
        for _ in range(reps):
            r = run()
            mx.eval(r)
            runs.append([np.array(r[1]), np.array(r[2])])
        key = v if vi < len(variants) else f"merge_ur{ur}"
        out[key] = summarize(runs, ["segment", "merge"], {"segment": ["q", "score", "select", "take"],
                                                          "merge": ["bound", "filter", "select", "take"]})  # fmt: skip
        out[key]["merge_ur"] = ur
    return out if len(out) > 1 else out[variants[0]]


def attention_case(rows: int, ctx: int, ratio: int, reps: int, outer: bool = False) -> dict[str, Any]:
    """ratio 4: CSA (window + TOPK selected ids), 128: HCA (window + every entry), 0: sliding (window)."""
    batch, _, q, window, pool, ind, sinks = attention_inputs(np.random.default_rng(0), rows, ctx, ratio)
    scale = D**-0.5
    plan = ka.Plan(batch, q, window, pool, ind, scale, ratio or None)
    if pool is None:
        table, pool_in, ind_in = i32_dummy((rows, 1)), window, i32_dummy((1, 1))
    else:
        table, pool_in = batch.tables[ratio], pool
        ind_in = ind if ind is not None else ka.arange_rows(rows, table.shape[1] * PAGE)
    args = [batch.slots, batch.positions, batch.q_rows, table, q, window, pool_in, ind_in, f32_params(scale), sinks,
            i32_dummy((1,))]  # fmt: skip
    tmpl = dict(plan.part_tmpl)
    kind = "dsplit" if plan.final else ("partial" if "ONE" in tmpl else "wide")
    body = {"dsplit": ka.DSPLIT, "wide": ka.WIDE, "partial": ka.PARTIAL}[kind]
    smem = {"dsplit": lambda: ka.dsplit_smem(D), "wide": lambda: ka.wide_smem(D, tmpl["HG"]),
            "partial": lambda: ka.smem_bytes(D, tmpl["ONE"])}[kind]()  # fmt: skip
    part = probe(f"attn_{kind}", list(ka.PART_IN), ["out" if plan.final else "part"], body, smem, ka.ATTN_HELPERS,
                 WIDE_MARKS if kind == "wide" else (DSPLIT_OUTER if outer else None),
                 DSPLIT_LOOP if kind == "dsplit" and not outer else None)  # fmt: skip
    nblk = plan.part_grid[0] // plan.nt * plan.part_grid[1] * plan.part_grid[2]
    comb = None if plan.final else probe("attn_combine", list(ka.COMB_IN), ["out"], ka.COMBINE, 0, "")

    def run() -> list[mx.array]:
        o, t1 = part(inputs=args, template=plan.part_tmpl, grid=plan.part_grid, threadgroup=(plan.nt, 1, 1),
                     output_shapes=[plan.part_shapes[0], (nblk * NSLOT,)],
                     output_dtypes=[q.dtype if plan.final else mx.float32, mx.uint32], init_value=0)  # fmt: skip
        if comb is None:
            return [o, t1]
        out, t2 = comb(inputs=[batch.q_rows, o, sinks], template=plan.comb_tmpl, grid=plan.comb_grid,
                       threadgroup=(128, 1, 1), output_shapes=[q.shape, (q.shape[0] * NH * NSLOT,)],
                       output_dtypes=[q.dtype, mx.uint32], init_value=0)  # fmt: skip
        return [out, t1, t2]

    want = ka.sparse_attention_rows_cuda(batch, q, window, pool, ind, sinks, scale=scale, ratio=ratio or None)
    got = run()
    mx.eval(want, got)
    err = float(mx.max(mx.abs(want.astype(mx.float32) - got[0].astype(mx.float32))).item())
    assert err < 1e-2, f"instrumented attention differs from the real one: {err}"
    runs = []
    for _ in range(reps):
        r = run()
        mx.eval(r)
        runs.append([np.array(x) for x in r[1:]])
    ph = {"wide": ["load", "qk", "softmax", "pv"],
          "dsplit": ["pre", "offsets", "loop", "epilogue"] if outer else ["wait", "qk", "softmax", "pv"]}
    return {"kind": kind, "blocks": nblk} | summarize(runs, [kind] + ([] if comb is None else ["combine"]), ph)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="indexer:8:131072,indexer:1:131072,indexer:8:1048576,"
                    "attention:8:131072,attention:8:8192,attention:128:8:8192,sliding:8:8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seg-variants", default="base", help=f"indexer segment variants: {','.join(SEG_VARIANTS)}")
    ap.add_argument("--merge-ur", default="0",
                    help="merge list loads per lane in flight (0: the plan's; the first: with every variant)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    res = {}
    for c in a.cases.split(","):
        parts = c.split(":")
        op = parts[0]
        if op == "indexer":
            r = indexer_case(int(parts[1]), int(parts[2]), a.reps, a.seg_variants.split(","),
                             [int(u) for u in a.merge_ur.split(",")])  # fmt: skip
        elif op in ("attention", "sliding", "outer"):  # outer: dsplit's phases outside its loop (HCA / sliding)
            ratio = 0 if op == "sliding" else (int(parts[1]) if len(parts) == 4 else 4)
            r = attention_case(int(parts[-2]), int(parts[-1]), ratio, a.reps, outer=op == "outer")
        else:
            raise SystemExit(f"unknown case {c}")
        res[c] = r
        print(c, json.dumps(r), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "phases.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
