"""Per-kernel summary of ncu CSV files (`ncu --metrics gpu__time_duration.sum --csv`, as
bench/gpu_session18.sh writes them): launches, median and summed GPU time per (kernel, grid).
CPU only; reads the files the device call brought back.

    python bench/ncu_sum.py bench/results/ncu18/chain43_new.csv bench/results/ncu18/chain43_old.csv
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from collections import defaultdict
from pathlib import Path

METRIC = "gpu__time_duration.sum"


def durations(path: Path) -> list[tuple[str, str, float]]:
    """(kernel, grid, µs) per profiled launch; our kernels by their dsv4 name, MLX's by the first 40 characters."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith('"')]  # ncu's own log lines are not CSV
    out = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != METRIC:
            continue
        m = re.search(r"custom_kernel_dsv4_(.*?)_[0-9a-f]{10}", r["Kernel Name"])
        name = m.group(1) if m else r["Kernel Name"][:40]
        out.append((name, r["Grid Size"], float(r["Metric Value"].replace(",", "")) / 1000))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    for path in ap.parse_args().files:
        rows = durations(path)
        by: dict[tuple[str, str], list[float]] = defaultdict(list)
        for name, grid, us in rows:
            by[(name, grid)].append(us)
        print(f"== {path.name}: {len(rows)} launches, {sum(us for *_, us in rows):.1f} us")
        for (name, grid), v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            print(f"   {name:28s} {grid:14s} n={len(v):4d}  median {statistics.median(v):7.2f}  sum {sum(v):8.1f}")


if __name__ == "__main__":
    main()
