"""The server keeps MLX's f32 matmuls in f32 (MLX's CUDA default is TF32) unless the operator set it."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = "import os, dsv4_serve.service.__main__ as m; m.exact_f32_matmuls(); print(os.environ['MLX_ENABLE_TF32'])"


def run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if env_value is not None:
        env["MLX_ENABLE_TF32"] = env_value
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout


def test_tf32_off_by_default() -> None:
    assert run(None).strip() == "0"


def test_operator_setting_wins() -> None:
    assert run("1").strip() == "1"
