"""A model that cannot load ends `dsv4-serve serve`: non-zero exit, the reason on stderr, within seconds (issue 48:
a server with a missing model had run on for minutes with /health 200, so a liveness probe never restarted it)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, Server, _free_port, server_command

EXIT_WITHIN_S = 30


def _serve(*args: str, cwd: Path) -> tuple[int, str, float]:
    """Run `serve` to its exit: (exit code, stderr, seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [*server_command(), "serve", "--host", "127.0.0.1", "--port", str(_free_port()), *args]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after {EXIT_WITHIN_S}s: {e.stderr!r}"[-3000:])
    return r.returncode, r.stderr, time.monotonic() - t0


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_missing_model_exits_nonzero(start_server: type[Server], tmp_path: Path) -> None:
    start_server  # noqa: B018 - the fixture skips where the engine is not importable
    rc, err, secs = _serve("--model", "/nonexistent", cwd=tmp_path)
    assert rc == 1 and secs < EXIT_WITHIN_S, err
    assert _last_line(err) == ("dsv4-serve: the engine cannot serve: ValueError: config.json not found: "
                               "/nonexistent/config.json")  # fmt: skip


def test_malformed_checkpoint_exits_nonzero(start_server: type[Server], tmp_path: Path) -> None:
    start_server  # noqa: B018
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": ')
    rc, err, _ = _serve("--model", str(bad), cwd=tmp_path)
    assert rc == 1 and "config.json is not valid JSON" in _last_line(err), err
    # A real checkpoint whose weights file is cut short.
    r = subprocess.run([*server_command(), "make-tiny", str(bad)], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    rc, err, _ = _serve("--model", str(bad), cwd=tmp_path)
    assert rc == 1 and "model.safetensors" in _last_line(err) and "truncated" in _last_line(err), err


def test_state_that_does_not_fit_exits_nonzero(start_server: type[Server], tmp_path: Path) -> None:
    """The memory case: a decode state budget that cannot hold one request stops start-up as a load error does."""
    start_server  # noqa: B018
    rc, err, _ = _serve("--max-state-gib", "0.000001", cwd=tmp_path)
    assert rc == 1 and "state budget of" in _last_line(err), err


def test_decode_graphs_on_without_cuda_exits_nonzero(start_server: type[Server], tmp_path: Path) -> None:
    """`--decode-graphs on` where no CUDA graph can run (this CPU) is a start-up error naming why, not a server
    that quietly runs the MLX step (auto does that, with one log line)."""
    start_server  # noqa: B018
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("a CUDA GPU: graphs can run here")
    rc, err, _ = _serve("--decode-graphs", "on", cwd=tmp_path)
    assert rc == 1, err
    assert _last_line(err) == ("dsv4-serve: the engine cannot serve: ValueError: --decode-graphs on: MLX's default "
                               "device is not a CUDA GPU")  # fmt: skip


def test_sigterm_during_start_up_exits_at_once(start_server: type[Server], tmp_path: Path) -> None:
    """A server stopped while its engine still loads (a cold GPU start warms up for minutes) ends within seconds,
    exit 0: the drain has nothing accepted to wait for, and a running warm-up is not waited for (it was: the drain's
    timeout + 30 s, then an abort in the interpreter's exit under the running native thread)."""
    start_server  # noqa: B018
    import httpx

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # V4-Flash's dummy weights take minutes to draw on a CPU: the engine is still loading when the signal comes
    cmd = [*server_command(), "serve", "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
           "--model", "flash", "--layers", "1", "--experts", "8"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + EXIT_WITHIN_S
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1.0)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("the server never answered")
        assert ready.status_code == 503  # still loading
        t0 = time.monotonic()
        proc.terminate()
        _, err = proc.communicate(timeout=EXIT_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and time.monotonic() - t0 < 20, (proc.returncode, err[-2000:])
    assert "dsv4-serve: stopped during start-up" in err
