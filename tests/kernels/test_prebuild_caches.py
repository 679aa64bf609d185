"""tools/prebuild_caches.py: the decode graphs' translation units a server records depend on the model's dims,
`--max-rows` and `--max-model-len`, not on its layer count or state budget, which is what lets the tool build a
full-depth server's cubins from a 4-layer model on a machine without a GPU (and a longer --max-model-len gives
other units: the check is not vacuous). In a child process: the tool fakes CUDA for the whole interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import hashlib, sys
from tools.prebuild_caches import fake_cuda_with_graphs, graph_units
from dsv4_serve.service.engine.build import build_engine
noter, rec = fake_cuda_with_graphs(True)
layers, budget, rows, max_len = (int(a) for a in sys.argv[1:])
eng, _ = build_engine("flash", load_format="dummy", experts=32, layers=layers, max_rows=rows, max_model_len=max_len,
                      state_budget_bytes=budget, prefix_cache_bytes=0)
units = graph_units(eng, rec)
print(len(units), hashlib.sha256("".join(sorted(units)).encode()).hexdigest()[:16], len(noter.variants))
"""


def test_units_do_not_depend_on_layers_or_the_state_budget() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSV4_KERNEL_CACHE": "0"}
    got = []
    for config in ((4, 1 << 30, 2, 4096), (5, 2 << 30, 2, 4096), (4, 1 << 30, 2, 8192)):  # a process each: memory
        out = subprocess.run([sys.executable, "-c", CODE, *map(str, config)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        got.append(out.stdout.split("\n")[-2].split())
    (n4, h4, v4), (n5, h5, _), (n8k, h8k, _) = got
    assert int(n4) > 20 and int(v4) > 20  # the step's kernels and the noted variants (a graph step has ~24 a row count)
    assert (n5, h5) == (n4, h4)  # 5 layers (a second CSA) and twice the budget: the same units
    assert n8k == n4 and h8k != h4  # a longer --max-model-len: wider block tables, the same kernels built otherwise
