"""Two API keys on one real server (tiny model): neither reaches the other's conversations, cache or output.

Each test reproduces an attack of issue 49: reading another key's state by its id, learning another key's
prompt from the prefix cache (cached_tokens), and importing forged, replayed, cross-key, non-finite or
oversized states; then a seeded fuzz of POST /v1/state. After every attack the other key's greedy output is
what it was before (probed cold, under a fresh cache_salt, and in its own namespace)."""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import struct
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL, Server

MAGIC = b"DSV4-STATE\n"
SECRET = b"tenants-e2e-state-secret-0123456789"
K1, K2 = "key-one", "key-two"
BODY_MB = 0.05  # the JSON endpoints' cap; states are larger and go by their own


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tenants") / "state.key"
    path.write_bytes(SECRET)
    return str(path)


def serve(start_server, secret_file: str) -> Server:
    return start_server("--api-key", K1, "--api-key", K2, "--state-secret-file", secret_file,
                        "--max-body-mb", str(BODY_MB))  # fmt: skip


@pytest.fixture(scope="module")
def two(start_server, secret_file: str) -> Server:
    return serve(start_server, secret_file)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(srv: Server, key: str, prompt: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0, **extra}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=auth(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict[str, Any]) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def greedy(resp: dict[str, Any]) -> tuple[str, list[str], list[float]]:
    lp = resp["choices"][0]["logprobs"]
    return resp["choices"][0]["text"], lp["tokens"], [round(x, 4) for x in lp["token_logprobs"]]


def export(srv: Server, key: str, rid: str) -> httpx.Response:
    return httpx.get(f"{srv.url}/v1/state/{rid}", headers=auth(key), timeout=60)


def post_state(srv: Server, key: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/state", content=data, timeout=60,
                      headers={**auth(key), "content-type": "application/octet-stream"})  # fmt: skip


def split(state: bytes) -> tuple[dict[str, Any], bytes]:
    """A state's header and payload (format 2: MAGIC, version, header length, header, payload, MAC)."""
    _, n = struct.unpack_from("<II", state, len(MAGIC))
    start = len(MAGIC) + 8
    return json.loads(state[start : start + n]), state[start + n : -32]


def frame(head: bytes, payload: bytes, version: int = 2, size: int | None = None) -> bytes:
    return MAGIC + struct.pack("<II", version, len(head) if size is None else size) + head + payload


def sign(body: bytes, key: bytes = SECRET) -> bytes:
    return body + hmac.new(key, body, hashlib.sha256).digest()


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def probe(srv: Server, prompt: list[int], salt: str) -> tuple[Any, ...]:
    """K2's greedy continuation of `prompt`: cold under a fresh salt (text, tokens, logprobs), then the tokens in
    its own namespace (where a hit can only be K2's own earlier request)."""
    salted, plain = complete(srv, K2, prompt, 8, cache_salt=salt), complete(srv, K2, prompt, 8)
    assert cached(salted) == 0
    return greedy(salted), greedy(plain)[1]


def test_another_key_gets_404_for_a_state(two: Server) -> None:
    r = complete(two, K1, prompt_of(1, 120) + [7, 7], 6)
    mine = export(two, K1, r["id"])
    assert mine.status_code == 200 and mine.headers["content-type"] == "application/octet-stream"
    other = export(two, K2, r["id"])
    assert other.status_code == 404 and other.json()["error"]["code"] == "state_not_found", other.text
    assert K1 not in other.text and r["id"] in other.text  # the body names the id asked for, nothing of K1's
    assert httpx.get(f"{two.url}/v1/state/{r['id']}", timeout=30).status_code == 401


