"""`serve --distributed` when a rank cannot start: every rank exits non-zero with the reason, within seconds.
The two ranks run on the CPU (ring backend, 127.0.0.1) as two plain processes, not under mlx.launch (which
terminates the others when one fails): no rank may rely on its launcher to end it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from dsv4_serve.model.checkpoint import write_checkpoint
from dsv4_serve.model.tiny import tiny_model
from tests.distributed.test_two_ranks import ROOT, _free_port

WITHIN_S = 30


def _checkpoint(tmp_path: Path, drop_expert: int) -> Path:
    """A release-format tiny checkpoint whose index lists no `layers.0.ffn.experts.{drop_expert}.w1.weight`:
    only the rank that holds that expert reads it (the others skip it), so only that rank fails its load."""
    model, args, tok = tiny_model(seed=0, dtype=mx.float32)
    ckpt = tmp_path / "ckpt"
    write_checkpoint(model, args, ckpt, dtype="release", shards=2, tokenizer=tok)
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][f"layers.0.ffn.experts.{drop_expert}.w1.weight"]
    index.write_text(json.dumps(data))
    return ckpt


def _two_ranks(tmp_path: Path, *cmd: str) -> tuple[list[int | None], list[str], float]:
    """Ranks 0 and 1 of `cmd` as two processes: their exit codes (None: still running after a minute), their
    output and the seconds until both ended."""
    port = _free_port(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "MLX_"))}
    env.update(PYTHONPATH=str(ROOT), MLX_HOSTFILE=str(hostfile))
    procs, logs = [], [tmp_path / f"rank{r}.log" for r in (0, 1)]
    t0 = time.monotonic()
    try:
        for rank, log in enumerate(logs):
            with log.open("wb") as f:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**env, "MLX_RANK": str(rank)}, stdout=f,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))  # fmt: skip
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(max(1.0, t0 + 60 - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return codes, [log.read_text(errors="replace") for log in logs], took


@pytest.mark.parametrize("failing", ["both", "rank0", "rank1"])
def test_every_rank_exits_when_one_cannot_start(tmp_path: Path, failing: str) -> None:
    """`both`: --model /nonexistent; `rank0` / `rank1`: a checkpoint only that rank's load rejects (the
    missing tensor is one of its experts: expert 0 is rank 0's, expert 7 of 8 is rank 1's)."""
    model = "/nonexistent" if failing == "both" else str(_checkpoint(tmp_path, 0 if failing == "rank0" else 7))
    codes, out, took = _two_ranks(tmp_path, sys.executable, "-m", "dsv4_serve.service", "serve", "--distributed",
                                  "--host", "127.0.0.1", "--port", str(_free_port()), "--model", model,
                                  "--dequantize")  # fmt: skip (the tiny model's dims: float shards)
    assert all(c not in (0, None) for c in codes), (codes, [o[-3000:] for o in out])
    assert took < WITHIN_S, (took, [o[-3000:] for o in out])
    if failing == "both":
        assert all("/nonexistent" in o for o in out), out
    else:
        bad, good = (out[0], out[1]) if failing == "rank0" else (out[1], out[0])
        assert f"experts.{0 if failing == 'rank0' else 7}.w1.weight is missing" in bad, bad[-3000:]
        assert f"rank {failing[-1]} cannot start" in good, good[-3000:]


def test_follower_exits_non_zero_when_rank_0_ends_on_a_failure(tmp_path: Path) -> None:
    """A LeaderEngine closed as on a failure after it served (FAIL, not STOP): the follower exits non-zero."""
    codes, out, _ = _two_ranks(tmp_path, sys.executable, "tests/distributed/run_rank.py",
                               str(tmp_path / "ids.json"), "--engine-fail")  # fmt: skip
    assert codes[0] == 0 and codes[1] not in (0, None), (codes, [o[-3000:] for o in out])
    assert "rank 0 stopped on a failure" in out[1], out[1][-3000:]
