"""Export and import of a cached conversation state (GET /v1/state/{id}, POST /v1/state), the engine
thread's part: reading an entry's arrays for `state_format.seal`, and installing what `state_format.open_state`
checked as a prefix cache entry in its owner's namespace. The format and its checks: state_format.py.

The model identity is a hash of the config, the dtype and a sample of every weight: a state from another
model (or other weights) is refused. A state belongs to the API key that made it: another key's export is
"not found", and an import goes into its own key's namespace and never replaces an entry there (409, as
a replay of an export already imported here is). Engine thread only.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dsv4_serve.service.engine.prefix_cache import Entry, PrefixCache
from dsv4_serve.service.engine.request import StateConflict, StateError, StateNotFound
from dsv4_serve.service.engine.state_format import Layout, Opened

if TYPE_CHECKING:
    from dsv4_serve.service.engine.engine import Engine

MAX_NONCES = 1 << 16  # imported exports remembered (replays refused); past it the oldest are forgotten


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


def layout(engine: Engine) -> Layout:
    """The state layout of this engine's model and pools (computed once)."""
    got = getattr(engine, "_state_layout", None)
    if got is None:
        pools = _cache(engine).pools
        slot = tuple((k, _dtype_name(v.dtype), tuple(v.shape[1:])) for k, v in pools.slot_arrays().items())
        entries = tuple((k, _dtype_name(v.dtype), r, int(v.shape[-1])) for r in pools.ratios
                        for k, v in pools.page_pools(r).items())  # fmt: skip
        got = engine._state_layout = Layout(model_identity(engine.model), engine.vocab_size, engine.max_model_len,
                                            slot, entries)  # fmt: skip
    return got


def export_for(engine: Engine, state_id: str, tenant: str) -> tuple[dict[str, Any], list[bytes]]:
    """GET /v1/state/{id} on the engine thread: the header and raw arrays of the end state of finished request
    `state_id`, when API key `tenant` made it (for `state_format.seal`, off this thread)."""
    settle = getattr(engine, "settle", None)  # a replayed step left running writes the pools: it ends first
    if settle is not None:
        settle()
    cache, lay = _cache(engine), layout(engine)
    entry = cache.by_request(state_id)
    if entry is None or entry.ns[0] != tenant:
        raise StateNotFound(f"no cached state for {state_id!r} (unknown, still running, evicted, or another key's)")
    return export_entry(cache, entry, lay)


def export_entry(cache: PrefixCache, entry: Entry, lay: Layout) -> tuple[dict[str, Any], list[bytes]]:
    pools, n = cache.pools, entry.length
    arrays = {"tokens": mx.array(entry.tokens(), dtype=mx.int32), **{f"slot.{k}": v for k, v in entry.slot.items()}}
    for r in pools.ratios:
        arrays.update({f"entries.{k}": v for k, v in pools.read_entries(r, entry.pages[r], n // r).items()})
    mx.eval(list(arrays.values()))
    want = lay.arrays(n)
    if [k for k, _, _ in want] != list(arrays):
        raise RuntimeError("export: the entry's arrays do not follow the layout")
    header = {"model": lay.identity, "tenant": entry.ns[0], "salt": entry.ns[1], "nonce": secrets.token_hex(16),
              "tokens": n, "arrays": want}  # fmt: skip
    return header, [_raw(v) for v in arrays.values()]


def install(cache: PrefixCache, state: Opened, nonces: OrderedDict[str, None] | None = None) -> tuple[str, int]:
    """Cache a checked state in its namespace; (its id for GET /v1/state/{id}, its token count). StateConflict
    when its tokens are cached there already or its nonce was imported before; StateError when it cannot fit."""
    tokens, ns, pools, n = state.tokens, state.namespace, cache.pools, len(state.tokens)
    if nonces is not None and state.nonce in nonces:
        raise StateConflict("this export was imported here before (a replay); export the state again to move it")
    if cache.has(tokens, ns):
        raise StateConflict("a state for these tokens is cached for this key already")
    need = cache.pages_of(n)
    if pools.slot_bytes() + sum(k * pools.page_bytes(r) for r, k in need.items()) > cache.budget:
        raise StateError(f"the state ({n} tokens) is larger than this server's prefix cache budget")
    while any(pools.free_pages(r) < k for r, k in need.items()) and cache.evict_one():
        pass
    if any(pools.free_pages(r) < k for r, k in need.items()):
        raise StateError("no free decode state pages for this state now; retry later")
    want = {f"slot.{k}": (v.dtype, v.shape[1:]) for k, v in pools.slot_arrays().items()}
    for r in pools.ratios:
        want.update({f"entries.{k}": (v.dtype, [n // r, v.shape[-1]]) for k, v in pools.page_pools(r).items()})
    if set(want) != set(state.arrays):
        raise StateError("the state's arrays do not match this model's decode state")
    arrays = {k: _from_raw(state.arrays[k], dtype, shape) for k, (dtype, shape) in want.items()}
    pages = {r: pools.new_pages(r, k) for r, k in need.items()}
    for r in pools.ratios:
        names = pools.page_pools(r)
        pools.write_entries(r, pages[r], {k: arrays[f"entries.{k}"] for k in names})
    slot = {k.removeprefix("slot."): v for k, v in arrays.items() if k.startswith("slot.")}
    mx.eval(list(slot.values()), pools.arrays())
    rid = f"state-{secrets.token_hex(16)}"
    cache.insert(tokens, slot, pages, rid, ns)
    if nonces is not None:
        nonces[state.nonce] = None
        while len(nonces) > MAX_NONCES:
            nonces.popitem(last=False)
    return rid, n


def _from_raw(raw: np.ndarray, dtype: mx.Dtype, shape: list[int]) -> mx.array:
    """Raw little-endian bytes as an mx array of `dtype` and `shape`."""
    if not raw.size:
        return mx.zeros(shape, dtype)
    return mx.array(raw.reshape(-1, dtype.size)).view(dtype).reshape(shape)


def _cache(engine: Engine) -> PrefixCache:
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        raise StateError("this server runs without a prefix cache (--prefix-cache-gib 0): no states to move")
    return cache


def import_for(engine: Engine, state: Opened) -> tuple[str, int]:
    """POST /v1/state on the engine thread, after `state_format.open_state` (off it)."""
    nonces = getattr(engine, "_state_nonces", None)
    if nonces is None:
        nonces = engine._state_nonces = OrderedDict()
    touched = getattr(engine, "touched", None)  # the entry's pages are written: the decode graphs re-read the pools
    if touched is not None:
        touched()
    return install(_cache(engine), state, nonces)
