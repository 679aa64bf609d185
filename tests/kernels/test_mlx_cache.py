"""kernels/cuda/mlx_cache.py: MLX's kernel cache entries for our kernels, made where MLX would look for them.

The expected values come from outside the code under test: std::hash from g++ (libstdc++, x86-64) on the same
bytes, the generated source written by hand from MLX 0.32's custom_kernel.cpp build_kernel, the cache path from its
jit_module.cpp get_ptx_path. With NVRTC (the `test` extra) a real kernel's entry is built and written as MLX reads
it; the Noter is driven through a stand-in for MLX's factory (MLX's own makes no kernel without a CUDA GPU)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from dsv4_serve.kernels.cuda import mlx_cache
from dsv4_serve.kernels.cuda.pool_rows import SOURCE as WRITE_ROWS
from tests.kernels.nvrtc_here import NEEDS_NVRTC

# printf("%zx", std::hash<std::string>{}(s)) compiled with g++ 11 (x86-64); the last: 1,000 bytes (i * 7 + 3)
HASHES = [(b"", 0x553E93901E462A6E), (b"a", 0x454DDEE488C1ED6B), (b"abcdefg", 0xDEEE6830A3AF82AF),
          (b"abcdefgh", 0x783DB3E38DB898BB), (b"abcdefghi", 0xB4EC9257851C8AAF),
          (b"custom_kernel_dsv4_write_rows_0123456789_bfloat16_t_512", 0xBC203A9BF681516F),
          (mlx_cache.DEFAULT_HEADER.encode(), 0x12199E8B122A4742),
          (bytes((i * 7 + 3) & 255 for i in range(1000)), 0xA20FC4E610A1CFA1)]  # fmt: skip


@pytest.mark.parametrize(("data", "want"), HASHES)
def test_std_hash_is_libstdcxx(data: bytes, want: int) -> None:
    assert mlx_cache.std_hash(data) == want


def test_the_source_is_mlx_build_kernel_byte_for_byte() -> None:
    template = [("T", mx.bfloat16), ("D", 512), ("ALL", True), ("NO", False)]
    func = mlx_cache.kernel_name("dsv4_k_abc", template)
    assert func == "custom_kernel_dsv4_k_abc_bfloat16_t_512_t_f"
    text = mlx_cache.mlx_source(func, "#define X 1\n", "out[0] = a[a_shape[0] - 1] + b[0];",
                                [("a", mx.float32, 2), ("b", mx.int32, 1), ("s", mx.float32, 0)],
                                [("out", mx.float32), ("tok", mx.int32)], template)  # fmt: skip
    want = (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "#define X 1\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_dsv4_k_abc_bfloat16_t_512_t_f(\n"
        "    const float* a,\n    const __grid_constant__ Shape a_shape,\n"
        "    const int32_t* b,\n    const float* s,\n"
        "    float* out,\n    int32_t* tok) {\n"
        "  using T = __nv_bfloat16;\n  constexpr int D = 512;\n  constexpr bool ALL = true;\n"
        "  constexpr bool NO = false;\n\n"
        "out[0] = a[a_shape[0] - 1] + b[0];\n}\n\n} // namespace mlx::core::cu\n"
    )
    assert text == want
    assert mlx_cache.module_name(func, text) == f"{func}_{mlx_cache.std_hash(want.encode()):x}"
    # no template: no blank line before the body
    bare = mlx_cache.mlx_source("k", "", "x;", [("a", mx.float32, 1)], [("o", mx.float32)], [])
    assert bare.endswith("    float* o) {\nx;\n}\n\n} // namespace mlx::core::cu\n")


def test_long_module_names_become_directories_as_mlx_reads_them(tmp_path: Path) -> None:
    assert mlx_cache.ptx_path(tmp_path, "m" * 245) == tmp_path / ("m" * 245 + ".ptx")
    name = "a" * 245 + "b" * 245 + "c" * 10
    assert mlx_cache.ptx_path(tmp_path, name) == tmp_path / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")
    exact = "a" * 245 + "b" * 245  # the rest is the last 245 characters: the file, not one more directory
    assert mlx_cache.ptx_path(tmp_path, exact) == tmp_path / ("a" * 245) / ("b" * 245 + ".ptx")


def test_the_noter_notes_each_variant_once_while_noting() -> None:
    made: list[dict] = []

    def base(**kw):  # MLX's factory's part the Noter needs: a callable kernel object
        made.append(kw)
        return lambda **call: ("launched", call["grid"])

    noter = mlx_cache.Noter()
    noter.base = base
    k = noter.factory(name="dsv4_w_1", input_names=["x"], output_names=["y"], source="y[0] = x[x_shape[0] - 1];",
                      header="", ensure_row_contiguous=True)  # fmt: skip
    x = mx.zeros((3, 4), mx.float32)
    call = dict(inputs=[x], template=[("N", 4)], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                output_dtypes=[mx.float32])  # fmt: skip
    assert k(**call) == ("launched", (1, 1, 1)) and k(**call) == ("launched", (1, 1, 1))
    assert made[0]["name"] == "dsv4_w_1" and len(noter.variants) == 1
    k(**{**call, "template": [("N", 8)]})
    k(**{**call, "inputs": [x.astype(mx.bfloat16)]})
    assert len(noter.variants) == 3
    ((func, text),) = [v for v in noter.variants.values() if v[0].endswith("_4") and "const float* x" in v[1]]
    assert func == "custom_kernel_dsv4_w_1_4" and "const __grid_constant__ Shape x_shape" in text
    noter.warmed = True  # after the warm-up: a new variant is still noted, and counted as late; a known one is not
    k(**call)
    assert noter.late == 0
    k(**{**call, "template": [("N", 32)]})
    assert len(noter.variants) == 4 and noter.late == 1
    noter.noting = False
    k(**{**call, "template": [("N", 16)]})
    assert len(noter.variants) == 4 and noter.late == 1
    k(**{**call, "inputs": [object()]})  # a launch the noter cannot read still launches (noting back on)


@NEEDS_NVRTC
def test_populate_builds_and_writes_an_entry_mlx_can_load(tmp_path: Path) -> None:
    """write_rows as kernels/cuda/common.py hands it to MLX: built with MLX's signature, our prelude, sm_90a."""
    from dsv4_serve.kernels.cuda.common import HEADER, minify

    noter = mlx_cache.Noter()
    noter.base = lambda **kw: (lambda **call: None)
    k = noter.factory(name="dsv4_write_rows_t", input_names=["pool", "rows", "values", "carry"],
                      output_names=["token"], source=minify(WRITE_ROWS), header=minify(HEADER) + "\n")  # fmt: skip
    k(inputs=[mx.zeros((2, 64, 512), mx.bfloat16), mx.zeros((3,), mx.int32), mx.zeros((3, 512), mx.bfloat16),
              mx.zeros((5,), mx.int32)], template=[("T", mx.bfloat16), ("D", 512)], grid=(256, 1, 1),
      threadgroup=(256, 1, 1), output_shapes=[(5,)], output_dtypes=[mx.int32])  # fmt: skip
    assert noter.populate(tmp_path, "sm_90a") == (1, 0)
    ((module, (func, _)),) = noter.variants.items()
    ptx = mlx_cache.ptx_path(tmp_path, module)
    assert ptx.read_bytes()[:4] == b"\x7fELF"  # a cubin: what MLX stores for a device NVRTC targets in SASS
    name, lowered = ptx.with_suffix(".txt").read_text().rstrip("\n").split("\t")
    assert name == f"mlx::core::cu::{func}" and lowered.startswith("_ZN3mlx4core2cu") and func in lowered
    assert noter.populate(tmp_path, "sm_90a") == (0, 0)  # there already: nothing built again


