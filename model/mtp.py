"""DeepSeek-V4's multi-token-prediction (MTP) block, `mtp.0.*`: a draft of the token after next.

As DeepSeek's reference defines it (inference/model.py, `class MTPBlock(Block)`), for the main model's final
mHC streams h at position p ([nc, H]: after the last layer, before the HyperHead) and the token t_{p+1}
sampled from them:

    e = enorm(embed(t_{p+1})),   x_j = e_proj(e) + h_proj(hnorm(h_j))   for every stream j
    x = Block(x)                 a decoder block of its own (layer id num_hidden_layers): mHC units, attention, MoE
    logits = head(norm(HyperHead(x)))   with its own hc_head_fn / base / scale and norm

`embed` and `head` are the main model's (the release stores no mtp.0.embed / mtp.0.head). The block's attention
is sliding-window only (the release's trailing compress_ratios entry is 0), so its decode state is one window
ring a request: `StatePools(..., mtp=True)`, the ring at index num_hidden_layers of `pools.window`. Its MoE
routes by score (its layer id is past num_hash_layers).

Positions: the pair (h_p, t_{p+1}) runs at position p and writes ring row p % W (as vLLM positions a draft
model: at the target's positions). Only relative positions reach a sliding layer's attention (the output is
de-rotated), so placing the pair at p + 1 would give the same logits but for the RoPE angles' rounding.
The ring holds what the block saw at a request's last W positions: every position, the prompt's included,
goes through the block once for its drafts to be the trained ones (`draft_step` in the batched step,
`prompt_ring` at the end of a parallel prefill's forward; docs/mtp.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from dsv4_serve.kernels import RowBatch
from dsv4_serve.kernels.matmul import f32_linear_rows
from dsv4_serve.model.block import Block
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import RMSNorm, hc_head, rope_angles
from dsv4_serve.model.state import StateHandle, StatePools


class MTPBlock(Block):
    """A Block with the MTP's input mix (e_proj, h_proj, enorm, hnorm) and its own HyperHead and norm."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer)
        nc, h, eps = args.hc_mult, args.hidden_size, args.rms_norm_eps
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.norm = RMSNorm(h, eps)
        self.hc_head_fn = mx.zeros((nc, nc * h))
        self.hc_head_base = mx.zeros((nc,))
        self.hc_head_scale = mx.zeros((1,))

    def mix_in(self, streams: mx.array, emb: mx.array) -> mx.array:
        """streams [B, nc, H], the next tokens' embeddings [B, H] -> the block's input streams [B, nc, H]."""
        b, nc, h = streams.shape
        e = self.e_proj(self.enorm(emb))
        x = self.h_proj(self.hnorm(streams.reshape(b * nc, h))).reshape(b, nc, h)  # hnorm: per stream
        return x + e[:, None, :]

    def draft(self, streams: mx.array, token_ids: mx.array, batch: RowBatch, pools: StatePools, embed: nn.Module,
              head: mx.array, freqs: mx.array) -> tuple[mx.array, mx.array]:  # fmt: skip
        """(draft logits [B, vocab] f32, the block's output streams [B, nc, H]: a chained step's input); writes
        the rows' MTP window ring (lazily, as a decode step)."""
        hs = self(self.mix_in(streams, embed(token_ids)), token_ids, batch, pools, freqs)
        y = self.norm(hc_head(hs, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.args))
        return f32_linear_rows(y, head), hs  # REF: the shared head, in f32


def draft_step(model, batch: RowBatch, streams: mx.array, token_ids: mx.array, pools: StatePools) -> mx.array:
    """One MTP step for the rows of `batch`: streams [B, nc, H] are the main model's at each row's position p
    (`DeepseekV4.streams` of the step on the same batch), token_ids [B] the tokens sampled from them (t_{p+1}).
    Returns the draft logits [B, vocab] f32 for t_{p+2} and writes each row's MTP ring at p; lazy (the caller
    evaluates the logits with `pools.arrays()`). Touches no state of the main model's layers."""
    return draft_streams(model, batch, streams, token_ids, pools)[0]


def draft_streams(model, batch: RowBatch, streams: mx.array, token_ids: mx.array,
                  pools: StatePools) -> tuple[mx.array, mx.array]:  # fmt: skip
    """`draft_step`, and the block's output streams [B, nc, H]: chained drafting (k > 1) feeds them back as the
    next position's `streams` with the draft as its token, as vLLM's MTP proposer chains the layer."""
    if not model.mtp:
        raise ValueError("draft_step: the model has no MTP block (num_nextn_predict_layers is 0)")
    if not pools.mtp:
        raise ValueError("draft_step: the state pools hold no MTP window (build them with StatePools(..., mtp=True))")
    a, b = model.args, batch.size
    if tuple(streams.shape) != (b, a.hc_mult, a.hidden_size) or tuple(token_ids.shape) != (b,):
        raise ValueError(f"draft_step: streams {tuple(streams.shape)} / token_ids {tuple(token_ids.shape)} for "
                         f"{b} rows: expected ({b}, {a.hc_mult}, {a.hidden_size}) / ({b},)")  # fmt: skip
    return model.mtp[0].draft(streams, token_ids, batch, pools, model.embed, model.head.weight, model.freqs(False))


def prompt_ring(model, pools: StatePools, work: Sequence[tuple[StateHandle, Sequence[int], int]], streams: mx.array,
                next_ids: Sequence[int], positions: mx.array) -> None:  # fmt: skip
    """The MTP block over a parallel prefill's positions (model/prefill.py, at its forward's end): row q of the
    chunks pairs the forward's final streams h_q with t_{q+1} (the chunk's next token; next_ids[i]: the one after
    chunk i's last) and writes the MTP ring row q % W, as `draft_step` at every position would. Only the ring is
    kept (a prompt position drafts nothing), so of the block only its attention's projection runs: the window kv
    is a function of the block's input at q alone. Lazy."""
    if not model.mtp or not pools.mtp:
        raise ValueError("prompt_ring: needs the model's MTP block and the pools' MTP ring")
    block, a = model.mtp[0], model.args
    if len(next_ids) != len(work) or block.attn.ratio:
        raise ValueError(f"prompt_ring: {len(next_ids)} next tokens for {len(work)} chunks (one a chunk)")
    ids = mx.array([int(t) for (_, toks, _), n in zip(work, next_ids, strict=True) for t in [*toks[1:], n]],
                   dtype=mx.int32)  # fmt: skip
    _, _, _, kv, *_ = block.before(block.mix_in(streams, model.embed(ids)), *rope_angles(model.freqs(False),
                                                                                         positions, 0, a))
    w, slots, rows, src, off = a.sliding_window, [], [], [], 0
    for handle, toks, start in work:
        t = len(toks)
        for j in range(max(0, t - w), t):  # a ring row once: the chunk's last W positions
            slots.append(handle.slot)
            rows.append((start + j) % w)
            src.append(off + j)
        off += t
    ring = pools.window[block.attn.layer]
    ring[mx.array(slots, dtype=mx.int32), mx.array(rows, dtype=mx.int32)] = kv[mx.array(src, dtype=mx.int32)].astype(
        pools.dtype)
    pools.window[block.attn.layer] = mx.contiguous(ring)
