"""model/graph_plan_store.py on the CPU (the CUDA path recorded with stand-in kernels, as tools/graph_plan.py does):
a recorded step's plan written and read back is the same plan and the same launches (so the same translation
units: the cubin cache's keys), its weights' and constants' addresses found again by label are the ones recorded,
the key follows the row count and the DSV4_* variables, and a corrupt entry is not used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, sys
from pathlib import Path
import numpy as np
from bench.stand_in import flash_rows, stand_in_recorder
rec = stand_in_recorder()
from dsv4_serve.kernels.graph.codegen import translation_unit
from dsv4_serve.model import graph_plan_store as S
from dsv4_serve.model.graph_record import record_step
model, pools, handles, widths = flash_rows()
plan, launches, lb, expected = record_step(model, pools, rec, handles[:2], widths)
store, k = S.PlanStore(Path(sys.argv[1])), S.key(model, pools, 2, widths)
store.save(k, plan, launches, lb)
plan2, launches2, lb2 = store.load(k)
exp2, named = S.expected_logits(model, pools, handles[:2], widths)
why = S.resolve(plan2, named)
units = lambda ls: [translation_unit(x.kernel, x.template, x.inputs, [o.dtype for o in x.outputs]) for x in ls]
persistent = lambda p: {b.id: p.addresses[b.id] for b in p.buffers.values() if b.kind in ("weight", "const")}
out = {"why": why, "logits_buffer": lb2 == lb, "launches": launches2 == launches, "n": len(launches),
       "plan": [plan2.launches == plan.launches, plan2.buffers == plan.buffers, plan2.arena == plan.arena,
                plan2.arena_bytes == plan.arena_bytes, plan2.staging == plan.staging, plan2.kept == plan.kept],
       "addresses": persistent(plan2) == persistent(plan), "n_addresses": len(persistent(plan)),
       "units": units(launches2) == units(launches), "expected": bool(np.array_equal(exp2, expected)),
       "keys": [S.key(model, pools, 1, widths) != k, S.key(model, pools, 2, widths) == k]}
os.environ["DSV4_SKINNY_GROUPS"] = "0"
out["env"] = S.key(model, pools, 2, widths) != k
named["weight"].pop(plan2.buffers[next(b.id for b in plan2.buffers.values() if b.kind == "weight")].label)
out["missing"] = S.resolve(plan2, named)
(Path(sys.argv[1]) / f"{k}.json").write_text("{")
out["corrupt"] = store.load(k) is None
print(json.dumps(out))
"""


def test_a_stored_plan_is_the_recorded_plan(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MLX_ENABLE_TF32": "0"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["why"] is None and out["logits_buffer"] and out["n"] > 20
    assert out["launches"] and all(out["plan"]) and out["units"] and out["expected"]
    assert out["addresses"] and out["n_addresses"] > 20  # every weight and constant found again by its label
    assert out["keys"] == [True, True] and out["env"]
    assert out["missing"].startswith("weight ") and out["missing"].endswith("is not here as recorded")
    assert out["corrupt"]
