"""tools/build_profile.py runs on a CPU: the decode step's graph built through the CUDA path with the launches
stood in for (its own process: the tool replaces MLX's cuda_kernel and the backend's device check)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_build_profile_builds_the_cuda_path_step() -> None:
    out = subprocess.run([sys.executable, "tools/build_profile.py", "--tiny", "--steps", "2", "--top", "80"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"build: ([\d.]+) ms a step .*, ([\d.]+) us a layer, \d+ layers", out.stdout)
    assert m and float(m.group(1)) > 0, out.stdout[:500]
    # the fast ops ran (their Python wrappers are in the profile), not the references
    assert "sparse_attention_rows_cuda" in out.stdout and "compressor_pair_rows_inplace_cuda" in out.stdout


def test_build_profile_times_a_slot_reset_both_ways() -> None:
    """--reset: a slot's reset through write_slots and through a write_rows an array, both timed (the tiny model's
    per-slot arrays)."""
    out = subprocess.run([sys.executable, "tools/build_profile.py", "--tiny", "--reset", "--steps", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"reset: (\d+) per-slot arrays, .*write_slots ([\d.]+), write_rows each ([\d.]+)", out.stdout)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0 and float(m.group(3)) > 0, out.stdout[:500]
