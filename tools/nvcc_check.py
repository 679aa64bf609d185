"""Offline compile check of the CUDA kernels with nvcc (no GPU, no MLX CUDA): catches syntax and type
errors before a device call. Builds each kernel's translation unit as MLX would (`common.standalone`)
for the model's template values and runs `nvcc -arch=sm_90 -c` on it; prints registers / spills.

    python tools/nvcc_check.py [--only idx_merge,attn_dsplit] [--nvcc nvcc]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from dsv4_serve.kernels.cuda import attention as at  # noqa: E402
from dsv4_serve.kernels.cuda import attention_dsplit_src as dsrc  # noqa: E402
from dsv4_serve.kernels.cuda import attention_prefill_src as psrc  # noqa: E402
from dsv4_serve.kernels.cuda import attention_src as asrc  # noqa: E402
from dsv4_serve.kernels.cuda import attention_wmma_src as wsrc  # noqa: E402
from dsv4_serve.kernels.cuda import compressor as cp  # noqa: E402
from dsv4_serve.kernels.cuda import compressor_inplace as cpi  # noqa: E402
from dsv4_serve.kernels.cuda import compressor_pair as cpp  # noqa: E402
from dsv4_serve.kernels.cuda import dequant as dq  # noqa: E402
from dsv4_serve.kernels.cuda import (
    hc,
    hc_fused,  # noqa: E402
    norms,  # noqa: E402
    rope,  # noqa: E402
    router,  # noqa: E402
)
from dsv4_serve.kernels.cuda import indexer as ix  # noqa: E402
from dsv4_serve.kernels.cuda import matmul as mm  # noqa: E402
from dsv4_serve.kernels.cuda import tiles_mm as tm  # noqa: E402
from dsv4_serve.kernels.cuda.common import E2M1, launch_bounds, standalone  # noqa: E402
from dsv4_serve.kernels.cuda.select import HELPERS  # noqa: E402

I32, U32, F32, BF = mx.int32, mx.uint32, mx.float32, mx.bfloat16


def units() -> dict[str, str]:
    seg_in = [("positions", I32, True), ("q_rows", I32, False), ("table", I32, True), ("q", BF, False),
              ("weights", F32, False), ("keys", BF, False), ("after", I32, False)]  # fmt: skip
    seg_t = [("T", BF), ("NI", 64), ("DI", 128), ("PAGE", 64), ("TOPK", 512), ("CH", ix.CH), ("ST", ix.STAGES)]
    merge_in = [("positions", I32, True), ("q_rows", I32, False), ("cand", U32, False)]
    part_in = [("slots", I32, False), ("positions", I32, True), ("q_rows", I32, False), ("table", I32, True),
               ("q", BF, True), ("window", BF, True), ("pool", BF, False), ("indices", I32, True),
               ("fparams", F32, False), ("sinks", F32, False), ("after", I32, False)]  # fmt: skip
    part_t = [("T", BF), ("D", 512), ("PAGE", 64), ("RATIO", 4), ("HG", at.HG), ("CK", at.CK), ("THREADS", at.THREADS)]
    out: dict[str, str] = {}
    for name, seg, mb in (("idx_segment", 1024, 0), ("idx_segment_bounds", 1024, 2), ("idx_segment_1m", 8192, 0),
                          ("idx_segment_1m_bounds", 8192, 2), ("idx_segment_dense", 1024, 2)):  # fmt: skip
        # 128K / 1M segments, without / with the bound; dense: 128K as planned (every key to the merge)
        dense = name.endswith("dense")
        out[name] = standalone("idx_segment", seg_in, [("cand", U32)],
                               seg_t + [("SEG", seg), ("LDC", 32768 if dense else 16384), ("NSEG", 32),
                                        ("DENSE", dense), ("CAPS", 512 if dense else 0)], ix.SEGMENT,
                               header=HELPERS + launch_bounds(ix.NT, mb))  # fmt: skip
    one_in = [(n, t, shp or n == "q") for n, t, shp in seg_in]
    one_t = [("T", BF), ("NI", 64), ("DI", 128), ("PAGE", 64), ("TOPK", 512), ("CH", ix.CH), ("ST", ix.ONE_STAGES)]
    for eb in (128, 256, 512):
        out[f"idx_one_{eb}"] = standalone("idx_one", one_in, [("out", I32)],
                                          one_t + [("NTO", 512 if eb > 128 else 256), ("EB", eb),
                                                   ("CAPN", 32768), ("CAPL", 13056)], ix.ONE,
                                          header=HELPERS + ix.ONE_HELPERS)  # fmt: skip
    out["idx_one_ws"] = standalone("idx_one", one_in + [("workspace", U32, True)], [("out", I32)],
                                   one_t + [("NTO", 256), ("EB", 128), ("CAPN", 2048), ("CAPL", 13056)],
                                   ix.ONE_WS, header=HELPERS + ix.ONE_HELPERS)  # fmt: skip
    tiny = [("T", BF), ("NI", 16), ("DI", 32), ("PAGE", 16), ("TOPK", 8), ("CH", ix.CH), ("ST", ix.ONE_STAGES)]
    out["idx_one_tiny"] = standalone("idx_one", one_in, [("out", I32)],
                                     tiny + [("NTO", 256), ("EB", 128), ("CAPN", 1024), ("CAPL", 3840)], ix.ONE,
                                     header=HELPERS + ix.ONE_HELPERS)  # fmt: skip
    for dense in (False, True):
        ll, seg = (32768, 1024) if dense else (16384, 8192)
        out["idx_merge" + ("_dense" if dense else "")] = standalone(
            "idx_merge", merge_in, [("out", I32)],
            [("TOPK", 512), ("L", ll), ("LDC", ll), ("NSEG", 32), ("SEG", seg), ("CAPS", 512 if dense else 0),
             ("CAPC", ix.MERGE_CAP), ("UR", ix.merge_ur(ll, dense)), ("HB", ix.MERGE_HB), ("DENSE", dense)],
            ix.MERGE, header=ix.MERGE_HEADER)  # fmt: skip
    for one in (True, False):
        out[f"attn_partial_one{int(one)}"] = standalone(
            "attn_partial", part_in, [("part", F32)], part_t + [("ONE", one)],
            wsrc.PARTIAL, header=asrc.ATTN_HELPERS)  # fmt: skip
    for ds in (1, 4, 8):
        out[f"attn_dsplit{ds}"] = standalone("attn_dsplit", part_in, [("out", BF)], part_t + [("DS", ds)],
                                             dsrc.DSPLIT, header=asrc.ATTN_HELPERS)  # fmt: skip
    wide_t = [(k, 64 if k == "HG" else v) for k, v in part_t]
    out["attn_wide"] = standalone("attn_wide", part_in, [("part", F32)], wide_t, asrc.WIDE,
                                  header=asrc.ATTN_HELPERS)  # fmt: skip
    wide512_t = [(k, {"HG": 64, "THREADS": 512}.get(k, v)) for k, v in part_t]
    out["attn_wide512"] = standalone("attn_wide", part_in, [("part", F32)], wide512_t, asrc.WIDE,
                                     header=asrc.ATTN_HELPERS)  # fmt: skip
    wide32_t = [(k, 32 if k == "HG" else v) for k, v in part_t]
    out["attn_wide32"] = standalone("attn_wide", part_in, [("part", F32)], wide32_t, asrc.WIDE,
                                    header=asrc.ATTN_HELPERS)  # fmt: skip
    heads_in = [("slots", I32, False), ("positions", I32, True), ("q_rows", I32, False), ("table", I32, False),
                ("q", BF, True), ("keys", BF, False), ("pool", BF, False), ("indices", I32, True),
                ("fparams", F32, False), ("sinks", F32, False)]  # fmt: skip
    for name, t in (("dq_mxfp8_bf16", BF), ("dq_mxfp8_f16", mx.float16)):
        out[name] = standalone("dq_mxfp8", [("w", U32, True), ("s", mx.uint8, False)], [("out", t)], [("T", t)],
                               dq.SOURCE, header=dq.HELPER)  # fmt: skip
    for name, ratio, every in (("attn_heads_csa", 4, False), ("attn_heads_hca", 128, True)):
        heads_t = [("T", BF), ("D", 512), ("PAGE", 64), ("RATIO", ratio), ("WIN", 128), ("ALL", every), ("HG", 64),
                   ("CK", 64), ("THREADS", 512)]  # fmt: skip
        out[name] = standalone("attn_heads", heads_in, [("out", BF)], heads_t, psrc.HEADS,
                               header=asrc.ATTN_HELPERS + launch_bounds(512, 1))  # fmt: skip
    tiny_t = [(k, {"D": 64, "PAGE": 16}.get(k, v)) for k, v in part_t]  # test_precompile_tiny's dims
    out["attn_dsplit_d64"] = standalone("attn_dsplit", part_in, [("out", BF)], tiny_t + [("DS", 2)], dsrc.DSPLIT,
                                        header=asrc.ATTN_HELPERS)  # fmt: skip
    out["attn_combine"] = standalone("attn_combine", [("q_rows", I32, True), ("part", F32, True),
                                     ("sinks", F32, True)], [("out", BF)],
                                     [("T", BF), ("D", 512)], asrc.COMBINE)  # fmt: skip
    comp_in = [(n, I32 if n in ("slots", "positions", "q_rows", "table") else F32, n in ("slots", "table"))
               for n in cp.INPUTS]  # fmt: skip
    comp_out = [("st_kv", F32), ("st_s", F32), ("entry", BF), ("dest", I32), ("sidx", I32)]
    for ratio, d in ((4, 512), (128, 512), (4, 128)):
        for full in (True, False):
            names, src = cp.variant(full)
            out[f"compressor_{ratio}_{d}_full{int(full)}"] = standalone(
                "compressor", comp_in, [o for o in comp_out if o[0] in names],
                cp.template(BF, F32, ratio, d, 32, 64, full), src)  # fmt: skip
    ip_in = [(n, I32 if n in ("slots", "positions", "q_rows", "table", "after") else (BF if n == "pool" else F32),
              n in ("slots", "table")) for n in cpi.INPUTS]  # fmt: skip
    for ratio, d in ((4, 512), (128, 512), (4, 128)):
        tmpl = cp.template(BF, F32, ratio, d, 32, 64, False) + [("NT", cpi.NT), ("NSPLIT", cpi.nsplit(ratio, d))]
        out[f"compressor_inplace_{ratio}_{d}"] = standalone("compressor_inplace", ip_in, [("token", I32)], tmpl,
                                                            cpi.SOURCE, header=cpi.ROW)  # fmt: skip
    tmpl = cp.template(BF, F32, 128, 512, 32, 64, False) + [("NT", cpi.NT), ("NSPLIT", cpi.nsplit(128, 512))]
    ws_in = ip_in + [("workspace", U32, True)]
    out["compressor_inplace_128_512_ws"] = standalone("compressor_inplace", ws_in, [("token", I32)], tmpl,
                                                      cpi.SOURCE_WS, header=cpi.ROW)  # fmt: skip
    pair_in = [(n, I32 if n in ("slots", "positions", "q_rows", "table", "after") else
                (BF if n in ("pool", "pool2") else F32), n in ("slots", "table")) for n in cpp.INPUTS]  # fmt: skip
    pair_t = cp.template(BF, F32, 4, 512, 32, 64, False) + [("D2", 128), ("N2", F32), ("NT", cpi.NT), ("NSPLIT", 1)]
    out["compressor_pair"] = standalone("compressor_pair", pair_in, [("token", I32)], pair_t, cpp.SOURCE,
                                        header=cpi.ROW)  # fmt: skip
    for o, w, has in ((BF, BF, True), (F32, F32, False)):  # RMSNorm; the mHC input RMS (f32 out, no weight)
        out[f"rms_norm_{'w' if has else 'f32'}"] = standalone(
            "rms_norm", [("x", BF, True), ("w", w, False), ("fparams", F32, False)], [("out", o)],
            [("T", BF), ("O", o), ("W", w), ("HAS_W", has)], norms.RMS_SOURCE)  # fmt: skip
    out["hc_pre_rows_4_20"] = standalone(
        "hc_pre_rows", [("h", BF, True), ("fn", F32, False), ("scale", F32, False), ("base", F32, False),
                        ("fparams", F32, False)], [("x", BF), ("post", F32), ("comb", F32)],
        [("T", BF), ("NC", 4), ("ITERS", 20)], hc_fused.fused_source())  # fmt: skip
    out["hc_pre_split_4_20"] = standalone(
        "hc_pre_split", [("h", BF, True), ("fn", F32, False), ("scale", F32, False), ("base", F32, False),
                         ("fparams", F32, False), ("workspace", U32, False)], [("x", BF), ("post", F32), ("comb", F32)],
        [("T", BF), ("NC", 4), ("ITERS", 20)], hc_fused.fused_source(split=True))  # fmt: skip
    for split in (False, True):  # the pre-mix with the unit's RMSNorm on x
        ins = [("h", BF, True), ("fn", F32, False), ("scale", F32, False), ("base", F32, False),
               ("fparams", F32, False), *([("workspace", U32, False)] if split else []), ("xw", F32, False)]
        out[f"hc_pre_norm_{'split' if split else 'rows'}_4_20"] = standalone(
            "hc_pre_norm", ins, [("x", BF), ("post", F32), ("comb", F32)],
            [("T", BF), ("NC", 4), ("ITERS", 20), ("XW", F32)],
            hc_fused.fused_source(split=split, norm=True))  # fmt: skip
    out["router_topk_6"] = standalone(
        "router_topk", [("logits", F32, True), ("bias", F32, False), ("fparams", F32, False)],
        [("idx", U32), ("w", F32)], [("K", 6), ("MAXE", router.MAX_EXPERTS), ("MAXK", router.MAX_K)],
        router.SOURCE)  # fmt: skip
    out["moe_combine_6"] = standalone(
        "moe_combine", [("pairs", BF, True), ("w", F32, False), ("shared", BF, False)], [("out", BF)],
        [("O", BF), ("K", 6)], router.COMBINE_SOURCE)  # fmt: skip
    out["moe_combine_post_6_4"] = standalone(
        "moe_combine_post", [("pairs", BF, True), ("w", F32, False), ("shared", BF, False), ("h", BF, False),
                             ("post", F32, False), ("comb", F32, False)], [("out", BF)],
        [("T", BF), ("K", 6), ("NC", 4)], router.COMBINE_POST_SOURCE)  # fmt: skip
    for norm, has_w in ((True, False), (True, True), (False, False)):
        out[f"rms_rope_{int(norm)}{int(has_w)}"] = standalone(
            "rms_rope", [("x", BF, True), ("c", F32, False), ("s", F32, False), ("w", BF, False),
                         ("fparams", F32, False)], [("out", BF)],
            [("T", BF), ("W", BF), ("NORM", norm), ("HAS_W", has_w), ("PER", 64)], rope.SOURCE)  # fmt: skip
        out[f"rms_rope_many_{int(norm)}{int(has_w)}"] = standalone(
            "rms_rope_many", [("x", BF, True), ("c", F32, False), ("s", F32, False), ("w", F32, False),
                              ("fparams", F32, False)], [("out", BF)],
            [("T", BF), ("W", F32), ("NORM", norm), ("HAS_W", has_w), ("PER", 64)], rope.MANY_SOURCE)  # fmt: skip
    out["hc_post_4"] = standalone(
        "hc_post", [("y", BF, False), ("h", BF, True), ("post", F32, False), ("comb", F32, False)], [("out", BF)],
        [("T", BF), ("NC", 4)], norms.POST_SOURCE)  # fmt: skip
    hc_in = [("m", F32, False), ("scale", F32, False), ("base", F32, False), ("h", BF, True), ("fparams", F32, False)]
    for nc, iters in ((4, 20), (1, 1), (8, 5)):
        out[f"hc_pre_mix_{nc}_{iters}"] = standalone(
            "hc_pre_mix", hc_in, [("x", BF), ("post", F32), ("comb", F32)],
            [("T", BF), ("NC", nc), ("ITERS", iters)], hc.SOURCE)  # fmt: skip
    # the skinny matmuls, V4-Flash shapes of each weight format / epilogue
    mm_in = [("x", BF, False), ("w", U32, False), ("s", mx.uint8, False), ("w2", U32, False),
             ("s2", mx.uint8, False), ("idx", U32, False), ("fparams", F32, False)]  # fmt: skip
    for name, o, wf, k, n, pair, exp, topk in (("mm_fp8", BF, 1, 4096, 1024, False, 0, 1),
                                               ("mm_fp8_pair", BF, 1, 4096, 2048, True, 0, 1),
                                               ("mm_bf16_f32", F32, 0, 4096, 129280, False, 0, 1),
                                               ("mm_bf16_f32_two", F32, 0, 4096, 1024, 2, 0, 1),
                                               ("mm_fp8_cat", BF, 1, 4096, 1024, 3, 0, 1),
                                               ("mm_fp4_gate_up", BF, 2, 4096, 2048, True, 1, 6),
                                               ("mm_fp4_down", BF, 2, 2048, 4096, False, 2, 6)):  # fmt: skip
        n2 = 512 if pair == 3 else 0  # CAT: wkv's rows after wq_a's
        mt, wk, wr, u = mm.geometry(n + n2, k, wf, int(pair), exp)
        for gr in (False, True):  # the decode step's 1..8 rows; a short prompt's 8-row groups
            out[name + ("_groups" if gr else "")] = standalone(
                "skinny_mm", mm_in, [("out", o)],
                [("T", BF), ("O", o), ("WF", wf), ("K", k), ("N", n), ("MT", mt), ("PAIR", int(pair)), ("WK", wk),
                 ("WR", wr), ("U", u), ("EXP", exp), ("TOPK", topk), ("N2", n2), ("GR", gr)],
                mm.SOURCE, header=E2M1)  # fmt: skip
    gm_in = [("x", BF, False), ("w", U32, False), ("s", mx.uint8, False), ("w2", U32, False),
             ("s2", mx.uint8, False), ("ptab", I32, False), ("texp", U32, False), ("fparams", F32, False),
             ("hw", F32, False)]  # fmt: skip
    for name, o, wf, k, pair, xdiv in (("tiles_gate_up", BF, 2, 4096, 1, 6), ("tiles_down", BF, 2, 2048, 0, 1),
                                       ("tiles_f32", F32, 0, 4096, 0, 1), ("tiles_f32_pair", F32, 0, 4096, 2, 1),
                                       ("tiles_idx_scores", F32, 0, 128, 3, 1)):
        out[name] = standalone("tiles_mm", gm_in, [("out", o)],
                               [("T", BF), ("O", o), ("WF", wf), ("K", k), ("PAIR", pair), ("XDIV", xdiv),
                                ("MT", 1 if pair in (1, 2) else 2), ("WR", tm.WR), ("TR", tm.TR), ("XS", tm.XS)],
                               tm.SOURCE,
                               header=E2M1 + tm.HEADER + launch_bounds(32 * tm.WR, 2))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--nvcc", default="nvcc")
    opt = ap.parse_args()
    only = [s for s in opt.only.split(",") if s]
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for name, src in units().items():
            if only and not any(name.startswith(o) for o in only):
                continue
            cu = Path(d) / f"{name}.cu"
            cu.write_text(src)
            r = subprocess.run([opt.nvcc, "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-c", str(cu), "-o",
                                str(cu.with_suffix(".o"))], capture_output=True, text=True)  # fmt: skip
            info = [ln.split(": ", 1)[-1] for ln in r.stderr.splitlines()]
            regs = [ln for ln in info if "registers" in ln or "spill" in ln]
            print(f"{name:22s} {'OK' if r.returncode == 0 else 'FAIL'}  {' | '.join(regs)[:160]}")
            if r.returncode:
                bad += 1
                print("\n".join(ln for ln in r.stderr.splitlines() if "error" in ln)[:3000])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
