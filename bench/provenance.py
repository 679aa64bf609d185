"""Which code a benchmark ran: the git commit where there is a current .git, and a digest of the sources.

The device machine gets a copy of the working tree whose `.git` can be stale, so `git rev-parse` there
may name an older commit. The digest (sha1 over the tracked-style sources: kernels/, model/, service/,
bench/ *.py and *.sh) identifies the code itself: `python bench/provenance.py` prints it for this
checkout, to match against a result file's `source_digest`.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("kernels", "model", "service", "bench")


def source_digest() -> str:
    h = hashlib.sha1()
    for d in DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def provenance() -> dict[str, str]:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"git": git.stdout.strip() or "unknown", "source_digest": source_digest()}


if __name__ == "__main__":
    print(provenance())
