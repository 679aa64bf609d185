"""Exported decode states (service/engine/state_format.py, state_io.py) and the prefix cache's namespaces on the
tiny model (f32, CPU): a state moves between page sizes and gives cold logits; anything altered, foreign,
another key's, replayed or non-finite is refused by name; hostile headers signed with the secret are refused
without any other exception; a freed slot's values never reach its next occupant; one namespace's stores evict
its own entries before another's."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections import OrderedDict
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from dsv4_serve.service.engine.prefix_cache import PrefixCache
from dsv4_serve.service.engine.request import StateConflict, StateError
from dsv4_serve.service.engine.state_format import MAGIC, Layout, open_state, seal
from dsv4_serve.service.engine.state_io import export_entry, install, layout, model_identity
from tests.service.test_prefix_cache import CAP, LEN, PAGE, cold_logits
from tests.service.test_prefix_cache import prompt as prompt  # noqa: F401 - the module-scoped fixtures
from tests.service.test_prefix_cache import tiny as tiny  # noqa: F401

SECRET = b"0123456789abcdef0123456789abcdef"
NS = ("tenant-one", "")


def lay_of(model, cache: PrefixCache) -> Layout:
    engine = SimpleNamespace(prefix_cache=cache, model=model, vocab_size=model.args.vocab_size, max_model_len=CAP)
    return layout(engine)


def parts(data: bytes) -> tuple[dict, bytes]:
    """The header and payload of a sealed state (the framing as the format's docstring gives it)."""
    (version, n) = struct.unpack_from("<II", data, len(MAGIC))
    start = len(MAGIC) + 8
    return json.loads(data[start : start + n]), data[start + n : -32]


def signed(head: bytes, payload: bytes, version: int = 2, secret: bytes = SECRET, size: int | None = None) -> bytes:
    body = MAGIC + struct.pack("<II", version, len(head) if size is None else size) + head + payload
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def resign(data: bytes, change_head=None, change_payload=None) -> bytes:
    head, payload = parts(data)
    head = change_head(head) if change_head else head
    payload = change_payload(bytearray(payload)) if change_payload else payload
    return signed(json.dumps(head).encode(), bytes(payload))


def offset(head: dict, name: str) -> int:
    """Byte offset of array `name` in the payload (the tiny model's arrays are all 4-byte types)."""
    off = 0
    for k, _, shape in head["arrays"]:
        if k == name:
            return off
        off += 4 * int(np.prod(shape))
    raise KeyError(name)


def poke(payload: bytearray, at: int, value: float) -> bytearray:
    payload[at : at + 4] = struct.pack("<f", value)
    return payload


def test_a_state_moves_between_page_sizes_within_its_namespace_and_refuses_others(tiny, prompt) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE)
    cache = PrefixCache(pools, 1 << 30, interval=0)
    h = pools.alloc(CAP)
    model.prefill(pools, h, prompt[:150], 0, chunk=150, logits=False)
    data = seal(SECRET, *export_entry(cache, cache.store(h, prompt[:150], ns=NS), lay_of(model, cache)))
    other = StatePools(args, max_slots=2, max_positions=CAP, page_size=16)  # another page size
    there = PrefixCache(other, 1 << 30, interval=0)
    lay, nonces = lay_of(model, there), OrderedDict()
    opened = open_state(data, SECRET, lay, NS[0])
    rid, n = install(there, opened, nonces)
    assert n == 150 and there.by_request(rid).length == 150 and there.by_request(rid).ns == NS
    assert there.lookup(prompt) is None and there.lookup(prompt, ns=("tenant-two", "")) is None
    h2 = there.adopt(other.alloc(CAP), there.lookup(prompt, ns=NS))
    got = np.array(model.prefill(other, h2, prompt[150:], 150, chunk=LEN))
    assert np.max(np.abs(got - cold_logits(tiny, prompt))) <= 1e-5
    other.free(h2)

    with pytest.raises(StateConflict, match="replay"):
        install(there, opened, nonces)
    again = open_state(seal(SECRET, *export_entry(cache, cache.lookup(prompt, ns=NS), lay)), SECRET, lay, NS[0])
    with pytest.raises(StateConflict, match="already"):  # a fresh export of the same tokens: never replaces
        install(there, again, nonces)
    with pytest.raises(StateError) as cross:  # another key's genuine export: a forged one's error, word for word
        open_state(data, SECRET, lay, "tenant-two")
    with pytest.raises(StateError) as forged:
        open_state(bytes(data[:-1]) + bytes([data[-1] ^ 1]), SECRET, lay, NS[0])
    assert str(cross.value) == str(forged.value)
    assert model_identity(tiny_model(seed=1)[0]) != lay.identity  # other weights, same config
    head, payload = parts(data)
    flipped = [bytearray(data) for _ in range(3)]
    for blob, at in zip(flipped, (len(MAGIC) + 20, len(data) - len(payload) - 10, len(data) - 1), strict=True):
        blob[at] ^= 0x10  # the header, the payload, the MAC
    score = offset(head, "slot.comp_score1")
    bad = {
        "signature": [*map(bytes, flipped), data[:-5], data[:-40] + data[-32:],
                      signed(json.dumps(head).encode(), payload, secret=b"x" * 32)],
        "bad magic": [b"hello", b"", MAGIC],
        "version": [signed(json.dumps(head).encode(), payload, version=1), data[:11] + b"\x01" + data[12:]],
        "another model": [resign(data, lambda h: {**h, "model": "x"})],
        "do not match": [resign(data, lambda h: {**h, "arrays": h["arrays"][:-1]}),
                         resign(data, lambda h: {**h, "arrays": [[a[0], "float16", a[2]] for a in h["arrays"]]})],
        "tokens": [resign(data, lambda h: {**h, "tokens": 0}), resign(data, lambda h: {**h, "tokens": CAP})],
        "token ids": [resign(data, None, lambda p: p[:0] + struct.pack("<i", args.vocab_size) + p[4:]),
                      resign(data, None, lambda p: p[:0] + struct.pack("<i", -1) + p[4:])],
        "payload": [resign(data, None, lambda p: p[:-4]), resign(data, None, lambda p: p + b"\0" * 4)],
        "non-finite": [resign(data, None, lambda p: poke(p, offset(head, "slot.window0") + 8, float("nan"))),
                       resign(data, None, lambda p: poke(p, score, float("inf"))),
                       resign(data, None, lambda p: poke(p, offset(head, "entries.ckv1"), float("-inf")))],
    }  # fmt: skip
    for why, blobs in bad.items():
        for blob in blobs:
            with pytest.raises(StateError, match=why):
                open_state(blob, SECRET, lay, NS[0])
    # A score window's -inf marks a row not written yet: accepted
    assert open_state(resign(data, None, lambda p: poke(p, score, float("-inf"))), SECRET, lay, NS[0]).tokens


