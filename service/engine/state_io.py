"""Export and import of a cached conversation state (GET /v1/state/{id}, POST /v1/state).

Layout (version 1): MAGIC, a little-endian uint32 header length, the header (JSON: version, the model's
identity, the token ids, the arrays' names / dtypes / shapes in payload order), the payload (each array's
raw bytes, C order), then the SHA-256 of everything before it. The arrays are the slot copy
(`slot.<name>`, StatePools.slot_state) and the prefix's compressed entries per pool (`entries.<name>`,
[p // ratio, d]): entries, not pages, so the page size of the importing server does not matter.
The identity is a hash of the config, the dtype and a sample of every weight: a state from another
model (or other weights) is refused, as is anything malformed (`StateError`, the API's 400).
Engine thread only.
"""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from dataclasses import asdict

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dsv4_serve.service.engine.prefix_cache import Entry, PrefixCache
from dsv4_serve.service.engine.request import StateError, StateNotFound

MAGIC = b"DSV4-STATE\n"
VERSION = 1
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def model_identity(model) -> str:
    """A hash of the config, the dtype and the first bytes of every parameter (sharded models: rank 0's)."""
    h = hashlib.sha256(json.dumps(asdict(model.args), sort_keys=True, default=str).encode())
    h.update(str(model.dtype).encode())
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    heads = [a.reshape(-1)[:16] for _, a in params]
    mx.eval(heads)
    for (name, a), head in zip(params, heads, strict=True):
        h.update(f"{name}:{a.shape}:{a.dtype}".encode())
        h.update(_raw(head))
    return h.hexdigest()


def _raw(a: mx.array) -> bytes:
    """An array's bytes in C order (any dtype: through a uint8 view, since numpy has no bfloat16)."""
    a = mx.contiguous(a)
    return np.array(a.view(mx.uint8) if a.ndim else a.reshape(1).view(mx.uint8)).tobytes()


def _dtype_name(d: mx.Dtype) -> str:
    return str(d).removeprefix("mlx.core.")


def export_state(cache: PrefixCache, entry: Entry, identity: str) -> bytes:
    pools, n = cache.pools, entry.length
    arrays = {f"slot.{k}": v for k, v in entry.slot.items()}
    for r in pools.ratios:
        arrays.update({f"entries.{k}": v for k, v in pools.read_entries(r, entry.pages[r], n // r).items()})
    mx.eval(list(arrays.values()))
    header = {
        "version": VERSION,
        "model": identity,
        "tokens": entry.tokens(),
        "arrays": [[k, _dtype_name(v.dtype), list(v.shape)] for k, v in arrays.items()],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<I", len(head)) + head + b"".join(_raw(v) for v in arrays.values())
    return body + hashlib.sha256(body).digest()


def _parse(data: bytes) -> tuple[dict, memoryview]:
    if not data.startswith(MAGIC):
        raise StateError("not a dsv4-serve state (bad magic)")
    if len(data) < len(MAGIC) + 4 + 32 or hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise StateError("the state is corrupt (checksum mismatch)")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start : start + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"the state's header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise StateError("the state's header is not an object")
    return header, memoryview(data)[start + size : len(data) - 32]


def import_state(cache: PrefixCache, data: bytes, identity: str, vocab_size: int, max_len: int) -> tuple[str, int]:
    """Parse, check and cache a state; (its id for GET /v1/state/{id}, its token count)."""
    header, payload = _parse(data)
    if header.get("version") != VERSION:
        raise StateError(f"state version {header.get('version')!r} is not supported (this server reads {VERSION})")
    if header.get("model") != identity:
        raise StateError("the state is from another model (its model identity does not match this server's)")
    tokens = header.get("tokens")
    ok = isinstance(tokens, list) and tokens and all(type(t) is int and 0 <= t < vocab_size for t in tokens)
    if not ok:
        raise StateError(f"the state's tokens must be a non-empty list of ids in [0, {vocab_size})")
    if len(tokens) >= max_len:
        raise StateError(f"the state holds {len(tokens)} tokens; this server's context is {max_len}")
    pools, n = cache.pools, len(tokens)
    want = {f"slot.{k}": (v.dtype, tuple(v.shape[1:])) for k, v in pools.slot_arrays().items()}
    for r in pools.ratios:
        for name, arr in pools.page_pools(r).items():
            want[f"entries.{name}"] = (arr.dtype, (n // r, arr.shape[-1]))
    arrays, off = {}, 0
    listed = header.get("arrays")
    ok = isinstance(listed, list) and all(isinstance(a, list) and len(a) == 3 for a in listed)
    if not ok or [a[0] for a in listed] != list(want):
        raise StateError("the state's arrays do not match this model's decode state")
    for name, dtype, shape in listed:
        wdtype, wshape = want[name]
        if dtype != _dtype_name(wdtype) or not isinstance(shape, list) or tuple(shape) != wshape:
            raise StateError(f"array {name}: {dtype} {shape}, this server needs {_dtype_name(wdtype)} {list(wshape)}")
        size = int(np.prod(wshape, dtype=np.int64)) * wdtype.size
        if off + size > len(payload):
            raise StateError("the state is truncated")
        raw = np.frombuffer(payload[off : off + size], dtype=np.uint8)
        arrays[name] = mx.array(raw.reshape(*wshape[:-1], wshape[-1] * wdtype.size)).view(wdtype) if size else (
            mx.zeros(wshape, wdtype))  # fmt: skip
        off += size
    if off != len(payload):
        raise StateError("the state has trailing bytes")
    need = cache.pages_of(n)
    if pools.slot_bytes() + sum(k * pools.page_bytes(r) for r, k in need.items()) > cache.budget:
        raise StateError(f"the state ({n} tokens) is larger than this server's prefix cache budget")
    while any(pools.free_pages(r) < k for r, k in need.items()) and cache.evict_one():
        pass
    if any(pools.free_pages(r) < k for r, k in need.items()):
        raise StateError("no free decode state pages for this state now; retry later")
    pages = {r: pools.new_pages(r, k) for r, k in need.items()}
    for r in pools.ratios:
        pools.write_entries(r, pages[r], {k.removeprefix("entries."): v for k, v in arrays.items()
                                          if k.startswith("entries.") and k.removeprefix("entries.") in
                                          pools.page_pools(r)})  # fmt: skip
    slot = {k.removeprefix("slot."): v for k, v in arrays.items() if k.startswith("slot.")}
    mx.eval(list(slot.values()), pools.arrays())
    rid = f"state-{uuid.uuid4().hex}"
    cache.insert(tokens, slot, pages, rid)
    return rid, n


def _identity(engine) -> str:
    ident = getattr(engine, "_state_identity", None)
    if ident is None:
        ident = engine._state_identity = model_identity(engine.model)
    return ident


def _cache(engine) -> PrefixCache:
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        raise StateError("this server runs without a prefix cache (--prefix-cache-gib 0): no states to move")
    return cache


def export_for(engine, state_id: str) -> bytes:
    """GET /v1/state/{id} on the engine thread: the end state of finished request `state_id`."""
    cache = _cache(engine)
    entry = cache.by_request(state_id)
    if entry is None:
        raise StateNotFound(f"no cached state for {state_id!r} (unknown, still running, or evicted)")
    return export_state(cache, entry, _identity(engine))


def import_for(engine, data: bytes) -> tuple[str, int]:
    """POST /v1/state on the engine thread."""
    return import_state(_cache(engine), data, _identity(engine), engine.vocab_size, engine.max_model_len)
