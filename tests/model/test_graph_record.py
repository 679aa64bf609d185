"""model/graph_record.record_step on the CPU: the engine's graph capture records the V4-Flash step (the CUDA path with
each kernel stood in for, as tools/graph_plan.py does) into a plan with no gap at every row count, its logits the
last launch's output. It once recorded on the batch its warm-up step had used, whose memoized RoPE tables were then
no launch's output (468 gaps on the H100, 2026-12-06): the recording takes a fresh batch. And with MLX's CUDA
behaviour stood in for (a DLPack read moves a buffer to a new address for good, the address kernel reads without
moving): every address compared with the plan's is read as the plan read it (the H100, 2026-12-07: the logits'
DLPack read moved them, and no row count could be captured)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MOVES = """
from dsv4_serve.kernels.graph import record as R
moved, SHIFT, cpu_read = [], 1 << 44, R.address  # the ranges exported (moved into managed memory on CUDA)

def now(a):  # where the array's bytes are now
    p = cpu_read(a)
    return None if p is None else p + SHIFT if any(s <= p < e for s, e in moved) else p

def dlpack(a):  # CUDA's DLPack read: the buffer moves (once) to a new address, which it returns
    p = cpu_read(a)
    if p is not None and not any(s <= p < e for s, e in moved):
        moved.append((p, p + a.nbytes))
    return now(a)

R.address = dlpack
R.addresses = lambda arrays: [now(a) for a in arrays]  # the address kernel: reads, moves nothing
"""

SCRIPT = """
import json, sys
import mlx.core as mx
from bench.stand_in import stand_in_recorder
rec = stand_in_recorder()
{moves}
from bench.stand_in import flash_rows
from dsv4_serve.model.graph_record import record_step
model, pools, handles, widths = flash_rows()
out = {}
for n in {counts}:
    got = record_step(model, pools, rec, handles[:n], widths)
    out[n] = got if isinstance(got, str) else {"launches": len(got[1]), "steps": got[0].count("step"),
                                               "logits": list(got[3].shape)}
print(json.dumps(out))
"""


def recorded(moves: str, counts: tuple[int, ...]) -> dict[str, object]:
    script = SCRIPT.replace("{moves}", moves).replace("{counts}", repr(counts))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MLX_ENABLE_TF32": "0"})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_with_buffers_that_move_when_exported_every_row_count_records() -> None:
    out = recorded(MOVES, (1, 2))
    for n in ("1", "2"):
        assert isinstance(out[n], dict), (n, out[n])
        assert out[n]["logits"] == [int(n), 129280], out[n]


def test_the_engine_s_recording_has_no_gap_at_any_row_count() -> None:
    out = recorded("", (1, 2, 3))
    for n in ("1", "2", "3"):
        assert isinstance(out[n], dict), (n, out[n])
        assert out[n]["steps"] == 6 and out[n]["logits"] == [int(n), 129280], out[n]
    assert out["1"]["launches"] == out["3"]["launches"] > 4 * 20
