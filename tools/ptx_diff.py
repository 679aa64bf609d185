"""Offline proof that a kernel refactor left the generated code alone (no GPU): every CUDA kernel unit of
tools/nvcc_check.py, built from a git revision and from the working tree, compiled to PTX with nvcc,
compared with the virtual register names erased (NVVM numbers registers by allocation order).

    python tools/ptx_diff.py --rev HEAD~1 [--only attn_wide,idx_one]

Prints per unit: same / DIFFERENT (the first differing lines) / new / gone. Exit 1 if any differs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# tools/nvcc_check.py; bench/nvcc_check.py in revisions before it moved (so --rev can reach back past the move)
DUMP = ("import json, sys; sys.path.insert(0, '.')\n"
        "try:\n    from tools.nvcc_check import units\n"
        "except ImportError:\n    from bench.nvcc_check import units\n"
        "print(json.dumps(units()))")


def units_at(tree: Path) -> dict[str, str]:
    """tree's kernel units: its `dsv4_serve.kernels` imported from tree (a shim package on PYTHONPATH, ahead of
    the editable install's finder, which maps the name to the working tree)."""
    env = dict(os.environ)
    if tree != ROOT:
        shim = tree / "_shim" / "dsv4_serve"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "__init__.py").write_text("")
        for sub in ("kernels", "model", "service"):
            if (tree / sub).is_dir() and not (shim / sub).exists():
                (shim / sub).symlink_to(tree / sub)
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "_shim"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", DUMP], cwd=tree, capture_output=True, text=True, check=True, env=env)
    return json.loads(r.stdout)


def checkout(rev: str, into: Path) -> Path:
    paths = ["kernels", "model", "bench", "tools"]  # tools/ holds nvcc_check.py since the move; older revisions lack it
    if subprocess.run(["git", "cat-file", "-e", f"{rev}:tools"], cwd=ROOT, capture_output=True).returncode:
        paths.remove("tools")
    blob = subprocess.run(["git", "archive", rev, *paths], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(blob.stdout)) as t:
        t.extractall(into, filter="data")
    return into


def ptx(src: str, d: Path, nvcc: str) -> list[str]:
    cu = d / "k.cu"
    cu.write_text(src)
    subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-ptx", "-o", str(d / "k.ptx"), str(cu)], check=True,
                   capture_output=True)  # fmt: skip
    lines = [ln for ln in (d / "k.ptx").read_text().splitlines() if not ln.lstrip().startswith("//")]
    lines = [re.sub(r"\$L__BB\d+_\d+", "$L", ln) for ln in lines]  # block labels: numbered in order, too
    lines = [re.sub(r"_ZZ\w+", _local, ln) for ln in lines]  # function-local statics: the name alone
    return [re.sub(r"%(r|rd|rs|f|fd|p)\d+", r"%\1", ln) for ln in lines if not ln.lstrip().startswith(".reg")]


def _local(m: re.Match[str]) -> str:
    """A function-local static's mangled name (`_ZZ<function>E<len><name>`) -> `<name>`: the same shared
    array keeps its name when its code moves into a device function."""
    s = m.group(0)
    for e in re.finditer(r"E(\d+)", s):
        if len(s) - e.end() == int(e.group(1)):
            return s[e.end() :]
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--only", default="")
    ap.add_argument("--nvcc", default="nvcc")
    opt = ap.parse_args()
    only = [s for s in opt.only.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        old = units_at(checkout(opt.rev, Path(tmp) / "old"))
        new = units_at(ROOT)
        bad = 0
        for name in sorted(set(old) | set(new)):
            if only and not any(name.startswith(o) for o in only):
                continue
            if name not in old or name not in new:
                print(f"{name:24s} {'new' if name in new else 'gone'}")
                continue
            a, b = ptx(old[name], Path(tmp), opt.nvcc), ptx(new[name], Path(tmp), opt.nvcc)
            if a == b:
                print(f"{name:24s} same")
                continue
            bad += 1
            diff = [x for x in difflib.unified_diff(a, b, lineterm="", n=0) if x[:1] in "+-"][2:12]
            print(f"{name:24s} DIFFERENT\n  " + "\n  ".join(diff))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
