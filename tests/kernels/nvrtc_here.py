"""Whether NVRTC and the CUDA headers are here (the `test` extra brings them; no GPU needed): the skip of the tests
that build kernels with kernels/graph/nvrtc.py."""

from __future__ import annotations

import pytest


def missing() -> str | None:
    """None where NVRTC can build here, else why not."""
    try:
        from dsv4_serve.kernels.graph import cubin_cache
        from dsv4_serve.kernels.graph.nvrtc import include_dirs

        include_dirs()
        cubin_cache.nvrtc_version()
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        return f"no NVRTC here: {type(e).__name__}: {e}"
    return None


WHY = missing()
NEEDS_NVRTC = pytest.mark.skipif(WHY is not None, reason=str(WHY))
