"""Repro of the compiled chain43 reference failing in mx.compile (`IndexError: _Map_base::at`, thrown in
`mlx::core::detail::compile_replace`: a traced array's input missing from the replay map; gdb `catch throw`),
MLX 0.32.4, CPU. Prints ok / fail per variant: the fail needs two CSA layers, the reference compressor and a read of
the pool it wrote; a stub attention that reads the main pool makes it pass again.

    python bench/repro_chain43_compile.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench import cases  # noqa: E402

ORIG = dict(cases.REF)


def run(label: str, kinds: list[int], **ops) -> None:
    cases.REF.clear()
    cases.REF.update(ORIG | ops)
    try:
        mx.eval(cases.chain43(2, 1024, kinds=kinds).ref_c())
        print(f"ok    {label}")
    except Exception as e:  # noqa: BLE001 - the repro reports it
        print(f"fail  {label}: {type(e).__name__}: {e}")
    finally:
        cases.REF.clear()
        cases.REF.update(ORIG)


def keys_read_only(batch, q, weights, keys, topk, after=None):
    return (keys.reshape(-1)[:topk].astype(mx.int32) * 0)[None, :] + mx.zeros((q.shape[0], 1), mx.int32)


def attn_stub(batch, q, win, pool, ind, sinks, scale, ratio=0, after=None):
    return q + (0 if ind is None else ind.sum().astype(q.dtype))


def attn_stub_reads_pool(batch, q, win, pool, ind, sinks, scale, ratio=0, after=None):
    return q + (0 if pool is None else pool.reshape(-1)[:1].sum().astype(q.dtype))


def no_compressor(batch, kv, sc, ape, norm, ks, ss, pool, **kw):
    return ks, ss, pool, None


if __name__ == "__main__":
    run("one CSA layer", [4])
    run("CSA + HCA", [4, 128])
    run("two CSA layers", [4, 4])
    run("two CSA layers, no compressor", [4, 4], compressor_rows=no_compressor)
    run("two CSA layers, stub attention, indexer reads keys only", [4, 4], indexer_rows=keys_read_only,
        sparse_attention_rows=attn_stub)  # fmt: skip
    run("two CSA layers, stub attention reading the pool, indexer reads keys only", [4, 4],
        indexer_rows=keys_read_only, sparse_attention_rows=attn_stub_reads_pool)  # fmt: skip
