"""The grammar compile process that grammar_pool.py starts and kills: it reads a tokenizer description, then
compiles one structural-tag format at a time and answers with the compiled grammar serialized. Run as a
script (`python grammar_child.py`): it imports only xgrammar and the standard library, so it starts fast and
holds no model. Frames on stdin / stdout: a 4-byte big-endian length, then the bytes."""

from __future__ import annotations

import json
import os
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
    write_frame(out, b"ready")
    while (req := read_frame(inp)) is not None:
        try:
            compiled = compiler.compile_structural_tag(json.loads(req))
            write_frame(out, b"k" + compiled.serialize_json().encode())
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types for bad schemas / regexes
            write_frame(out, b"e" + str(e)[:2000].encode(errors="replace"))


if __name__ == "__main__":
    main()
