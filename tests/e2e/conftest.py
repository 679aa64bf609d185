"""A real `dsv4-serve serve` (embedded tiny model) under uvicorn on 127.0.0.1, in a subprocess."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "deepseek-v4-tiny"


def server_command() -> list[str]:
    script = Path(sys.executable).parent / "dsv4-serve"  # the pyproject entry point, when installed
    return [str(script)] if script.exists() else [sys.executable, "-m", "dsv4_serve.service"]


def installed() -> bool:
    """dsv4-serve is installed (editable or not): `dsv4_serve` imports without the checkout's root on the path."""
    try:
        importlib.metadata.distribution("dsv4-serve")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, env: dict[str, str] | None = None, command: list[str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="dsv4-e2e-", suffix=".log", delete=False)  # noqa: SIM115
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_") or k == "DSV4_KERNELS"}
        if not installed():  # else the checkout's root must stay off the path: its kernels/ would shadow PyPI's
            full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
        full_env.update(env or {})
        cmd = [*(command or server_command()), "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT)

    def log_tail(self, n: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _engine_importable() -> bool:
    try:
        names = ("dsv4_serve.model.loader", "dsv4_serve.model.tokenizer", "mlx")
        return all(importlib.util.find_spec(m) is not None for m in names)
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="session")
def start_server() -> Iterator[type[Server]]:
    """Factory: `srv = start_server('--max-rows', '1')`; every server started is stopped at the end."""
    if not _engine_importable():
        pytest.skip("the engine (model.loader / model.tokenizer / mlx) is not importable yet")
    started: list[Server] = []

    def make(*args: str, env: dict[str, str] | None = None, command: list[str] | None = None) -> Server:
        srv = Server(*args, env=env, command=command)
        started.append(srv)
        srv.wait_ready()
        return srv

    yield make  # type: ignore[misc]
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def server(start_server: type[Server]) -> Server:
    """One shared server with the defaults (8 rows)."""
    return start_server()


def joined(choices: list[Any]) -> list[dict[str, Any]]:
    """The calls that streamed tool-call deltas (openai SDK chunk choices) build: a call's first delta has its id
    and name, the later ones pieces of its arguments (index only)."""
    calls: list[dict[str, Any]] = []
    for ch in choices:
        for tc in ch.delta.tool_calls or ():
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.name, tc
                calls.append({"name": tc.function.name, "arguments": tc.function.arguments or ""})
            else:
                assert tc.function.name is None, tc
                calls[tc.index]["arguments"] += tc.function.arguments
    return calls
