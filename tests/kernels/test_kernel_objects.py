"""kernels/cuda/common.py `kernel`: one `mx.fast.cuda_kernel` object per kernel text, found again by its texts
without a digest, and made again (through whatever stands in for the factory then) once `_kernels` is cleared, as
the graphs' recorder and the kernel cache's noter need. The factory is a stand-in that counts its calls (MLX's
own makes no kernel object without a CUDA GPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.kernels.cuda import common

SOURCE = "out[0] = x[0];\n" * 200  # ~3 KB, as the kernels' sources are


@pytest.fixture
def factory(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    made: list[dict] = []

    def make(**kw: object) -> object:
        made.append(kw)
        return object()

    monkeypatch.setattr(mx.fast, "cuda_kernel", make)
    monkeypatch.setattr(common, "_kernels", {})
    monkeypatch.setattr(common, "_by_text", {})
    return made


def test_the_same_texts_give_the_same_object_made_once(factory: list[dict]) -> None:
    a = common.kernel("t", ("x",), ("out",), SOURCE)
    b = common.kernel("t", ("x",), ("out",), "".join(SOURCE))  # equal text, another string object
    assert a is b and len(factory) == 1
    assert factory[0]["name"].startswith("dsv4_t_") and factory[0]["shared_memory"] == 0


def test_other_texts_or_shared_memory_give_other_objects(factory: list[dict]) -> None:
    a = common.kernel("t", ("x",), ("out",), SOURCE)
    assert common.kernel("t", ("x",), ("out",), SOURCE + "out[1] = 0;") is not a
    assert common.kernel("t", ("x",), ("out",), SOURCE, 1024) is not a
    assert common.kernel("t", ("x",), ("out",), SOURCE, header="#define Y 1") is not a
    assert len(factory) == 4


def test_a_cleared_cache_makes_the_kernel_again(factory: list[dict]) -> None:
    a = common.kernel("t", ("x",), ("out",), SOURCE)
    common.forget_kernels()
    b = common.kernel("t", ("x",), ("out",), SOURCE)
    common._kernels.clear()  # as the recorder's tests clear it
    c = common.kernel("t", ("x",), ("out",), SOURCE)
    assert len({id(a), id(b), id(c)}) == 3 and len(factory) == 3
