"""Each kernel's device code in a content-addressed include file, so that MLX hashes a short stub per launch.

MLX's CUDA `CustomKernel::eval_gpu` hashes the whole kernel source, header included, on every launch to
build its module-cache key. That costs about 0.2 us per KB on the H200's host
(bench/results/host-cost-h200.md). The 43-layer step launches about 1.5 MB of source per step, so about
0.3 ms of host time per step.

So the header and the body go to a file named by the code's digest. The body is written as an
object-like macro, and it expands where MLX declares the kernel's arguments and template constants.
MLX then gets one `#include "<absolute path>"` line as the header and the macro's name as the source.
NVRTC opens an absolute include path directly.

MLX passes an input's `_shape` / `_strides` / `_ndim` only when the source names them. The stub's
comment names the ones the body uses.

`DSV4_CUDA_INCLUDE=0` keeps the code inline. `DSV4_CUDA_INCLUDE_DIR` sets the folder; the default is
`$XDG_CACHE_HOME/dsv4-serve/cuda`. A folder that cannot be written also keeps the code inline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

ENABLED = os.environ.get("DSV4_CUDA_INCLUDE", "1").strip() not in ("0", "")
SUFFIXES = ("_shape", "_strides", "_ndim")  # what MLX's custom_kernel.cpp looks for in the source, per input


def folder() -> Path:
    d = os.environ.get("DSV4_CUDA_INCLUDE_DIR", "").strip()
    if d:
        return Path(d).expanduser().absolute()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.expanduser("~/.cache")
    return Path(cache, "dsv4-serve", "cuda").absolute()


def strip_comment(line: str) -> str:
    """`line` without a trailing `//` comment outside string and character literals."""
    quote = ""
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif line.startswith("//", i):
            return line[:i].rstrip()
        i += 1
    return line


def macro(name: str, body: str) -> str | None:
    """`#define name` + `body` (minified: one statement per line) joined by line splices; `#pragma X`
    lines become `_Pragma("X")`. None if the body has another preprocessor line."""
    lines = []
    for raw in body.splitlines():
        line = strip_comment(raw)  # a `//` would swallow the spliced lines after it
        if line.startswith("#"):
            if not line.startswith("#pragma ") or '"' in line:
                return None
            line = f'_Pragma("{line[len("#pragma "):]}")'
        if line:
            lines.append(line)
    return f"#define {name} \\\n" + " \\\n".join(lines) + "\n"


def uses(inputs: Sequence[str], body: str) -> list[str]:
    """The `<input><suffix>` names MLX would find in `body` (a substring search, as MLX does it)."""
    return [n + s for n in inputs for s in SUFFIXES if n + s in body]


def write(path: Path, text: str) -> None:
    """`text` at `path`, atomically (another process may write the same file at the same time)."""
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def split(kname: str, inputs: Sequence[str], header: str, body: str) -> tuple[str, str] | None:
    """(header, source) for MLX: `#include` of a file that holds `header` and `body` as a macro, and the
    macro's name. `kname` names the code (it carries its digest). None: keep the code inline."""
    if not ENABLED:
        return None
    name = f"DSV4_BODY_{kname}"
    m = macro(name, body)
    path = folder() / f"{kname}.cuh"
    if m is None or any(c in str(path) for c in "\"\\\n"):
        return None
    try:
        write(path, header.rstrip("\n") + "\n" + m)
    except OSError:
        return None
    names = uses(inputs, body)
    return f'#include "{path}"\n', name + (f" /* {' '.join(names)} */" if names else "")
