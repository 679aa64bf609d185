"""indexer_rows on CUDA: one launch up to ONE_MAX entries of row capacity (32K context), else two.

Up to ONE_MAX (`one`, indexer_one_src.py): blocks of EB entries score, write their keys and add a
histogram of their top bits to the row's; the row's last block to finish selects from there and
writes the ids (a radix select over the k-th key's bin only, then an ordered compaction).
Beyond (128K, 1M context):
1. `segment`: grid (segments of SEG entries, rows), 8 warps. A block streams its segment's keys
   through the row's block table into shared memory (cp.async, 4 chunks of 64 entries in flight;
   one table read and fixed-offset copies per chunk when pages hold whole chunks) and scores them
   with mma.sync m16n8k16 (bf16/f16 in, f32 accumulation; B fragments by ldmatrix): warp w holds the
   q fragments of head tile w % (NI/16) in registers for the whole segment, its entry tiles' mma
   chains run interleaved, and `w_h relu(.)` is summed over its 16 heads in registers (shuffles)
   before the head tiles are added (the scoring body both kernels share). The segment's
   order-preserving uint32 score keys stay in shared memory; a radix select (11+11+10 bits) finds
   its k-th largest, and an ordered compaction writes its top min(k, entries) candidates (key, id)
   in id order, padded with key 0 (below every score). It also writes a lower bound of its m-th
   largest key, m = ceil(k / the row's segments) (the floor of that key's bin in
   the select's first radix pass): the least of those bounds has at least k keys above it. One
   output, three planes. Segments of at most 2 k entries (`dense_segments`) skip the select and the
   compaction: they write every key at its entry's place (the list position is the id; no ids plane),
   the bound from the maxima of the 32 classes i mod 32 (their m-th largest: m distinct keys are >= it;
   m <= 32, else the first radix pass), and a compact list: their keys >= tau, the least class maximum
   (~120 of 1,024 at 128K), with their places, if at most k.
2. `merge`: one block per q-buffer row. Each warp keeps the candidates >= the least bound from its run
   of the list (nseg * k candidates), in order; with dense segments warp w takes segment w, from its
   compact list when that holds every key >= the bound (tau <= bound), else from its keys (usually ~1-2 k
   kept in all). A radix select over the kept keys' offsets from the bound (passes over the bits their
   span needs) + an ordered compaction write the ids in ascending order (the list is in id order, so
   "ties to the lowest id" is "first in the list"). No sort. Rows no batch row names get -1.
The top-k of a row is a subset of the union of its segments' top-k, so the result is exact.
Fast path: q and keys bf16/f16, index heads 16/32/64/128, dim a multiple of 16 up to 256,
topk <= 2048; anything else runs the reference.
"""

from __future__ import annotations

import math
import os
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda import common
from dsv4_serve.kernels.cuda.common import i32_dummy, kernel, launch_bounds, next_pow2, plan_cached
from dsv4_serve.kernels.cuda.indexer_merge_src import MERGE
from dsv4_serve.kernels.cuda.indexer_one_src import ONE, ONE_HELPERS, ONE_WS
from dsv4_serve.kernels.cuda.indexer_src import SEGMENT
from dsv4_serve.kernels.cuda.select import HELPERS
from dsv4_serve.kernels.indexer import WS_HEAD, WS_KEYS_MAX, check_indexer, check_workspace, indexer_rows_reference
from dsv4_serve.kernels.rows import RowBatch, check_after, checked

