"""bench/prefill.py on the CPU (`--tiny`): two prompts share the batched forward, oldest first; the JSON holds
a cell per (prompt, concurrency) and the prefill's logits agree with token-by-token decode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_bench_runs_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, "bench/prefill.py", "--tiny", "--prompts", "40,64", "--concurrent", "1,2",
           "--chunk", "32", "--agree", "48", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    cells = res["results"]
    assert [(c["prompt"], c["concurrent"]) for c in cells] == [(40, 1), (40, 2), (64, 1), (64, 2)]
    # 32 tokens a forward: 40 -> 2 forwards, 2 x 40 -> 3 (the second one shares the second), 2 x 64 -> 4
    assert [c["forwards"] for c in cells] == [2, 3, 2, 4]
    for c in cells:
        assert len(c["ttft_ms"]) == c["concurrent"] and c["ttft_ms"] == sorted(c["ttft_ms"])  # oldest first
        assert c["tokens_per_s"] > 0 and c["floor_s"] > 0 and "gpu_busy_s" not in c  # no CUPTI on a CPU
    assert res["agreement"]["max_abs_logit_diff"] <= 1e-4 and res["agreement"]["argmax_equal"]
