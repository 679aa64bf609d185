"""Prompt logprobs through a real server on a make-tiny checkpoint (fp32) against transformers' full forward:
`echo` + `logprobs` (also with `max_tokens=0`, streamed, and in a list of prompts), vLLM's `prompt_logprobs`,
and lm-eval's `local-completions` loglikelihood path on a local multiple-choice task.

The 300-token prompt crosses the CSA/HCA boundaries; with `--prefill-chunk 64` most positions are scored
from the parallel prefill's every-position head and one position in 65 from the batched step's logits."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from dsv4_serve.service.api.chat import token_text
from tests.e2e.conftest import Server
from tests.e2e.lm_eval_task import DOCS, write_task

LEN, TOL = 300, 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_serve.model.cli import make_tiny_main

    path = tmp_path_factory.mktemp("tiny-ckpt")
    make_tiny_main([str(path), "--seed", "0", "--dtype", "float32"])
    return path


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    from tests.oracle import hf_load

    return hf_load(ckpt)


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """[T, V] log-softmax of transformers' cache-free forward (row t scores token t + 1), in float64."""
    from tests.oracle import hf_full_logits

    x = hf_full_logits(hf, ids).astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def srv(start_server, ckpt: Path) -> Server:
    return start_server("--model", str(ckpt), "--prefill-chunk", "64", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tok(ckpt: Path):
    from dsv4_serve.model.tokenizer import load_tokenizer

    return load_tokenizer(ckpt)


PROMPT = [int(t) for t in np.random.default_rng(7).integers(7, 512, LEN)]


def test_echo_matches_transformers(client: openai.OpenAI, hf, tok) -> None:
    ref = hf_logprobs(hf, PROMPT)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == LEN
    lp = c.logprobs
    assert lp.tokens == [token_text(tok, i) for i in PROMPT] and c.text == tok.decode(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = np.array([ref[t - 1, PROMPT[t]] for t in range(1, LEN)])
    got = np.array(lp.token_logprobs[1:], dtype=np.float64)
    assert np.abs(got - want).max() <= TOL
    for t in range(1, LEN):  # the top 3 (plus the prompt token itself) with their logprobs
        top3 = np.argsort(-ref[t - 1], kind="stable")[:3]
        want_top = {token_text(tok, int(i)): ref[t - 1, i] for i in top3}
        want_top[token_text(tok, PROMPT[t])] = ref[t - 1, PROMPT[t]]
        assert set(lp.top_logprobs[t]) == set(want_top)
        assert max(abs(lp.top_logprobs[t][k] - v) for k, v in want_top.items()) <= TOL
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(c.text)


def test_text_offset_after_partial_utf8(client: openai.OpenAI, tok) -> None:
    """Characters split over tokens: a token inside a character points at the character's start."""
    text = "aé b😀c, the fox"
    enc = tok.encode(text, add_special_tokens=False)
    ids, want = enc.ids, [start for start, _ in enc.offsets]  # the tokenizer's own character spans
    assert any("\ufffd" in tok.decode([i]) for i in ids) and len(set(want)) < len(want)  # split characters
    for prompt in (text, ids):
        c = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
        assert c.text == text and c.logprobs.text_offset == want


def test_vllm_prompt_logprobs_and_generation(srv: Server, hf, tok) -> None:
    ref = hf_logprobs(hf, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "logprobs": 0}
    c = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    pl = c["prompt_logprobs"]
    assert len(pl) == LEN and pl[0] is None
    for t in range(1, LEN):
        e = pl[t][str(PROMPT[t])]
        assert abs(e["logprob"] - ref[t - 1, PROMPT[t]]) <= TOL
        assert e["rank"] == 1 + int((ref[t - 1] > ref[t - 1, PROMPT[t]] + 1e-6).sum())
        assert len(pl[t]) in (2, 3)  # the top 2, and the prompt token if it is not one of them
    assert len(c["logprobs"]["tokens"]) == 3 and not c["text"].startswith(tok.decode(PROMPT))  # no echo


def test_echo_with_tokens_streamed_and_batched(client: openai.OpenAI, tok) -> None:
    kw = {"model": "tiny", "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    one = client.completions.create(prompt=PROMPT[:90], **kw).choices[0]
    prompt_text = tok.decode(PROMPT[:90])
    assert one.text.startswith(prompt_text) and len(one.logprobs.tokens) == 90 + 4
    gen_offsets = one.logprobs.text_offset[90:]
    assert gen_offsets[0] == len(prompt_text) and gen_offsets == sorted(gen_offsets)
    chunks = list(client.completions.create(prompt=PROMPT[:90], stream=True, **kw))
    assert chunks[0].choices[0].text.startswith(prompt_text)
    assert "".join(c.choices[0].text for c in chunks) == one.text
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == one.logprobs.token_logprobs
    batch = client.completions.create(prompt=[PROMPT[:90], PROMPT[:40]], **kw)
    by_index = sorted(batch.choices, key=lambda c: c.index)
    assert [c.index for c in by_index] == [0, 1]
    assert by_index[0].text == one.text and by_index[0].logprobs.token_logprobs == one.logprobs.token_logprobs
    assert by_index[1].text.startswith(tok.decode(PROMPT[:40]))
    assert batch.usage.prompt_tokens == 130



def test_lm_eval_local_completions_loglikelihood(srv: Server, ckpt: Path, hf, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_task(tmp_path, "dsv4_local_mc")
    lm = get_model("local-completions")(
        base_url=f"{srv.url}/v1/completions", model="tiny", tokenizer=str(ckpt), tokenizer_backend="huggingface",
        batch_size=4, num_concurrent=1, max_retries=1, max_length=512,
    )  # fmt: skip
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=["dsv4_local_mc"], task_manager=TaskManager(
            include_path=str(tmp_path)), log_samples=True, limit=None)  # fmt: skip
    except (OSError, ConnectionError) as e:  # a local task should need no network; skip only if it does
        if "offline" in str(e).lower() or "connect" in str(e).lower():
            pytest.skip(f"lm-eval needed the network for a local task: {e}")
        raise
    samples = out["samples"]["dsv4_local_mc"]
    assert len(samples) == len(DOCS)
    accs = []
    for s in samples:
        doc = s["doc"]
        lls = []
        for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
            ctx, cont = lm._encode_pair(context, continuation)
            ref = hf_logprobs(hf, ctx + cont)
            want = sum(ref[len(ctx) + i - 1, t] for i, t in enumerate(cont))
            got, _greedy = resp[0]
            assert abs(got - want) <= TOL * len(cont), (context, continuation, got, want)
            lls.append(want)
        accs.append(float(int(np.argmax(lls)) == doc["label"]))
    assert out["results"]["dsv4_local_mc"]["acc,none"] == pytest.approx(np.mean(accs))


def test_serial_prefill_scores_every_prompt_token_from_the_step(start_server, ckpt: Path, hf) -> None:
    """--serial-prefill: every prompt token goes through the batched step; its logits row scores the next one."""
    srv = start_server("--model", str(ckpt), "--serial-prefill", "--served-model-name", "tiny")
    ref = hf_logprobs(hf, PROMPT[:70])
    body = {"model": "tiny", "prompt": PROMPT[:70], "max_tokens": 0, "echo": True, "logprobs": 0}
    got = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    want = [ref[t - 1, PROMPT[t]] for t in range(1, 70)]
    assert got["token_logprobs"][0] is None and np.abs(np.array(got["token_logprobs"][1:]) - want).max() <= TOL
