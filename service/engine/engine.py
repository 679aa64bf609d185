"""Engine: the model, its decode-state pools and one batched step. Every method runs on the engine thread."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from dsv4_serve.kernels.upload import upload
from dsv4_serve.model.deepseek_v4 import DeepseekV4
from dsv4_serve.model.prefill import Forward
from dsv4_serve.model.speculative import MAX_DRAFTS
from dsv4_serve.model.state import StateHandle
from dsv4_serve.service.engine import graphs as engine_graphs
from dsv4_serve.service.engine.prefix_cache import PrefixCache
from dsv4_serve.service.engine.prefix_ops import PrefixOps
from dsv4_serve.service.engine.prompt_logprobs import PendingPrompt, score_lazy
from dsv4_serve.service.engine.request import PromptLogprob
from dsv4_serve.service.engine.sizing import default_state_budget, free_device_bytes, pools_for_budget
from dsv4_serve.service.engine.speculator import Speculator
from dsv4_serve.service.engine.warmup import install_kernel_noter, warm_up

# The engine thread's host time, by phase: the step's graph built in Python, MLX encoding and launching it
# (async_eval), the sampler's graph, the wait for the sampled tokens.
HOST_PHASES = ("build", "encode", "sample", "wait")
log = logging.getLogger("dsv4.engine")

Handle = StateHandle
PREFIX_SHARE = 0.25  # default prefix cache budget: this share of the state pools' bytes ...
PREFIX_MIN_BYTES = 64 << 20  # ... but at least this much
# A prefill slice's layers x rows at most (as well as its host time): the slice's GPU time, which the host's does
# not see (a 2,048-row V4-Flash layer: ~8 ms of H200 time, ~3 ms of host). 4,096: 2 layers of a 2,048-token forward.
SLICE_ROWS_LAYERS = int(os.environ.get("DSV4_PREFILL_SLICE_ROWS", "4096"))


class Engine(PrefixOps):
    def __init__(
        self,
        model: DeepseekV4,
        *,
        max_rows: int = 8,
        max_model_len: int | None = None,
        state_budget_bytes: int | None = None,
        page_size: int = 64,
        prefix_cache_bytes: int | None = None,
        prefix_interval: int = 128,
        speculative: int = 0,
        decode_graphs: str = "off",
        graph_cache_dir: Path | None = None,
    ):
        args = model.args
        if speculative and not model.mtp:  # speculative decoding with the MTP block (service/engine/speculation.py)
            raise ValueError("speculative decoding needs the model's MTP block (mtp.0.*), and this model has none")
        if not 0 <= speculative <= MAX_DRAFTS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_DRAFTS}, got {speculative}")
        if not 1 <= max_rows <= 8:
            raise ValueError(f"max_rows must be in 1..8, got {max_rows}")
        limit = args.max_position_embeddings
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in 1..{limit}, got {max_model_len}")
        self.model, self.args = model, args
        self.max_rows = max_rows
        self.max_model_len = max_model_len or limit
        self.vocab_size = args.vocab_size
        self.eos_token_id = args.eos_token_id
        # The decode step as replayed CUDA graphs (service/engine/graphs.py): the recorder goes in before any
        # kernel object is made, over the kernel cache's noter (unless DSV4_KERNEL_CACHE=0); the graphs are captured
        # at the end of the warm-up, MLX's kernel cache filled after it.
        self.kernel_noter = install_kernel_noter()
        rec = engine_graphs.prepare(decode_graphs, speculative)
        if state_budget_bytes is None:
            state_budget_bytes = default_state_budget(
                args, max_rows=max_rows, max_model_len=self.max_model_len, dtype=model.dtype, page_size=page_size,
                mtp=bool(speculative), cache_share=PREFIX_SHARE if prefix_cache_bytes != 0 and self.parallel_prefill
                else 0.0, free_bytes=free_device_bytes(), copies=1 if rec is None else 2)  # fmt: skip
        self.pools = pools_for_budget(
            args, max_rows=max_rows, max_model_len=self.max_model_len, budget_bytes=state_budget_bytes,
            dtype=model.dtype, page_size=page_size, mtp=bool(speculative),
        )
        self.speculator = Speculator(speculative, max_rows) if speculative else None
        self.graphs = None if rec is None else engine_graphs.DecodeGraphs(self, rec, decode_graphs, graph_cache_dir)
        if self.graphs is not None:
            # a replay reads its tokens from the host (the staging copy): no step queued on the device's tokens. The
            # next step is queued with the host's once a step is read back, before its events go out
            # (stepping.decode_step; DSV4_GRAPH_PIPELINE=0: not): greedy tokens equal to the MLX step's on an H100
            # (bench/gpu_all.sh PART=verify, 2026-12-07), one stream's TPOT 10.49 -> 10.15 ms (docs/cuda_graphs.md).
            self.pipeline_decode = False
            self.pipeline_host = os.environ.get("DSV4_GRAPH_PIPELINE", "1").strip() != "0"
            self.graph_overlap = os.environ.get("DSV4_GRAPH_OVERLAP", "0").strip() == "1"
        log.info("decode state: %.3f GiB for %d rows (%s)", self.pools.bytes_total() / 2**30, max_rows,
                 "budget" if state_budget_bytes is not None else "every row at max_model_len")
        # The prefix cache: off for engines without the parallel prefill (a distributed leader: its
        # followers replay decode steps only). Default budget: a share of the state pools' bytes.
        if prefix_cache_bytes is None:
            prefix_cache_bytes = max(PREFIX_MIN_BYTES, int(PREFIX_SHARE * self.pools.bytes_total()))
        # The engine thread's host seconds by phase (HOST_PHASES), cumulative: `step` adds build (the
        # graph in Python) and encode (MLX's async_eval), stepping.decode_step the sampler's and the wait
        # for the tokens; worker.stats() copies them for /metrics (plain floats: no lock needed to read).
        self.host_seconds = dict.fromkeys(HOST_PHASES, 0.0)
        self.prefix_cache: PrefixCache | None = None
        # A prefill forward built a slice at a time between decode steps (`prefill_batch(slice_seconds=)`), and
        # the handles released while it was in flight: their slots are still written by its later layers.
        self._forward: Forward | None = None
        self._deferred: list[Handle] = []
        # Its chunks' prompt logprobs: what to score (k, next_ids; None: nothing), then scored once it is built.
        self._scoring: list[tuple[int, Sequence[int]] | None] = []
        self._scores: list[PendingPrompt | None] = []
        self.prefill_rows_layers = self.prefill_layers = 0  # prefill built so far (the pacer's measure: pacing.py)
        # A prefill's host ms by part, cumulative (the engine profile's slow lines, dsv4_prefill_host_seconds): its
        # layers built and queued, the whole forward's evaluation waited for (the GPU's lag behind the build),
        # the prefix cache's snapshot at the prompt's end, and the admission's slot reset (a replay settled first).
        self.prefill_ms = {"prefill_build_ms": 0.0, "prefill_eval_ms": 0.0, "prefill_snapshot_ms": 0.0,
                           "prefill_admit_ms": 0.0}  # fmt: skip
        if prefix_cache_bytes > 0 and self.parallel_prefill:
            self.prefix_cache = PrefixCache(self.pools, prefix_cache_bytes, prefix_interval)
            log.info("prefix cache: %.3f GiB, a snapshot every %d prompt positions", prefix_cache_bytes / 2**30,
                     prefix_interval)  # fmt: skip

    # ---- state accounting ----------------------------------------------------------------------
    def state_bytes_for(self, n_tokens: int) -> int:
        return self.pools.bytes_for(n_tokens)

    def bytes_in_use(self) -> int:
        return self.pools.bytes_in_use()

    def bytes_budget(self) -> int:
        return self.pools.bytes_total()

    def fits_ever(self, n_tokens: int, rows: int = 1) -> bool:
        """Could `rows` requests of n_tokens positions each (n > 1 sampling) be admitted into empty pools?"""
        p = self.pools
        if not 1 <= n_tokens <= self.max_model_len or not 1 <= rows <= self.max_rows:
            return False
        return all(rows * p.pages_for(n_tokens, r) <= p.pages[r] - 1 for r in p.ratios)

    def can_admit(self, n_tokens: int) -> bool:
        """Free pages, or pages the prefix cache alone holds (evicted LRU first until the request fits)."""
        p, cache = self.pools, self.prefix_cache
        if p.can_alloc(n_tokens):
            return True
        if cache is None or not p.has_free_slot() or not self.fits_ever(n_tokens):
            return False
        if any(p.pages_for(n_tokens, r) > p.free_pages(r) + cache.reclaimable(r) for r in p.ratios):
            return False  # running requests hold the pages: evicting would not help
        while not p.can_alloc(n_tokens) and cache.evict_one():
            pass
        return p.can_alloc(n_tokens)

    def admit(self, n_tokens: int) -> Handle:
        t0 = time.perf_counter()
        self.touched()  # a slot reset on allocation
        handle = self.pools.alloc(n_tokens)
        self.prefill_ms["prefill_admit_ms"] += 1e3 * (time.perf_counter() - t0)
        return handle

    def touched(self) -> None:
        """MLX work is about to write the state pools: a replay left running ends first, and the decode graphs read
        the pools' addresses again before the next replay (a pool MLX wrote may be a new buffer)."""
        if self.graphs is not None:
            self.settle()
            self.graphs.touched()

    def settle(self) -> None:
        """Wait for a step left running (`step(wait=False)`) before MLX reads its logits or the state it writes."""
        if self.graphs is not None:
            self.host_seconds["wait"] += self.graphs.settle()

    def release(self, handle: Handle) -> None:
        """Free a request's state; a slot the prefill forward in flight still writes is freed when it ends."""
        fwd = self._forward
        if fwd is not None and any(h.slot == handle.slot for h, _, _ in fwd.work):
            self._deferred.append(handle)
            return
        self.pools.free(handle)

    # ---- the step ------------------------------------------------------------------------------
    # The worker may queue step N + 1 with step N's sampled tokens still on the device (`tokens`), so
    # that building one step overlaps the GPU running the previous one; False where every step's
    # token ids must be known on the host first (the distributed leader sends its followers the sampled
    # tokens by an all_sum inside the step instead: service/engine/follower.py).
    pipeline_decode = True
    # The replayed graphs' form of it (their tokens come from the host): the next step queued once a step's tokens
    # are read back, before the host publishes them (`step(wait=False)`, then `settle`).
    pipeline_host = False
    graph_overlap = False  # DSV4_GRAPH_OVERLAP (prefill_advance)

    def step(self, feeds: Sequence[tuple[Handle, int | None, int]], tokens: mx.array | None = None,
             wait: bool = True) -> mx.array:  # fmt: skip
        """One batched step: row i feeds token feeds[i][1] (or tokens[i], an int32 device array) at position
        feeds[i][2]. Returns logits [B, V] f32; the state update is already scheduled with them, so the
        sampler's one sync covers both. `wait` False: a replayed step may be left running (`settle` first)."""
        t0 = time.perf_counter()
        if not 1 <= len(feeds) <= self.max_rows:
            raise ValueError(f"step: rows must be 1..{self.max_rows}, got {len(feeds)}")
        if self.graphs is not None:  # one replayed graph (run when this returns, unless `wait` is False), or MLX's
            logits = self.graphs.step(feeds, tokens, wait)
            if logits is not None:  # the host's part of the replay call, and its wait for the GPU (0: left running)
                waited = self.graphs.last_wait
                self.host_seconds["encode"] += time.perf_counter() - t0 - waited
                self.host_seconds["wait"] += waited
                return logits
            self.touched()
        handles = [f[0] for f in feeds]
        batch = self.model.make_batch(self.pools, handles, [f[2] for f in feeds])
        if tokens is None:
            tokens = upload([f[1] for f in feeds])
        elif tokens.shape != (len(feeds),):
            raise ValueError(f"step: tokens must have shape ({len(feeds)},), got {tokens.shape}")
        logits = self.model.step(batch, tokens, self.pools)
        t1 = time.perf_counter()
        mx.async_eval(logits, self.pools.arrays())
        host = self.host_seconds
        host["build"] += t1 - t0
        host["encode"] += time.perf_counter() - t1
        return logits

    # Prompts go through `prefill` (all tokens of a chunk at once); an engine may turn this off, and the
    # worker then feeds prompts token by token (the distributed leader queues its chunks into the next plan).
    parallel_prefill = True

    def prefill(self, handle: Handle, token_ids: Sequence[int], start: int) -> None:
        """Feed prompt tokens of one request at positions start.. in one parallel pass (no logits kept)."""
        self.touched()
        self.model.prefill(self.pools, handle, token_ids, start, chunk=max(1, len(token_ids)), logits=False)

    def copy_state(self, src: Handle, dst: Handle, positions: int) -> None:
        """`dst` takes `src`'s state after `positions` positions (n > 1: the rows share one prefill)."""
        self.touched()
        self.pools.copy_slot(src, dst, positions)

    # Whether prefill_batch can build a forward in slices (the distributed leader's forwards run with the next
    # plan on every rank: not).
    sliced_prefill = True

    def prefill_batch(self, work: Sequence[tuple[Handle, Sequence[int], int]], slice_seconds: float | None = None,
                      scores: Sequence[tuple[int, Sequence[int]] | None] | None = None,
                      next_ids: Sequence[int] | None = None, rows_layers: int | None = None) -> bool:  # fmt: skip
        """Several requests' prompt chunks, (handle, token_ids, start) each, in ONE parallel forward (no
        logits kept); the worker's per-step budget bounds their total. With `slice_seconds`, only the
        forward's first slice of layers (`model.prefill.Forward`): `prefill_advance` builds the rest, decode
        steps of other rows in between. True when the whole forward is built. `scores`, one entry a chunk:
        None, or (k, next_ids) for prompt logprobs: the head over every token of that chunk at the forward's
        end, scoring the prompt token after each (k alternatives), read by `prefill_scores()` once built.
        `next_ids` (speculative decoding: the prompt token after each chunk) runs the MTP block's ring over the
        chunks' positions at the forward's end (docs/mtp.md)."""
        if self._forward is not None:
            raise RuntimeError("prefill_batch: a prefill forward is already in flight")
        scores = list(scores) if scores is not None else [None] * len(work)
        if len(scores) != len(work) or any(s and len(s[1]) != len(w[1]) for s, w in zip(scores, work, strict=False)):
            raise ValueError("prefill_batch: scores needs one entry a chunk, next_ids one a token")
        self._forward = Forward(self.model, self.pools, work, logits=False, every=[s is not None for s in scores],
                                mtp_next=next_ids)  # fmt: skip
        self._scoring, self._scores = scores, []
        return self.prefill_advance(slice_seconds, rows_layers)

    def prefill_advance(self, slice_seconds: float | None = None, rows_layers: int | None = None) -> bool:
        """The next slice of the forward in flight (None: all of it; at most `rows_layers`, default
        SLICE_ROWS_LAYERS); True when it is built. Built whole, its state is evaluated here (a failure then ends
        its requests only); built in slices, it is queued."""
        fwd = self._forward
        if fwd is None:
            raise RuntimeError("prefill_advance: no prefill forward in flight")
        # DSV4_GRAPH_OVERLAP: the slice's first layers are built while a replay left running runs (nothing of them
        # is evaluated before it ends: Forward.advance's before_eval), else the replay ends first.
        overlap = self.graphs is not None and self.graph_overlap
        if overlap:
            self.graphs.touched(settle=False)  # type: ignore[union-attr]
        else:
            self.touched()
        layers, t0 = fwd.built, time.perf_counter()
        try:
            built = fwd.advance(slice_seconds, rows_layers or SLICE_ROWS_LAYERS, self.settle if overlap else None)
            self.settle()  # (a no-op unless nothing was queued)
            t1 = time.perf_counter()
            self.prefill_ms["prefill_build_ms"] += 1e3 * (t1 - t0)
            self.prefill_rows_layers += fwd.rows * (fwd.built - layers)
            self.prefill_layers += fwd.built - layers
            if built and fwd.out is not None:  # the scored chunks' rows (async_eval'd with the state)
                self._scores = [None if s is None else score_lazy(o, s[1], s[0])
                                for s, o in zip(self._scoring, fwd.out, strict=True)]  # fmt: skip
            if built:
                (mx.eval if slice_seconds is None else mx.async_eval)(self.pools.arrays())
                self.prefill_ms["prefill_eval_ms"] += 1e3 * (time.perf_counter() - t1)
        except BaseException:
            self.prefill_abandon()
            raise
        if built:
            self.prefill_abandon()
        return built

    def prefill_scores(self) -> list[list[PromptLogprob] | None]:
        """The prompt logprobs of the forward just built, one entry a chunk (None: not scored), read back."""
        pending, self._scores = self._scores, []
        return [None if p is None else p.result() for p in pending]

    def prefill_abandon(self) -> None:
        """No forward in flight any more (built, or failed: its requests fail); the slots released meanwhile
        are freed."""
        self._forward, deferred, self._deferred = None, self._deferred, []
        for h in deferred:
            self.pools.free(h)

    @property
    def prefilling(self) -> bool:
        """A prefill forward is in flight (built in slices)."""
        return self._forward is not None

    @property
    def prefill_rows(self) -> int | None:
        """The rows (prompt tokens) of the forward in flight; None if none (the pacer sizes its slices by them)."""
        return None if self._forward is None else self._forward.rows

    def warmup(self) -> None:
        """Build every kernel and compiled segment a request needs before /ready says yes (warmup.py)."""
        warm_up(self)