def test_hostile_headers_signed_with_the_secret_are_state_errors(tiny) -> None:
    """Bounded parsing even past the HMAC: deep nesting, huge ints, other types, lengths out of range."""
    model, args = tiny
    lay = lay_of(model, PrefixCache(StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE), 1 << 20))
    keys = {"model": lay.identity, "tenant": "", "salt": "", "nonce": "0" * 32, "tokens": 3, "arrays": []}
    heads = [b"[" * 200_000, b'{"tokens": ' + b"9" * 5000 + b"}", b"\xff\xfe\x00", b"", b"[]", b"null", b"1e999",
             b'{"model": 1}', json.dumps({**keys, "extra": 1}).encode(), json.dumps({**keys, "tokens": 2.0}).encode(),
             json.dumps({**keys, "tokens": True}).encode(), json.dumps({**keys, "nonce": "x"}).encode(),
             json.dumps({**keys, "arrays": {"a": 1}}).encode(), json.dumps({**keys, "tokens": 10**30}).encode(),
             json.dumps({**keys, "arrays": [[[[[[1]]]]]] * 1000}).encode()]  # fmt: skip
    blobs = [signed(h, b"\0" * 64) for h in heads]
    blobs += [signed(b"{}", b"", size=2**32 - 1), signed(b"{}", b"", size=3), signed(b"{}" * 10, b"", size=1 << 21)]
    for blob in blobs:
        with pytest.raises(StateError):
            open_state(blob, SECRET, lay, "")


def test_half_precision_values_are_checked_by_their_bits() -> None:
    lay = Layout("m", 10, 100, (("comp_score0", "bfloat16", (2,)), ("window0", "float16", (2,))), ())
    head = json.dumps({"model": "m", "tenant": "", "salt": "s", "nonce": "0" * 32, "tokens": 1,
                       "arrays": [[k, d, list(s)] for k, d, s in lay.arrays(1)]}).encode()  # fmt: skip

    def state(score: int, window: int) -> bytes:
        return signed(head, struct.pack("<iHHHH", 3, 0x3F80, score, 0x3C00, window))

    opened = open_state(state(0xFF80, 0x0000), SECRET, lay, "")  # bf16 -inf in a score window: its empty mark
    assert opened.tokens == [3] and opened.namespace == ("", "s")
    for score, window in ((0x7FC0, 0), (0x7F80, 0), (0xFFC1, 0), (0, 0x7E00), (0, 0x7C00), (0, 0xFC00)):
        with pytest.raises(StateError, match="non-finite"):
            open_state(state(score, window), SECRET, lay, "")


