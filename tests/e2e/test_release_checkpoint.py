"""`serve --model DIR` on a release-format checkpoint (FP8 + UE8M0 projections, packed FP4 experts, BF16/F32
rest): it serves with the weights kept as mxfp8/mxfp4, token for token as `generate --quantize` (one row, no
server) on the same directory."""

from __future__ import annotations

import json
import subprocess

import httpx

from dsv4_serve.model.cli import make_tiny_main
from dsv4_serve.model.tokenizer import load_tokenizer
from tests.e2e.conftest import ROOT, server_command

PROMPT = [12, 400, 7, 99, 3, 250, 18]


def generate(ckpt, *extra: str) -> list[int]:
    cmd = [*server_command(), "generate", "--model", str(ckpt), "--prompt-ids", ",".join(map(str, PROMPT)),
           "--max-tokens", "12", *extra]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["ids"]


def test_serve_release_checkpoint(start_server, tmp_path) -> None:
    ckpt = tmp_path / "release"
    make_tiny_main([str(ckpt), "--seed", "3", "--dtype", "release"])
    srv = start_server("--model", str(ckpt))
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    served = r.json()
    want = generate(ckpt, "--quantize")
    eos = 1
    assert served["usage"]["completion_tokens"] == len([t for t in want if t != eos])
    # The text of the quantized CLI run, through the checkpoint's own tokenizer.json.
    assert served["choices"][0]["text"] == load_tokenizer(ckpt).decode([t for t in want if t != eos])
