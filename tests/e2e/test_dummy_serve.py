"""`serve --load-format dummy`: random weights for a preset or a config.json through the real server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.dummy import dummy_model
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tokenizer import build_tiny_tokenizer
from tests.e2e.conftest import ROOT, server_command


def _greedy(prompt: list[int], n: int) -> list[int]:
    """What the server must answer: the same builder's model, prefilled and decoded in this process."""
    model = dummy_model(ModelArgs.tiny(), experts=4, layers=3)
    pools = StatePools(model.args, max_slots=1, max_positions=len(prompt) + n, page_size=64, dtype=model.dtype)
    h = pools.alloc(len(prompt) + n)
    out = [int(mx.argmax(model.prefill(pools, h, prompt, 0)))]
    while len(out) < n:
        out.append(int(mx.argmax(model.decode(pools, [h], [out[-1]], [len(prompt) + len(out) - 1])[0])))
    return out


def test_dummy_preset_serves_a_completion(start_server) -> None:
    srv = start_server("--load-format", "dummy", "--model", "tiny", "--experts", "4", "--layers", "3",
                       "--max-model-len", "128")
    models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["tiny"]
    tok = build_tiny_tokenizer(ModelArgs.tiny().vocab_size)
    prompt = "The quick brown fox"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8, "total_tokens": len(ids) + 8,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert got["choices"][0]["text"] == tok.decode(_greedy(ids, 8), skip_special_tokens=False)


def _serve_error(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([*server_command(), "serve", "--port", "1", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    return p.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("--load-format", "dummy", "--model", "nope"), "--model nope: 'nope' is neither a preset (flash, pro, tiny) "
     "nor a config.json"),
    (("--load-format", "dummy", "--model", "flash", "--experts", "2"), "--model flash --experts 2: experts must be "
     "in 6..256"),
    (("--load-format", "dummy", "--model", "pro", "--layers", "99"), "layers must be in 1..61"),
    (("--load-format", "dummy",), "--load-format dummy needs --model"),
    (("--experts", "32",), "--experts / DSV4_EXPERTS applies to --load-format dummy only"),
    (("--load-format", "safetensors",), "invalid choice: 'safetensors'"),
])
def test_bad_dummy_arguments(args: tuple[str, ...], message: str) -> None:
    assert message in _serve_error(*args)


def test_bad_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(ModelArgs.tiny().to_config_json() | {"o_groups": 3}))
    err = _serve_error("--load-format", "dummy", "--model", str(tmp_path))
    assert f"--model {tmp_path}: config key 'o_groups' must divide num_attention_heads" in err


def test_config_json_without_tokenizer(tmp_path: Path) -> None:
    """A config.json with no tokenizer.json beside it: token-id prompts only (the API says so for text)."""
    from dsv4_serve.service.engine.build import build_engine

    (tmp_path / "config.json").write_text(json.dumps(ModelArgs.tiny().to_config_json()))
    engine, tok = build_engine(str(tmp_path / "config.json"), load_format="dummy", layers=2, max_model_len=64)
    assert tok is None and engine.args.num_hidden_layers == 2
    h = engine.admit(4)
    assert engine.step([(h, 3, 0)]).shape == (1, engine.args.vocab_size)


def test_served_name() -> None:
    from dsv4_serve.service.settings import Settings

    assert Settings(load_format="dummy", model="flash").served_name == "flash"
    assert Settings(load_format="dummy", model="/models/v4-mini/config.json").served_name == "v4-mini"
