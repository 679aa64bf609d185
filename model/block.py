"""A decoder block: attention and MoE, each between its mHC unit's pre-mix (+ norm) and post-mix.

The main model's layers (model/deepseek_v4.py) and the MTP block (model/mtp.py) are this class.
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import mlx.nn as nn

from dsv4_serve.model.attention import Attention
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import MoE, RMSNorm, hc_post, hc_pre_norm, step_angles


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
        instead of ~150 separately dispatched ops (host-bound at <= 8 rows). Traced once per batch size and thread.
        Not compiled when sharded (all_sum inside) or with DSV4_COMPILE=0.

        One pair of compiled functions per thread (a `threading.local`): MLX keeps a compiled function's traces
        in a cache per thread, keyed by the callable's address, and a freed one erases its traces from the last
        calling thread's cache only; one used on two threads (warm-up on one, the engine thread on another) left
        its traces, and the weights they captured, for a new callable at its address to replay (issue 57,
        docs/mlx_compile_cache_bug.md). Used on one thread only, it is freed with the block or when that thread
        ends (on it, while its cache lives), and its erase reaches every trace it made."""
        local = self.__dict__.get("_compiled")
        if local is None:
            local = self.__dict__["_compiled"] = threading.local()
        seg = getattr(local, "seg", None)
        if seg is None:
            sharded = self.attn.group is not None or getattr(self.ffn, "group", None) is not None
            if sharded or os.environ.get("DSV4_COMPILE", "1") == "0":
                seg = (self.before, self.after)
            else:
                seg = (mx.compile(self.before), mx.compile(self.after))
            local.seg = seg
        return seg

    def reset_compiled(self) -> None:
        """Forget traced segments (they captured the weights), on every thread: call after replacing modules or
        weights."""
        self.__dict__.pop("_compiled", None)
