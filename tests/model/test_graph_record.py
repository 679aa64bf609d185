"""model/graph_record.record_step on the CPU: the engine's graph capture records the V4-Flash step (the CUDA path with
each kernel stood in for, as tools/graph_plan.py does) into a plan with no gap at every row count, its logits the
last launch's output. It once recorded on the batch its warm-up step had used, whose memoized RoPE tables were then
no launch's output (468 gaps on the H100, 2026-12-06): the recording takes a fresh batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import mlx.core as mx
from tools.build_profile import _stand_in, zero_weights
from dsv4_serve.kernels.graph.record import Recorder
rec = Recorder(_stand_in)
rec.install()
import dsv4_serve.kernels.cuda
from dsv4_serve.kernels import backend
from dsv4_serve.kernels.cuda import set_graph_glue
backend._use_fast = lambda: True
set_graph_glue(True)
zero_weights()
from bench.step import flash_args, random_model
from dsv4_serve.model.graph_record import record_step
from dsv4_serve.model.state import StatePools
model = random_model(flash_args(4, 16))
pools = StatePools(model.args, max_slots=3, max_positions=512, page_size=64, dtype=model.dtype)
handles = [pools.alloc(512) for _ in range(3)]
widths = {r: pools.table_width(r) for r in pools.ratios}
out = {}
for n in (1, 2, 3):
    got = record_step(model, pools, rec, handles[:n], widths)
    out[n] = got if isinstance(got, str) else {"launches": len(got[1]), "steps": got[0].count("step"),
                                               "logits": list(got[3].shape)}
print(json.dumps(out))
"""


def test_the_engine_s_recording_has_no_gap_at_any_row_count() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MLX_ENABLE_TF32": "0"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for n in ("1", "2", "3"):
        assert isinstance(out[n], dict), (n, out[n])
        assert out[n]["steps"] == 6 and out[n]["logits"] == [int(n), 129280], out[n]
    assert out["1"]["launches"] == out["3"]["launches"] > 4 * 20
