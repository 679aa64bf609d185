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
from bench.stand_in import stand_in_recorder
rec = stand_in_recorder()
from bench.stand_in import flash_rows
from dsv4_serve.model.graph_record import record_step
model, pools, handles, widths = flash_rows()
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