def test_a_freed_slot_s_values_never_reach_its_next_occupant(tiny, prompt) -> None:
    """NaN everywhere in a slot (window ring, compressor values and scores), freed: the next request there
    reads nothing of it (masked rows weigh 0, and 0 x NaN would be NaN)."""
    model, args = tiny
    pools = StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE)
    h = pools.alloc(CAP)
    pools.load_slot(h.slot, {k: mx.full(v.shape[1:], float("nan"), v.dtype) for k, v in pools.slot_arrays().items()})
    mx.eval(pools.arrays())
    pools.free(h)
    h = pools.alloc(CAP)
    got = np.array(model.prefill(pools, h, prompt[:150], 0, chunk=150))
    assert np.isfinite(got).all() and np.max(np.abs(got - cold_logits(tiny, prompt[:150]))) <= 1e-5
    logits = np.array(model.step(model.make_batch(pools, [h], [150]), mx.array([prompt[150]], dtype=mx.int32), pools))
    assert np.isfinite(logits).all()


def _four_prefix_cache(args):  # noqa: ANN001, ANN202
    """A cache of four 150-token prefixes' bytes, one prefix's bytes, and store(ns, first): [first] * 150."""
    pools = StatePools(args, max_slots=1, max_positions=CAP, page_size=PAGE, pages={4: 200, 128: 30})
    one = pools.slot_bytes() + 5 * pools.page_bytes(4) + pools.page_bytes(128)  # a 150-token prefix
    cache = PrefixCache(pools, 4 * one, interval=0)

    def store(ns, first: int) -> None:  # noqa: ANN001
        h = pools.alloc(CAP)
        assert cache.store(h, [first] * 150, ns=ns) is not None
        pools.free(h)

    return cache, one, store


def test_namespaces_see_only_their_entries_and_the_largest_one_is_evicted_first(tiny) -> None:
    cache, one, store = _four_prefix_cache(tiny[1])
    a, b = ("key-a", ""), ("key-b", "")

    store(a, 1)
    store(a, 2)
    assert cache.lookup([1] * 151, ns=b) is None and cache.lookup([1] * 151, ns=("key-a", "salt")) is None
    assert cache.lookup([1] * 151, ns=a).length == 150
    for k in range(10, 16):  # b stores six prefixes: past the budget, b's own oldest go, never a's
        store(b, k)
        assert cache.bytes <= cache.budget
    assert cache.lookup([1] * 151, ns=a) is not None and cache.lookup([2] * 151, ns=a) is not None
    assert cache.namespace_bytes(a) == 2 * one and cache.namespace_bytes(b) == 2 * one
    assert cache.evictions == 4 and cache.lookup([15] * 151, ns=b) is not None


def test_a_tenant_s_bytes_count_across_its_salts_so_a_fresh_salt_flood_evicts_its_own(tiny) -> None:
    """Issue 63: a tenant sending a fresh cache_salt a request never held the largest (tenant, salt) namespace,
    so its flood evicted everyone else. Bytes count per tenant across its salts: the flood evicts its own
    entries, least recently used first across its salts."""
    cache, one, store = _four_prefix_cache(tiny[1])
    a = ("key-a", "")

    store(a, 1)
    store(a, 2)
    for k in range(10, 20):  # b: ten prefixes, each under a salt of its own
        store(("key-b", f"salt-{k}"), k)
        assert cache.bytes <= cache.budget
    assert cache.lookup([1] * 151, ns=a).length == 150 and cache.lookup([2] * 151, ns=a).length == 150
    assert cache.tenant_bytes("key-a") == 2 * one and cache.tenant_bytes("key-b") == 2 * one
    assert cache.evictions == 8
    b_left = [k for k in range(10, 20) if cache.has([k] * 150, ("key-b", f"salt-{k}"))]
    assert b_left == [18, 19]  # b's newest two: its oldest went first, across its salts
    # A lookup refreshes an entry across salts: b's salt-18 entry used now, salt-19's goes next.
    assert cache.lookup([18] * 151, ns=("key-b", "salt-18")) is not None
    store(("key-b", "salt-20"), 20)
    assert cache.has([18] * 150, ("key-b", "salt-18")) and not cache.has([19] * 150, ("key-b", "salt-19"))
    assert cache.lookup([1] * 151, ns=a) is not None


def test_a_short_or_unreadable_state_secret_file_is_refused(tmp_path) -> None:
    from dsv4_serve.service.settings import Settings

    short, good = tmp_path / "short.key", tmp_path / "good.key"
    short.write_bytes(b"x" * 31 + b"\n")
    good.write_bytes(b"y" * 32 + b"\n")
    with pytest.raises(ValueError, match="at least 32"):
        Settings(state_secret_file=str(short)).state_secret()
    with pytest.raises(OSError):
        Settings(state_secret_file=str(tmp_path / "missing.key")).state_secret()
    assert Settings(state_secret_file=str(good)).state_secret() == b"y" * 32
    assert Settings().state_secret() is None
