"""Process-global caches of arrays serve every thread (issue 57, docs/engine.md#process-global-state): an array
MLX has not evaluated belongs to the stream of the thread that built it, and another thread's eval of it raises
"There is no Stream(cpu, 0) in current thread"."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from dsv4_serve.service.engine import sampler


def test_the_grammar_masks_bit_tables_built_on_one_thread_serve_another() -> None:
    v = 77  # a vocabulary size no other test uses: the tables are built here
    sampler._bit_cache.pop(v, None)
    masks = np.zeros((1, (v + 31) // 32), dtype=np.int32)
    masks[0, 0] = 0b1010  # tokens 1 and 3 allowed
    t = threading.Thread(target=lambda: sampler.apply_masks(mx.zeros((1, v)), masks))  # built, never evaluated
    t.start()
    t.join()
    out = np.array(sampler.apply_masks(mx.arange(v, dtype=mx.float32)[None], masks))
    want = np.full((1, v), -np.inf, dtype=np.float32)
    want[0, [1, 3]] = [1.0, 3.0]
    assert np.array_equal(out, want)