CH, NT, STAGES = 64, 256, 4  # entries per pipelined chunk, threads per segment block, chunks in flight
MAX_TOPK = 2048
MAX_SEG = 16384
MERGE_CAP = 16384  # candidates >= the bound the merge keeps in shared memory (more: it reads the list)
MERGE_UR = 16  # at most this many list loads in flight per merge lane (a warp's 512 keys at 1M, top-512)
MERGE_HB = 12  # bits per pass of the merge's select over offsets (two passes: spans below 2^24)
# A row's capacity (table width x page: set by max_model_len) up to this takes the one-launch kernel.
# H200, 8 rows, compiled chain (bench/host_cost.py --indexer-paths): one vs segment + merge 57 vs 85 us
# at 2K entries, 74 vs 74 at 8K, 143 vs 88 at 32K (there the last block's select is the tail).
ONE_MAX = WS_KEYS_MAX
ONE_STAGES = 3  # its chunks in flight (3 blocks per SM at 64 x 128 dims)
# __launch_bounds__(NT, 2) on the segment kernel up to this many entries per segment (128K context: 1024).
# ptxas then runs each warp's 4 entry tiles' mma chains side by side (112 registers, not 57); H200, 8 rows,
# 128K: segment span 35.7 -> 32.3 us (1 row: 24.9 -> 20.7). At 1M (8192-entry segments) the same bound took
# 211 -> 305 us (bench/phases.py, idx variant `bounds`; 2026-11-30, 0b8b092), so longer segments keep no bound.
SEG_BOUNDED_MAX = 4096
# One shared-memory carveout for both launches at 128K (segments of <= SEG_BOUNDED_MAX entries, 2 blocks an SM):
# the driver sizes each kernel's L1 / shared split by its own need (segment 2 x 83 KB, merge 128 KB), and
# reconfiguring every SM between the two costs a gap (8 rows, 128K: kernels ~5 us apart in a graph, 0.1 us at
# 1 row). Padded to 2 x 108 KB and 200 KB, both take the largest (228 KB) one. H200, 8 rows, 128K, back to back,
# a process an arm: 57.5 vs 60.6 us a call (2026-11-30, c60ea9c). Compute capability 9.x / 10.x
# (227 KB a block); DSV4_IDX_CARVE=0 turns it off.
CARVE_SEG, CARVE_MERGE = 108 * 1024, 200 * 1024


def carve() -> bool:
    if os.environ.get("DSV4_IDX_CARVE", "1").strip() == "0":
        return False
    # 228 KB of shared memory an SM: Hopper (9.x) and data-centre Blackwell (10.x); not 12.x (~100 KB)
    return int(mx.device_info().get("compute_capability_major", 0)) in (9, 10)


SEG_IN = ("positions", "q_rows", "table", "q", "weights", "keys", "after")  # after: an in-place writer's token
MERGE_IN = ("positions", "q_rows", "cand")
# 1,024 threads a merge block: at most 64 registers (the bound makes ptxas keep to them, whatever its version)
MERGE_HEADER = HELPERS + launch_bounds(1024, 1)


def segment_size(cap: int, topk: int) -> int:
    """Entries per segment block (rows of more than ONE_MAX entries): at most ~32 segments per row (the
    merge reads 32 x topk candidates, or 32 x 2 topk keys with `dense_segments`), at least twice the top-k
    (else a segment's select keeps nearly all it scored)."""
    lo = max(1024, 2 * next_pow2(topk))
    return min(MAX_SEG, max(lo, next_pow2(math.ceil(cap / 32))))


def dense_segments(seg: int, topk: int) -> bool:
    """Whether segments skip their own top-k and hand the merge every key (DENSE): a select there would keep
    at least half the segment (128K context at top-512: 1024-entry segments). H200, 8 rows, 128K: the
    segment's select + take were 12.3K of its ~50K cycles (bench/phases.py; 2026-11-30, 392e147)."""
    return seg <= 2 * topk


def merge_ur(length: int, dense: bool) -> int:
    """Loads per merge lane in flight: a warp's items in one round where MERGE_UR allows. Dense segments: 8
    (a warp's segment's compact list, ~120 keys at 128K; fewer registers: its items are (key, place) pairs)."""
    return 8 if dense else max(1, min(MERGE_UR, math.ceil(math.ceil(length / 32) / 32)))


def segment_min_blocks(seg: int) -> int:
    """The segment kernel's `__launch_bounds__` min blocks per SM for `seg`-entry segments (0: no bound)."""
    return 2 if seg <= SEG_BOUNDED_MAX else 0


def one_block(cap: int) -> int:
    """Entries per block of the one-launch kernel: enough blocks to fill the GPU at 8 rows."""
    return 128 if cap <= 8192 else (256 if cap <= 65536 else 512)


