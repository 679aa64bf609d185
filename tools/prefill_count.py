"""Kernels a prefill forward launches on CUDA, by layer kind, counted on any machine from its graph (no GPU).

A prefill forward of a few hundred tokens is host-bound on the H200 (a 32-token prompt: 0.31 s for 57 ms of
GPU work, 10,514 kernels; docs/performance.md), so its kernel count is its first-order cost. As
tools/kernel_count.py does for the decode step, every op that `kernels/cuda` serves with its own launches
is stood in for by one `mx.depends` node a launch (the skinny matmuls, the glue kernels, the mHC pre-mix;
the tile GEMMs of the grouped experts and the f32 products; prefill attention's `dsplit` launch; MLX's
dequantize, one kernel on CUDA), while the
Python around those launches (the experts' tile tables, the attention's reversed keys, the compressors'
pooling, the indexer's scores) runs as it does on CUDA. The forward's graph (`mx.export_to_dot`) is then
counted, views apart: on CUDA each other primitive is about one kernel. Models of 2-3 layers at small dims
with the release's structure; the count of a layer kind is what one more layer of it adds to a forward.

    python tools/prefill_count.py [--tokens 32,256] [--start 0] [--prompts 1] [--build]
        (--prompts: requests in the forward, --tokens each; --build: also the host ms to build a 43-layer forward's
        graph, Python and MLX's graph making; on the H200 MLX's encode adds ~10 us a kernel)

8 prompts of 32 tokens (2026-12-07): 24,580 kernels a V4-Flash forward when each request's compressors and indexer
picks ran on their own, 10,900 with one compressor call for all (model/prefill_compress.py), 6,721 with one call of
the indexer's picks too (model/prefill_indexer.py); one prompt 5,909 throughout, 5,825 once the rings' writes took
the slot as an index array like the rest (an integer index cost a kernel a layer). With the picks of queries that see
at most the top-k entries made on the host (`every_visible`: no scores, no top-k) and the release's index_topk here
(the tiny model's 4 had kept a short prompt's picks scored): 8 prompts 5,227, one prompt of 32 tokens 4,436 (a CSA
layer 197 -> 131 kernels), of 256 tokens 4,379.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from dsv4_serve.kernels import backend  # noqa: E402
from dsv4_serve.kernels import matmul as kmatmul  # noqa: E402
from dsv4_serve.model.config import ModelArgs  # noqa: E402
from dsv4_serve.model.deepseek_v4 import DeepseekV4  # noqa: E402
from dsv4_serve.model.prefill import prefill_batch, prefill_chunk  # noqa: E402
from dsv4_serve.model.state import StatePools  # noqa: E402
from tools.kernel_count import STANDINS, counted, one, release_structure, standins  # noqa: E402


class _OneLaunch:
    """A launch plan whose call is one graph node of its output shape (kernels/cuda/tiles_mm.Plan's and
    kernels/cuda/attention.Plan's stand-in)."""

    def __init__(self, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
        self.shape, self.dtype, self.fast, self.fparams = shape, dtype, True, mx.zeros((1,))

    def __call__(self, *inputs: Any) -> mx.array:
        return one([(self.shape, self.dtype)], *inputs)[0]

    launch = compiled = __call__


ROOTS: list[mx.array] = []  # the tokens of the in-place writes the forward commits (counted with its outputs)


class _Ordering:
    """model/prefill.py's `mx` with its own `mx.depends` counted: an ordering node (the in-place writes after their
    reads, the layer's output after its writes) that MLX evaluates without a launch, where the stand-ins' are
    launches; `forward_count` takes these out of the Depends nodes."""

    def __init__(self) -> None:
        self.nodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def depends(self, inputs: list[mx.array], deps: list[mx.array]) -> list[mx.array]:
        self.nodes += len(inputs)
        return mx.depends(inputs, deps)


ORDERING = _Ordering()


def _write_rows(pool: mx.array, rows: mx.array, values: mx.array, carry: mx.array | None = None
                ) -> tuple[mx.array, mx.array]:  # fmt: skip
    """kernels/cuda/pool_rows.py's write: one launch, the pool itself and a token (`carry`'s copy, or 1 element)."""
    return pool, one([(carry.shape if carry is not None else (1,), mx.int32)], pool, rows, values, carry)[0]


def _commit(pool: mx.array, token: mx.array | None) -> mx.array:
    """`commit` without its evaluation mid-build (which would leave the write out of the counted graph): a root."""
    if token is not None:
        ROOTS.append(token)
    return pool


@contextlib.contextmanager
def cuda_prefill() -> Iterator[None]:
    """The CUDA path's prefill ops (their Python as is, each kernel launch one node; the in-place writes' tokens
    kept in ROOTS), undone after."""
    import dsv4_serve.kernels.cuda.experts_grouped as ceg
    import dsv4_serve.kernels.cuda.pooled as cpo
    import dsv4_serve.kernels.cuda.prefill_attention as cpa
    from dsv4_serve.model import prefill, prefill_compress

    saved = (ceg.Plan, cpa.Plan, ceg.plan_cached, cpa.plan_cached, cpa.kernel, cpo.kernel)
    saved_writes = (prefill.write_rows, prefill_compress.write_rows, prefill_compress.commit)
    ROOTS.clear()
    ORDERING.nodes, prefill.mx = 0, ORDERING  # type: ignore[assignment]
    prefill.write_rows = prefill_compress.write_rows = _write_rows
    prefill_compress.commit = _commit  # (prefill.py commits none: its tokens are the layer output's dependencies)

    def tile_plan(p: int, k: int, n: int, tiles: int, *, wf: int, pair: int, xdiv: int, out: mx.Dtype,
                  limit: float | None = None) -> _OneLaunch:  # fmt: skip
        return _OneLaunch((2, p, n) if pair == 2 else (p, n), out)

    def attn_plan(r: int, page: int, width: int, q: mx.array, *_: Any) -> _OneLaunch:
        return _OneLaunch(q.shape, q.dtype)

    def dequantize(w: mx.array, scales: mx.array, *_: Any, bits: int = 8, dtype: mx.Dtype = mx.bfloat16,
                   **__: Any) -> mx.array:  # fmt: skip
        """One kernel on CUDA (MLX's CPU backend runs it as several ops)."""
        return one([((*w.shape[:-1], w.shape[-1] * 32 // bits), dtype)], w, scales)[0]

    def heads_kernel(*_: Any, **__: Any) -> Any:  # `HEADS` (cpa.heads_attention's direct launch)
        def launch(*, inputs: list, output_shapes: list, output_dtypes: list, **___: Any) -> list[mx.array]:
            return one(list(zip(output_shapes, output_dtypes, strict=True)), *inputs)

        return launch

    def scores(q: mx.array, w: mx.array, keys: mx.array) -> mx.array:  # tiles_mm PAIR 3: one launch
        return one([((q.shape[0], keys.shape[0]), mx.float32)], q, w, keys)[0]

    ceg.Plan, cpa.Plan, cpa.kernel = tile_plan, attn_plan, heads_kernel
    cpo.kernel = heads_kernel  # DSV4_POOLED_KERNEL=1: the compressors' pooling, one launch (kernels/cuda/pooled.py)
    ceg.plan_cached = cpa.plan_cached = lambda key, make: make()
    deq, mx.dequantize = mx.dequantize, dequantize
    with standins(glue=True):
        backend.register("grouped_experts", ceg.grouped_experts_cuda)
        backend.register("prefill_attention", cpa.prefill_attention_cuda)

        def lin(x: mx.array, w: mx.array) -> mx.array:  # past 64 rows: the tile GEMM, one launch
            if x.shape[0] > kmatmul.MANY_ROWS:
                return one([((x.shape[0], w.shape[0]), mx.float32)], x, w)[0]
            return STANDINS["f32_linear_rows"](x, w)

        def pair(x: mx.array, w1: mx.array, w2: mx.array) -> tuple[mx.array, mx.array]:
            out = one([((2, x.shape[0], w1.shape[0]), mx.float32)], x, w1, w2)[0]
            return out[0], out[1]

        lin.rows_per_launch = pair.rows_per_launch = kmatmul.MANY_ROWS  # as kernels/cuda/matmul.py's (8-row groups)
        backend.register("f32_linear_rows", lin)
        backend.register("f32_linear_pair_rows", pair)
        backend.register("indexer_scores", scores)
        backend.register("dequantize_mxfp8", lambda w, s, dtype: dequantize(w, s, dtype=dtype))
        try:
            yield
        finally:
            ceg.Plan, cpa.Plan, ceg.plan_cached, cpa.plan_cached, cpa.kernel, cpo.kernel = saved
            mx.dequantize = deq
            prefill.write_rows, prefill_compress.write_rows, prefill_compress.commit = saved_writes
            prefill.mx = mx


RELEASE_TOPK = 512  # the release's index_topk (the tiny model's 4 would make a short prompt's picks a top-k)


def model_of(ratios: list[int]) -> tuple[DeepseekV4, ModelArgs]:
    """tools/kernel_count.py's release-structured model, H and I multiples of 128 (the tile GEMMs' shapes)."""
    return release_structure(ratios, hidden_size=256, moe_intermediate_size=128, index_topk=RELEASE_TOPK)


def forward_count(ratios: list[int], tokens: int, start: int, prompts: int = 1) -> collections.Counter:
    """Kernels of one forward of `prompts` requests, `tokens` each at position `start`."""
    model, a = model_of(ratios)
    pools = StatePools(a, max_slots=prompts, max_positions=start + tokens + 8, page_size=16, dtype=mx.bfloat16)
    hs = [pools.alloc(start + tokens) for _ in range(prompts)]
    mx.eval(*pools.arrays())
    ids = [[(i + 7 * j) % a.vocab_size for i in range(start + tokens)] for j in range(prompts)]
    with cuda_prefill():
        if start:  # the state of the tokens before, evaluated: not part of the counted forward
            mx.eval(prefill_batch(model, pools, [(h, s[:start], 0) for h, s in zip(hs, ids, strict=True)]),
                    *pools.arrays())  # fmt: skip
        ORDERING.nodes = 0
        out = prefill_batch(model, pools, [(h, s[start:], start) for h, s in zip(hs, ids, strict=True)])
        c = counted([*out, *pools.arrays(), *ROOTS])
        c["Depends"] -= ORDERING.nodes  # ordering, not launches
        return +c


def layer_counts(tokens: int, start: int = 0, prompts: int = 1) -> dict[str, collections.Counter]:
    """Per layer kind, the kernels one more layer of that kind adds to a forward (its RoPE tables are made
    once a kind a forward, as the model's first layer of the kind does)."""
    out = {}
    for kind, r in (("sliding", 0), ("CSA", 4), ("HCA", 128)):
        c = forward_count([0, r, r], tokens, start, prompts)
        c.subtract(forward_count([0, r], tokens, start, prompts))
        out[kind] = +c
    return out


def flash_estimate(tokens: int, start: int = 0, prompts: int = 1) -> int:
    """Kernels a V4-Flash forward (43 layers: 2 sliding, 21 CSA, 20 HCA) by this count."""
    per = {k: sum(c.values()) for k, c in layer_counts(tokens, start, prompts).items()}
    first = {r: sum(forward_count([0, r], tokens, start, prompts).values()) for r in (0, 4, 128)}
    return first[4] + (first[128] - first[0]) + per["sliding"] + 20 * per["CSA"] + 19 * per["HCA"]


def build_ms(tokens: int, reps: int = 7) -> tuple[float, int]:
    """Host ms to build one forward's lazy graph (median; the first call apart) of a 43-layer model with
    V4-Flash's layer kinds at small dims, the CUDA launches stood in for, and its kernels by this count."""
    model, a = model_of([0, 0] + [4, 128] * 20 + [4])
    pools = StatePools(a, max_slots=1, max_positions=tokens + 8, page_size=16, dtype=mx.bfloat16)
    h = pools.alloc(tokens)
    mx.eval(*pools.arrays())
    ids = [i % a.vocab_size for i in range(tokens)]
    times, n = [], 0
    with cuda_prefill():
        for rep in range(reps):
            t0 = time.perf_counter()
            out = prefill_chunk(model, pools, h, ids, 0)
            times.append(time.perf_counter() - t0)
            if rep == 0:
                n = sum(counted([out, *pools.arrays(), *ROOTS]).values())
            mx.eval(out, *pools.arrays(), *ROOTS)
            ROOTS.clear()
    return 1e3 * statistics.median(times[1:]), n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,256")
    ap.add_argument("--start", type=int, default=0, help="tokens already prefilled (the chunk's first position)")
    ap.add_argument("--prompts", type=int, default=1, help="requests in the forward, --tokens each")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--build", action="store_true", help="also time the host build of a 43-layer forward")
    opt = ap.parse_args()
    print(f"{'tokens':>6} {'layer':8} {'kernels':>7}  most common")
    for t in (int(x) for x in opt.tokens.split(",")):
        for kind, c in layer_counts(t, opt.start, opt.prompts).items():
            print(f"{t:6d} {kind:8} {sum(c.values()):7d}  " + ", ".join(f"{n} {k}" for n, k in c.most_common(opt.top)))
        print(f"{t:6d} {'V4-Flash':8} {flash_estimate(t, opt.start, opt.prompts):7d}  (43 layers, the embedding and "
              f"the head; {opt.prompts} prompt(s) of {t} tokens)")
        if opt.build:
            ms, n = build_ms(t)
            print(f"{t:6d} {'build':8} {n:7d}  {ms:.1f} ms of host to build the forward (43 layers, small dims)")


if __name__ == "__main__":
    main()
