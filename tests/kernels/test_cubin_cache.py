"""kernels/graph/cubin_cache.py with NVRTC itself (the `test` extra brings it; no GPU needed): a second start loads
what the first built, byte for byte; a corrupt, truncated or foreign entry is rebuilt and rewritten, never loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_serve.kernels.graph import cubin_cache
from dsv4_serve.kernels.graph.cubin_cache import CubinCache
from tests.kernels.nvrtc_here import NEEDS_NVRTC

SRC = 'extern "C" __global__ void k%d(float* y) { y[threadIdx.x] = %d.0f; }'


pytestmark = NEEDS_NVRTC


def _get(cache: CubinCache, i: int) -> tuple[bytes, str]:
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin

    src = SRC % (i, i)
    return cache.get(src, f"k{i}", "sm_90a", lambda: compile_cubin(src, f"k{i}", "sm_90a"))


def _entry(d: Path, i: int) -> Path:
    k = cubin_cache.key(SRC % (i, i), f"k{i}", "sm_90a", cubin_cache.nvrtc_version())
    return d / f"{k.hex()[:40]}.cubin"


def test_a_second_start_loads_what_the_first_built(tmp_path: Path) -> None:
    first = CubinCache(tmp_path)
    built = _get(first, 1)
    assert (first.builds, first.hits) == (1, 0)
    assert built[0][:4] == b"\x7fELF" and built[1] == "k1"
    again = CubinCache(tmp_path)  # a new process's cache over the same directory
    assert _get(again, 1) == built
    assert (again.builds, again.hits) == (0, 1)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty"])
def test_a_bad_entry_is_rebuilt_not_loaded(tmp_path: Path, damage: str) -> None:
    good = _get(CubinCache(tmp_path), 1)
    other = _get(CubinCache(tmp_path), 2)
    path = _entry(tmp_path, 1)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "foreign":  # kernel 2's valid entry under kernel 1's name
        data = bytearray(_entry(tmp_path, 2).read_bytes())
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    cache = CubinCache(tmp_path)
    assert _get(cache, 1) == good != other
    assert (cache.builds, cache.hits, cache.rebuilt) == (1, 0, 1)
    assert cubin_cache.decode(path.read_bytes(), cubin_cache.key(SRC % (1, 1), "k1", "sm_90a",
                                                                 cubin_cache.nvrtc_version())) == good  # rewritten


def test_no_directory_builds_every_time_and_an_unwritable_one_still_serves(tmp_path: Path) -> None:
    off = CubinCache(None)
    assert _get(off, 3) == _get(off, 3)
    assert off.builds == 2
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cache = CubinCache(blocked / "cubins")
    assert _get(cache, 3)[1] == "k3" and cache.builds == 1


def test_has_says_what_get_would_load(tmp_path: Path) -> None:
    cache = CubinCache(tmp_path)
    src = SRC % (3, 3)
    assert not cache.has(src, "k3", "sm_90a")
    _get(cache, 3)
    assert cache.has(src, "k3", "sm_90a") and not cache.has(src, "k3", "sm_80")
    _entry(tmp_path, 3).write_bytes(b"\0" * 64)  # damaged: get would rebuild it
    assert not cache.has(src, "k3", "sm_90a")
    assert not CubinCache(None).has(src, "k3", "sm_90a")


def test_compile_many_gives_what_compile_cubin_gives_one_by_one() -> None:
    from dsv4_serve.kernels.graph.nvrtc import compile_cubin, compile_many

    units = {SRC % (i, i): f"k{i}" for i in range(4, 7)}
    got = compile_many(units, "sm_90a", workers=3)
    assert list(got) == list(units)
    for src, name in units.items():
        assert got[src] == compile_cubin(src, name, "sm_90a")
    assert compile_many({}, "sm_90a") == {}
