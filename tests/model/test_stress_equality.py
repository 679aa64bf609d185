"""tools/stress_equality.py, the engine's equality checks repeated in one process (issue 57): 200 iterations, 40
of each check, shuffled, every one holds. `stress` tests do not run by default (pyproject's addopts); run them
with `pytest -m stress`. A longer run: `python tools/stress_equality.py --iterations 1000`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.stress
def test_the_equality_checks_hold_over_a_long_process() -> None:
    run = subprocess.run([sys.executable, "tools/stress_equality.py", "--iterations", "200", "--seed", "57"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)  # fmt: skip
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert last.startswith("checks: {") and "'plain': 40" in last and "failures: 0;" in last, last
