"""NVRTC's cubins on disk, so a warm restart captures the step's graphs without building a kernel again.

A V4-Flash step needs ~36 distinct kernels; NVRTC builds them in ~55 s (H100, 2026-12-06), which every start
paid. An entry is keyed by what decides the cubin: the translation unit's text, the kernel's C++ name, the
architecture and NVRTC's version (a new NVRTC may emit other code). Its file holds a magic, the key's digest, the
lowered name, the cubin and a SHA-256 of all of it: an entry that is truncated, corrupt or written for another
key is rebuilt (and rewritten), never loaded. Writes go to a temporary file renamed into place, so a reader
never sees half an entry and two processes may share a directory.

Default directory: `$XDG_CACHE_HOME/dsv4-serve/cubins` (`~/.cache/...`); `serve --graph-cache-dir` (env
`DSV4_GRAPH_CACHE_DIR`) picks another, and an empty value turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("dsv4.graph")

MAGIC = b"DSV4CUBIN1\n"
_HEAD = struct.Struct("<32sII")  # key digest, lowered name bytes, cubin bytes


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4-serve" / "cubins"


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion: {err}")
    return f"{major}.{minor}"


def key(source: str, name: str, arch: str, version: str) -> bytes:
    """The entry's key: SHA-256 over everything that decides the cubin."""
    h = hashlib.sha256()
    for part in (source, name, arch, version):
        h.update(part.encode())
        h.update(b"\0")
    return h.digest()


def encode(k: bytes, lowered: str, cubin: bytes) -> bytes:
    body = MAGIC + _HEAD.pack(k, len(lowered.encode()), len(cubin)) + lowered.encode() + cubin
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, k: bytes) -> tuple[bytes, str] | None:
    """(cubin, lowered name) of an entry written for key `k`; None for anything else (corrupt, truncated,
    another key's)."""
    if len(data) < len(MAGIC) + _HEAD.size + 32 or not data.startswith(MAGIC):
        return None
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        return None
    got, n_name, n_cubin = _HEAD.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _HEAD.size
    if got != k or len(body) != start + n_name + n_cubin:
        return None
    return bytes(body[start + n_name :]), body[start : start + n_name].decode()


class CubinCache:
    """`get(source, name, arch, build)`: the entry's (cubin, lowered name), or `build`'s, stored."""

    def __init__(self, directory: Path | None) -> None:
        self.dir = directory
        self.hits = self.builds = self.rebuilt = 0
        self._version: str | None = None

    def _entry(self, source: str, name: str, arch: str) -> tuple[bytes, Path]:
        """The kernel's key and its file (the cache has a directory)."""
        if self._version is None:
            self._version = nvrtc_version()
        k = key(source, name, arch, self._version)
        return k, self.dir / f"{k.hex()[:40]}.cubin"  # type: ignore[operator]

    def has(self, source: str, name: str, arch: str) -> bool:
        """A valid entry for this kernel is on disk (read and checked as `get` would)."""
        if self.dir is None:
            return False
        k, path = self._entry(source, name, arch)
        try:
            return decode(path.read_bytes(), k) is not None
        except OSError:
            return False

    def get(self, source: str, name: str, arch: str,
            build: Callable[[], tuple[bytes, str]]) -> tuple[bytes, str]:  # fmt: skip
        if self.dir is None:
            self.builds += 1
            return build()
        k, path = self._entry(source, name, arch)
        try:
            data = path.read_bytes()
        except OSError:
            data = None
        if data is not None:
            found = decode(data, k)
            if found is not None:
                self.hits += 1
                return found
            self.rebuilt += 1
            log.warning("cubin cache: %s is not a valid entry for this kernel; rebuilding it", path)
        self.builds += 1
        cubin, lowered = build()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(encode(k, lowered, cubin))
            os.replace(tmp, path)
        except OSError as e:  # a read-only or full disk costs the next start its builds, nothing else
            log.warning("cubin cache: could not write %s: %s", path, e)
        return cubin, lowered
