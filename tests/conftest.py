"""Test-wide setup.

MLX's CUDA backend runs float32 matmuls as TF32 by default (`MLX_ENABLE_TF32`); the float32 tests
(tiny model, decode vs prefill vs transformers) check f32 exactness to 1e-5, which TF32's 10-bit
mantissa cannot meet. MLX reads the variable once, at its first matmul: set it before any test runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")
