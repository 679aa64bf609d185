"""The byte floor both benches divide by: a plain copy's bandwidth, measured in the same run.

On a CUDA device the copy is a 16-byte-per-thread kernel (`mx.fast.cuda_kernel`): MLX's own `x + 0`
reads about half of it on the H200 (1.84 against 3.80 TB/s in one session), which would understate
every `x floor` ratio. Elsewhere (the CPU in CI) it is `x + 0`. Each timed eval carries MLX's eval
cost (~50 us on the H200's host), so the copy is 2 GiB: that cost is then ~2% of it (512 MB read
2.97 TB/s where bench/kernels.py's 2 GiB read 3.54 in the same session).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx

COPY = r"""
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_shape[0]) reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(x)[i];
"""
_kernel: Any = None


def copy_kernel() -> Any:
    """The copy kernel (inputs `x`, `n`: its shape[0] is the number of 16-byte words to copy)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="bench_copy16", input_names=["x", "n"], output_names=["out"], source=COPY)
    return _kernel


def on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device().type == mx.gpu)


def copy_bandwidth(nbytes: int = 1 << 31, reps: int = 10) -> float:
    """Bytes per second (read + write) of a copy of `nbytes`, the median of `reps` evals."""
    words = nbytes // 16
    x = mx.random.randint(0, 1 << 30, (words * 4,), dtype=mx.int32)
    if on_cuda():
        n = mx.zeros((words,), mx.int32)
        k = copy_kernel()

        def run() -> mx.array:
            return k(inputs=[x, n], grid=(words, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                     output_dtypes=[x.dtype])[0]  # fmt: skip

        mx.eval(x, n)
    else:

        def run() -> mx.array:
            return x + 0

        mx.eval(x)
    mx.eval(run())  # compile / warm
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(run())
        ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(ts)
