"""`dsv4-serve make-tiny` and `dsv4-serve generate`, run as the user runs them (subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from dsv4_serve.model.cli import generate_main, make_tiny_main
from dsv4_serve.model.tokenizer import SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dsv4_serve.service", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_generate_embedded_default_within_10s() -> None:
    if mx.default_device() == mx.gpu:  # a fresh GPU host first NVRTC-compiles every kernel (MLX caches the
        run("generate", "--prompt", "x", "--max-tokens", "2")  # PTX on disk): the bound is for a warm host
    t0 = time.monotonic()
    r = run("generate", "--prompt", "Hello, the cat", "--max-tokens", "16")
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["ids"]) == 16 or out["ids"][-1] == 1
    assert all(0 <= i < 512 for i in out["ids"]) and isinstance(out["text"], str)
    assert not any(t in out["text"] for t in SPECIAL_TOKENS)  # EOS ends the ids, never the text (as the server)
    assert elapsed < 10, f"generate took {elapsed:.1f} s"


def test_help_names_both_prompt_forms() -> None:
    r = run("--help")
    assert r.returncode == 0 and "--prompt text or --prompt-ids" in " ".join(r.stdout.split()), r.stdout


@pytest.mark.parametrize("dtype", ["float32", "release"])
def test_make_tiny_then_generate(tmp_path, dtype: str) -> None:
    d = tmp_path / "tiny"
    r = run("make-tiny", str(d), "--seed", "1", "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / f).is_file(), f
    r = run("generate", "--model", str(d), "--prompt-ids", "0,5,17,42", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)["ids"]
    assert 1 <= len(ids) <= 8
    again = run("generate", "--model", str(d), "--prompt-ids", "0,5,17,42", "--max-tokens", "8")
    assert json.loads(again.stdout)["ids"] == ids  # greedy is deterministic


def test_generate_in_process_sampling_and_errors(tmp_path, capsys) -> None:
    assert make_tiny_main([str(tmp_path), "--seed", "2"]) == 0
    capsys.readouterr()
    args = ["--model", str(tmp_path), "--prompt", "the cat", "--max-tokens", "6", "--temperature", "0.9"]
    assert generate_main([*args, "--seed", "7"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert generate_main([*args, "--seed", "7"]) == 0
    assert json.loads(capsys.readouterr().out) == a  # seeded sampling is reproducible
    (tmp_path / "tokenizer.json").unlink()
    assert generate_main(["--model", str(tmp_path), "--prompt", "x", "--max-tokens", "2"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert generate_main(["--model", str(tmp_path), "--prompt-ids", "0,1,2", "--max-tokens", "2"]) == 0
    assert "text" not in json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        generate_main(["--prompt-ids", "0,999", "--max-tokens", "2"])
