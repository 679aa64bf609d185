"""The embedded tiny model (the default without --model, and the tests'): ModelArgs.tiny() with every weight drawn
from a fixed NumPy seed, held as a release checkpoint would be (f32-resident weights in f32), and the tiny
tokenizer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from dsv4_serve.kernels.matmul import weights_as_stored
from dsv4_serve.model.checkpoint import is_f32_resident
from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.deepseek_v4 import DeepseekV4
from dsv4_serve.model.tokenizer import build_tiny_tokenizer


def randomize(model: DeepseekV4, args: ModelArgs, seed: int) -> list[tuple[str, mx.array]]:
    """Every parameter drawn from a fixed NumPy seed, scaled so that activations stay O(1)."""
    rng = np.random.default_rng(seed)
    out = []
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if name.endswith("tid2eid"):  # distinct experts per token
            v = np.argsort(rng.random((shape[0], args.n_routed_experts)), axis=1)[:, : shape[1]]
            out.append((name, mx.array(v.astype(np.int32))))
            continue
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("_scale", "hc_head_scale")):
            v = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(("_base", "attn_sink", "ape")):
            v = 0.5 * rng.standard_normal(shape)
        elif name.endswith("gate.bias"):
            v = 0.1 * rng.standard_normal(shape)
        elif name == "embed.weight":
            v = rng.standard_normal(shape)
        else:  # projections (incl. stacked experts [E, out, in] and hc *_fn): std 1/sqrt(fan_in)
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out.append((name, mx.array(v.astype(np.float32))))
    return out


def tiny_model(seed: int = 0, dtype: mx.Dtype = mx.float32) -> tuple[DeepseekV4, ModelArgs, Tokenizer]:
    """The embedded default: ModelArgs.tiny() with random weights from `seed`, plus the tiny tokenizer."""
    args = ModelArgs.tiny()
    model = DeepseekV4(args)
    weights = randomize(model, args, seed)
    as_stored = weights_as_stored()
    weights = [(n, w if w.dtype == mx.int32 or is_f32_resident(n, as_stored) else w.astype(dtype)) for n, w in weights]
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model, args, build_tiny_tokenizer(args.vocab_size)
