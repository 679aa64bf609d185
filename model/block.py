"""A decoder block: attention and MoE, each between its mHC unit's pre-mix (+ norm) and post-mix.

The main model's layers (model/deepseek_v4.py) and the MTP block (model/mtp.py) are this class.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from dsv4_serve.model.attention import Attention
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.layers import MoE, RMSNorm, hc_post, hc_pre_norm, step_angles

# MLX keys a compiled function's traces by the address of its Python callable, in a cache per thread, and a freed
# compiled function erases its traces from the last calling thread's cache only: a callable later made at the same
# address replays another thread's stale trace, with the weights that trace captured (issue 57,
# docs/mlx_compile_cache_bug.md). So the segments go through one compiled function made once and never freed, whose
# traces take the block's weights as inputs (nothing captured) and are told apart by a serial per block and reset.
_serials = itertools.count(1)
_live: dict[int, weakref.ref[Block]] = {}


def _segment(serial: int, part: str, weights: Sequence[mx.array], *xs: mx.array) -> tuple[mx.array, ...] | mx.array:
    """Traced only: the block `serial`'s `part` ("before" / "after") with `weights` (its parameters, tracers here)
    put in place of its own for the call."""
    block = _live[serial]()
    assert block is not None, f"the block of compiled segment {serial} is gone"
    return block.traced(weights, getattr(block, part), xs)


_SEGMENT = mx.compile(_segment)


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

    def _segments(self) -> tuple[Callable[..., tuple[mx.array, ...]], Callable[..., mx.array]]:
        """The pure parts around the kernels, compiled: a layer is then ~2 fused graphs + its kernel calls
        instead of ~150 separately dispatched ops (host-bound at <= 8 rows). Traced once per batch size, through
        `_SEGMENT` with this block's serial and its parameters as inputs. Not compiled when sharded (all_sum
        inside) or with DSV4_COMPILE=0."""
        seg = self.__dict__.get("_compiled")
        if seg is None:
            sharded = self.attn.group is not None or getattr(self.ffn, "group", None) is not None
            if sharded or os.environ.get("DSV4_COMPILE", "1") == "0":
                seg = (self.before, self.after)
            else:
                serial = next(_serials)
                _live[serial] = weakref.ref(self, lambda _, s=serial: _live.pop(s, None))
                names, weights = zip(*tree_flatten(self.parameters()), strict=True)
                self.__dict__["_weights"] = (names, list(weights))
                seg = (partial(_SEGMENT, serial, "before", list(weights)),
                       partial(_SEGMENT, serial, "after", list(weights)))  # fmt: skip
            self.__dict__["_compiled"] = seg
        return seg

    def traced(self, weights: Sequence[mx.array], fn: Callable[..., object], xs: Sequence[mx.array]) -> object:
        """fn(*xs) with `weights` (tracers, in `tree_flatten(self.parameters())` order) as the parameters: a
        trace reads its weights as inputs, so it holds none and another block's weights never reach it."""
        names, own = self.__dict__["_weights"]
        self.update(tree_unflatten(list(zip(names, weights, strict=True))))
        try:
            return fn(*xs)
        finally:
            self.update(tree_unflatten(list(zip(names, own, strict=True))))

    def reset_compiled(self) -> None:
        """Forget traced segments (a new serial: the next call traces again, with the parameters as they are then):
        call after replacing modules or weights."""
        self.__dict__.pop("_compiled", None)
        self.__dict__.pop("_weights", None)