def one_threads(cap: int) -> int:
    """Threads per block of the one-launch kernel: the row's last block selects alone, and more warps
    hide more of its latency on long rows (512 x 80 registers: one block per SM)."""
    return 256 if cap <= 8192 else 512


def smem_bytes(ni: int, di: int, words: int, stages: int = STAGES) -> int:
    """Pipeline buffers, per-head-tile partial scores, `words` uint32 (segment keys + histogram; or
    the histogram)."""
    return stages * CH * (di + 8) * 2 + (ni // 16) * CH * 4 + words * 4


def supported(q: mx.array, keys: mx.array, topk: int) -> bool:
    ni, di = q.shape[1], q.shape[2]
    return (
        q.dtype in (mx.bfloat16, mx.float16)
        and keys.dtype == q.dtype
        and ni in (16, 32, 64, 128)
        and di % 16 == 0
        and 16 <= di <= 256
        and topk <= MAX_TOPK
    )


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("compiled", "fast", "merge", "merge_grid", "merge_tmpl", "nt", "one", "out_shape", "seg", "seg_grid",
                 "seg_shapes", "seg_tmpl", "ws")  # fmt: skip

    def __init__(self, batch: RowBatch, q: mx.array, keys: mx.array, topk: int, ws_cols: int | None = None
                 ) -> None:  # fmt: skip
        self.fast = supported(q, keys, topk)
        if not self.fast:
            return
        b, page = batch.size, batch.page_size
        ni, di = q.shape[1], q.shape[2]
        cap = batch.tables[4].shape[1] * page
        self.out_shape = (q.shape[0], topk)
        self.one = cap <= ONE_MAX
        capn = -(-cap // 4) * 4
        # the tickets, histograms and keys in the caller's workspace rows: no fill node, and the output is the
        # ids alone (no slice and reshape nodes). A workspace without room for the keys (ONE_MAX raised past
        # WS_KEYS_MAX, bench/host_cost.py --indexer-paths) leaves the scratch in the output.
        self.ws = ws_cols is not None and self.one and ws_cols >= WS_HEAD + capn
        base = [("T", q.dtype), ("NI", ni), ("DI", di), ("PAGE", page), ("TOPK", topk), ("CH", CH)]
        if self.one:  # score everywhere, the row's last block selects: 1 launch
            eb = one_block(cap)
            capl = ONE_STAGES * CH * (di + 8) * 2 // 4
            ins, src = (SEG_IN + ("workspace",), ONE_WS) if self.ws else (SEG_IN, ONE)
            self.seg = kernel("idx_one_ws" if self.ws else "idx_one", ins, ("out",), src,
                              smem_bytes(ni, di, 2048, ONE_STAGES), HELPERS + ONE_HELPERS)  # fmt: skip
            self.nt = one_threads(cap)
            self.seg_tmpl = base + [("ST", ONE_STAGES), ("NTO", self.nt), ("EB", eb), ("CAPN", capn), ("CAPL", capl)]
            self.seg_grid = (-(-cap // eb) * self.nt, b + 1, 1)
            # without a workspace, one output: the top-k ids, then the scratch planes (indexer_one_src); one
            # output and one init_value fill cost the host less than two of each
            ids = -(-(q.shape[0] * topk) // 4) * 4
            self.seg_shapes = [self.out_shape] if self.ws else [(ids + -(-b // 4) * 4 + b * (2048 + capn),)]
        else:
            seg = segment_size(cap, topk)
            nseg = -(-cap // seg)
            dense = dense_segments(seg, topk)
            cand = nseg * (seg if dense else topk)
            ld = -(-cand // 4) * 4
            sm = smem_bytes(ni, di, seg + 2048)
            pad = segment_min_blocks(seg) == 2 and carve()
            if pad:
                sm = max(sm, CARVE_SEG)
            self.seg = kernel("idx_segment", SEG_IN, ("cand",), SEGMENT, sm,
                              HELPERS + launch_bounds(NT, segment_min_blocks(seg)))  # fmt: skip
            caps = topk if dense else 0  # a dense segment's compact list: at most half its keys
            self.seg_tmpl = base + [("ST", STAGES), ("SEG", seg), ("LDC", ld), ("NSEG", nseg), ("DENSE", dense),
                                    ("CAPS", caps)]  # fmt: skip
            self.nt = NT
            self.seg_grid = (nseg * NT, b, 1)
            # keys, ids, bounds; DENSE: keys, compact lists, bounds, taus, lengths (indexer_src.CAND)
            self.seg_shapes = [(b * ((ld + 2 * nseg * caps + 3 * nseg) if dense else (2 * ld + nseg)),)]
            self.merge = kernel("idx_merge", MERGE_IN, ("out",), MERGE, CARVE_MERGE if pad else 8 * MERGE_CAP,
                                MERGE_HEADER)  # fmt: skip
            self.merge_tmpl = [("TOPK", topk), ("L", cand), ("LDC", ld), ("NSEG", nseg), ("SEG", seg), ("CAPS", caps),
                               ("CAPC", MERGE_CAP), ("UR", merge_ur(cand, dense)), ("HB", MERGE_HB),
                               ("DENSE", dense)]  # fmt: skip
            self.merge_grid = (q.shape[0] * 1024, 1, 1)
        self.compiled = mx.compile(self.launch)

    def launch(self, positions: mx.array, q_rows: mx.array, table: mx.array, q: mx.array, weights: mx.array,
               keys: mx.array, after: mx.array, *workspace: mx.array) -> mx.array:  # fmt: skip
        outs = self.seg(
            inputs=[positions, q_rows, table, q, weights, keys, after, *workspace],
            template=self.seg_tmpl,
            grid=self.seg_grid,
            threadgroup=(self.nt, 1, 1),
            output_shapes=self.seg_shapes,
            output_dtypes=[mx.int32] if self.one else [mx.uint32],
            init_value=0 if self.one and not self.ws else None,
        )
        if self.ws:
            return outs[0]
        if self.one:
            n, k = self.out_shape
            return outs[0][: n * k].reshape(n, k)
        (out,) = self.merge(
            inputs=[positions, q_rows, *outs],
            template=self.merge_tmpl,
            grid=self.merge_grid,
            threadgroup=(1024, 1, 1),
            output_shapes=[self.out_shape],
            output_dtypes=[mx.int32],
        )
        return out


def indexer_rows_cuda(batch: RowBatch, q: mx.array, weights: mx.array, keys: mx.array, *, topk: int,
                      after: mx.array | None = None, workspace: mx.array | None = None) -> mx.array:  # fmt: skip
    def check() -> None:  # a chained batch's rows read their slot's keys by count alone, as single rows do
        check_indexer(batch, q, weights, keys, topk=topk, chains=True)

    check_after("indexer_rows", after)

    try:
        key: tuple[Any, ...] = ("indexer_rows", type(topk), topk, q.shape, q.dtype, weights.shape, weights.dtype,
                                keys.shape, keys.dtype)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check()
        raise

    ws = isinstance(workspace, mx.array)
    if workspace is not None and not ws:  # the batch's errors first, then the workspace's (raises)
        check()
        check_workspace(workspace, batch.size, batch.tables[4].shape[1] * batch.page_size)
    cols = workspace.shape[1] if ws and workspace.ndim == 2 else None
    key += (cols, workspace.shape, workspace.dtype) if ws else (None,)

    def check_all() -> None:  # the workspace too, once per batch and key: its shape and dtype are in the key
        check()
        check_workspace(workspace, batch.size, batch.tables[4].shape[1] * batch.page_size)  # the batch is valid

    def make() -> Plan:
        pk = key[:10] + (batch.size, batch.page_size, batch.tables[4].shape, ONE_MAX)
        return plan_cached(pk, lambda: Plan(batch, q, keys, topk, cols))

    plan: Plan = checked(batch, key, check_all, make)
    if not plan.fast:
        return indexer_rows_reference(batch, q, weights, keys, topk=topk, after=after, workspace=workspace)
    run = plan.compiled if common.COMPILE else plan.launch
    return run(batch.positions, batch.q_rows, batch.tables[4], q, weights, keys,
               i32_dummy((1,)) if after is None else after, *([workspace] if plan.ws else []))  # fmt: skip
