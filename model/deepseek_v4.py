"""DeepSeek-V4: embed -> mHC streams -> layers (attention + MoE) -> HyperHead -> norm -> head.

`decode()` runs one step for a batch of 1..8 rows, each at its own position with its own state slot and
pages. `prefill()` feeds a prompt chunk of one request through every layer at once (`model/prefill.py`):
the same state and last-token logits as token-by-token decoding, up to f32 summation order.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from dsv4_serve import kernels
from dsv4_serve.kernels import Row, RowBatch
from dsv4_serve.kernels.matmul import f32_linear_rows
from dsv4_serve.kernels.upload import upload
from dsv4_serve.model.block import Block
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import RMSNorm, hc_head, inv_freq
from dsv4_serve.model.layers import reset_compiled as forget_hc_pre
from dsv4_serve.model.mtp import MTPBlock
from dsv4_serve.model.prefill import prefill_batch, prefill_chunk
from dsv4_serve.model.state import StateHandle, StatePools

# Prompt tokens per parallel prefill pass (the service's --prefill-chunk default). On the H200 a V4-Flash forward
# has a large host cost whatever its size: 256-token forwards ran 0.14-0.17 s, a 2,048-token one 0.33 s (6,219
# tokens/s, bench/prefill.py, b5096d6, 2026-12-02). Running streams no longer wait a whole forward: the engine
# builds it in slices with a decode step after each (service/engine/prefilling.py).
PREFILL_CHUNK = 2048


class DeepseekV4(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        args.validate()
        nc, h = args.hc_mult, args.hidden_size
        self.embed = nn.Embedding(args.vocab_size, h)
        self.layers = [Block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.head = nn.Linear(h, args.vocab_size, bias=False)
        self.hc_head_fn = mx.zeros((nc, nc * h))
        self.hc_head_base = mx.zeros((nc,))
        self.hc_head_scale = mx.zeros((1,))
        self.args = args
        # RoPE tables are config, not weights: keep them out of parameters().
        self._freqs = {False: inv_freq(args, False), True: inv_freq(args, True)}
        # The MTP block (`mtp.0.*`, after every other parameter: the tiny model's draws keep their order). It
        # shares embed and head; nothing in step / prefill runs it (model/mtp.py: draft_step).
        self.mtp = [MTPBlock(args, args.num_hidden_layers + k) for k in range(args.num_nextn_predict_layers)]

    def freqs(self, compressed: bool) -> mx.array:
        """The RoPE frequencies of a layer kind: sliding (False) or CSA / HCA (True)."""
        return self._freqs[compressed]

    def blocks(self) -> list[Block]:
        """The decoder layers, then the MTP blocks."""
        return [*self.layers, *self.mtp]

    def reset_compiled(self) -> None:
        for block in self.blocks():
            block.reset_compiled()
        forget_hc_pre()

    @property
    def dtype(self) -> mx.Dtype:
        return self.embed.weight.dtype

    def step(self, batch: RowBatch, token_ids: mx.array, pools: StatePools) -> mx.array:
        """One decode step for the rows of `batch` (row i reads token_ids[i]); logits [B, vocab] f32.

        Updates the rows' state in `pools` (lazily: the caller evaluates logits and pools together)."""
        return self.logits(self.streams(batch, token_ids, pools))

    def logits(self, hs: mx.array) -> mx.array:
        """Streams after the last layer [B, nc, H] -> logits [B, vocab] f32 (REF: the head in f32)."""
        return f32_linear_rows(self.collapse(hs), self.head.weight)

    def hidden(self, batch: RowBatch, token_ids: mx.array, pools: StatePools) -> mx.array:
        """The step up to the final norm [B, H] (follower ranks of a distributed model skip the head)."""
        return self.collapse(self.streams(batch, token_ids, pools))

    def streams(self, batch: RowBatch, token_ids: mx.array, pools: StatePools) -> mx.array:
        """The step's mHC streams after the last layer [B, nc, H]: the MTP block's input (model/mtp.py)."""
        a = self.args
        if isinstance(self.embed, nn.QuantizedEmbedding):
            x = self.embed(token_ids)
            # laid out once: the first layer's pre- and post-mix kernels would each copy the strided broadcast
            hs = mx.contiguous(mx.broadcast_to(x[:, None, :], (x.shape[0], a.hc_mult, x.shape[1])))
        else:  # the same gather and layout (one kernel on CUDA with DSV4_GRAPH_GLUE=1)
            hs = kernels.embed_streams(self.embed["weight"], token_ids, a.hc_mult)
        for i, block in enumerate(self.layers):
            hs = block(hs, token_ids, batch, pools, self._freqs[a.layer_ratio(i) != 0])
        return hs

    def collapse(self, hs: mx.array) -> mx.array:
        """Streams [B, nc, H] -> HyperHead -> final norm [B, H] (the head's input)."""
        return self.norm(hc_head(hs, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.args))

    def make_batch(self, pools: StatePools, handles: Sequence[StateHandle], positions: Sequence[int]) -> RowBatch:
        rows = [
            Row(slot=h.slot, position=int(p), q_row=i, tables=h.tables)
            for i, (h, p) in enumerate(zip(handles, positions, strict=True))
        ]
        for h, p in zip(handles, positions, strict=True):
            if not 0 <= p < h.capacity:
                raise ValueError(f"decode: position {p} is outside the request's capacity {h.capacity}")
        widths = {r: pools.table_width(r) for r in pools.ratios}
        return RowBatch.build(rows, pools.page_size, widths)

    def decode(
        self, pools: StatePools, handles: Sequence[StateHandle], token_ids: Sequence[int], positions: Sequence[int]
    ) -> mx.array:
        """Build the rows, run one step and evaluate logits and the updated state together."""
        batch = self.make_batch(pools, handles, positions)
        logits = self.step(batch, upload([int(t) for t in token_ids]), pools)
        mx.eval(logits, pools.arrays())
        return logits

    def prefill(self, pools: StatePools, handle: StateHandle, token_ids: Sequence[int], start: int,
                chunk: int = PREFILL_CHUNK, logits: bool = True, every: bool = False) -> mx.array | None:  # fmt: skip
        """Feed one request's prompt tokens at positions start..; returns the logits of the last one [vocab]
        (None with `logits=False`: the state only, no head; `every=True`: every token's [T, vocab], row t
        predicting token t + 1). Parallel over the tokens, `chunk` at a time (work buffers scale
        with the chunk: kernels/prefill_attention.py)."""
        if not token_ids:
            raise ValueError("prefill: token_ids must not be empty")
        if chunk < 1:
            raise ValueError(f"prefill: chunk must be >= 1, got {chunk}")
        if start < 0 or start + len(token_ids) > handle.capacity:
            raise ValueError(f"prefill: positions {start}..{start + len(token_ids) - 1} are outside the "
                             f"request's capacity {handle.capacity}")  # fmt: skip
        out, rows = None, []
        for i in range(0, len(token_ids), chunk):
            last = logits and (every or i + chunk >= len(token_ids))
            out = prefill_chunk(self, pools, handle, token_ids[i : i + chunk], start + i, logits=last,
                                every=every and logits)  # fmt: skip
            mx.async_eval(pools.arrays() if out is None else [out, *pools.arrays()])
            rows.append(out)
        if every and logits:
            out = rows[0] if len(rows) == 1 else mx.concatenate(rows)
        mx.eval(pools.arrays() if out is None else out)
        return out

    def prefill_batch(self, pools: StatePools, work: Sequence[tuple[StateHandle, Sequence[int], int]],
                      logits: bool = True) -> list[mx.array] | None:  # fmt: skip
        """Several requests' chunks, work[i] = (handle, token_ids, start), through ONE forward
        (`model.prefill.prefill_batch`), state and logits evaluated; each request's last-token logits
        [vocab] (None with `logits=False`). The caller bounds the total tokens (the work buffers')."""
        out = prefill_batch(self, pools, work, logits)
        mx.eval(pools.arrays() if out is None else [*out, *pools.arrays()])
        return out
