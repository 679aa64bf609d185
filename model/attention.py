"""The three attention kinds (sliding / CSA / HCA) for a batch of decode rows.

The only model file that calls `kernels`: per layer one compressor dispatch (in CSA layers the main and the
indexer's compressor together, `compressor_pair_rows_inplace`), one indexer dispatch and one
sparse-attention dispatch for all rows.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from dsv4_serve import kernels
from dsv4_serve.kernels import matmul as kmatmul
from dsv4_serve.kernels.rows import ordered
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import RMSNorm, rope_angles
from dsv4_serve.model.quant import linear_cat
from dsv4_serve.model.state import StatePools

# The in-place compressor (kernels.compressor_rows_inplace: state and pool written through their buffers on
# CUDA, no pool scatter, one launch). The default since its model-level GPU test and the engine tests passed
# on the H200 (2026-11-30, 107803a); DSV4_INPLACE_COMPRESSOR=0 selects the functional op (kernel + pool scatter).
INPLACE_COMPRESSOR = os.environ.get("DSV4_INPLACE_COMPRESSOR", "1") != "0"


class Compressor(nn.Module):
    def __init__(self, args: ModelArgs, ratio: int, dim: int):
        super().__init__()
        coff = 2 if ratio == 4 else 1
        self.wkv = nn.Linear(args.hidden_size, coff * dim, bias=False)
        self.wgate = nn.Linear(args.hidden_size, coff * dim, bias=False)
        self.ape = mx.zeros((ratio, coff * dim))
        self.norm = RMSNorm(dim, args.rms_norm_eps)
        self.ratio, self.dim = ratio, dim

    def project(self, x: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, ...]:
        """Pure part: kv / score projections in f32 (REF: the weights are upcast, not the other way round),
        passed on with the RoPE angles of the entry a row would emit this step (its window's first token)."""
        kv, score = kmatmul.f32_linear_pair_rows(x, self.wkv.weight, self.wgate.weight)  # one launch on CUDA
        return kv, score, cos, sin

    def inputs(self, proj, kv_state, score_state, pool) -> kernels.CompressorArgs:
        return kernels.CompressorArgs(proj[0], proj[1], self["ape"].astype(mx.float32), self["norm"]["weight"],
                                      kv_state, score_state, pool, self.dim)  # fmt: skip

    def apply(self, batch, proj, kv_state, score_state, pool, eps, workspace=None, after=None):
        """-> (kv_state, score_state, pool, token): kernels.compressor_rows_inplace (on CUDA written in
        place; the pool's readers take `after=token`; `after`: the window ring write's token, passed on so
        that the attention after this token reads the ring written); with INPLACE_COMPRESSOR off, the
        functional update and `after` as the token."""
        a = self.inputs(proj, kv_state, score_state, pool)
        kw = dict(ratio=self.ratio, head_dim=self.dim, eps=eps, cos=proj[2], sin=proj[3])
        if INPLACE_COMPRESSOR:
            return kernels.compressor_rows_inplace(batch, *a[:7], **kw, after=after, workspace=workspace)
        return (*kernels.compressor_rows(batch, *a[:7], **kw), after)


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.wq_b = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, args.index_n_heads, bias=False)
        self.compressor = Compressor(args, 4, args.index_head_dim)
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        h, nh, d = args.hidden_size, args.num_attention_heads, args.head_dim
        self.wq_a = nn.Linear(h, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, nh * d, bias=False)
        self.wkv = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, args.rms_norm_eps)
        self.wo_a = nn.Linear(nh * d // args.o_groups, args.o_groups * args.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, h, bias=False)
        self.attn_sink = mx.zeros((nh,))
        self.ratio = args.layer_ratio(layer)
        # Local head/group counts and the tensor-parallel group: model/distributed.py shrinks the first
        # two and sets the group (the partial wo_b outputs are summed over ranks); None: one process.
        self.n_heads, self.n_groups, self.group = nh, args.o_groups, None
        if self.ratio:
            self.compressor = Compressor(args, self.ratio, d)
        if self.ratio == 4:
            self.indexer = Indexer(args)
        self.layer, self.args = layer, args

    def project(
        self, x: mx.array, c: mx.array, s: mx.array, ccos: mx.array | None = None, csin: mx.array | None = None,
        ci: mx.array | None = None, si: mx.array | None = None,
    ) -> tuple[mx.array, ...]:  # fmt: skip
        """Everything before the kernels, a pure function of x and the layer kind's RoPE inputs
        (`layers.rope_angles`): q, the new window kv, the RoPE tables (for the output), the compressors'
        projections and, in CSA layers, the indexer's q and head weights; last the window kv before its norm."""
        a, r = self.args, self.ratio
        b, nh, d, eps = x.shape[0], self.n_heads, a.head_dim, a.rms_norm_eps
        qa, kva = linear_cat(x, self.wq_a, self.wkv)  # the two projections of x: one launch on CUDA
        qr = self.q_norm(qa)
        qb, qib = linear_cat(qr, self.wq_b, self.indexer.wq_b) if r == 4 else (self.wq_b(qr), None)
        # each q head's unweighted RMS and the window kv's kv_norm, then RoPE: one op (one launch on CUDA) each
        q = kernels.rms_rope_rows(qb.reshape(b, nh, d), c, s, eps=eps)
        kv = kernels.rms_rope_rows(kva, c, s, weight=self.kv_norm.weight, eps=self.kv_norm.eps)
        out = (q, kv, c, s)
        if r:
            out += self.compressor.project(x, ccos, csin)
        if r == 4:
            ix = self.indexer
            q_i = kernels.rms_rope_rows(qib.reshape(b, ix.n_heads, ix.head_dim), ci, si)
            scale = ix.head_dim**-0.5 * ix.n_heads**-0.5
            wp = ix.weights_proj
            w = (wp(x).astype(mx.float32) * scale if isinstance(wp, nn.QuantizedLinear)
                 else kernels.index_weights_rows(x, wp.weight, scale=scale))  # fmt: skip
            out += (q_i, w, *ix.compressor.project(x, ccos, csin))
        return (*out, kva)  # last: the window kv as projected, for the ring write's kernel (`attend`)

    def attend(self, proj: tuple[mx.array, ...], batch: kernels.RowBatch, pools: StatePools) -> mx.array:
        """The kernel part: window write, compressor(s), indexer, sparse attention; o [B, nh, D]."""
        a, layer, r = self.args, self.layer, self.ratio
        q = proj[0]
        # Window ring: row p % W, written before attention (the current token is one of the W keys), the kv's
        # norm + RoPE with it; p % W once per step (batch.once), not once per layer. On CUDA with
        # DSV4_GRAPH_GLUE=1 one kernel writes the ring in place: its token orders the ring's readers.
        w = a.sliding_window
        ring = batch.once(("window_ring_row", w), lambda: batch.positions % w)
        # (the twin writes proj[1], the kv `project` normed and rotated; the kernel does both from kva itself, and
        # MLX then never runs proj[1]'s launch: nothing reads it)
        write = lambda after=None: kernels.rms_rope_ring_rows(  # noqa: E731
            ordered(proj[-1], after), proj[2], proj[3], pools.window[layer], batch.slots, batch.positions, ring,
            weight=self.kv_norm.weight, eps=self.kv_norm.eps, kv=proj[1],
        )  # fmt: skip
        # A chained batch (a slot's consecutive positions as rows: kernels/rows.py) reads the ring as before the
        # step with its own keys as a tail, and writes the ring after the attention: row p must still see p + 1 - W.
        chained, tail, wtok = batch.chained, None, None
        if chained:
            tail = proj[1].astype(pools.window[layer].dtype)
        else:
            pools.window[layer], wtok = write()
        pool, indices, after, ik_after = None, None, wtok, None
        if r:
            comp = self["compressor"]  # nn.Module's children are dict items: [] skips its __getattr__ (~0.5 us)
            main = (pools.comp_kv[layer], pools.comp_score[layer], pools.ckv[layer])
        if r == 4:
            ix = self["indexer"]
            idx = (pools.idx_kv[layer], pools.idx_score[layer], pools.ikeys[layer])
        if r == 4 and INPLACE_COMPRESSOR:  # the main and the indexer's compressor: one dispatch
            main, idx, after = kernels.compressor_pair_rows_inplace(
                batch, comp.inputs(proj[4:8], *main), ix["compressor"].inputs(proj[10:14], *idx),
                ratio=4, eps=a.rms_norm_eps, cos=proj[6], sin=proj[7], after=wtok,
            )  # fmt: skip
            ik_after = after
        elif r:
            *main, after = comp.apply(batch, proj[4:8], *main, a.rms_norm_eps, pools.comp_ws.get(layer), wtok)
            if r == 4:
                *idx, ik_after = ix["compressor"].apply(batch, proj[10:14], *idx, a.rms_norm_eps)
        if r:
            pools.comp_kv[layer], pools.comp_score[layer], pools.ckv[layer] = main
            pool = main[2]
        if r == 4:
            pools.idx_kv[layer], pools.idx_score[layer], pools.ikeys[layer] = idx
            indices = kernels.indexer_rows(batch, proj[8].astype(pools.dtype), proj[9], idx[2], topk=ix.topk,
                                           after=ik_after, workspace=pools.idx_ws[layer])  # fmt: skip
        # HCA attends to every emitted entry: indices None (the op masks by each row's count; its CUDA
        # path reads a cached arange, no per-step index array)
        o = kernels.sparse_attention_rows(
            batch, q.astype(pools.dtype), pools.window[layer], pool, indices,
            self["attn_sink"].astype(mx.float32), scale=a.head_dim**-0.5, ratio=r, after=after, tail=tail,
        )  # fmt: skip
        if chained:  # after the attention's reads (an in-place writer is ordered by its input: `ordered`)
            pools.window[layer], token = write(o)
            if token is not None:  # the write is run with the step: the output waits for it (x * 1: the same bits)
                o = o * (1 + (token.reshape(-1)[:1].view(mx.uint8)[:1] & 0)).astype(o.dtype)
        return o

    def output(self, o: mx.array, c: mx.array, s_back: mx.array, dtype: mx.Dtype) -> mx.array:
        """After the kernels: de-rotate (V = K carries RoPE: rotate by -p with `project`'s C and s_back = -S),
        grouped output projection."""
        a, b, d = self.args, o.shape[0], self.args.head_dim
        o = kernels.rms_rope_rows(o.astype(dtype), c, s_back)
        # Group k (contiguous heads) goes through its own rows of wo_a.
        g, r = self.n_groups, a.o_lora_rank
        u = o.reshape(b, g, self.n_heads * d // g)
        wo_a = self.wo_a
        if isinstance(wo_a, nn.QuantizedLinear):  # mxfp8 as released: one launch on CUDA, each group read once
            z = kmatmul.grouped_qlinear_rows(u, wo_a.weight.reshape(g, r, -1), wo_a.scales.reshape(g, r, -1))
        else:
            z = mx.einsum("bgi,gri->bgr", u, wo_a.weight.reshape(g, r, -1))
        out = self.wo_b(z.reshape(b, g * r))
        return out if self.group is None else mx.distributed.all_sum(out, group=self.group)

    def __call__(self, x: mx.array, batch: kernels.RowBatch, pools: StatePools, freqs: mx.array) -> mx.array:
        proj = self.project(x, *rope_angles(freqs, batch.positions, self.ratio, self.args))
        return self.output(self.attend(proj, batch, pools), proj[2], -proj[3], x.dtype)
