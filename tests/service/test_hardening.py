"""The hardening parts on their own: key handling, limits before work, finite numbers, the capped
stream queue. The HTTP side of each runs against a real server in tests/e2e/test_hardening.py."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.model.tokenizer import build_tiny_tokenizer
from dsv4_serve.service.__main__ import build_parser, serve
from dsv4_serve.service.api import limits
from dsv4_serve.service.api.auth import KeySet
from dsv4_serve.service.api.protocol import APIError, ChatCompletionRequest, CompletionRequest
from dsv4_serve.service.engine.request import LOGPROB_FLOOR, FinishReason, SamplingParams, finite_logprob
from dsv4_serve.service.engine.sampler import sample
from dsv4_serve.service.engine.worker import EngineWorker
from dsv4_serve.service.settings import Settings
from tests.service.test_worker import ControlledEngine


# ---- API keys ----------------------------------------------------------------------------------
def test_keys_from_flags_env_and_file(tmp_path) -> None:
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b"])
    assert Settings.load({"api_key": args.api_key}, env={}).api_keys() == ("a", "b")
    assert Settings.load(env={"DSV4_API_KEY": " k1, k2 ,"}).api_keys() == ("k1", "k2")
    f = tmp_path / "keys"
    f.write_text("# operators\nfile-key-1\n\n  file-key-2  \n")
    s = Settings.load(env={"DSV4_API_KEY": "k1", "DSV4_API_KEY_FILE": str(f)})
    assert s.api_keys() == ("k1", "file-key-1", "file-key-2")
    assert Settings.load(env={}).api_keys() == ()


def test_a_key_file_that_names_no_key_stops_start_up(tmp_path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        Settings.load(env={"DSV4_API_KEY_FILE": str(empty)}).api_keys()
    assert serve(Settings.load({"api_key_file": str(tmp_path / "missing")}, env={})) == 2
    assert serve(Settings.load({"api_key_file": str(empty)}, env={})) == 2
    assert "--api-key-file" in capsys.readouterr().err


def test_keyset_accepts_only_its_bearer_keys() -> None:
    ks = KeySet(["alpha", "beta"])
    assert ks and not KeySet([])
    assert ks.accepts(b"Bearer alpha") and ks.accepts(b"bearer beta") and ks.accepts(b"Bearer  beta ")
    for bad in (None, b"", b"Bearer", b"Bearer alph", b"Bearer alphaX", b"Basic alpha", b"alpha", b"Bearer gamma"):
        assert not ks.accepts(bad), bad


# ---- limits before work ------------------------------------------------------------------------
def test_body_limit_default_grows_with_the_context() -> None:
    assert limits.body_limit_bytes(None, 1024) == limits.MIN_BODY_BYTES
    assert limits.body_limit_bytes(None, 1 << 20) == 32 << 20
    assert limits.body_limit_bytes(0.5, 1 << 20) == 1 << 19


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(512)


def test_the_text_bound_never_rejects_text_that_fits(tok) -> None:
    """No text has more characters than its tokens' count times the bound (the check is sound)."""
    per = limits.max_token_chars(tok)
    assert per == max(len(s) for s in tok.get_vocab(with_added_tokens=True))
    rng = np.random.default_rng(0)
    longest = max(tok.get_vocab(with_added_tokens=True), key=len)
    texts = [longest * 50, "The quick brown fox " * 40, "<｜User｜>" * 30, " " * 500]
    texts += ["".join(chr(c) for c in rng.integers(32, 0x3000, 300)) for _ in range(5)]
    for text in texts:
        n = len(tok.encode(text, add_special_tokens=False).ids)
        assert len(text) <= n * per
        limits.check_text_fits(tok, text, n, "prompt")  # a context of exactly n tokens takes it
    with pytest.raises(APIError) as e:
        limits.check_text_fits(tok, "x" * (10 * per + 1), 10, "messages")
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "context_length_exceeded")


def test_encode_off_the_loop_matches_encode(tok) -> None:
    for text in ("hi there", "The quick brown fox jumps. " * 2000):
        assert len(text) <= limits.INLINE_ENCODE_CHARS or len(text) > 50000
        assert asyncio.run(limits.encode(tok, text)) == tok.encode(text, add_special_tokens=False).ids


def test_strict_json_and_finite_floats() -> None:
    ok = limits.parse_body(b'{"prompt": "NaN and Infinity are words here", "temperature": 0.5}', CompletionRequest)
    assert ok.prompt.startswith("NaN")
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                b'{"prompt": "x", "seed": -Infinity}'):  # fmt: skip
        with pytest.raises(APIError) as e:
            limits.parse_body(raw, CompletionRequest)
        assert (e.value.status, e.value.code) == (400, "invalid_json")
    with pytest.raises(APIError) as e:  # 1e999 is valid JSON that overflows to inf
        limits.parse_body(b'{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e999}',
                          ChatCompletionRequest)  # fmt: skip
    assert (e.value.status, e.value.param) == (400, "repetition_penalty")


