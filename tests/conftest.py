"""Test-wide setup.

MLX's CUDA backend runs float32 matmuls as TF32 by default (`MLX_ENABLE_TF32`); the float32 tests
(tiny model, decode vs prefill vs transformers) check f32 exactness to 1e-5, which TF32's 10-bit
mantissa cannot meet. MLX reads the variable once, at its first matmul: set it before any test runs.

pytest (and `python -m`) put the checkout's root on sys.path (for `tests.*`), where its folders `kernels/`,
`model/` and `service/` (the project imports them as `dsv4_serve.*`) would answer a top-level import of those
names: transformers imports PyPI's `kernels`. `_Installed` makes such an import find only what is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import zlib
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

os.environ.setdefault("MLX_ENABLE_TF32", "0")

_ROOT = Path(__file__).resolve().parents[1]


class _Installed(importlib.abc.MetaPathFinder):
    """`kernels`, `model`, `service` from sys.path without the checkout's root (ModuleNotFoundError if none)."""

    NAMES = ("kernels", "model", "service")

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname not in self.NAMES:
            return None
        elsewhere = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
        spec = importlib.machinery.PathFinder.find_spec(fullname, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {fullname!r} (the project's is dsv4_serve.{fullname})")
        return spec


sys.meta_path.insert(0, _Installed())


@pytest.fixture(autouse=True)
def _mx_random_per_test(request: pytest.FixtureRequest) -> None:
    """Each test draws its `mx.random` data from a seed of its own id: the same inputs whichever tests ran
    before it (an earlier test's draws or seed used to change them, which made an order-dependent GPU failure
    hard to tell from a real one; 91fa5b0)."""
    import mlx.core as mx

    mx.random.seed(zlib.crc32(request.node.nodeid.encode()))


_ONE_BYTE = [bytes([i]) for i in range(256)]  # CPython's shared one-byte bytes objects


@pytest.fixture(autouse=True, scope="module")
def _shared_bytes_intact(request: pytest.FixtureRequest):
    """Native code that writes into a Python bytes buffer it was handed (NVRTC's log into `b" " * 1`) changes
    CPython's shared one-byte objects for the whole process, and tests far away fail (7c5b83a): name the module
    that did it instead."""
    yield
    bad = [i for i, b in enumerate(_ONE_BYTE) if b[0] != i]
    assert not bad, f"{request.node.nodeid} changed CPython's shared one-byte bytes objects {bad} (b' ' is {b' '!r})"
