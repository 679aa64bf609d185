"""API keys: `Authorization: Bearer KEY` on /v1/*, the tokenizer routes and /openapi.json (and /metrics with
--metrics-key), checked in constant time before routing; 401 with an OpenAI error body otherwise. /health and
/ready stay open (probes). Also installs the body cap (limits.BodyLimit) inside the key check, so a request without
a key is turned away before its body is read. A request with a key carries its tenant id in the ASGI scope
(`tenant_of`): a digest of the key, never the key, which scopes its prefix cache and its states."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

from dsv4_serve.service.api.limits import BodyLimit, BodyPace, body_limit_bytes, send_error
from dsv4_serve.service.api.protocol import error_body

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM serves them at the root
DOC_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # the API's description: as /v1/*


TENANT = "dsv4.tenant"  # ASGI scope key of the request's tenant id


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def tenant_id(digest: bytes) -> str:
    """The tenant id of the key with this digest: stable across servers, and no way back to the key."""
    return hashlib.sha256(b"dsv4-serve tenant\0" + digest).hexdigest()[:32]


def tenant_of(request: Any) -> str:
    """The request's tenant id; "" (one namespace for all) when the server runs without API keys."""
    return str(request.scope.get(TENANT, ""))


class KeySet:
    """Keys kept as SHA-256 digests: every check compares fixed-length digests against every key
    (hmac.compare_digest, no early exit), so its time says nothing about any key."""

    def __init__(self, keys: tuple[str, ...] | list[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, header: bytes | None) -> bool:
        return self.match(header) is not None

    def match(self, header: bytes | None) -> bytes | None:
        """The digest of the header's key when it is one of these keys, else None."""
        scheme, _, token = (header or b"").partition(b" ")
        given = _digest(token.strip() if scheme.lower() == b"bearer" else b"\0not-a-bearer-token")
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(d, given)
        return given if ok else None


def _unauthorized(what: str) -> dict[str, Any]:
    msg = f"Incorrect or missing API key for {what}: send 'Authorization: Bearer <key>'"
    return error_body(msg, "invalid_request_error", None, "invalid_api_key")


class APIKeys:
    """ASGI middleware: /v1/* and TOKENIZER_PATHS need one of `keys`, /metrics `metrics` (when either set is
    non-empty)."""

    def __init__(self, app: Any, keys: KeySet, metrics: KeySet) -> None:
        self.app, self.keys, self.metrics = app, keys, metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            keyed = path.startswith("/v1/") or path == "/v1" or path in TOKENIZER_PATHS or path in DOC_PATHS
            need = self.keys if keyed else None
            if path == "/metrics":
                need = self.metrics
            if need:
                given = need.match(dict(scope["headers"]).get(b"authorization"))
                if given is None:
                    await send_error(send, 401, _unauthorized(path), {"WWW-Authenticate": "Bearer"})
                    return
                if need is self.keys:
                    scope[TENANT] = tenant_id(given)
        await self.app(scope, receive, send)


def guard(app: Any, ctl: Any) -> None:
    """Install the body pace and the body cap and, outside them, the key check on `app` (a FastAPI / Starlette
    app)."""
    s = ctl.settings
    app.add_middleware(BodyPace, timeout=s.body_timeout, min_rate=s.body_min_rate * 1024)  # 408 for a trickle
    # POST /v1/state reads its body under a cap of its own (state_routes.py: sized from the model's state)
    app.add_middleware(BodyLimit, limit=lambda: body_limit_bytes(s.max_body_mb, ctl.max_model_len),
                       exempt=("/v1/state",))  # fmt: skip
    metrics = KeySet([s.metrics_key] if s.metrics_key else [])
    app.add_middleware(APIKeys, keys=KeySet(s.api_keys()), metrics=metrics)
