"""2 ranks on the CPU (ring backend, 127.0.0.1) under mlx.launch: sharded greedy == single-process greedy."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.checkpoint import write_checkpoint
from dsv4_serve.model.loader import load_model
from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine import canary
from tests.distributed.run_rank import greedy

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Path(sys.executable).parent / "mlx.launch"
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed next to python")


def _free_port(n: int = 1) -> int:
    """A port p with p..p+n-1 free (the ring backend listens on consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _launch(*cmd: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "MLX_"))}
    env["PYTHONPATH"] = str(ROOT)
    launch = [str(LAUNCH), "-n", "2", "-p", str(_free_port(2)), "--", *cmd]
    with log.open("wb") as f:  # own session: the whole job can be killed as one process group
        return subprocess.Popen(launch, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[9:]) for e in env if e.startswith(b"MLX_RANK=")), None)


@pytest.mark.parametrize("source", ["tiny", "checkpoint"])
def test_two_ranks_greedy_matches_single_process(tmp_path: Path, source: str) -> None:
    """8 concurrent rows, greedy: ids identical, logits equal to fp32 rounding. `checkpoint`: each rank
    reads its shard of a release-format (FP8/FP4) checkpoint, compared with the full load."""
    out, log = tmp_path / "ids.json", tmp_path / "launch.log"
    model, args, tok = tiny_model(seed=0, dtype=mx.float32)
    extra = []
    if source == "checkpoint":
        ckpt = tmp_path / "ckpt"
        write_checkpoint(model, args, ckpt, dtype="release", shards=2, tokenizer=tok)
        model, args = load_model(ckpt, dtype=mx.float32)
        extra = [str(ckpt)]
    proc = _launch(sys.executable, "tests/distributed/run_rank.py", str(out), *extra, log=log)
    try:
        want_ids, want_logits = greedy(model)
        rc = proc.wait(90)
    finally:
        _kill(proc)
    assert rc == 0, log.read_text(errors="replace")[-4000:]
    got = json.loads(out.read_text())
    assert got["size"] == 2 and got["experts"] == model.args.n_routed_experts // 2
    assert got["ids"] == want_ids
    np.testing.assert_allclose(np.array(got["logits"]), np.array(want_logits), rtol=1e-4, atol=1e-4)


def test_two_ranks_engine_prefill_and_pipeline(tmp_path: Path) -> None:
    """LeaderEngine + follow(): 8 rows prefilled in parallel (each prompt split into pieces of 5 tokens over
    several plan messages), then pipelined steps fed the device tokens; ids identical to one process."""
    from dsv4_serve.service.engine.engine import Engine
    from tests.distributed.run_rank import engine_greedy

    out, log = tmp_path / "ids.json", tmp_path / "launch.log"
    proc = _launch(sys.executable, "tests/distributed/run_rank.py", str(out), "--engine", log=log)
    try:
        model, _args, _tok = tiny_model(seed=0, dtype=mx.float32)
        want = engine_greedy(Engine(model, max_rows=8, max_model_len=64))
        rc = proc.wait(90)
    finally:
        _kill(proc)
    assert rc == 0, log.read_text(errors="replace")[-4000:]
    got = json.loads(out.read_text())
    assert got["size"] == 2 and got["ids"] == want


def _generate_single(model, prompt: list[int], n: int) -> list[int]:
    """Greedy ids from one process (what `dsv4-serve generate` computes): parallel prefill, then decode."""
    from dsv4_serve.model.state import StatePools

    pools = StatePools(model.args, max_slots=1, max_positions=len(prompt) + n, page_size=64, dtype=model.dtype)
    h = pools.alloc(len(prompt) + n)
    logits = model.prefill(pools, h, prompt, 0)
    out = [int(mx.argmax(logits))]
    while len(out) < n:
        logits = model.decode(pools, [h], [out[-1]], [len(prompt) + len(out) - 1])
        out.append(int(mx.argmax(logits[0])))
    return out


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


PROMPTS = [[(11 * i + 7 * j + 5) % 500 + 2 for j in range(n)] for i, n in enumerate((1, 3, 7, 12, 17, 24, 33, 41))]


@pytest.mark.parametrize("source", ["embedded", "dummy"])
def test_serve_distributed_http(tmp_path: Path, source: str) -> None:
    """Rank 0 serves 8 concurrent greedy requests: prompts prefilled in parallel (chunks of 16 tokens a step,
    the longer ones over several steps), decode pipelined; every request's ids are those of one process.
    `dummy`: each rank builds its own shard of `--load-format dummy --model tiny` (float weights)."""
    log = tmp_path / "serve.log"
    port = _free_port()
    script = Path(sys.executable).parent / "dsv4-serve"
    serve = [str(script)] if script.exists() else [sys.executable, "-m", "dsv4_serve.service"]
    extra = ["--load-format", "dummy", "--model", "tiny", "--dequantize"] if source == "dummy" else []
    proc = _launch(*serve, "serve", "--distributed", "--host", "127.0.0.1", "--port", str(port),
                   "--max-model-len", "256", "--drain-timeout", "5", "--prefill-chunk", "16", *extra, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "not ready:\n" + log.read_text(errors="replace")[-4000:]
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

        def ask(prompt: list[int]) -> dict:
            body = {"model": "tiny" if source == "dummy" else "deepseek-v4-tiny", "prompt": prompt,
                    "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, PROMPTS))
        scored = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 0, "echo": True,
                                                           "logprobs": 1}, timeout=60)  # fmt: skip
        assert scored.status_code == 400 and scored.json()["error"]["param"] == "echo", scored.text
        prefilled = _metric(url, "dsv4_prefill_tokens_total")
        ahead = _metric(url, "dsv4_decode_steps_ahead_total")
        ranks = {_rank_of(p): p for p in _children(proc.pid)}
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[0], signal.SIGTERM)  # rank 0 drains, then tells rank 1 to stop
        rc = proc.wait(60)
        assert rc == 0, log.read_text(errors="replace")[-4000:]
        assert all(not Path(f"/proc/{p}").exists() for p in ranks.values())
    finally:
        _kill(proc)
    # Prompt tokens fed by the parallel prefill, 16 a step (the rest went one a step through the decode
    # step, as on one process): more than one step's chunk, so plans carried prefills step after step. (The
    # canary's first check before /ready prefills its prompt too: engine work, counted.)
    assert 16 < prefilled <= sum(len(p) - 1 for p in PROMPTS) + canary.PROMPT_LEN - 1
    assert ahead > 0  # decode steps queued before the previous one was read back
    if source == "dummy":
        from dsv4_serve.model.config import ModelArgs
        from dsv4_serve.model.dummy import dummy_model
        from dsv4_serve.model.tokenizer import build_tiny_tokenizer

        model, tok = dummy_model(ModelArgs.tiny(), quantize=False), build_tiny_tokenizer(512)
    else:
        model, _args, tok = tiny_model()
    for prompt, got in zip(PROMPTS, answers, strict=True):
        assert got["usage"]["completion_tokens"] == 12
        want = tok.decode(_generate_single(model, prompt, 12), skip_special_tokens=True)  # the service hides them
        assert got["choices"][0]["text"] == want