def test_the_noter_goes_in_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for where MLX has no CUDA GPU (this machine, CI): nothing replaces `mx.fast.cuda_kernel`."""
    from dsv4_serve.kernels import backend
    from dsv4_serve.service.engine.warmup import install_kernel_noter

    monkeypatch.setenv("DSV4_KERNEL_CACHE", "1")
    factory = mx.fast.cuda_kernel
    if backend.name() == "cuda":
        pytest.skip("a CUDA machine: the noter goes in there")
    assert install_kernel_noter() is None and mx.fast.cuda_kernel is factory


@pytest.mark.parametrize(("value", "mode"), [(None, "1"), ("", "1"), ("1", "1"), ("watch", "watch"), ("0", "0")])
def test_the_kernel_cache_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                                   mode: str) -> None:  # fmt: skip
    """DSV4_KERNEL_CACHE: on by default (a warm restart's warm-up 120.6 -> 1.3 s on an H100, the tokens equal to a
    cold server's: docs/cuda_graphs.md#start-up); anything but its three values stops the start."""
    from dsv4_serve.service.engine.warmup import kernel_cache_mode

    if value is None:
        monkeypatch.delenv("DSV4_KERNEL_CACHE", raising=False)
    else:
        monkeypatch.setenv("DSV4_KERNEL_CACHE", value)
    assert kernel_cache_mode() == mode
    monkeypatch.setenv("DSV4_KERNEL_CACHE", "yes")
    with pytest.raises(ValueError, match="DSV4_KERNEL_CACHE must be one of"):
        kernel_cache_mode()


@pytest.mark.parametrize(("mode", "noting"), [("1", False), ("watch", True)])
def test_after_the_warm_up_the_noter_notes_only_when_watching(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                               noting: bool) -> None:  # fmt: skip
    """Making a variant's key costs ~1-4 us of Python a launch (a decode step through MLX launches ~1,100): after the
    warm-up only `watch` keeps noting; the cache is filled from what the warm-up noted either way."""
    from dsv4_serve.service.engine import warmup

    monkeypatch.setenv("DSV4_KERNEL_CACHE", mode)
    monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": 9, "compute_capability_minor": 0})
    filled: list[str] = []
    noter = mlx_cache.Noter()
    monkeypatch.setattr(noter, "populate", lambda cache, arch: (filled.append(arch), (0, 0))[1])
    warmup.fill_kernel_cache(noter).join(10)
    assert noter.warmed and noter.noting is noting and filled == ["sm_90a"]
