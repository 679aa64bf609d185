"""vLLM's /tokenize, /detokenize and /tokenizer_info against a real server, and lm-eval's `local-completions` with
`tokenizer_backend=remote` (lm_eval.utils.RemoteTokenizer: no tokenizer on the client) running a loglikelihood task
from its command line: its log-likelihoods equal a direct echo call's on the same token ids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL, Server
from tests.e2e.lm_eval_task import DOCS, write_task

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def tok():
    from dsv4_serve.model.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(512)  # the embedded tiny model's


def test_tokenize_prompt(server: Server, tok) -> None:
    text = "Hello, world! The quick brown fox" + EOS
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = tok.encode(text, add_special_tokens=False).ids
    assert body["tokens"] == want and body["count"] == len(want) and want[-1] == 1  # EOS text -> its id
    assert body["token_strs"] == [tok.id_to_token(i) for i in want]
    models = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert body["max_model_len"] == models["max_model_len"]
    plain = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == want and "token_strs" not in plain


def test_tokenize_chat_is_the_chat_prompt(server: Server) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
    assert r["count"] == chat["usage"]["prompt_tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == f"{BOS}Be brief.<｜User｜>What is the capital of France?<｜Assistant｜></think>"
    think = httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "chat_template_kwargs": {"thinking": True}})
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": think.json()["tokens"]}).json()["prompt"].endswith(
        "<｜Assistant｜><think>")


def test_detokenize(server: Server, tok) -> None:
    ids = tok.encode("Time flies like an arrow", add_special_tokens=False).ids
    r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": [0, *ids, 1]})
    assert r.status_code == 200 and r.json() == {"prompt": BOS + "Time flies like an arrow" + EOS}


def test_tokenizer_info(server: Server) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == (BOS, EOS)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "hi", "model": "gpt-4o"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     400, "continue_final_message"),
    ("/detokenize", {"tokens": [1, 512]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])  # fmt: skip
def test_bad_requests(server: Server, path: str, body: dict, status: int, param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_api_key_guards_them(start_server) -> None:
    srv = start_server("--api-key", "k1")
    for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
                               ("GET", "/tokenizer_info", None)):  # fmt: skip
        assert httpx.request(method, f"{srv.url}{path}", json=body).status_code == 401
        ok = httpx.request(method, f"{srv.url}{path}", json=body, headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200, ok.text



def test_lm_eval_remote_tokenizer_loglikelihood(server: Server, tok, tmp_path: Path) -> None:
    """`lm_eval --model local-completions ... tokenizer_backend=remote` on a local task, offline, from a directory
    without any tokenizer: each (context, continuation) scores the ids the server's /tokenize gives."""
    pytest.importorskip("lm_eval")
    exe = shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    assert exe is not None
    write_task(tmp_path, "dsv4_remote_mc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    # no PYTHONPATH: lm-eval's process needs nothing of ours (the checkout's kernels/ would shadow PyPI's)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    args = f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1"
    cmd = [exe, "--model", "local-completions", "--model_args", args, "--tasks", "dsv4_remote_mc",
           "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"), "--log_samples"]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [samples_file] = list((tmp_path / "out").rglob("samples_dsv4_remote_mc_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    for s in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]  # {"gen_args_0": {"arg_0": ...}}
        assert len(pairs) == len(s["doc"]["choices"])
        for (context, continuation), resp in zip(pairs, s["resps"], strict=True):
            ctx = tok.encode(context, add_special_tokens=False).ids  # as lm-eval's _encode_pair splits them
            cont = tok.encode(context + continuation, add_special_tokens=False).ids[len(ctx):]
            body = {"model": MODEL, "prompt": ctx + cont, "max_tokens": 0, "echo": True, "logprobs": 0}
            lp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
            want = sum(lp["token_logprobs"][len(ctx):])
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-5), (context, continuation, resp)
