"""The bytes of an exported decode state (GET /v1/state/{id}, POST /v1/state): sealing and opening, no mlx.

Layout (version 2): MAGIC, little-endian uint32 version and header length, the header (JSON: the model's
identity, the owner's tenant id and cache_salt, a random nonce, the token count and the arrays' names /
dtypes / shapes in payload order), the payload (each array's raw little-endian bytes, C order: the token
ids as int32, then the slot copy `slot.<name>` and each page pool's first p // ratio entries
`entries.<name>`), then an HMAC-SHA256 of everything before it under the server's state secret.

Opening checks the cheap, fixed-size things first (magic, version, size), then the HMAC over everything
(a state nobody with the secret sealed is never parsed further), then the header against `Layout` (the
importing model's identity and decode-state shapes; the tenant: another key's state is refused as a forged one),
then every value: token ids in the vocabulary, floats finite (score windows may hold -inf: their mark
for a row not written yet; NaN or +inf never). Pure numpy and hmac: runs off the engine thread.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsv4_serve.service.engine.request import Namespace, StateError

MAGIC = b"DSV4-STATE\n"
VERSION = 2
FIXED = struct.Struct("<II")  # version, header length
MAC_BYTES = 32
MAX_HEADER = 1 << 20  # a real header: ~100 bytes an array (a few hundred arrays at most)
HEADER_KEYS = {"model", "tenant", "salt", "nonce", "tokens", "arrays"}
# A state altered, forged, sealed under another secret or exported for another API key: one answer for all
# (another key's genuine export must not be told apart from a forgery).
UNVERIFIED = ("the state's signature does not verify for this API key: it was altered, truncated, exported for "
              "another API key, or by a server with another state secret (--state-secret-file)")
_NUMPY = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int32": "<i4"}
_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}
_CHUNK = 1 << 22  # elements checked at a time (a bounded temporary)


@dataclass(frozen=True)
class Layout:
    """What this server's model makes of a state of n tokens: the arrays' dtypes and shapes."""

    identity: str  # state_io.model_identity
    vocab_size: int
    max_len: int  # a state holds fewer tokens than this
    slot: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) of each slot array
    entries: tuple[tuple[str, str, int, int], ...]  # (name, dtype, ratio, width) of each page pool

    def arrays(self, n: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every array of an n-token state, in payload order."""
        return [("tokens", "int32", (n,)), *((f"slot.{k}", d, s) for k, d, s in self.slot),
                *((f"entries.{k}", d, (n // r, w)) for k, d, r, w in self.entries)]  # fmt: skip

    def payload_bytes(self, n: int) -> int:
        return sum(_SIZE[d] * int(np.prod(s, dtype=np.int64)) for _, d, s in self.arrays(n))

    def max_bytes(self) -> int:
        """The largest state this server can import: max_len - 1 tokens, the largest header, the MAC."""
        return len(MAGIC) + FIXED.size + MAX_HEADER + self.payload_bytes(self.max_len - 1) + MAC_BYTES


@dataclass(frozen=True)
class Opened:
    """A state that passed every check: its tokens, namespace, nonce and raw arrays (by name, uint8)."""

    tokens: list[int]
    namespace: Namespace
    nonce: str
    arrays: dict[str, np.ndarray]


def seal(secret: bytes, header: dict[str, Any], raws: list[bytes]) -> bytes:
    head = json.dumps({**header, "arrays": [[k, d, list(s)] for k, d, s in header["arrays"]]},
                      separators=(",", ":")).encode()  # fmt: skip
    body = b"".join([MAGIC, FIXED.pack(VERSION, len(head)), head, *raws])
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def open_state(data: bytes | bytearray | memoryview, secret: bytes, layout: Layout, tenant: str) -> Opened:
    """Check a state as this server, for API key `tenant`, would import it. StateError (400) for anything
    malformed, altered, foreign or non-finite; another key's genuine state gets a forged one's StateError."""
    view = memoryview(data).cast("B")
    start = len(MAGIC) + FIXED.size
    if len(view) < start + MAC_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise StateError("not a dsv4-serve state (bad magic)")
    version, size = FIXED.unpack_from(view, len(MAGIC))
    if version != VERSION:
        raise StateError(f"state version {version} is not supported (this server reads version {VERSION}); "
                         "export it again from a server of this version")  # fmt: skip
    if len(view) > layout.max_bytes():
        raise StateError(f"the state is larger than any this model can hold ({layout.max_bytes()} bytes)")
    mac = hmac.new(secret, view[:-MAC_BYTES], hashlib.sha256).digest()
    if not hmac.compare_digest(mac, bytes(view[-MAC_BYTES:])):
        raise StateError(UNVERIFIED)
    if size > MAX_HEADER or start + size > len(view) - MAC_BYTES:
        raise StateError("the state's header length is out of range")
    header = _header(bytes(view[start : start + size]))
    if header["model"] != layout.identity:
        raise StateError("the state is from another model (its model identity does not match this server's)")
    if header["tenant"] != tenant:  # the same answer as a forged state: no oracle for another key's exports
        raise StateError(UNVERIFIED)
    n = header["tokens"]
    if not 1 <= n < layout.max_len:
        raise StateError(f"the state holds {n} tokens; this server takes 1..{layout.max_len - 1}")
    want = layout.arrays(n)
    if header["arrays"] != [[k, d, list(s)] for k, d, s in want]:
        raise StateError("the state's arrays do not match this model's decode state")
    payload = view[start + size : len(view) - MAC_BYTES]
    if len(payload) != layout.payload_bytes(n):
        raise StateError(f"the state's payload is {len(payload)} bytes; {n} tokens take {layout.payload_bytes(n)}")
    arrays, off = {}, 0
    for name, dtype, shape in want:
        nbytes = _SIZE[dtype] * int(np.prod(shape, dtype=np.int64))
        raw = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=off)
        _check_values(name, dtype, raw.view(_NUMPY[dtype]), layout.vocab_size)
        arrays[name] = raw
        off += nbytes
    tokens = arrays.pop("tokens").view("<i4").tolist()
    return Opened(tokens, (tenant, header["salt"]), header["nonce"], arrays)


def _header(raw: bytes) -> dict[str, Any]:
    """The header, parsed with bounds: at most MAX_HEADER bytes (the caller), no deep nesting or huge ints
    accepted (json's own errors: RecursionError, ValueError), exactly the expected keys and types."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise StateError(f"the state's header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict) or set(header) != HEADER_KEYS:
        raise StateError(f"the state's header must be an object with the keys {sorted(HEADER_KEYS)}")
    ok = (isinstance(header["model"], str) and isinstance(header["tenant"], str) and isinstance(header["salt"], str)
          and isinstance(header["nonce"], str) and len(header["nonce"]) == 32 and type(header["tokens"]) is int
          and isinstance(header["arrays"], list))  # fmt: skip
    if not ok:
        raise StateError("the state's header fields have the wrong types")
    return header


def _check_values(name: str, dtype: str, values: np.ndarray, vocab_size: int) -> None:
    for i in range(0, len(values), _CHUNK):
        part = values[i : i + _CHUNK]
        if dtype == "int32":
            if part.size and (int(part.min()) < 0 or int(part.max()) >= vocab_size):
                raise StateError(f"the state's token ids must be in [0, {vocab_size})")
            continue
        if dtype == "bfloat16":  # exponent all ones: inf or NaN; the sign bit and a zero mantissa: -inf
            special = (part & 0x7F80) == 0x7F80
            neg_inf = part == 0xFF80
        else:
            special, neg_inf = ~np.isfinite(part), np.isneginf(part)
        allowed = neg_inf if "_score" in name else np.zeros_like(special)
        if np.any(special & ~allowed):
            raise StateError(f"array {name} holds non-finite values")
