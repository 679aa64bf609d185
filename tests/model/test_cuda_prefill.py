"""The parallel prefill's CUDA path end to end (the tile GEMMs of the experts and the f32 products, prefill's
attention as decode's kernel rows, the host-made indices) against token-by-token decode's CUDA path, on the GPU,
at V4-Flash dims and release precision (4 layers: sliding, CSA, HCA, CSA; 8 routed experts).

The two paths round in different places (a product of many rows is a cuBLAS or tile GEMM, of one row a skinny
kernel), so they agree within bf16 tolerance, not bit for bit: the last token's logits and every state pool the
request owns (window ring, compressed entries, indexer keys), relative error <= TOL of each's scale and cosine
>= 0.999. The tiny model's CPU tests (tests/model/test_prefill.py) hold the same comparison to 1e-5 in f32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend
from dsv4_serve.model.state import StatePools

TOL = 5e-2
LEN = 300  # past HCA's first window (128) and CSA's 75 entries, all within the indexer's top-k


def owned(pools: StatePools, h, args, n_tokens: int) -> dict[str, np.ndarray]:
    """The request's window ring, and the compressed entries and indexer keys it has emitted, in f32."""
    out = {f"window{i}": np.array(w[h.slot].astype(mx.float32)) for i, w in enumerate(pools.window)}
    for name in ("ckv", "ikeys"):
        for layer, arr in getattr(pools, name).items():
            r = args.compress_ratios[layer]
            rows = np.concatenate([np.array(arr[p].astype(mx.float32)) for p in h.tables[r]])
            out[f"{name}{layer}"] = rows[: n_tokens // r]
    return out


def agree(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape and np.isfinite(got).all(), what
    scale = np.abs(want).max() + 1e-6
    assert np.abs(got - want).max() <= TOL * scale, (what, float(np.abs(got - want).max() / scale))
    cos = (got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want) + 1e-30)
    assert cos >= 0.999, (what, float(cos))


def compare_prefill_to_decode(model, args, dtype: mx.Dtype, page: int, chunks: list[list[int]],
                              head: bool = True) -> None:  # fmt: skip
    """Each chunking of a LEN-token prompt against the prompt decoded token by token. `head=False`: the chunks'
    forwards without a head, as the engine runs them (nothing reads the last layer's output), the state alone."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, args.vocab_size, LEN)]
    pools = StatePools(args, max_slots=2, max_positions=LEN + 8, page_size=page, dtype=dtype)
    ref = pools.alloc(LEN + 8)
    for i, t in enumerate(prompt):
        last = model.decode(pools, [ref], [t], [i])[0]
    want_logits, want = np.array(last), owned(pools, ref, args, LEN)
    for sizes in chunks:
        h, start = pools.alloc(LEN + 8), 0
        for c in sizes:
            if head:
                got_logits = model.prefill(pools, h, prompt[start : start + c], start, chunk=c)
            else:
                assert model.prefill_batch(pools, [(h, prompt[start : start + c], start)], logits=False) is None
            start += c
        if head:
            agree(np.array(got_logits), want_logits, f"logits {sizes}")
        for k, v in owned(pools, h, args, LEN).items():
            agree(v, want[k], f"{k} {sizes}")
        pools.free(h)


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
def test_cuda_prefill_leaves_decodes_logits_and_state() -> None:
    from bench.step import flash_args, random_model

    args = flash_args(4, 8)
    compare_prefill_to_decode(random_model(args), args, mx.bfloat16, 256, [[LEN], [100, 200], [37, 263]])


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_prefill_without_a_head_writes_the_last_layer(monkeypatch, inplace: bool) -> None:
    """The engine's forwards have no head, so nothing reads the last layer's output; its writes (entries, indexer
    keys, and in place the ring and compressor rows) ran on CUDA only through tokens that hung on that output, and
    never ran (2026-12-07). The last layer here is CSA: its entries and keys are compared."""
    from bench.step import flash_args, random_model
    from dsv4_serve.model import prefill_compress

    monkeypatch.setattr(prefill_compress, "STATE_INPLACE", inplace)
    args = flash_args(4, 8)
    compare_prefill_to_decode(random_model(args), args, mx.bfloat16, 256, [[LEN], [100, 200]], head=False)


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
def test_cuda_prefill_with_the_slot_rows_written_in_place(monkeypatch) -> None:
    """DSV4_PREFILL_STATE_INPLACE: the rings' and compressors' slot rows written in place (`write_rows`); a second
    chunk reads the ring the first left, so a ring written before the attention that reads the old one would
    not agree here."""
    from bench.step import flash_args, random_model
    from dsv4_serve.model import prefill_compress

    monkeypatch.setattr(prefill_compress, "STATE_INPLACE", True)
    args = flash_args(4, 8)
    compare_prefill_to_decode(random_model(args), args, mx.bfloat16, 256, [[100, 200], [37, 263]])


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cuda_available(), reason="needs an MLX CUDA GPU")
def test_cuda_prefill_with_the_pooling_kernel(monkeypatch) -> None:
    """DSV4_POOLED_KERNEL: the compressors' pooling in one launch (kernels/cuda/pooled.py) leaves decoding's state."""
    from bench.step import flash_args, random_model
    monkeypatch.setenv("DSV4_POOLED_KERNEL", "1")
    args = flash_args(4, 8)
    compare_prefill_to_decode(random_model(args), args, mx.bfloat16, 256, [[LEN], [100, 200], [37, 263]])