def test_the_prefix_cache_is_per_key_and_per_salt(two: Server) -> None:
    doc = prompt_of(2, 720)
    assert cached(complete(two, K1, doc + [11], 2)) == 0
    assert cached(complete(two, K1, doc + [12], 2)) >= 700  # K1's own second request: a hit
    assert cached(complete(two, K2, doc + [12], 2)) == 0  # K2 guessing K1's document learns nothing
    assert cached(complete(two, K1, doc + [13], 2, cache_salt="alpha")) == 0  # another salt, another cache
    assert cached(complete(two, K1, doc + [14], 2, cache_salt="alpha")) >= 700  # the same salt: a hit
    assert cached(complete(two, K2, doc + [14], 2, cache_salt="alpha")) == 0  # the salt is per key
    # Chat and the Responses API take cache_salt too (vLLM's field, through the openai SDK's extra_body).
    system = [{"role": "system", "content": "A long shared instruction. " * 60}]
    chats = {k: openai.OpenAI(base_url=f"{two.url}/v1", api_key=k, max_retries=0) for k in (K1, K2)}

    def chat(key: str, q: str, salt: str) -> int:
        msgs = [*system, {"role": "user", "content": q}]
        r = chats[key].chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,
                                               extra_body={"cache_salt": salt})  # fmt: skip
        return r.usage.prompt_tokens_details.cached_tokens

    assert chat(K1, "first?", "beta") == 0 and chat(K1, "second?", "beta") > 0 and chat(K2, "second?", "beta") == 0
    resp = chats[K1].responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={"cache_salt": "beta"})
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens >= 1
    bad = httpx.post(f"{two.url}/v1/completions", headers=auth(K1), timeout=30,
                     json={"prompt": [5, 6], "max_tokens": 1, "cache_salt": ""})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_hostile_imports_are_4xx_and_change_nothing_for_the_other_key(two: Server, start_server,
                                                                      secret_file: str) -> None:  # fmt: skip
    r = complete(two, K1, prompt_of(3, 300), 6)
    state = export(two, K1, r["id"]).content
    head, payload = split(state)
    assert len(state) > BODY_MB * 2**20  # larger than the JSON cap: POST /v1/state has its own
    n = head["tokens"]
    tokens = list(struct.unpack_from(f"<{n}i", payload))
    victim = tokens + [9, 8, 7, 6]  # a prompt that would adopt the state if it reached K2's cache
    assert cached(complete(two, K2, victim, 2)) == 0  # K2 never sent it: no hit in its own namespace
    before = probe(two, victim, "before")

    # 1. forged: another prompt's token ids in the payload, the format-1 trailer (a plain SHA-256) recomputed
    forged = frame(json.dumps(head).encode(), struct.pack(f"<{n}i", *prompt_of(4, n)) + payload[4 * n :])
    for blob in (forged + hashlib.sha256(forged).digest(), sign(forged, b"guessed-secret-" * 3)):
        got = post_state(two, K1, blob)
        assert got.status_code == 400 and "signature" in got.text, got.text
    # 2. replayed: the same export again (its tokens are cached for K1 already: never replaced)
    assert post_state(two, K1, state).status_code == 409
    # 3. cross-key: K2 imports K1's export (K2 could read its tokens, but never owns the state); the answer is a
    # forged state's, word for word, so K2 cannot tell a genuine export of another key from a forgery (issue 63)
    cross, fake = post_state(two, K2, state), post_state(two, K2, forged + hashlib.sha256(forged).digest())
    assert cross.status_code == fake.status_code == 400 and cross.json() == fake.json(), (cross.text, fake.text)
    # 4. non-finite: validly signed (this test holds the secret), a NaN in the window ring, +inf in an entry
    arrays = head["arrays"]
    at = {name: off for name, off in zip([a[0] for a in arrays], _offsets(arrays), strict=True)}
    for name in ("slot.window0", "entries.ckv1"):
        bad = bytearray(payload)
        bad[at[name] : at[name] + 4] = struct.pack("<f", float("nan") if name.startswith("slot") else float("inf"))
        got = post_state(two, K1, sign(frame(json.dumps(head).encode(), bytes(bad))))
        assert got.status_code == 400 and "non-finite" in got.text, got.text
    # 5. oversized: refused from Content-Length, and while a chunked body streams in
    assert post_state(two, K1, bytes(3 << 20)).status_code == 413
    chunked = httpx.post(f"{two.url}/v1/state", headers=auth(K1), timeout=60,
                         content=(bytes(1 << 16) for _ in range(64)))  # fmt: skip
    assert chunked.status_code == 413, chunked.text
    assert probe(two, victim, "after") == before  # K2: the same greedy output, still no hit

    # The same state is welcome where it is not cached yet (a server sharing the secret): K1 resumes from it,
    # K2 does not see it; importing it twice there is a replay.
    there = serve(start_server, secret_file)
    moved = post_state(there, K1, state)
    assert moved.status_code == 200 and moved.json()["tokens"] == n, moved.text
    replay = post_state(there, K1, state)
    assert replay.status_code == 409 and "replay" in replay.text, replay.text
    assert cached(complete(there, K1, victim, 8)) == n
    assert probe(there, victim, "there") == before


def _offsets(arrays: list[list[Any]]) -> list[int]:
    """Each array's byte offset in the payload (the tiny model's arrays are all 4-byte types)."""
    out, off = [], 0
    for _, _, shape in arrays:
        out.append(off)
        size = 4
        for d in shape:
            size *= d
        off += size
    return out


def test_a_seeded_fuzz_of_the_state_endpoint_never_gets_a_5xx(two: Server) -> None:
    rng = random.Random(49)
    r = complete(two, K1, prompt_of(5, 200), 4)
    state = export(two, K1, r["id"]).content
    head, payload = split(state)
    raw_head = json.dumps(head).encode()
    hostile = [b"[" * 100_000, b'{"tokens": ' + b"9" * 5000 + b"}", b"\xff\xfe", b"null", b"1e999", b'{"a":' * 5000,
               json.dumps({**head, "tokens": 10**40}).encode(), json.dumps({**head, "tokens": -1}).encode(),
               json.dumps({**head, "arrays": [[[[["x"]]]]]}).encode(), json.dumps({**head, "model": None}).encode(),
               json.dumps({**head, "tenant": "someone-else"}).encode(), json.dumps({**head, "extra": 1}).encode(),
               json.dumps({**head, "nonce": "0" * 32}).encode()]  # fmt: skip
    cases: list[bytes] = []
    for _ in range(50):  # truncated
        cases.append(state[: rng.randrange(len(state))])
    for _ in range(60):  # bit flips, 1..8 anywhere
        b = bytearray(state)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    for _ in range(20):  # wrong version, header length out of range (signed: past the MAC)
        version = rng.choice([0, 1, 3, 2**32 - 1, rng.randrange(2**32)])
        cases.append(state[:11] + struct.pack("<I", version) + state[15:])
        size = rng.choice([0, 2**32 - 1, len(raw_head) + rng.randint(1, 999)])
        cases.append(sign(frame(raw_head, payload, size=size)))
    for h in hostile:  # hostile headers: resealed as an attacker can (SHA-256), and signed with the secret
        body = frame(h, payload)
        cases += [body + hashlib.sha256(body).digest(), sign(body), sign(frame(h, b""))]
    for _ in range(30):  # random bytes behind the magic, signed or not
        junk = MAGIC + rng.randbytes(rng.randrange(0, 4096))
        cases.append(sign(junk) if rng.random() < 0.5 else junk)
    assert len(cases) >= 200
    victim = [*prompt_of(5, 200), 4, 4]
    before = probe(two, victim, "fuzz-before")
    statuses = [post_state(two, K1, c).status_code for c in cases]
    assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert httpx.get(f"{two.url}/ready", timeout=10).status_code == 200
    assert probe(two, victim, "fuzz-after") == before
