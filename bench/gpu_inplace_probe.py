"""Probe (GPU): do decode steps update the state pools in place on MLX CUDA, synced and pipelined?

Part A runs the model loop of tests/service/test_pipeline.py (tiny model, pools large enough for a copy
to show) three ways and prints each one's peak memory above the start against the largest pool array:
`sync` (tokens read back every step), `sync+synchronize` (and mx.synchronize() after the read-back) and
`pipelined` (step i + 1 queued before step i is read). MLX CUDA keeps every node input alive until its
command buffer completes, so a pool that step i still reads cannot be donated to step i + 1's scatter.

Part B: a kernel that writes rows into its *input* pool (const_cast) and outputs a 1-element token,
and a reader that takes the token as an input (the CUDA-graph edge): written values are read back in
the same step over a pipelined loop, and the peak memory shows no pool copy.

    PYTHONPATH=/tmp/mlxsite:$PWD python3 bench/gpu_inplace_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def part_a() -> None:
    from model.config import ModelArgs
    from model.deepseek_v4 import DeepseekV4
    from model.state import StatePools

    a = ModelArgs.tiny()
    model = DeepseekV4(a)
    mx.eval(model.parameters())
    got = {}
    for arm in ("sync", "sync+synchronize", "pipelined", "sync"):
        pools = StatePools(a, max_slots=8, max_positions=240_000, page_size=64, dtype=mx.float32)
        handles = [pools.alloc(50_000) for _ in range(2)]
        mx.eval(pools.arrays())
        largest = sorted(x.nbytes for x in pools.arrays())[-4]
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        tok, pending, out = mx.array([5, 9], dtype=mx.int32), None, []
        piped = arm == "pipelined"
        for i in range(7 if piped else 6):
            if i < 6:
                logits = model.step(model.make_batch(pools, handles, [3 + i, 3 + i]), tok, pools)
                tok = mx.argmax(logits, axis=-1).astype(mx.int32)
                mx.async_eval(tok, pools.arrays())
            done, pending = (pending, tok) if piped else (tok, None)
            if done is not None:
                out.append(done.tolist())
                if arm == "sync+synchronize":
                    mx.synchronize()
        got[arm] = out
        print(f"A {arm:18s} peak above start {(mx.get_peak_memory() - base) / 2**20:8.1f} MiB, 4th largest pool "
              f"{largest / 2**20:7.1f} MiB", flush=True)  # fmt: skip
        del pools, handles
    print("A tokens equal:", all(v == got["sync"] for v in got.values()))


WRITE = r"""
  // write rows in place into the input pool (MLX does not know): one block per row
  T* p = const_cast<T*>(pool);
  const int b = blockIdx.x, D = pool_shape[1];
  for (int d = threadIdx.x; d < D; d += blockDim.x) p[(size_t)dest[b] * D + d] = rows[(size_t)b * D + d];
  if (b == 0 && threadIdx.x == 0) token[0] = dest[0];
"""
READ = r"""
  const int b = blockIdx.x, D = pool_shape[1];
  const T zero = (T)0 * (T)token[0];  // reads the token: the CUDA-graph edge from the writer
  for (int d = threadIdx.x; d < D; d += blockDim.x) out[(size_t)b * D + d] = pool[(size_t)dest[b] * D + d] + zero;
"""


def part_b() -> None:
    n, d, b = 1 << 18, 256, 8  # a 256 MiB f32 pool
    w = mx.fast.cuda_kernel("probe_write_inplace", ["pool", "dest", "rows"], ["token"], WRITE)
    r = mx.fast.cuda_kernel("probe_read_after", ["pool", "dest", "token"], ["out"], READ)

    def write(pool: mx.array, dest: mx.array, rows: mx.array) -> mx.array:
        return w(inputs=[pool, dest, rows], template=[("T", mx.float32)], grid=(b * 128, 1, 1), threadgroup=(128, 1, 1),
                 output_shapes=[(1,)], output_dtypes=[mx.int32])[0]  # fmt: skip

    def read(pool: mx.array, dest: mx.array, token: mx.array) -> mx.array:
        return r(inputs=[pool, dest, token], template=[("T", mx.float32)], grid=(b * 128, 1, 1),
                 threadgroup=(128, 1, 1), output_shapes=[(b, d)], output_dtypes=[mx.float32])[0]  # fmt: skip

    for compiled in (False, True):
        fw, fr = (mx.compile(write), mx.compile(read)) if compiled else (write, read)
        pool = mx.zeros((n, d))
        mx.eval(pool)
        rng = np.random.default_rng(0)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        bad, pending, prev = 0, None, mx.zeros((b, d))
        for _ in range(40):
            dest = mx.array(rng.choice(n, b, replace=False).astype(np.int32))
            # rows depend on the previous step's read (a chain, as the real step's data)
            rows = prev + mx.array(rng.standard_normal((b, d)).astype(np.float32))
            tok = fw(pool, dest, rows)
            got = fr(pool, dest, tok)
            mx.async_eval(got)
            if pending is not None:
                want_p, got_p = pending
                bad += int(not mx.array_equal(want_p, got_p).item())
            pending, prev = (rows, got), got
        bad += int(not mx.array_equal(*pending).item())
        peak = (mx.get_peak_memory() - base) / 2**20
        written = float(mx.abs(pool).sum()) > 0
        print(f"B compiled={compiled}: mismatched steps {bad} / 40, pool written {written}, peak above start "
              f"{peak:.1f} MiB (pool {n * d * 4 / 2**20:.0f} MiB)", flush=True)  # fmt: skip


if __name__ == "__main__":
    print(mx.__version__, mx.default_device())
    part_b()
    part_a()