@pytest.mark.parametrize(
    ("field", "over", "at", "param"),
    [
        ("stop_list", ["x" * (limits.MAX_STOP_CHARS + 1)], ["x" * limits.MAX_STOP_CHARS], "stop"),
        ("stop_token_ids", [1] * (limits.MAX_STOP_TOKEN_IDS + 1), [1] * limits.MAX_STOP_TOKEN_IDS, "stop_token_ids"),
        ("logit_bias", {str(i): 1.0 for i in range(limits.MAX_LOGIT_BIAS + 1)},
         {str(i): 1.0 for i in range(limits.MAX_LOGIT_BIAS)}, "logit_bias"),
        ("tools", [{"type": "function"}] * (limits.MAX_TOOLS + 1), [{"type": "function"}] * limits.MAX_TOOLS, "tools"),
        ("tools", [{"description": "d" * limits.MAX_TOOLS_BYTES}], [{"description": "d" * 1000}], "tools"),
    ],
)
def test_caps_on_list_fields(field: str, over, at, param: str) -> None:
    with pytest.raises(APIError) as e:
        limits.check_caps(SimpleNamespace(**{field: over}))
    assert (e.value.status, e.value.param) == (400, param)
    limits.check_caps(SimpleNamespace(**{field: at}))  # at the cap: no error


def test_content_type() -> None:
    for ok in (None, "application/json", "application/json; charset=utf-8", "application/merge+json"):
        limits.check_content_type(ok)
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        with pytest.raises(APIError) as e:
            limits.check_content_type(bad)
        assert e.value.status == 415


# ---- numbers -----------------------------------------------------------------------------------
def test_tiny_temperatures_are_greedy_with_finite_logprobs() -> None:
    rng = np.random.default_rng(3)
    rows = rng.normal(0, 3, (3, 40)).astype(np.float32)
    params = [SamplingParams(temperature=t, logprobs=5, seed=1) for t in (1e-300, 5e-324, 9.9e-6)]
    assert all(p.greedy for p in params) and not SamplingParams(temperature=1e-5).greedy
    out = sample(mx.array(rows), params, [[], [], []], [0, 0, 0])
    for row, (tokid, lp, top) in zip(rows, out, strict=True):
        assert tokid == int(np.argmax(row))  # greedy
        assert math.isfinite(lp) and all(math.isfinite(v) for _, v in top)


def test_masked_alternatives_are_reported_at_the_floor() -> None:
    """EOS and stop ids banned by min_tokens are -inf; asked for as top logprobs they read -9999."""
    v = 8
    row = np.linspace(0, 1, v, dtype=np.float32)[None, :]
    p = SamplingParams(temperature=0.0, logprobs=v, min_tokens=3, stop_token_ids=(6,))
    ((tokid, lp, top),) = sample(mx.array(row), [p], [[]], [0], eos_token_id=7)
    assert tokid == 5 and math.isfinite(lp)
    assert dict(top)[7] == dict(top)[6] == LOGPROB_FLOOR and len(top) == v
    assert finite_logprob(float("-inf")) == finite_logprob(float("nan")) == LOGPROB_FLOOR
    assert finite_logprob(-1.5) == -1.5


# ---- a reader that stops: the capped queue -----------------------------------------------------
def test_an_unread_stream_holds_at_most_its_queue_and_is_aborted() -> None:
    model, _, _ = tiny_model(seed=0)
    eng = ControlledEngine(model, max_rows=2, max_model_len=128, page_size=64)
    w = EngineWorker(lambda: (eng, None), stream_queue=6)
    w.start()
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def body():
        assert await w.wait_ready(30), w.start_error
        try:
            it = await w.submit([3, 4], long)
            first = await it.__anext__()
            peak = 0
            for _ in range(2000):  # never read: the queue fills, overflows, the row is freed
                peak = max(peak, w.stats()["stream_events_queued"])
                if w.stats()["running"] == 0 and eng.bytes_in_use() == 0:
                    break
                await asyncio.sleep(0.005)
            rest = [ev async for ev in it]
            return first, peak, rest, w.stats()
        finally:
            await w.drain(0)

    first, peak, rest, stats = asyncio.run(body())
    assert first.token_id is not None and peak <= 6
    assert stats["running"] == 0 and stats["tokens_total"] < long.max_tokens
    assert len(rest) == 6 + 1 and all(ev.token_id is not None for ev in rest[:-1])
    assert rest[-1].finish_reason is FinishReason.ABORT and rest[-1].token_id is None
