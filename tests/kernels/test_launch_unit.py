"""kernels/graph/codegen.launch_unit (the runtime's translation unit of a launch, made once per what decides it)
on the CPU: for every launch of the V4-Flash step recorded at 2 rows and at 1 row (stand-in kernels, as
tools/graph_plan.py records it), the unit `translation_unit` makes from the launch itself, so the cubin cache's
keys are unchanged; the two row counts' launches, whose baked shapes differ, keep their own units; and the
runtime's prebuild (`missing_units`) asks for the units neither held nor cached, reading each unit's cache entry
once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pathlib import Path
from bench.stand_in import flash_rows, stand_in_recorder
rec = stand_in_recorder()
from dsv4_serve.kernels.graph.codegen import launch_unit, translation_unit
from dsv4_serve.model.graph_record import record_step
model, pools, handles, widths = flash_rows()
two = record_step(model, pools, rec, handles[:2], widths)[1]
one = record_step(model, pools, rec, handles[:1], widths)[1]
plain = lambda x: translation_unit(x.kernel, x.template, x.inputs, [o.dtype for o in x.outputs])
units = [launch_unit(x) for x in two + one]
from dsv4_serve.kernels.graph.codegen import entry
from dsv4_serve.kernels.graph.cubin_cache import CubinCache
from dsv4_serve.kernels.graph.runtime import missing_units

class Counted(CubinCache):
    reads = 0
    def has(self, source, name, arch):
        Counted.reads += 1
        return super().has(source, name, arch)

cache = Counted(Path(sys.argv[1]))
distinct = sorted(set(units))
for u in distinct[::2]:  # every other unit cached (a stand-in cubin: has() checks the entry, not the code)
    ln = next(x for x in two + one if launch_unit(x) == u)
    cache.get(u, entry(ln.kernel), "sm_90a", lambda: (b"cubin", "lowered"))
loaded = distinct[1:2]  # one unit the runtime already holds
todo = missing_units(two + one, set(loaded), cache, "sm_90a")
print(json.dumps({"todo": sorted(todo) == sorted(set(distinct[1::2]) - set(loaded)), "reads": Counted.reads,
                  "checked": len(distinct) - len(loaded)}))
print(json.dumps({"n": len(units), "equal": units == [plain(x) for x in two + one],
                  "again": all(launch_unit(x) is u for x, u in zip(two + one, units)),
                  "distinct": len(set(units)), "distinct_plain": len({plain(x) for x in two + one}),
                  "shared": len({launch_unit(x) for x in two} & {launch_unit(x) for x in one}),
                  "rows_apart": len({launch_unit(x) for x in two} ^ {launch_unit(x) for x in one})}))
"""


def test_a_launch_s_unit_is_its_translation_unit_made_once(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MLX_ENABLE_TF32": "0"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    built, out = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    # the prebuild's selection: the units neither held nor cached, each cache entry read once (not once a launch)
    assert built["todo"] and built["reads"] == built["checked"] < out["n"]
    assert out["n"] > 40 and out["equal"] and out["again"]
    assert out["distinct"] == out["distinct_plain"] < out["n"]  # one unit serves many launches
    assert out["shared"] > 0 and out["rows_apart"] > 0  # kernels without baked row shapes are shared
