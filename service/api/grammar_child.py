"""The grammar compile process that grammar_pool.py starts and kills: it reads a tokenizer description, then
compiles one structural-tag format at a time and answers with the compiled grammar serialized. Run as a
script (`python grammar_child.py`): it imports only xgrammar and the standard library, so it starts fast and
holds no model. Frames on stdin / stdout: a 4-byte big-endian length, then the bytes.

Bounded (issue 63: one 126 KB schema drove an unbounded child to 2.3 GB RSS in 10 s): once xgrammar is in, its
address space may grow by `memory` bytes more (RLIMIT_AS: a compile past it fails with MemoryError, answered
"m", and the process exits so the next compile starts clean), and each compile gets `cpu` seconds of CPU time
(RLIMIT_CPU's soft limit moved before each: past it the kernel ends the process, should the server's
wall-clock kill not come).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
from typing import IO

HEADER = struct.Struct(">I")


def read_frame(f: IO[bytes]) -> bytes | None:
    """One frame, or None at the end of the input (the server went away)."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    data = f.read(n)
    return data if len(data) == n else None


def write_frame(f: IO[bytes], data: bytes) -> None:
    f.write(HEADER.pack(len(data)) + data)
    f.flush()


def vm_size() -> int:
    """This process's address space in bytes (VmSize), what RLIMIT_AS bounds."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def limit_cpu(seconds: float) -> None:
    """The soft CPU-time limit `seconds` past what this process has used so far (the hard one stays)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used.ru_utime + used.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")  # the answers; whatever a library prints goes to stderr
    os.dup2(2, 1)
    os.nice(10)  # on a busy CPU the engine's threads come first
    import xgrammar as xgr

    inp = sys.stdin.buffer
    head = read_frame(inp)
    if head is None:
        return
    cfg = json.loads(head)
    info = xgr.TokenizerInfo.deserialize_json(cfg["info"])
    compiler = xgr.GrammarCompiler(info, max_threads=int(cfg["threads"]), cache_enabled=False)  # the server caches
    limit = vm_size() + int(cfg["memory"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    write_frame(out, b"ready" + str(limit).encode())
    while (req := read_frame(inp)) is not None:
        limit_cpu(float(cfg["cpu"]))
        try:
            compiled = compiler.compile_structural_tag(json.loads(req))
            write_frame(out, b"k" + compiled.serialize_json().encode())
        except MemoryError:
            write_frame(out, b"m")
            return  # what the failed compile left allocated goes with the process
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types for bad schemas / regexes
            if "bad_alloc" in str(e):
                write_frame(out, b"m")
                return
            write_frame(out, b"e" + str(e)[:2000].encode(errors="replace"))


if __name__ == "__main__":
    main()
