"""DeepSeek-V4: embed -> mHC streams -> layers (attention + MoE) -> HyperHead -> norm -> head.

`decode()` runs one step for a batch of 1..8 rows, each at its own position with its own state slot and
pages. `prefill()` feeds a prompt chunk of one request through every layer at once (`model/prefill.py`):
the same state and last-token logits as token-by-token decoding, up to f32 summation order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from dsv4_serve.kernels import Row, RowBatch
from dsv4_serve.kernels.matmul import f32_linear_rows
from dsv4_serve.kernels.upload import upload
from dsv4_serve.model.attention import Attention
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import MoE, RMSNorm, hc_head, hc_post, hc_pre_norm, inv_freq, step_angles
from dsv4_serve.model.layers import reset_compiled as forget_hc_pre
from dsv4_serve.model.prefill import prefill_batch, prefill_chunk
from dsv4_serve.model.state import StateHandle, StatePools

# Prompt tokens per parallel prefill pass (the service's --prefill-chunk default). On the H200 a V4-Flash forward
# has a large host cost whatever its size: 256-token forwards ran 0.14-0.17 s, a 2,048-token one 0.33 s (6,219
# tokens/s, bench/prefill.py, b5096d6, 2026-12-02). Running streams no longer wait a whole forward: the engine
# builds it in slices with a decode step after each (service/engine/prefilling.py).
PREFILL_CHUNK = 2048


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        nc, h = args.hc_mult, args.hidden_size
        self.attn_norm = RMSNorm(h, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(h, args.rms_norm_eps)
        self.attn = Attention(args, layer)
        self.ffn = MoE(args, layer)
        for unit in ("attn", "ffn"):
            setattr(self, f"hc_{unit}_fn", mx.zeros(((2 + nc) * nc, nc * h)))
            setattr(self, f"hc_{unit}_base", mx.zeros(((2 + nc) * nc,)))
            setattr(self, f"hc_{unit}_scale", mx.zeros((3,)))
        self.args = args

    def before(self, h: mx.array, *angles: mx.array) -> tuple[mx.array, ...]:
        """Pure: attention mHC-pre + norm + every projection the kernels need (angles: rope_angles)."""
        x, post, comb = hc_pre_norm(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm,
                                    self.args)  # fmt: skip
        return (post, comb, *self.attn.project(x, *angles))

    def after(self, o, h, post, comb, c, s_back, token_ids) -> mx.array:
        """Pure: attention output + mHC-post, then the whole MoE half of the block."""
        a = self.args
        h = hc_post(self.attn.output(o, c, s_back, h.dtype), h, post, comb)
        # The ffn unit's weights come from the post-attention streams.
        x, post, comb = hc_pre_norm(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm, a)
        return self.ffn.post_mixed(x, token_ids, h, post, comb)

    def __call__(self, h, token_ids, batch, pools, freqs):
        before, after = self._segments()
        attn = self["attn"]  # nn.Module's children are dict items: [] skips its __getattr__
        r = attn.ratio
        # the layer kind's RoPE inputs, then the de-rotation's table (-S): once a step per layer kind, compiled
        *angles, back = batch.once(("rope_angles", r, id(freqs)),
                                   lambda: step_angles(freqs, batch.positions, r, self.args))  # fmt: skip
        post, comb, *proj = before(h, *angles)
        o = attn.attend(tuple(proj), batch, pools)
        return after(o, h, post, comb, proj[2], back, token_ids)

    def _segments(self):
        """The pure parts around the kernels, compiled: a layer is then ~2 fused graphs + its kernel calls
        instead of ~150 separately dispatched ops (host-bound at <= 8 rows). Traced once per batch size.
        Not compiled when sharded (all_sum inside) or with DSV4_COMPILE=0."""
        seg = self.__dict__.get("_compiled")
        if seg is None:
            sharded = self.attn.group is not None or getattr(self.ffn, "group", None) is not None
            if sharded or os.environ.get("DSV4_COMPILE", "1") == "0":
                seg = (self.before, self.after)
            else:
                seg = (mx.compile(self.before), mx.compile(self.after))
            self.__dict__["_compiled"] = seg
        return seg

    def reset_compiled(self) -> None:
        """Forget traced segments (they captured the weights): call after replacing modules or weights."""
        self.__dict__.pop("_compiled", None)


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

    def reset_compiled(self) -> None:
        for block in self.layers:
            block.reset_compiled()
        forget_hc_pre()

    @property
    def dtype(self) -> mx.Dtype:
        return self.embed.weight.dtype

    def step(self, batch: RowBatch, token_ids: mx.array, pools: StatePools) -> mx.array:
        """One decode step for the rows of `batch` (row i reads token_ids[i]); logits [B, vocab] f32.

        Updates the rows' state in `pools` (lazily: the caller evaluates logits and pools together)."""
        y = self.hidden(batch, token_ids, pools)
        return f32_linear_rows(y, self.head.weight)  # REF: the head in f32

    def hidden(self, batch: RowBatch, token_ids: mx.array, pools: StatePools) -> mx.array:
        """The step up to the final norm [B, H] (follower ranks of a distributed model skip the head)."""
        a = self.args
        x = self.embed(token_ids)
        # laid out once: the first layer's pre- and post-mix kernels would each copy the strided broadcast
        hs = mx.contiguous(mx.broadcast_to(x[:, None, :], (x.shape[0], a.hc_mult, x.shape[1])))
        for i, block in enumerate(self.layers):
            hs = block(hs, token_ids, batch, pools, self._freqs[a.layer_ratio(i) != 0])
        return self.norm(hc_head(hs, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, a))

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
            out = prefill_chunk(self, pools, handle, token_ids[i : i + chunk], start + i, logits=last, every=every)
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
